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
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Protocol, Sequence

from tqdm.auto import tqdm

from turnrl.envs.base import STEP_RESULT_EXPECTED, Env, StepResult, opened_problem, step_result_problem
from turnrl.errors import one_line
from turnrl.rollout.chat import ChatFormat

ENV_ERROR = "env_error"   # Trajectory.finish of a trajectory its environment's exception ended


@dataclass
class Sample:
    """One policy turn from an engine."""
    token_ids: list[int]
    logprobs: list[float]   # logprob of each sampled id under the engine's (unscaled) model
    finish: str             # "stop": a stop string or end of sequence; "length": max tokens hit
    prompt_tokens: int = 0  # the request's prompt ...
    cached_tokens: int = 0  # ... and how much of it the engine's prefix cache served (vLLM's count)


class Engine(Protocol):
    def generate(self, prompts: Sequence[Sequence[int]], *, max_tokens: Sequence[int],
                 stop: Sequence[str], temperature: float, top_p: float,
                 seeds: Sequence[int]) -> list[Sample]: ...


class Stepper(Protocol):
    """An engine driven one step at a time (an engine's optional `stepper(stop=, temperature=,
    top_p=)` returns one; `BatchStepper` makes one of any `Engine`). `options` of `add`: one
    request's own temperature, top_p and stop (the agent gateway's calls), over the stepper's."""
    def add(self, key: int, prompt: Sequence[int], max_tokens: int, seed: int | None,
            options: dict | None = None) -> None: ...
    def step(self) -> list[tuple[int, Sample]]: ...   # the requests that finished in this step
    def busy(self) -> bool: ...
    def abort(self) -> None: ...                      # drop every unfinished request


class BatchStepper:
    """A whole-batch `generate` as a stepper: one step generates everything added since the
    last, so all trajectories whose turns are due together share one call (one call per
    distinct set of request options)."""

    def __init__(self, engine: Engine, *, stop: Sequence[str], temperature: float, top_p: float):
        self.engine, self.options = engine, dict(stop=tuple(stop), temperature=temperature, top_p=top_p)
        self.queue: list[tuple[int, Sequence[int], int, int | None, dict]] = []

    def add(self, key: int, prompt: Sequence[int], max_tokens: int, seed: int | None,
            options: dict | None = None) -> None:
        merged = {**self.options, **{k: v for k, v in (options or {}).items() if k in self.options}}
        merged["stop"] = tuple(merged["stop"])
        self.queue.append((key, prompt, max_tokens, seed, merged))

    def step(self) -> list[tuple[int, Sample]]:
        batch, self.queue = self.queue, []
        out = []
        for options in {tuple(sorted(o.items())): o for *_, o in batch}.values():
            part = [entry for entry in batch if entry[4] == options]
            samples = self.engine.generate([p for _, p, *_ in part], max_tokens=[m for _, _, m, *_ in part],
                                           seeds=[s for *_, s, _ in part], **options)
            out += [(key, sample) for (key, *_), sample in zip(part, samples)]
        return out

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
    step_timeout_s: float | None = None   # one environment step (env.step_timeout_s); None: no limit


@dataclass
class Trajectory:
    example: dict
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)         # 1 = sampled by the policy
    turn_ids: list[int] = field(default_factory=list)          # turn of each response token
    engine_logprobs: list[float] = field(default_factory=list)  # 0.0 where loss_mask is 0
    teacher_logprobs: list[float] = field(default_factory=list)  # reward.teacher's (opd), 0.0 where loss_mask is 0
    # reward.teacher.top_k: the teacher's k most likely tokens and their logprobs at each response
    # token's position, [] where loss_mask is 0
    teacher_top_ids: list[list[int]] = field(default_factory=list)
    teacher_top_logprobs: list[list[float]] = field(default_factory=list)
    turn_texts: list[str] = field(default_factory=list)
    observations: list[str] = field(default_factory=list)
    turn_rewards: list[float] = field(default_factory=list)
    levels: list[str] = field(default_factory=list)             # each policy turn's level: low | high
    outcome: float = 0.0
    finish: str = ""        # answer | no_action | max_turns | token_budget | truncated | env_error
    info: dict = field(default_factory=dict)
    rewards: dict[str, float] = field(default_factory=dict)     # reward functions' values, by name
    extra_reward: float = 0.0                                   # their weighted sum
    outcome_weight: float = 1.0                                 # reward.outcome_weight: the outcome's in the reward
    # wall-clock (time.time()) start and end of each policy turn's generation and of each
    # environment step, for traces and timing metrics
    turn_times: list[tuple[float, float]] = field(default_factory=list)
    env_times: list[tuple[float, float]] = field(default_factory=list)
    # the policy version that sampled each policy turn (asynchronous training; see rollout.stream)
    turn_versions: list[int] = field(default_factory=list)
    # an agent program's episode (turnrl.gateway): the samples its calls merged into, each a
    # Trajectory the trainer trains on; empty: this trajectory is its own (and only) sample
    samples: list["Trajectory"] = field(default_factory=list)
    # the conversation in the OpenAI messages format, as the step loop held it (system, user, each
    # turn's assistant message and the environment's messages after it) and its tools: a correct
    # one is SFT data that renders back into these tokens (turnrl.gateway.conversations). An agent
    # program's sample: its last call's request messages and the answer (gateway.samples); its
    # episode: empty (every call's messages are in info["gateway_calls"])
    messages: list[dict] = field(default_factory=list)
    tools: list[dict] = field(default_factory=list)
    # prompt tokens of its turns' requests the engine computed (prefilled), and those its prefix
    # cache served: a later turn re-sends the whole conversation
    prefill_tokens: int = 0
    cached_tokens: int = 0

    @property
    def num_turns(self) -> int:
        return len(self.turn_texts)

    @property
    def reward(self) -> float:
        """What training maximizes: the environment's outcome (or, where its grader gives partial
        credit, `info["partial_credit"]`: reasoning-gym's score_answer), times reward.outcome_weight,
        plus the reward functions'."""
        return self.outcome_weight * float(self.info.get("partial_credit", self.outcome)) + self.extra_reward

    @property
    def first_observation(self) -> int:
        """Index in response_ids of the first observation token (len if none)."""
        return next((i for i, m in enumerate(self.loss_mask) if m == 0), len(self.response_ids))

    @property
    def shown_prompt(self) -> str:
        """What the model was shown first: the conversation's first user message (what the
        environment's reset returned: a game's first observation, not the row's `episode seed 3`),
        else (no conversation recorded: an agent program's episode) the row's prompt."""
        first = next((m.get("content") for m in self.messages if m.get("role") == "user"), None)
        if isinstance(first, str) and first:
            return first
        return str(self.example.get("prompt", "") or "")

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

    def end_untrained(self, reason: str) -> None:
        """End as an environment error (`ENV_ERROR`) for `reason`, none of it trained on (the loss
        mask of it and of each of its samples cleared): counted with env.max_error_fraction, never
        a silent zero. For what fails on a trajectory after its rollout (reward.teacher's logprobs)."""
        self.finish = ENV_ERROR
        self.info["env_error"] = reason
        for row in self.samples or [self]:
            row.loss_mask = [0] * len(row.response_ids)

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


def stop_strings(env: Env, fmt: ChatFormat) -> tuple[str, ...]:
    """What ends a policy turn of `env`: its `stop` strings (params' env.stop replaces them), or,
    where it has none (the ecosystem adapters), the chat template's end-of-turn token, which the
    engines also stop at as the model's eos: the same for a model whose template's end of turn is
    not its eos."""
    own = own_stops(env)
    if own:
        return own
    end = fmt.end_of_turn
    return (end,) if end else ()


def own_stops(env: Env) -> tuple[str, ...]:
    """The environment's `stop` strings (one string given alone is one stop string, not its characters)."""
    stop = getattr(env, "stop", ()) or ()
    return tuple(s for s in ((stop,) if isinstance(stop, str) else stop) if s)


def error_text(exc: BaseException) -> str:
    return one_line(exc, 400)


def error_result(exc: BaseException) -> StepResult:
    """The end of a trajectory whose environment raised."""
    return StepResult(None, 0.0, True, {"outcome": 0.0, "reason": ENV_ERROR, "env_error": error_text(exc)})


class MalformedStep(ValueError):
    """An environment's `step` returned something other than a good `StepResult`."""


class StepTimeout(TimeoutError):
    """An environment's `step` ran past env.step_timeout_s."""


def env_name(env: Env) -> str:
    """The plugin an environment comes from, for messages: module.Class."""
    cls = type(env)
    return f"{cls.__module__}.{cls.__qualname__}"


def checked(env: Env, result: object) -> StepResult:
    """`result` if it is a good StepResult, else the env_error end of the trajectory saying
    which plugin returned what, and what a step must return."""
    problem = step_result_problem(result)
    if problem is None:
        return result
    return error_result(malformed_step(env, problem))


def malformed_step(env: Env, problem: str) -> MalformedStep:
    """The error of a `step` that returned `problem` (step_result_problem), naming the plugin."""
    return MalformedStep(f"{env_name(env)}.step {problem}; it must return {STEP_RESULT_EXPECTED}")


def _safe_step(env: Env, text: str) -> tuple[StepResult, tuple[float, float]]:
    """The environment's answer (an env_error result if it raised or returned garbage) and when it ran."""
    start = time.time()
    try:
        result = checked(env, env.step(text))
    except Exception as exc:   # noqa: BLE001 - the environment is user code: end this trajectory only
        result = error_result(exc)
    return result, (start, time.time())


async def _safe_astep(env: Env, text: str) -> tuple[StepResult, tuple[float, float]]:
    start = time.time()
    try:
        result = checked(env, await env.step(text))
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


def start_trajectory(make_env: Callable[[], Env], example: dict, fmt: ChatFormat) -> tuple[Env | None, Trajectory]:
    """A fresh environment reset on `example`, and its trajectory; an environment that raises
    gives (None, a trajectory already ended with env_error and no response)."""
    try:
        env = make_env()
        first = env.reset(example) if hasattr(env, "reset") else None
        opened(env, first)
        prompt = fmt.prompt_ids(env.system_prompt, first, getattr(env, "tools", None))
        return env, _opened(Trajectory(example=example, prompt_ids=prompt), env, first)
    except Exception as exc:   # noqa: BLE001
        t = Trajectory(example=example, prompt_ids=fmt.prompt_ids("", str(example.get("prompt", ""))))
        t.record(error_result(exc))
        return None, t


def opened(env: Any, first: Any) -> None:
    """MalformedStep naming the plugin when a factory made no environment, or its `reset`
    returned no first message (turnrl.envs.base.opened_problem)."""
    problem = opened_problem(env, first)
    if problem is not None:
        raise MalformedStep(f"{env_name(env)}: {problem}" if hasattr(env, "reset") else problem)


def _opened(t: Trajectory, env: Env, first: str) -> Trajectory:
    """`t` with the conversation's opening messages (system, user) and the environment's tools."""
    t.messages = ([{"role": "system", "content": env.system_prompt}] if env.system_prompt else []) + \
        [{"role": "user", "content": first}]
    t.tools = list(getattr(env, "tools", None) or [])
    return t


def _said(t: Trajectory, fmt: ChatFormat, text: str) -> None:
    """A policy turn's text as the conversation's assistant message (without the token that closed it)."""
    for end in (fmt.end_of_turn, fmt.eos_token):
        if end and text.endswith(end):
            text = text[:-len(end)]
    t.messages.append({"role": "assistant", "content": text})


def answered_calls(result: StepResult) -> list[str | None] | None:
    """The ids of the calls an observation's results answer, one per result (None: not known),
    where the environment names them (`info["tool_call_ids"]`, as the `tools` environment does
    for a model that writes ids, Mistral v0.3's format); else None."""
    ids = result.info.get("tool_call_ids") if isinstance(result.info, dict) else None
    return [None if i is None else str(i) for i in ids] if isinstance(ids, (list, tuple)) else None


def _heard(t: Trajectory, env: Env, rendered: str | list[str], call_ids: Sequence[str | None] | None = None) -> None:
    """The environment's answer as the conversation's messages, in the environment's role ("tool"
    even where this template renders it as a user message: whoever renders the conversation adapts
    it to its own template, ChatFormat.messages_for_template, as a teacher of another chat does),
    each naming the call it answers where that is known."""
    role = env.observation_role
    messages = [rendered] if isinstance(rendered, str) else rendered
    ids = list(call_ids) if call_ids and len(call_ids) == len(messages) else [None] * len(messages)
    t.messages += [{"role": role, "content": m, **({"tool_call_id": i} if i else {})} for m, i in zip(messages, ids)]


def run_rollouts(engine: Engine | Mapping[str, Engine], examples: Sequence[dict], make_env: Callable[[], Env],
                 fmt: ChatFormat, budgets: Budgets, *, n: int = 1, temperature: float = 1.0,
                 top_p: float = 1.0, seed: int | None = None, env_workers: int = 2,
                 observation_lag: int = 0, rejoin: str = "lag", progress: bool = False,
                 desc: str = "rollout", on_group_done: Callable[[list[Trajectory]], None] | None = None,
                 on_trajectory_done: Callable[[Trajectory], None] | None = None) -> list[Trajectory]:
    """Roll out `n` trajectories per example; trajectory i belongs to group i // n.
    `on_trajectory_done(t)` is called (on this thread) as each trajectory ends, and
    `on_group_done(group)` as each group's n have ended, e.g. to score them while the others
    generate (turnrl.rollout.scored).

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
            env, t = start_trajectory(make_env, example, fmt)
            envs.append(env)
            trajs.append(t)
    if not any(e is not None for e in envs):
        for t in trajs if on_trajectory_done is not None else ():
            on_trajectory_done(t)
        for g in range(len(examples)) if on_group_done is not None else ():
            on_group_done(trajs[g * n:(g + 1) * n])
        return trajs
    rollout = BatchRollout(engine, envs, trajs, fmt, budgets, temperature=temperature, top_p=top_p, seed=seed,
                       observation_lag=observation_lag, rejoin=rejoin, progress=progress, desc=desc,
                       group_size=n, on_group_done=on_group_done, on_trajectory_done=on_trajectory_done)
    pool = ThreadPoolExecutor(max_workers=env_workers, thread_name_prefix="turnrl-env")
    try:
        rollout.run(pool)
    finally:   # not waiting for a step that ran past env.step_timeout_s: it finishes on its own thread
        pool.shutdown(wait=not rollout.timed_out, cancel_futures=True)
    return trajs


# An answer on its way: (the engine step it is due at, trajectory, its last sample, the env's work).
_Pending = tuple[int, int, Sample, Future]


class TurnEngine:
    """The turn-by-turn core of a rollout, shared by `run_rollouts` (one fixed batch) and
    turnrl.rollout.stream's `Stream` (trajectories that come and go while training goes on).

    It holds trajectories by index: each one's environment, current turn, that turn's level and
    when it went to the engine. `admit(i, env, t)` starts trajectory i; every policy turn goes to
    the engine of its level (`start_turn`, within the budgets); `decode` runs one engine step and
    sends each finished turn to its environment (`env_step`: the thread pool `pool`, or an event
    loop for coroutine steps); `take_answers` rejoins the answers by the `rejoin` rule ("lag":
    `observation_lag` engine steps later, in a fixed order; "ready": as they are back), and
    `end_turn` appends the observation and starts the next turn or ends the trajectory.

    A subclass says what ending means (`end(i, finish)`: count its group, hand it out) and when to
    step (its `run`); `release(i)` forgets a trajectory that has left. The engine's sampling
    options come from the probe environment: its stop strings (`stop_strings`: params' env.stop,
    else the chat template's end of turn) and whether its `step` is a coroutine function.
    """

    def __init__(self, engine: Engine | Mapping[str, Engine], fmt: ChatFormat, budgets: Budgets, probe: Env, *,
                 temperature: float, top_p: float, seed: int | None = None, observation_lag: int = 0,
                 rejoin: str = "ready"):
        if rejoin not in REJOIN:
            raise ValueError(f"rejoin = {rejoin!r}: must be one of {', '.join(REJOIN)}")
        self.fmt, self.budgets, self.seed = fmt, budgets, seed
        self.observation_lag, self.rejoin = observation_lag, rejoin
        self.sampling = dict(stop=stop_strings(probe, fmt), temperature=temperature, top_p=top_p)
        self.by_level = engine if isinstance(engine, Mapping) else {"low": engine}
        self.steppers: dict[int, Stepper] = {}      # one per distinct engine, whatever levels it plays
        for e in self.by_level.values():
            self.stepper_of(e)
        self.envs: dict[int, Env | None] = {}
        self.trajs: dict[int, Trajectory] = {}
        self.turn_of: dict[int, int] = {}
        self.level_at: dict[int, str] = {}       # the level of each trajectory's current turn
        self.asked_at: dict[int, float] = {}     # when its current turn went to the engine
        self.events = _EventLoop() if inspect.iscoroutinefunction(getattr(probe, "step", None)) else None
        self.pool: ThreadPoolExecutor | None = None
        # a heap by due step with rejoin "lag", in arrival order with "ready"
        self.waiting: list[_Pending] = []
        self.step_due: dict[int, float] = {}     # when each trajectory's step in flight runs past its limit
        self.timed_out = 0                       # steps that ran past it
        self.step = 0

    def admit(self, i: int, env: Env | None, t: Trajectory) -> None:
        """Trajectory i (`start_trajectory`'s pair): its first turn goes to the engine, or, its
        environment having failed to start (None), it ends at once."""
        self.envs[i], self.trajs[i], self.turn_of[i], self.level_at[i] = env, t, 0, "low"
        if env is not None:
            self.start_turn(i)
        else:
            self.end(i)

    def release(self, i: int) -> Trajectory:
        """Forget trajectory i (ended, its group handed out); its trajectory."""
        for table in (self.envs, self.turn_of, self.level_at, self.asked_at, self.step_due):
            table.pop(i, None)
        return self.trajs.pop(i)

    def end(self, i: int, finish: str | None = None) -> None:
        """Trajectory i ended (`finish`: why, where the loop ended it rather than its
        environment). A subclass counts it; call this first."""
        if finish is not None:
            self.trajs[i].finish = finish

    def close(self) -> None:
        """Stop the engines' generation in flight and the event loop of coroutine steps."""
        for stepper in self.steppers.values():
            stepper.abort()
        if self.events is not None:
            self.events.close()

    def env_step(self, i: int, text: str) -> Future:
        limit = self.budgets.step_timeout_s
        if limit is not None:
            self.step_due[i] = time.time() + limit
        if self.events is not None:
            return self.events.submit(_safe_astep(self.envs[i], text))
        return self.pool.submit(_safe_step, self.envs[i], text)

    def overdue(self, entry: _Pending) -> bool:
        """Whether the environment step of `entry` has run past env.step_timeout_s."""
        due = self.step_due.get(entry[1])
        return due is not None and not entry[3].done() and time.time() >= due

    def next_due(self) -> float | None:
        """Seconds until the first waiting step runs past its limit (None: no limit)."""
        dues = [self.step_due[e[1]] for e in self.waiting if e[1] in self.step_due]
        return max(0.0, min(dues) - time.time()) if dues else None

    def start_turn(self, i: int) -> None:
        t, turn, b = self.trajs[i], self.turn_of[i], self.budgets
        room = min(b.max_tokens_per_turn, b.max_tokens_total - len(t.response_ids),
                   b.max_context - len(t.prompt_ids) - len(t.response_ids))
        if room <= 0:                      # e.g. a prompt longer than the context
            return self.end(i, "token_budget")
        try:
            level = self.level_at[i] = level_of(self.envs[i], turn)
        except Exception as exc:   # noqa: BLE001 - a broken role() ends this trajectory
            t.record(error_result(exc))
            return self.end(i)
        self.asked_at[i] = time.time()
        self.stepper_of(self.engine_for(i, level)).add(i, t.prompt_ids + t.response_ids, room,
                                                        None if self.seed is None else _seed(self.seed, i, turn))

    def engine_for(self, i: int, level: str) -> Engine:
        """The engine trajectory i's turn at `level` goes to: that level's (a subclass may send
        some trajectories elsewhere: a game's frozen opponent)."""
        return self.by_level.get(level, self.by_level["low"])

    def stepper_of(self, engine: Engine) -> Stepper:
        """The stepper of `engine`, made on first use with the rollout's sampling options."""
        if id(engine) not in self.steppers:
            self.steppers[id(engine)] = engine.stepper(**self.sampling) if hasattr(engine, "stepper") else \
                BatchStepper(engine, **self.sampling)
        return self.steppers[id(engine)]

    def end_turn(self, i: int, sample: Sample, result: StepResult) -> None:
        """The environment's answer to trajectory i's turn: end it, or start its next turn."""
        t, turn = self.trajs[i], self.turn_of[i]
        if t.record(result):
            return self.end(i)
        if turn == self.budgets.max_turns - 1:
            return self.end(i, "max_turns")
        rendered, text = observation_texts(result.observation)
        calls = answered_calls(result)
        obs_ids = self.fmt.observation_ids(rendered, self.envs[i].observation_role,
                                           after_eos=self.fmt.ends_turn(sample.token_ids), call_ids=calls)
        if len(t.response_ids) + len(obs_ids) >= self.budgets.max_tokens_total:
            return self.end(i, "token_budget")
        t.add_observation(turn, obs_ids, text)
        _heard(t, self.envs[i], rendered, calls)
        self.turn_of[i] += 1
        self.start_turn(i)

    def take(self, entry: _Pending) -> None:
        _, i, sample, work = entry
        due = self.step_due.pop(i, None)
        try:
            result, ran = work.result(timeout=None if due is None else max(0.0, due - time.time()))
        except FutureTimeout:   # the step runs on (a blocking call cannot be stopped); its trajectory ends
            work.cancel()
            self.timed_out += 1
            limit = self.budgets.step_timeout_s
            result = error_result(StepTimeout(f"{env_name(self.envs[i])}.step took longer than env.step_timeout_s = "
                                              f"{limit:g} s; make the step return sooner, or raise the limit"))
            ran = (due - limit, time.time())
        self.trajs[i].env_times.append(ran)
        self.end_turn(i, sample, result)

    def take_answers(self) -> None:
        """The answers that rejoin now: those due (lag, in a fixed order) or back (ready)."""
        if self.rejoin == "lag":
            while self.waiting and self.waiting[0][0] <= self.step:
                self.take(heapq.heappop(self.waiting))
            return
        back, pending = [], []                       # without blocking
        for entry in self.waiting:
            (back if entry[3].done() or self.overdue(entry) else pending).append(entry)
        self.waiting = pending
        for entry in sorted(back, key=lambda e: e[1]):
            self.take(entry)

    def decode(self, busy: list[Stepper]) -> None:
        """One engine step; each finished turn goes to its environment."""
        self.step += 1
        for stepper in busy:
            for i, sample in stepper.step():
                t = self.trajs[i]
                text = self.fmt.tokenizer.decode(sample.token_ids, skip_special_tokens=False)
                t.add_turn(self.turn_of[i], sample.token_ids, sample.logprobs, text, self.level_at[i])
                _said(t, self.fmt, text)
                t.prefill_tokens += sample.prompt_tokens - sample.cached_tokens
                t.cached_tokens += sample.cached_tokens
                t.turn_times.append((self.asked_at[i], time.time()))
                if sample.finish == "length":   # cut by the token limit: no complete action
                    t.turn_rewards.append(0.0)
                    self.end(i, "truncated")
                    continue
                entry = (self.step + self.observation_lag, i, sample, self.env_step(i, text))
                if self.rejoin == "lag":
                    heapq.heappush(self.waiting, entry)
                else:
                    self.waiting.append(entry)


class BatchRollout(TurnEngine):
    """One `run_rollouts` call: a fixed batch, groups of `group_size` in order, a progress bar.
    A subclass may say how the batch opens (`open`: every trajectory admitted at once here; a
    game's tables seat only who moves first) and keep trajectories of its own beyond the batch
    (indices from len(batch) on: neither counted nor handed out)."""

    def __init__(self, engine: Engine | Mapping[str, Engine], envs: list[Env | None], trajs: list[Trajectory],
                 fmt: ChatFormat, budgets: Budgets, *, temperature: float, top_p: float, seed: int | None,
                 observation_lag: int, rejoin: str, progress: bool, desc: str, group_size: int = 1,
                 on_group_done: Callable[[list[Trajectory]], None] | None = None,
                 on_trajectory_done: Callable[[Trajectory], None] | None = None):
        live = [e for e in envs if e is not None]
        super().__init__(engine, fmt, budgets, live[0], temperature=temperature, top_p=top_p, seed=seed,
                         observation_lag=observation_lag, rejoin=rejoin)
        self.batch, self.batch_envs = trajs, envs
        self.group_size, self.on_group_done, self.on_trajectory_done = group_size, on_group_done, on_trajectory_done
        self.left_in_group = [group_size] * (len(trajs) // group_size)   # trajectories not yet ended
        self.bar = tqdm(total=len(trajs), desc=desc, unit="traj", disable=not progress, leave=False)

    def open(self) -> None:
        """Start the batch: every trajectory's first turn."""
        for i, (env, t) in enumerate(zip(self.batch_envs, self.batch)):
            self.admit(i, env, t)

    def run(self, pool: ThreadPoolExecutor) -> None:
        self.pool = pool
        try:
            self.open()
            while True:
                self.take_answers()
                busy = [s for s in self.steppers.values() if s.busy()]
                if busy:
                    self.decode(busy)
                elif not self.waiting:
                    break
                elif self.rejoin == "lag":
                    self.step = self.waiting[0][0]            # nothing to decode: the next answer
                else:                                         # nothing to decode: until one is back, or late
                    wait_futures([e[3] for e in self.waiting], timeout=self.next_due(), return_when=FIRST_COMPLETED)
        finally:
            self.close()
            self.bar.close()

    def end(self, i: int, finish: str | None = None) -> None:
        super().end(i, finish)
        if i >= len(self.batch):   # a subclass's own trajectory, not the batch's
            return
        self.bar.update()
        if self.on_trajectory_done is not None:
            self.on_trajectory_done(self.batch[i])
        group = i // self.group_size
        self.left_in_group[group] -= 1
        if not self.left_in_group[group] and self.on_group_done is not None:
            self.on_group_done(self.batch[group * self.group_size:(group + 1) * self.group_size])


def replay(env: Env, fmt: ChatFormat, example: dict, turns: Sequence[str]) -> Trajectory:
    """A trajectory from scripted policy turns, assembled exactly as `run_rollouts` does:
    used for the warm start's demonstrations and to test environments step by step. A turn
    that does not end with one of the environment's stop strings ends, as a model's would,
    with the end-of-turn token (`ChatFormat.end_of_turn_id`; trained on, like the rest of the turn)."""
    first = env.reset(example) if hasattr(env, "reset") else None
    opened(env, first)
    t = Trajectory(example=example, prompt_ids=fmt.prompt_ids(env.system_prompt, first, getattr(env, "tools", None)))
    _opened(t, env, first)
    for turn, text in enumerate(turns):
        ids = fmt.encode(text)
        if not text.endswith(own_stops(env)) and fmt.end_of_turn_id is not None:
            ids.append(fmt.end_of_turn_id)
        t.add_turn(turn, ids, [0.0] * len(ids), text, level_of(env, turn))
        _said(t, fmt, text)
        start = time.time()
        result = env.step(text)
        if inspect.isawaitable(result):
            result = asyncio.run(result)
        if (problem := step_result_problem(result)) is not None:   # as a rollout's `checked`, but raised
            raise malformed_step(env, problem)
        t.env_times.append((start, time.time()))
        if t.record(result):
            break
        rendered, shown = observation_texts(result.observation)
        calls = answered_calls(result)
        t.add_observation(turn, fmt.observation_ids(rendered, env.observation_role, after_eos=fmt.ends_turn(ids),
                                                    call_ids=calls), shown)
        _heard(t, env, rendered, calls)
    return t


def tool_rates(trajs: Sequence[Trajectory]) -> dict[str, float]:
    """For a tool environment (code_tool, search, tools; its info has `tool_ok` once a call was
    made): the share of trajectories that called the tool and whose last call ran; and where the
    environment counts calls per tool (`info["tool_by_name"]` = {tool: [calls, failures]}, the
    `tools` environment), `tools/<name>/error_frac`: the share of the calls that reached the tool
    and failed (raised, timed out, unreachable). {} otherwise."""
    if not any("tool_ok" in t.info or t.info.get("tool_by_name") for t in trajs):
        return {}
    out = {"tool_call_rate": sum("tool_ok" in t.info for t in trajs) / len(trajs),
           "tool_success_rate": sum(bool(t.info.get("tool_ok")) for t in trajs) / len(trajs)}
    totals: dict[str, list[int]] = {}
    for t in trajs:
        by_name = t.info.get("tool_by_name")
        for name, (calls, failed) in (by_name.items() if isinstance(by_name, dict) else ()):
            total = totals.setdefault(name, [0, 0])
            total[0] += calls
            total[1] += failed
    for name, (calls, failed) in sorted(totals.items()):
        if calls:
            out[f"tools/{name}/error_frac"] = failed / calls
    return out
