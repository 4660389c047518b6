"""Trajectories as MLflow traces: one trace per trajectory, a span per turn.

    rollout · step 5 · group 2 (AGENT)   inputs: task, answer   outputs: answer, finish, reward
      turn 1 (CHAIN)                     attributes: level, turn_reward, tokens
        generate (LLM)                   inputs: what the policy read   outputs: its text; token count
        code (TOOL)                      inputs: arguments   outputs: result   status ERROR + error
      turn 2 (CHAIN) ...
      reward (EVALUATOR)                 outcome, reward functions, total, turn rewards, advantage

An agent program's episode (`env.name: agent`) has a turn per call of the program: its LLM span
holds the request's messages and tools and the assistant message answered, the policy version
that sampled it and the sample (of the episode's) it was trained in. A program that traces itself
with MLflow (its own spans, autologging of its OpenAI client, which sends each call's W3C
`traceparent` to the gateway) logs its trace to the run's store and experiment (the program's
process inherits MLFLOW_TRACKING_URI and gets the run's experiment); that trace's spans are joined
into the episode's trace when it is logged: the program's spans under the root, each call's turn
span under the program's span that made the call, and the program's own trace tagged
`turnrl.joined_into` with the id of the joined one.

Everything comes from the `Trajectory` alone (turn texts and times, environment step times,
observations, turn rewards, levels, info), so any environment traces the same way: the
built-ins, a plug-in, MLMT's two levels (each turn says its level), on the synchronous and
asynchronous rollout paths (both record `turn_times` and `env_times`). An environment step is
named after the action tag that closed the turn (`</code>` -> `code`, `</search>` -> `search`,
`</answer>` -> `answer`), else `environment`; its arguments are the tag's content (else the
whole turn). A step's error: `env_error` for the step where the environment raised; for the
last tool call, `tool_ok: false` with its `tool_error` (the info an environment returns
describes its last call; earlier calls show their result text only).

The advantage on the root span is the group-normalized reward (R - mean_g) / (std_g + 1e-6),
GRPO's advantage, computed from the step's rewards: the training loop's advantages are per
token and algorithm-specific (turn-level terms, a critic) and are not handed to `on_step`.

Searchable with `mlflow.search_traces`: tags `kind` (rollout | evaluation), `step`, `group`,
`finish`, `reward`, `turns`, `env`, and for evaluations `stage` (baseline | final),
`benchmark`, `correct`; assessments (feedback) `reward` (a number: `feedback.reward >= 1`) on
rollouts and `correct` (with the grader's reason) on evaluation generations.
"""
from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

from turnrl.rewards.judge import verdicts

SOURCE_ID = "turnrl"
_TRAILING_SPECIAL = re.compile(r"(\s|<\|[^|<>]{1,40}\|>|</s>|<eos>|<end_of_turn>)+$")
_CLOSING = re.compile(r"</([A-Za-z_][\w\-]{0,40})>")
_MAX_TEXT = 20_000   # characters of one text kept in a span (a runaway generation stays readable)


@dataclass
class SpanPlan:
    name: str
    span_type: str
    start_ns: int
    end_ns: int
    inputs: Any = None
    outputs: Any = None
    attributes: dict = field(default_factory=dict)
    error: str | None = None
    children: list["SpanPlan"] = field(default_factory=list)
    under: str = ""   # the span id of the program's own span this span goes under (a joined trace)


@dataclass
class TracePlan:
    root: SpanPlan
    tags: dict[str, str]
    feedback: list[dict] = field(default_factory=list)   # {name, value, rationale}
    program_traces: list[str] = field(default_factory=list)   # the agent program's own traces, joined in

    def spans(self) -> list[SpanPlan]:
        out, todo = [], [self.root]
        while todo:
            span = todo.pop(0)
            out.append(span)
            todo = span.children + todo
        return out


# --------------------------------------------------------------------------- sampling
def traced_step(step: int, every: int, last_step: int) -> bool:
    """Whether training step `step` gets traces: every `every`-th step, the first and the last
    (`every` 0: none)."""
    return every > 0 and (step == 1 or step % every == 0 or step == last_step)


def sample_indices(count: int, k: int) -> list[int]:
    """`k` of `count` trajectories spread evenly over the batch (so over its groups)."""
    k = min(k, count)
    return sorted({(i * count) // k for i in range(k)}) if k > 0 else []


def group_advantages(rewards: Sequence[float], group_size: int, eps: float = 1e-6) -> list[float]:
    """(R - mean_g) / (std_g + eps) per trajectory, groups of `group_size` in order; std is
    Bessel-corrected (a singleton group gets 0), as turnrl.algos.group_normalize."""
    out: list[float] = []
    n = max(1, group_size)
    for start in range(0, len(rewards), n):
        group = [float(r) for r in rewards[start:start + n]]
        mean = sum(group) / len(group)
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / (len(group) - 1)) if len(group) > 1 else 0.0
        out += [(r - mean) / (std + eps) for r in group]
    return out


# --------------------------------------------------------------------------- one trajectory
def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


def _clip(text: Any) -> Any:
    if isinstance(text, str) and len(text) > _MAX_TEXT:
        return text[:_MAX_TEXT] + f"... [{len(text) - _MAX_TEXT} more characters]"
    return text


def action(text: str) -> tuple[str, str]:
    """(tool name, arguments) of a policy turn: the tag that closes it and its content, e.g.
    `... <code>print(2)</code>` -> ("code", "print(2)"); ("environment", the turn) otherwise."""
    body = _TRAILING_SPECIAL.sub("", text or "")
    closing = list(_CLOSING.finditer(body))
    if closing and closing[-1].end() == len(body):
        name = closing[-1].group(1)
        opened = body.rfind(f"<{name}>", 0, closing[-1].start())
        if opened >= 0:
            return name, body[opened + len(name) + 2:closing[-1].start()].strip()
        return name, body[:closing[-1].start()].strip()
    return "environment", body.strip()


def _tokens_by_turn(t) -> tuple[dict[int, int], dict[int, int]]:
    """(policy tokens, observation tokens) per turn index."""
    policy: dict[int, int] = {}
    observed: dict[int, int] = {}
    for mask, turn in zip(t.loss_mask, t.turn_ids):
        target = policy if mask else observed
        target[turn] = target.get(turn, 0) + 1
    return policy, observed


def _numbers(info: dict) -> dict[str, float]:
    return {k: float(v) for k, v in info.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v))} | {
        k: bool(v) for k, v in info.items() if isinstance(v, bool)}


def _tool_span(t, k: int, text: str, last_env: int, last_tool: int, turn_reward, observed: int) -> SpanPlan:
    """The environment's step after turn `k`: the tool named by the turn's closing tag, its
    arguments, the observation (or the trajectory's end), and the error where it failed."""
    info = t.info or {}
    e_start, e_end = t.env_times[k]
    tool, arguments = action(text)
    observation = t.observations[k] if k < len(t.observations) else None
    if observation is not None:
        result: Any = _clip(observation)
    else:   # the step that ended the trajectory (or one cut by a budget before its result joined)
        result = {"done": k == last_env, "finish": t.finish, "outcome": t.outcome,
                  **{key: info[key] for key in ("extracted", "prediction", "reason") if key in info}}
    error = None
    if k == last_env and t.finish == "env_error":
        error = str(info.get("env_error") or "the environment raised")
    elif k == last_tool and info.get("tool_ok") is False:
        error = str(info.get("tool_error") or info.get("error") or "the tool call failed")
    return SpanPlan(name=tool, span_type="TOOL", start_ns=_ns(e_start), end_ns=_ns(e_end),
                    inputs={"arguments": _clip(arguments)}, outputs={"result": result}, error=error,
                    attributes={"tool": tool, "seconds": round(e_end - e_start, 4), "turn_reward": turn_reward,
                                "observation_tokens": observed, **({"error": error} if error else {})})


def _move_spans(t, turn: int, at: float) -> list[SpanPlan]:
    """A game's other players' moves after the seat's turn `turn` (-1: before its first), a span
    each, the player named (`info["opponent_moves"]`, turnrl.games.tables)."""
    return [SpanPlan(name=f"move · {m['role']} ({m['player']})", span_type="AGENT", start_ns=_ns(at), end_ns=_ns(at),
                     outputs={"move": _clip(m["move"]), "legal": m["legal"]},
                     attributes={"role": m["role"], "player": m["player"], "legal": m["legal"]})
            for m in (t.info or {}).get("opponent_moves") or () if m.get("turn") == turn]


def _turn_spans(t, now: float) -> list[SpanPlan]:
    """A span per turn: the policy's generation and the environment's step after it."""
    turns = t.num_turns
    turn_times = list(getattr(t, "turn_times", []) or [])
    env_times = list(getattr(t, "env_times", []) or [])
    policy_tokens, observed_tokens = _tokens_by_turn(t)
    last_env = len(env_times) - 1
    # the step that made the last tool call: the last one the trajectory went on after
    ended_by_env = t.finish not in ("max_turns", "token_budget", "truncated")
    last_tool = last_env - 1 if ended_by_env else last_env
    children: list[SpanPlan] = []
    context = len(t.prompt_ids)
    first = turn_times[0][0] if turn_times else now
    children += _move_spans(t, -1, first)   # a game's moves before the seat's first (the first mover's)
    calls = (t.info or {}).get("gateway_calls") or []   # an agent program's episode: what each call read
    for k in range(turns):
        g_start, g_end = turn_times[k] if k < len(turn_times) else (now, now)
        text = t.turn_texts[k]
        level = t.levels[k] if k < len(t.levels) else "low"
        read = t.shown_prompt if k == 0 else (t.observations[k - 1] if k - 1 < len(t.observations) else "")
        out_tokens = policy_tokens.get(k, 0)
        generate = SpanPlan(
            name="generate" if level == "low" else "generate (high level)", span_type="LLM",
            start_ns=_ns(g_start), end_ns=_ns(g_end), inputs={"read": _clip(read)}, outputs={"text": _clip(text)},
            attributes={"tokens": out_tokens, "level": level, "seconds": round(g_end - g_start, 4),
                        "tokens_per_s": round(out_tokens / (g_end - g_start), 1) if g_end > g_start else None,
                        "mlflow.chat.tokenUsage": {"input_tokens": context, "output_tokens": out_tokens,
                                                   "total_tokens": context + out_tokens}})
        context += out_tokens + observed_tokens.get(k, 0)
        if k < len(calls):   # the gateway's record: the request's messages in, the assistant message out
            call = calls[k]
            generate.inputs = {"messages": [dict(m, content=_clip(m.get("content"))) for m in call["messages"]],
                               "tools": call["tools"]}
            generate.outputs = {"message": call["message"], "text": _clip(text)}
            generate.attributes.update(
                {"policy_version": call["version"], "sample": call["sample"], "completion_id": call["id"],
                 "finish": call["finish"], "tokens": call["completion_tokens"],
                 "mlflow.chat.tokenUsage": {"input_tokens": call["prompt_tokens"],
                                            "output_tokens": call["completion_tokens"],
                                            "total_tokens": call["prompt_tokens"] + call["completion_tokens"]}})
        spans = [generate]
        under = ""
        if k < len(calls) and program_context(calls[k].get("traceparent", "")):
            under = program_context(calls[k]["traceparent"])[1]   # the program's span that made this call
        turn_end = g_end
        turn_reward = t.turn_rewards[k] if k < len(t.turn_rewards) else None
        if k < len(env_times):
            spans.append(_tool_span(t, k, text, last_env, last_tool, turn_reward, observed_tokens.get(k, 0)))
            turn_end = max(turn_end, env_times[k][1])
        spans += _move_spans(t, k, turn_end)
        children.append(SpanPlan(
            name=f"turn {k + 1}" + (" (high level)" if level == "high" else ""), span_type="CHAIN",
            start_ns=_ns(g_start), end_ns=_ns(turn_end), children=spans, under=under,
            attributes={"turn": k + 1, "level": level, "turn_reward": turn_reward, "tokens": out_tokens}))
    return children


_TRACEPARENT = re.compile(r"^[0-9a-f]{2}-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-f]{2}$")


def program_context(traceparent: str) -> tuple[str, str] | None:
    """(MLflow trace id, span id) of the program's span that made a call, from the W3C
    `traceparent` header it sent (MLflow's OpenAI autologging sends one per call); None if none."""
    match = _TRACEPARENT.match((traceparent or "").strip().lower())
    if not match or set(match.group(1)) == {"0"}:
        return None
    return "tr-" + match.group(1), match.group(2)


def plan(t, *, name: str, tags: dict[str, Any], attributes: dict[str, Any] | None = None,
         advantage: float | None = None, correct: tuple[bool, str] | None = None) -> TracePlan:
    """The trace of trajectory `t` (a turnrl.rollout.multi_turn.Trajectory): spans with their times,
    tags, and the feedback to attach (`reward`, and `correct` with its reason when given)."""
    now = time.time()
    info = t.info or {}
    children = _turn_spans(t, now)
    starts = [c.start_ns for c in children] or [_ns(now)]
    end = max([c.end_ns for c in children] or [_ns(now)])
    final_text = t.turn_texts[-1] if t.turn_texts else ""
    answer = info.get("extracted", info.get("prediction"))
    reward = {"outcome": t.outcome, "reward_functions": dict(t.rewards), "reward": t.reward,
              "turn_rewards": list(t.turn_rewards)}
    if advantage is not None:
        reward["advantage"] = advantage
    if correct is not None:
        reward["correct"], reward["reason"] = correct
    for judge, verdict in verdicts(info):   # reward.judges: what each judge was asked and answered
        turn = f" turn {verdict['turn']}" if "turn" in verdict else ""
        children.append(SpanPlan(
            name=f"judge {judge}{turn}", span_type="LLM", start_ns=end, end_ns=end + _ns(verdict.get("seconds", 0.0)),
            inputs={"prompt": _clip(verdict["prompt"])}, outputs={"answer": _clip(verdict["answer"]),
                                                                  "score": verdict["score"]},
            attributes={"seconds": verdict.get("seconds"), "tries": verdict.get("tries"),
                        "cached": verdict.get("cached")}, error=verdict.get("error")))
    children.append(SpanPlan(name="reward", span_type="EVALUATOR", start_ns=end, end_ns=end,
                             inputs={"finish": t.finish, "answer": answer}, outputs=reward))
    root_attributes = {"finish": t.finish, "reward": t.reward, "outcome": t.outcome, "turns": t.num_turns,
                       "policy_tokens": t.policy_tokens(), "levels": list(t.levels),
                       **({"advantage": advantage, "advantage_kind": "group-normalized reward (R-mean)/(std+1e-6)"}
                          if advantage is not None else {}),
                       **{f"reward_{k}": v for k, v in t.rewards.items()},
                       **{f"info.{k}": v for k, v in _numbers(info).items()},
                       **(attributes or {})}
    root = SpanPlan(name=name, span_type="AGENT", start_ns=min(starts), end_ns=end,
                    inputs={"task": _clip(t.shown_prompt), "answer": str(t.example.get("answer", ""))},
                    outputs={"answer": answer if answer is not None else _clip(final_text[-2000:]),
                             "finish": t.finish, "reward": t.reward},
                    attributes=root_attributes, children=children,
                    error=str(info.get("env_error")) if t.finish == "env_error" else None)
    all_tags = {k: _tag(v) for k, v in {"finish": t.finish, "reward": t.reward, "turns": t.num_turns, **tags}.items()}
    feedback = [{"name": "reward", "value": float(t.reward),
                 "rationale": f"outcome {t.outcome:g}" + "".join(f" + {k} {v:g}" for k, v in t.rewards.items())}]
    if correct is not None:
        all_tags["correct"] = _tag(correct[0])
        feedback.append({"name": "correct", "value": bool(correct[0]), "rationale": str(correct[1])[:2000]})
    calls = info.get("gateway_calls") or []
    joined = sorted({context[0] for c in calls if (context := program_context(c.get("traceparent", "")))})
    return TracePlan(root=root, tags=all_tags, feedback=feedback, program_traces=joined)


def _tag(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


# --------------------------------------------------------------------------- to MLflow
def log(client, trace: TracePlan, *, experiment_id: str, run_id: str | None) -> str:
    """Write `trace` with `client` (an MlflowClient), linked to `run_id`; attach its feedback.
    Returns the trace id."""
    import mlflow
    from mlflow.entities import AssessmentSource, SpanStatus, SpanStatusCode

    def status(span: SpanPlan):
        return SpanStatus(SpanStatusCode.ERROR, span.error) if span.error else SpanStatus(SpanStatusCode.OK)

    r = trace.root
    joined: list[str] = []
    if trace.program_traces:
        r, joined = join_program_spans(r, fetch_program_spans(client, trace.program_traces))
    root = client.start_trace(r.name, span_type=r.span_type, inputs=r.inputs, attributes=_attrs(r.attributes),
                              tags=trace.tags, experiment_id=experiment_id, start_time_ns=r.start_ns, run_id=run_id)
    trace_id = root.trace_id

    def write(span: SpanPlan, parent_id: str) -> None:
        live = client.start_span(span.name, trace_id, parent_id, span_type=span.span_type, inputs=span.inputs,
                                 attributes=_attrs(span.attributes), start_time_ns=span.start_ns)
        for child in span.children:
            write(child, live.span_id)
        client.end_span(trace_id, live.span_id, outputs=span.outputs, status=status(span), end_time_ns=span.end_ns)

    for child in r.children:
        write(child, root.span_id)
    client.end_trace(trace_id, outputs=r.outputs, status=status(r), end_time_ns=r.end_ns)
    for program_trace in joined:   # the program's own trace points at the one it is joined into
        client.set_trace_tag(program_trace, "turnrl.joined_into", trace_id)
    source = AssessmentSource(source_type="CODE", source_id=SOURCE_ID)
    for fb in trace.feedback:
        mlflow.log_feedback(trace_id=trace_id, name=fb["name"], value=fb["value"], rationale=fb["rationale"],
                            source=source)
    return trace_id


# --------------------------------------------------------------------------- an agent program's own spans
PROGRAM_TRACE_WAIT_S = 10.0   # how long a program's trace may take to reach the store (its export is asynchronous)
_unfound_in_a_row = 0         # traces whose programs log elsewhere: after 3 unfound, stop waiting for them


def fetch_program_spans(client, trace_ids: Sequence[str], wait_s: float = PROGRAM_TRACE_WAIT_S) -> dict[str, list]:
    """The spans of each of an agent program's traces (MLflow `Span`s) found in the store, waiting
    up to `wait_s` in all for them to arrive; a trace not found (the program logs elsewhere, or
    not yet) is left out. After three traces in a row were not found, this process stops waiting."""
    global _unfound_in_a_row
    deadline = time.time() + (wait_s if _unfound_in_a_row < 3 else 0.0)
    found: dict[str, list] = {}
    for trace_id in trace_ids:
        while True:
            try:
                found[trace_id] = list(client.get_trace(trace_id).data.spans)
                break
            except Exception:   # noqa: BLE001 - not (yet) in the store
                if time.time() >= deadline:
                    break
                time.sleep(0.5)
        _unfound_in_a_row = 0 if trace_id in found else _unfound_in_a_row + 1
    return found


_INTERNAL = ("mlflow.traceRequestId", "mlflow.spanType", "mlflow.spanInputs", "mlflow.spanOutputs",
             "mlflow.spanFunctionName", "mlflow.trace.")


def join_program_spans(root: SpanPlan, program_spans: dict[str, list]) -> tuple[SpanPlan, list[str]]:
    """`root` with the program's own spans in it: each program trace's spans, their tree kept,
    under the root; each turn span that names (`under`) the program span that made its call moved
    under that span. Pure (builds a new root). Returns it and the program traces joined."""
    plans: dict[str, SpanPlan] = {}
    parents: dict[str, str | None] = {}
    for spans in program_spans.values():
        for span in spans:
            status = getattr(span, "status", None)
            failed = status is not None and str(getattr(status, "status_code", "")).endswith("ERROR")
            plans[span.span_id] = SpanPlan(
                name=span.name, span_type=str(span.span_type or "UNKNOWN"), start_ns=int(span.start_time_ns),
                end_ns=int(span.end_time_ns or span.start_time_ns), inputs=span.inputs, outputs=span.outputs,
                attributes={"program_span": True, **{k: v for k, v in (span.attributes or {}).items()
                                                     if not k.startswith(_INTERNAL)}},
                error=(getattr(status, "description", "") or "error") if failed else None)
            parents[span.span_id] = span.parent_id
    top: list[SpanPlan] = []
    for span_id, plan_ in plans.items():
        parent = parents[span_id]
        (plans[parent].children if parent in plans else top).append(plan_)
    kept = []
    for child in root.children:
        if child.under in plans:
            plans[child.under].children.append(child)
        else:
            kept.append(child)
    for plan_ in plans.values():
        plan_.children.sort(key=lambda c: c.start_ns)
    children = sorted(top + kept, key=lambda c: c.start_ns)
    start = min([root.start_ns] + [c.start_ns for c in top])
    end = max([root.end_ns] + [c.end_ns for c in top])
    joined = sorted(program_spans)
    attributes = {**root.attributes, **({"program_traces": joined} if joined else {})}
    return (SpanPlan(name=root.name, span_type=root.span_type, start_ns=start, end_ns=end, inputs=root.inputs,
                     outputs=root.outputs, attributes=attributes, error=root.error, children=children), joined)


def _attrs(attributes: dict) -> dict:
    return {k: v for k, v in attributes.items() if v is not None}


def log_traces(run, plans: list[TracePlan], run_id: str | None = None) -> None:
    """Queue traces on the stage run's Recorder (`run`: a turnrl.tracking.runs.StageRun), linked
    to the stage run (or `run_id`)."""
    for trace in plans:
        run.recorder.submit("traces", trace.root.name,
                            lambda c, p=trace: log(c, p, experiment_id=run.experiment_id,
                                                   run_id=run_id or run.run_id))


# --------------------------------------------------------------------------- what the stages trace
def rollout_traces(trajs: Sequence, step: int, group_size: int, per_step: int, *, env: str = "",
                   algorithm: str = "") -> list[TracePlan]:
    """The traces of training step `step`: `per_step` trajectories spread over the batch, each
    with its group and group-normalized reward."""
    advantages = group_advantages([t.reward for t in trajs], group_size)
    out = []
    for i in sample_indices(len(trajs), per_step):
        group = i // max(1, group_size)
        out.append(plan(trajs[i], name=f"rollout · step {step} · group {group}",
                        tags={"kind": "rollout", "step": step, "group": group, "env": env, "algorithm": algorithm},
                        attributes={"step": step, "group": group, "index": i, "env": env, "algorithm": algorithm},
                        advantage=advantages[i]))
    return out


def evaluation_traces(trajs: Sequence, benchmark: str, stage: str, per_benchmark: int, *,
                      reason=None, env: str = "") -> list[TracePlan]:
    """The traces of an evaluation block: `per_benchmark` generations spread over it, each with
    its correctness (outcome > 0) and the grader's reason (`reason(t)`) as feedback."""
    out = []
    for i in sample_indices(len(trajs), per_benchmark):
        t = trajs[i]
        why = reason(t) if reason else ""
        out.append(plan(t, name=f"evaluation · {stage} · {benchmark}",
                        tags={"kind": "evaluation", "stage": stage, "benchmark": benchmark, "env": env,
                              "problem": t.example.get("id", i)},
                        attributes={"stage": stage, "benchmark": benchmark, "index": i},
                        correct=(t.outcome > 0, why)))
    return out
