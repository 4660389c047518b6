"""An episode's recorded calls as training samples, token for token.

The gateway records every completion it serves as a `Call`: the prompt ids exactly as the
engine saw them, the ids it sampled, their logprobs and the policy version that sampled them.
An agent program calls many times per episode. Calls whose prompt extends an earlier call's
prompt + completion token for token continue that call's sample (the tokens in between, tool
results and the next user message, go in with loss mask 0, as environment tokens do in the
built-in rollouts); a call that extends none of them (the program dropped turns, stripped
thinking, summarised, or a sub-agent started its own conversation) starts a new sample.

    calls   c0: P0 -> S0      c1: P0 S0 O1 -> S1      c2: Q (edited context) -> S2
    samples [P0 | S0 O1 S1]   [Q | S2]                  (mask 1 on S0, S1, S2 only)

Every sample of an episode is a `Trajectory` whose `turn_ids` are the episode's call indices,
so an episode's samples laid end to end (`episode_view`) read as one multi-turn trajectory to
every algorithm: the episode's reward, and per-call rewards where the program posted them, give
the advantages, which go back onto each sample's own tokens. The episode itself is a
`Trajectory` too (`episode_trajectory`): its last sample's tokens for display, every call's text,
reward and version, and its samples in `Trajectory.samples`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from turnrl.rollout.multi_turn import Trajectory


@dataclass
class Call:
    """One completion the gateway served in an episode."""
    index: int                   # its place among the episode's calls
    prompt_ids: list[int]        # what the engine saw
    completion_ids: list[int]    # what it sampled
    logprobs: list[float]        # of each sampled id, under the weights that sampled it
    version: int                 # the policy version (weight pushes) that sampled it
    finish: str                  # "stop" or "length"
    text: str                    # the completion, special tokens kept
    messages: list = field(default_factory=list)   # the request's messages (traces)
    tools: list = field(default_factory=list)      # the request's tools (traces)
    message: dict = field(default_factory=dict)    # the assistant message answered
    completion_id: str = ""      # the response's `id` (per-call rewards name it)
    started: float = 0.0
    ended: float = 0.0
    reward: float = 0.0          # a per-call reward the program posted (0 if none)
    traceparent: str = ""        # the W3C trace context the program sent (MLflow's autologging does)

    @property
    def sequence(self) -> list[int]:
        return self.prompt_ids + self.completion_ids


def chains(calls: Sequence[Call]) -> list[list[Call]]:
    """The calls grouped into samples, in order of each sample's first call: a call joins the
    sample whose last call's prompt + completion its own prompt starts with (the longest such,
    should two qualify), else starts one. Pure; a sample is never extended twice from one tail,
    so two completions of one prompt (`n` > 1) are two samples unless a later call extends one."""
    out: list[list[Call]] = []
    for call in sorted(calls, key=lambda c: c.index):
        best, best_len = None, -1
        for chain in out:
            tail = chain[-1].sequence
            if len(tail) > best_len and len(call.prompt_ids) >= len(tail) and call.prompt_ids[:len(tail)] == tail:
                best, best_len = chain, len(tail)
        if best is None:
            out.append([call])
        else:
            best.append(call)
    return out


def sample_trajectory(chain: Sequence[Call], example: dict, episode_calls: int) -> Trajectory:
    """One sample: the first call's prompt, then each call's completion (mask 1, the engine's
    logprobs) and between two calls the tokens the program added (mask 0). Turn ids are episode
    call indices; `levels` and `turn_versions` cover all `episode_calls` calls of the episode
    (a sample's rows index them by turn id). Its `messages` and `tools`: the last call's request
    and answer (what reward.teacher.chat_template: teacher renders)."""
    first = chain[0]
    t = Trajectory(example=example, prompt_ids=list(first.prompt_ids))
    for previous, call in zip([None, *chain[:-1]], chain):
        if previous is not None:   # what the program added since the previous call's completion
            t.add_observation(previous.index, call.prompt_ids[len(previous.sequence):], "")
        t.add_turn(call.index, call.completion_ids, call.logprobs, call.text)
        t.turn_times.append((call.started, call.ended))
    t.levels = ["low"] * episode_calls
    last = chain[-1]
    if last.messages:   # its conversation: the last call's request, then the answer (its calls' turns last)
        t.messages = [*last.messages, last.message or {"role": "assistant", "content": last.text}]
        t.tools = list(last.tools)
    return t


def merged_fraction(calls: Sequence[Call], samples: int) -> float:
    """Share of calls after the first that continued a sample rather than starting one."""
    return (len(calls) - samples) / (len(calls) - 1) if len(calls) > 1 else 0.0


def episode_trajectory(example: dict, calls: Sequence[Call], *, outcome: float, finish: str,
                       info: dict | None = None, prompt_ids: Sequence[int] = ()) -> Trajectory:
    """The episode as one Trajectory: its samples (`samples`), every call's text, per-call
    reward and version (`turn_texts`, `turn_rewards`, `turn_versions`), the outcome, finish and
    info; for display and generation records its prompt and response are those of the sample
    holding the last call. An episode with no call (the program failed before its first) has
    no sample and no response (its prompt: `prompt_ids`, the rendered task): nothing of it is
    trained on."""
    calls = sorted(calls, key=lambda c: c.index)
    grouped = chains(calls)
    samples = [sample_trajectory(chain, example, len(calls)) for chain in grouped]
    last = next((s for s, chain in zip(samples, grouped) if chain[-1] is calls[-1]), None) if calls else None
    t = Trajectory(example=example, prompt_ids=list(last.prompt_ids) if last else list(prompt_ids))
    if last is not None:
        t.response_ids, t.loss_mask = list(last.response_ids), list(last.loss_mask)
        t.turn_ids, t.engine_logprobs = list(last.turn_ids), list(last.engine_logprobs)
        t.observations = [o for s in samples for o in s.observations]
    t.turn_texts = [c.text for c in calls]
    t.turn_rewards = [c.reward for c in calls]
    t.turn_versions = [c.version for c in calls]
    t.turn_times = [(c.started, c.ended) for c in calls]
    t.levels = ["low"] * len(calls)
    for s in samples:
        s.turn_versions = list(t.turn_versions)
        s.turn_rewards = list(t.turn_rewards)
        s.turn_texts = list(t.turn_texts)
    t.samples = samples
    t.outcome, t.finish = float(outcome), finish
    t.info.update(info or {})
    t.info.update(calls=float(len(calls)), samples=float(len(samples)),
                  merged_frac=merged_fraction(calls, len(samples)))
    sample_of = {c.index: k for k, chain in enumerate(grouped) for c in chain}
    t.info["gateway_calls"] = [   # for traces: what each call read and answered
        {"messages": c.messages, "tools": [tool.get("function", {}).get("name") for tool in c.tools],
         "message": c.message, "prompt_tokens": len(c.prompt_ids), "completion_tokens": len(c.completion_ids),
         "version": c.version, "sample": sample_of[c.index], "id": c.completion_id, "finish": c.finish,
         **({"traceparent": c.traceparent} if c.traceparent else {})}
        for c in calls]
    return t


def training_rows(trajs: Sequence[Trajectory]) -> tuple[list[Trajectory], list[int]]:
    """(the rows the trainer trains on, the episode each belongs to): an episode's samples, or
    the trajectory itself where it has none (every built-in environment)."""
    rows, episode_of = [], []
    for e, t in enumerate(trajs):
        for row in t.samples or [t]:
            rows.append(row)
            episode_of.append(e)
    return rows, episode_of


def episode_view(trajs: Sequence[Trajectory]) -> tuple[list[Trajectory], list[tuple[int, int]]]:
    """Each episode as one trajectory for the advantage functions, and where each training row
    sits in it: (the views, one per episode; per row of `training_rows`, (episode, offset of
    the row's response within its view's response)). A view is the first sample's prompt, then
    every sample's response end to end (turn ids are the episode's call indices throughout), a
    masked token between two samples (where the program edited its context: turn-level
    algorithms find the first turn's end at the first masked token, as after a tool result), with
    the episode's reward, per-call rewards, levels and versions. An episode of one sample (or a
    built-in trajectory) is its own view, unchanged."""
    views: list[Trajectory] = []
    placement: list[tuple[int, int]] = []
    for e, t in enumerate(trajs):
        if not t.samples:
            views.append(t)
            placement.append((e, 0))
            continue
        view = Trajectory(example=t.example, prompt_ids=list(t.samples[0].prompt_ids))
        for k, s in enumerate(t.samples):
            if k:   # one masked token where the context was edited: the algorithms' "observation" mark
                view.add_observation(view.turn_ids[-1] if view.turn_ids else 0, [0], "")
            placement.append((e, len(view.response_ids)))
            view.response_ids += s.response_ids
            view.loss_mask += s.loss_mask
            view.turn_ids += s.turn_ids
            view.engine_logprobs += s.engine_logprobs
        # reward.teacher's logprobs (and top_k's), laid out like the engine's
        for name, none in (("teacher_logprobs", 0.0), ("teacher_top_ids", []), ("teacher_top_logprobs", [])):
            if any(getattr(s, name) for s in t.samples):
                setattr(view, name, [x for k, s in enumerate(t.samples)
                                     for x in [none] * bool(k) + (getattr(s, name) or [none] * len(s.response_ids))])
        view.turn_texts, view.turn_rewards = list(t.turn_texts), list(t.turn_rewards)
        view.levels, view.turn_versions = list(t.levels), list(t.turn_versions)
        view.outcome, view.finish, view.info = t.outcome, t.finish, t.info
        view.rewards, view.extra_reward, view.outcome_weight = t.rewards, t.extra_reward, t.outcome_weight
        views.append(view)
    return views, placement
