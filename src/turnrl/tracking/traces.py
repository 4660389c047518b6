"""Trajectories as MLflow traces: one trace per trajectory, a span per turn.

    rollout · step 5 · group 2 (AGENT)   inputs: task, answer   outputs: answer, finish, reward
      turn 1 (CHAIN)                     attributes: level, turn_reward, tokens
        generate (LLM)                   inputs: what the policy read   outputs: its text; token count
        code (TOOL)                      inputs: arguments   outputs: result   status ERROR + error
      turn 2 (CHAIN) ...
      reward (EVALUATOR)                 outcome, reward functions, total, turn rewards, advantage

An agent program's episode (`env.name: agent`) has a turn per call of the program: its LLM span
holds the request's messages and tools and the assistant message answered, the policy version
that sampled it and the sample (of the episode's) it was trained in.

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


@dataclass
class TracePlan:
    root: SpanPlan
    tags: dict[str, str]
    feedback: list[dict] = field(default_factory=list)   # {name, value, rationale}

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
    calls = (t.info or {}).get("gateway_calls") or []   # an agent program's episode: what each call read
    for k in range(turns):
        g_start, g_end = turn_times[k] if k < len(turn_times) else (now, now)
        text = t.turn_texts[k]
        level = t.levels[k] if k < len(t.levels) else "low"
        read = t.example.get("prompt", "") if k == 0 else (t.observations[k - 1] if k - 1 < len(t.observations) else "")
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
        turn_end = g_end
        turn_reward = t.turn_rewards[k] if k < len(t.turn_rewards) else None
        if k < len(env_times):
            spans.append(_tool_span(t, k, text, last_env, last_tool, turn_reward, observed_tokens.get(k, 0)))
            turn_end = max(turn_end, env_times[k][1])
        children.append(SpanPlan(
            name=f"turn {k + 1}" + (" (high level)" if level == "high" else ""), span_type="CHAIN",
            start_ns=_ns(g_start), end_ns=_ns(turn_end), children=spans,
            attributes={"turn": k + 1, "level": level, "turn_reward": turn_reward, "tokens": out_tokens}))
    return children


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
                    inputs={"task": _clip(t.example.get("prompt", "")), "answer": str(t.example.get("answer", ""))},
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
    return TracePlan(root=root, tags=all_tags, feedback=feedback)


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
    source = AssessmentSource(source_type="CODE", source_id=SOURCE_ID)
    for fb in trace.feedback:
        mlflow.log_feedback(trace_id=trace_id, name=fb["name"], value=fb["value"], rationale=fb["rationale"],
                            source=source)
    return trace_id


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
