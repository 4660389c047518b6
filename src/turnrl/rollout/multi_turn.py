"""The multi-turn rollout loop: every trajectory advances on its own.

    every trajectory's first turn goes to the engine
    each engine step: the trajectories whose turn finished go to their environment (a thread
        pool: tool runs, searches, feedback) while the engine goes on with the others
    `observation_lag` engine steps later the environment's answer rejoins the batch as the
        next turn's context (observation tokens with loss mask 0), or the trajectory ends

So a tool call does not stop the batch: on vLLM the engine keeps decoding the other
trajectories while it runs (continuous batching across turns). An engine that only generates
a whole batch (transformers, test fakes) gets each turn of all live trajectories in one call,
as in a turn-by-turn loop.

When an answer rejoins is the `rejoin` policy:

- `lag` (the default): `observation_lag` engine steps after its turn ended. The schedule counts
  engine steps, never wall time, so a rollout repeats itself exactly for the same engine seed,
  weights and prompts: an answer not back when it is due is waited for, and meanwhile nothing
  decodes. With lag 0 every turn's answer is waited for at once, so a slow tool stalls the batch.
- `ready`: as soon as it is back. Every engine step polls the pending answers without blocking
  and those back join the next step, in trajectory order; the loop blocks only when the engine
  has nothing left to decode, and then only until the first answer is back. Tool latency hides
  behind the other trajectories' decoding, but the batch each step decodes depends on how long
  the tools took, so on an engine whose sampling depends on the batch (vLLM's own generator) a
  rerun is not token-identical. `observation_lag` does not apply.

Token in, token out: the ids the engine sampled go into the trajectory unchanged, with the
engine's logprob for each; observations are tokenized once (see `ChatFormat`).

Environments are the user's code: one that raises in its factory, `reset` or `step` ends that
trajectory (finish `env_error`, the exception in `info["env_error"]`) and the others go on; the
caller decides how many such errors a step may have (`env.max_error_fraction`). An environment
whose `step` is a coroutine function runs on an event loop beside the thread pool, every
trajectory's pending step in flight at once.
"""
from __future__ import annotations

import asyncio
import heapq
import inspect
import threading
import time
import zlib
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from typing import Callable, Mapping, Protocol, Sequence

from tqdm.auto import tqdm

from turnrl.envs.base import Env, StepResult
from turnrl.rollout.chat import ChatFormat

ENV_ERROR = "env_error"   # Trajectory.finish of a trajectory its environment's exception ended


@dataclass
class Sample:
    """One policy turn from an engine."""
    token_ids: list[int]
    logprobs: list[float]   # logprob of each sampled id under the engine's (unscaled) model
    finish: str             # "stop": a stop string or end of sequence; "length": max tokens hit


class Engine(Protocol):
    def generate(self, prompts: Sequence[Sequence[int]], *, max_tokens: Sequence[int],
                 stop: Sequence[str], temperature: float, top_p: float,
                 seeds: Sequence[int]) -> list[Sample]: ...


class Stepper(Protocol):
    """An engine driven one step at a time (an engine's optional `stepper(stop=, temperature=,
    top_p=)` returns one; `BatchStepper` makes one of any `Engine`)."""
    def add(self, key: int, prompt: Sequence[int], max_tokens: int, seed: int | None) -> None: ...
    def step(self) -> list[tuple[int, Sample]]: ...   # the requests that finished in this step
    def busy(self) -> bool: ...
    def abort(self) -> None: ...                      # drop every unfinished request


class BatchStepper:
    """A whole-batch `generate` as a stepper: one step generates everything added since the
    last, so all trajectories whose turns are due together share one call."""

    def __init__(self, engine: Engine, *, stop: Sequence[str], temperature: float, top_p: float):
        self.engine, self.options = engine, dict(stop=stop, temperature=temperature, top_p=top_p)
        self.queue: list[tuple[int, Sequence[int], int, int | None]] = []

    def add(self, key: int, prompt: Sequence[int], max_tokens: int, seed: int | None) -> None:
        self.queue.append((key, prompt, max_tokens, seed))

    def step(self) -> list[tuple[int, Sample]]:
        batch, self.queue = self.queue, []
        samples = self.engine.generate([p for _, p, _, _ in batch], max_tokens=[m for _, _, m, _ in batch],
                                       seeds=[s for *_, s in batch], **self.options)
        return [(key, sample) for (key, *_), sample in zip(batch, samples)]

    def busy(self) -> bool:
        return bool(self.queue)

    def abort(self) -> None:
        self.queue = []


@dataclass
class Budgets:
    max_turns: int
    max_tokens_per_turn: int
    max_tokens_total: int        # response tokens: policy and observation tokens after the prompt
    max_context: int = 1 << 30   # prompt + response: the engine's context length


@dataclass
class Trajectory:
    example: dict
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)         # 1 = sampled by the policy
    turn_ids: list[int] = field(default_factory=list)          # turn of each response token
    engine_logprobs: list[float] = field(default_factory=list)  # 0.0 where loss_mask is 0
    turn_texts: list[str] = field(default_factory=list)
    observations: list[str] = field(default_factory=list)
    turn_rewards: list[float] = field(default_factory=list)
    levels: list[str] = field(default_factory=list)             # each policy turn's level: low | high
    outcome: float = 0.0
    finish: str = ""        # answer | no_action | max_turns | token_budget | truncated | env_error
    info: dict = field(default_factory=dict)
    rewards: dict[str, float] = field(default_factory=dict)     # reward functions' values, by name
    extra_reward: float = 0.0                                   # their weighted sum
    # wall-clock (time.time()) start and end of each policy turn's generation and of each
    # environment step, for traces and timing metrics
    turn_times: list[tuple[float, float]] = field(default_factory=list)
    env_times: list[tuple[float, float]] = field(default_factory=list)

    @property
    def num_turns(self) -> int:
        return len(self.turn_texts)

    @property
    def reward(self) -> float:
        """What training maximizes: the environment's outcome plus the reward functions'."""
        return self.outcome + self.extra_reward

    @property
    def first_observation(self) -> int:
        """Index in response_ids of the first observation token (len if none)."""
        return next((i for i, m in enumerate(self.loss_mask) if m == 0), len(self.response_ids))

    def policy_tokens(self) -> int:
        return sum(self.loss_mask)

    def add_turn(self, turn: int, ids: Sequence[int], logprobs: Sequence[float], text: str,
                 level: str = "low") -> None:
        """Append a policy turn: the sampled ids exactly, trained on (mask 1)."""
        self.response_ids += ids
        self.loss_mask += [1] * len(ids)
        self.turn_ids += [turn] * len(ids)
        self.engine_logprobs += list(logprobs)
        self.turn_texts.append(text)
        self.levels.append(level)

    def add_observation(self, turn: int, ids: Sequence[int], text: str) -> None:
        """Append environment tokens after `turn`: never trained on (mask 0)."""
        self.response_ids += ids
        self.loss_mask += [0] * len(ids)
        self.turn_ids += [turn] * len(ids)
        self.engine_logprobs += [0.0] * len(ids)
        self.observations.append(text)

    def record(self, result: StepResult) -> bool:
        """Take the environment's answer to the last turn; True when the trajectory ended."""
        self.turn_rewards.append(float(result.reward))
        self.info.update(result.info)
        if result.done:
            self.outcome = float(result.info.get("outcome", result.reward))
            self.finish = str(result.info.get("reason", "done"))
        return result.done


def _seed(base: int, index: int, turn: int) -> int:
    return zlib.crc32(f"{base}:{index}:{turn}".encode()) & 0x7FFFFFFF


def level_of(env: Env, turn: int) -> str:
    """The hierarchy level of policy turn `turn`: an environment with two levels (math_refine's
    solver and feedback) says so with `role(turn)`; every turn of any other is "low"."""
    role = getattr(env, "role", None)
    if role is None:
        return "low"
    level = role(turn)
    if level not in ("low", "high"):
        raise ValueError(f"{type(env).__name__}.role({turn}) returned {level!r}; it must return 'low' or 'high'")
    return level


def error_text(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:300]}" if text else type(exc).__name__


def error_result(exc: BaseException) -> StepResult:
    """The end of a trajectory whose environment raised."""
    return StepResult(None, 0.0, True, {"outcome": 0.0, "reason": ENV_ERROR, "env_error": error_text(exc)})


def _safe_step(env: Env, text: str) -> tuple[StepResult, tuple[float, float]]:
    """The environment's answer (an env_error result if it raised) and when it ran."""
    start = time.time()
    try:
        result = env.step(text)
    except Exception as exc:   # noqa: BLE001 - the environment is user code: end this trajectory only
        result = error_result(exc)
    return result, (start, time.time())


async def _safe_astep(env: Env, text: str) -> tuple[StepResult, tuple[float, float]]:
    start = time.time()
    try:
        result = await env.step(text)
    except Exception as exc:   # noqa: BLE001
        result = error_result(exc)
    return result, (start, time.time())


class _EventLoop:
    """An asyncio loop on a thread of its own, for environments whose `step` is a coroutine
    function: their steps run concurrently, each returned as a concurrent.futures.Future."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="turnrl-env-loop", daemon=True)
        self.thread.start()

    def submit(self, coroutine) -> Future:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()


REJOIN = ("lag", "ready")


def observation_texts(observation: str | Sequence[str] | None) -> tuple[str | list[str], str]:
    """(what the chat format renders: one message or several, the text a trajectory keeps)."""
    if observation is None or isinstance(observation, str):
        return observation or "", observation or ""
    messages = [str(m) for m in observation]
    return messages, "\n".join(messages)


def _start(make_env: Callable[[], Env], example: dict, fmt: ChatFormat) -> tuple[Env | None, Trajectory]:
    """A fresh environment reset on `example`, and its trajectory; an environment that raises
    gives (None, a trajectory already ended with env_error and no response)."""
    try:
        env = make_env()
        first = env.reset(example)
        prompt = fmt.prompt_ids(env.system_prompt, first, getattr(env, "tools", None))
        return env, Trajectory(example=example, prompt_ids=prompt)
    except Exception as exc:   # noqa: BLE001
        t = Trajectory(example=example, prompt_ids=fmt.prompt_ids("", str(example.get("prompt", ""))))
        t.record(error_result(exc))
        return None, t


def run_rollouts(engine: Engine | Mapping[str, Engine], examples: Sequence[dict], make_env: Callable[[], Env],
                 fmt: ChatFormat, budgets: Budgets, *, n: int = 1, temperature: float = 1.0,
                 top_p: float = 1.0, seed: int | None = None, env_workers: int = 2,
                 observation_lag: int = 0, rejoin: str = "lag", progress: bool = False,
                 desc: str = "rollout") -> list[Trajectory]:
    """Roll out `n` trajectories per example; trajectory i belongs to group i // n.

    `engine` is one engine for every turn, or one per level ({"low": solver, "high": feedback
    model}) when two models share a conversation: each turn goes to the engine of its level
    (`level_of`).

    `rejoin`: when an environment's answer rejoins the batch: `lag` (after `observation_lag`
    engine steps, waited for if not back; 0: wait for it at once; reproducible) or `ready` (as
    soon as it is back, polled every engine step; hides tool latency, timing-dependent).

    With a `seed`, every (trajectory, turn) samples with its own derived seed where the engine
    takes one (transformers), so a rerun gives the same trajectories whatever the batching;
    without one the engine's own generator is used (faster on vLLM)."""
    if rejoin not in REJOIN:
        raise ValueError(f"rejoin = {rejoin!r}: must be one of {', '.join(REJOIN)}")
    envs: list[Env | None] = []
    trajs: list[Trajectory] = []
    for example in examples:
        for _ in range(n):
            env, t = _start(make_env, example, fmt)
            envs.append(env)
            trajs.append(t)
    live = [e for e in envs if e is not None]
    if not live:
        return trajs

    options = dict(stop=tuple(live[0].stop), temperature=temperature, top_p=top_p)
    two_levels = isinstance(engine, Mapping)
    by_level = engine if two_levels else {"low": engine}
    steppers: dict[int, Stepper] = {}      # one per distinct engine, whatever levels it plays
    for e in by_level.values():
        if id(e) not in steppers:
            steppers[id(e)] = e.stepper(**options) if hasattr(e, "stepper") else BatchStepper(e, **options)
    turn_of = [0] * len(trajs)
    level_at: list[str] = ["low"] * len(trajs)   # the level of each trajectory's current turn
    asked_at = [0.0] * len(trajs)                # when its current turn went to the engine
    bar = tqdm(total=len(trajs), desc=desc, unit="traj", disable=not progress, leave=False)
    events = _EventLoop() if inspect.iscoroutinefunction(live[0].step) else None

    def env_step(i: int, text: str) -> Future:
        if events is not None:
            return events.submit(_safe_astep(envs[i], text))
        return pool.submit(_safe_step, envs[i], text)

    def start_turn(i: int) -> None:
        t, turn = trajs[i], turn_of[i]
        room = min(budgets.max_tokens_per_turn, budgets.max_tokens_total - len(t.response_ids),
                   budgets.max_context - len(t.prompt_ids) - len(t.response_ids))
        if room <= 0:                      # e.g. a prompt longer than the context
            t.finish = "token_budget"
            bar.update()
            return
        try:
            level = level_at[i] = level_of(envs[i], turn)
        except Exception as exc:   # noqa: BLE001 - a broken role() ends this trajectory
            t.record(error_result(exc))
            bar.update()
            return
        engine_of = by_level.get(level, by_level["low"])
        asked_at[i] = time.time()
        steppers[id(engine_of)].add(i, t.prompt_ids + t.response_ids, room,
                                    None if seed is None else _seed(seed, i, turn))

    def end_turn(i: int, sample: Sample, result: StepResult) -> None:
        """The environment's answer to trajectory i's turn: end it, or start its next turn."""
        t, turn = trajs[i], turn_of[i]
        if t.record(result):
            bar.update()
            return
        if turn == budgets.max_turns - 1:
            t.finish = "max_turns"
            bar.update()
            return
        rendered, text = observation_texts(result.observation)
        obs_ids = fmt.observation_ids(rendered, envs[i].observation_role, after_eos=fmt.ends_turn(sample.token_ids))
        if len(t.response_ids) + len(obs_ids) >= budgets.max_tokens_total:
            t.finish = "token_budget"
            bar.update()
            return
        t.add_observation(turn, obs_ids, text)
        turn_of[i] += 1
        start_turn(i)

    def take(entry: tuple[int, int, Sample, Future]) -> None:
        _, i, sample, work = entry
        result, ran = work.result()
        trajs[i].env_times.append(ran)
        end_turn(i, sample, result)

    # answers on their way: (engine step they are due at, trajectory, its last sample, the env's work);
    # a heap by due step with rejoin "lag", in arrival order with "ready"
    waiting: list[tuple[int, int, Sample, Future]] = []
    step = 0
    with ThreadPoolExecutor(max_workers=env_workers) as pool:
        try:
            for i in range(len(trajs)):
                if envs[i] is not None:
                    start_turn(i)
                else:             # its environment failed to start
                    bar.update()
            while True:
                if rejoin == "lag":
                    while waiting and waiting[0][0] <= step:     # due answers, in a fixed order
                        take(heapq.heappop(waiting))
                else:                                            # the answers back by now, without blocking
                    back, pending = [], []
                    for entry in waiting:
                        (back if entry[3].done() else pending).append(entry)
                    waiting = pending
                    for entry in sorted(back, key=lambda e: e[1]):
                        take(entry)
                busy = [s for s in steppers.values() if s.busy()]
                if not busy:
                    if not waiting:
                        break
                    if rejoin == "lag":
                        step = waiting[0][0]                  # nothing to decode: the next answer
                    else:                                     # nothing to decode: until one is back
                        wait_futures([e[3] for e in waiting], return_when=FIRST_COMPLETED)
                    continue
                step += 1
                for stepper in busy:
                    for i, sample in stepper.step():
                        text = fmt.tokenizer.decode(sample.token_ids, skip_special_tokens=False)
                        trajs[i].add_turn(turn_of[i], sample.token_ids, sample.logprobs, text, level_at[i])
                        trajs[i].turn_times.append((asked_at[i], time.time()))
                        if sample.finish == "length":   # cut by the token limit: no complete action
                            trajs[i].turn_rewards.append(0.0)
                            trajs[i].finish = "truncated"
                            bar.update()
                            continue
                        entry = (step + observation_lag, i, sample, env_step(i, text))
                        if rejoin == "lag":
                            heapq.heappush(waiting, entry)
                        else:
                            waiting.append(entry)
        finally:
            for stepper in steppers.values():
                stepper.abort()
            if events is not None:
                events.close()
            bar.close()
    return trajs


def replay(env: Env, fmt: ChatFormat, example: dict, turns: Sequence[str]) -> Trajectory:
    """A trajectory from scripted policy turns, assembled exactly as `run_rollouts` does:
    used for the warm start's demonstrations and to test environments step by step. A turn
    that does not end with one of the environment's stop strings ends, as a model's would,
    with the end-of-turn token (`ChatFormat.end_of_turn_id`; trained on, like the rest of the turn)."""
    first = env.reset(example)
    t = Trajectory(example=example, prompt_ids=fmt.prompt_ids(env.system_prompt, first, getattr(env, "tools", None)))
    for turn, text in enumerate(turns):
        ids = fmt.encode(text)
        if not text.endswith(tuple(env.stop)) and fmt.end_of_turn_id is not None:
            ids.append(fmt.end_of_turn_id)
        t.add_turn(turn, ids, [0.0] * len(ids), text, level_of(env, turn))
        start = time.time()
        result = env.step(text)
        if inspect.isawaitable(result):
            result = asyncio.run(result)
        t.env_times.append((start, time.time()))
        if t.record(result):
            break
        rendered, shown = observation_texts(result.observation)
        t.add_observation(turn, fmt.observation_ids(rendered, env.observation_role, after_eos=fmt.ends_turn(ids)),
                          shown)
    return t


def tool_rates(trajs: Sequence[Trajectory]) -> dict[str, float]:
    """For a tool environment (code_tool, search; its info has `tool_ok` once a call was
    made): the share of trajectories that called the tool and whose last call ran. {} otherwise."""
    if not any("tool_ok" in t.info for t in trajs):
        return {}
    return {"tool_call_rate": sum("tool_ok" in t.info for t in trajs) / len(trajs),
            "tool_success_rate": sum(bool(t.info.get("tool_ok")) for t in trajs) / len(trajs)}
