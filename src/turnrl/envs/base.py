"""The environment protocol, and what a plugin declares besides it.

An environment is a small stateful object, one per trajectory:

    env = factory(**options)                 # env.name names the factory, env.options its arguments
    first_message = env.reset(example)       # example: a dict with at least prompt and answer
    result = env.step(policy_turn_text)      # StepResult(observation, reward, done, info)

Required attributes: `system_prompt` (the system message), `stop` (strings that end a policy
turn), `observation_role` ("tool" or "user": the chat role observations are rendered in).
params' `env.stop` replaces an environment's `stop` (every built-in and adapter alike:
`with_stop`); a turn of an environment with none ends at the model's end-of-turn token.

`observation` is text the environment adds to the conversation (a tool result, feedback, an
intervention); it is never trained on. `reward` is this turn's reward (turn-level algorithms
read it); when `done`, `info["outcome"]` holds the trajectory's outcome reward (e.g. answer
correctness) and `info["reason"]` why it ended. Numbers in `info` are logged per step as
`env_<key>_mean`; `info["tool_ok"]` marks a tool call (tool_call_rate, tool_success_rate).
`info` is passed on to reward functions as keyword arguments, so it must not use their names
(`RESERVED_INFO_KEYS`). A step that returns anything else (None, a reward of None, an int
observation, no info dict, a non-numeric outcome, a reserved key) ends its trajectory as an
environment error naming the plugin and what was wrong (`step_result_problem`).

Optional, each used where present:

- `async def step(text)`: a slow environment (a remote tool, an API) awaits instead of
  blocking a thread; every trajectory's pending step is in flight at once.
- `role(turn) -> "low" | "high"`: hierarchical environments (MLMT's feedback turn is "high",
  the solver's turns "low"). Hierarchical algorithms (`mlmt`) and the `levels` params (a
  second model for the high level, which levels train) read it; by default every turn is "low".
- A factory parameter named `context` receives an `EnvContext` (the preprocessed data folder,
  rollout.max_turns, the seed).
- `tools`: a list of function schemas (`{"type": "function", "function": {name, description,
  parameters}}`, what `apply_chat_template(tools=...)` takes): the prompt renders them with the
  model's chat template, in its family's function-calling format (the `tools` environment).
  An observation may then be a list of strings: one message in `observation_role` each (a tool
  result per call of the turn).

An `EnvSpec` bundles a factory with optional hooks: an options model, a synthetic task (rows
and demonstrations for the embedded tiny model's warm start) and a data hook that writes files
the environment reads (a search corpus) during `preprocess`.
"""
from __future__ import annotations

import dataclasses
import inspect
import math
import numbers
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence

from pydantic import BaseModel

#: The hierarchy levels a turn can have (`Env.role`).
LEVELS = ("low", "high")


#: Keys an environment's `info` must not have: reward functions are called as
#: fn(prompt, completion, answer, **info) with turns, observations, finish and example added.
RESERVED_INFO_KEYS = ("prompt", "completion", "answer", "turns", "observations", "finish", "example",
                      "response_tokens", "policy_tokens")
OBSERVATION_ROLES = ("tool", "user")
STEP_RESULT_EXPECTED = ("StepResult(observation: str | list[str] | None, reward: number, done: bool, info: dict; "
                        "info['outcome'] a number when done)")


@dataclass
class StepResult:
    observation: str | list[str] | None     # a list: several messages (one tool result per call)
    reward: float
    done: bool
    info: dict[str, Any] = field(default_factory=dict)


def _number_problem(value: Any, what: str) -> str | None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return f"{what} is {value!r} ({type(value).__name__}), not a number"
    if not math.isfinite(value):
        return f"{what} is {value!r}, not a finite number"
    return None


def step_result_problem(result: Any) -> str | None:
    """What is wrong with what a `step` returned (the first problem), or None if it is a good
    `StepResult` (duck-typed: any object with its four attributes)."""
    if not all(hasattr(result, a) for a in ("observation", "reward", "done", "info")):
        return f"returned {type(result).__name__}" + (f" {result!r}"[:80] if result is None else "")
    obs = result.observation
    if not (obs is None or isinstance(obs, str) or
            (isinstance(obs, (list, tuple)) and all(isinstance(m, str) for m in obs))):
        kinds = ", ".join(sorted({type(m).__name__ for m in obs})) if isinstance(obs, (list, tuple)) else ""
        return (f"returned an observation of {type(obs).__name__}" + (f" of {kinds}" if kinds else "") +
                ", not a string, a list of strings or None")
    problem = _number_problem(result.reward, "reward")
    if problem is not None:
        return f"returned a StepResult whose {problem}"
    if not (isinstance(result.done, bool) or type(result.done).__name__ == "bool_"):
        return f"returned done = {result.done!r} ({type(result.done).__name__}), not a bool"
    if not isinstance(result.info, dict):
        return f"returned info = {result.info!r}"[:120] + f" ({type(result.info).__name__}), not a dict"
    if not all(isinstance(k, str) for k in result.info):
        odd = [k for k in result.info if not isinstance(k, str)][:3]
        return f"returned info with keys that are not strings ({odd})"
    reserved = sorted(set(result.info) & set(RESERVED_INFO_KEYS))
    if reserved:
        return (f"returned info with the reserved key(s) {', '.join(map(repr, reserved))} (reward functions "
                "take them as arguments); rename them")
    if result.done and "outcome" in result.info:
        problem = _number_problem(result.info["outcome"], "info['outcome']")
        if problem is not None:
            return f"returned a final StepResult whose {problem}"
    if "partial_credit" in result.info:   # the reward in place of the outcome
        problem = _number_problem(result.info["partial_credit"], "info['partial_credit']")
        if problem is not None:
            return f"returned a StepResult whose {problem}"
    if "reason" in result.info and not isinstance(result.info["reason"], str):
        return f"returned info['reason'] = {result.info['reason']!r}, not a string (the trajectory's finish)"
    return None


def opened_problem(env: Any, first: Any) -> str | None:
    """What is wrong with an environment a factory made, and the first message its `reset`
    returned (the first problem), or None."""
    missing = [a for a in ("reset", "step", "system_prompt", "stop", "observation_role") if not hasattr(env, a)]
    if missing:
        return (f"the environment factory returned a {type(env).__name__}, which has no {', '.join(missing)}; it must "
                "return an environment (reset, step, system_prompt, stop, observation_role: docs/plugins.md)")
    if not isinstance(first, str):
        if inspect.isawaitable(first):
            getattr(first, "close", lambda: None)()   # never awaited: no warning for it
            return "reset is a coroutine function; reset must return the first message (a str) directly"
        return f"reset returned {type(first).__name__} {first!r:.60}; it must return the first user message as a str"
    if env.observation_role not in OBSERVATION_ROLES:
        return f"observation_role is {env.observation_role!r}; it must be 'tool' or 'user'"
    return None


class Env(Protocol):
    system_prompt: str          # instructions for the policy (system message)
    stop: tuple[str, ...]       # a policy turn ends at the first of these strings
    observation_role: str       # chat role of observations: "tool" or "user"

    def reset(self, example: dict) -> str: ...

    def step(self, text: str) -> StepResult: ...


def with_stop(factory: Callable[[], Env], stop: Sequence[str] | None) -> Callable[[], Env]:
    """`factory` whose environments end a policy turn at `stop` instead of their own `stop`
    (params' `env.stop`); None: the environment's own, unchanged."""
    if stop is None:
        return factory
    strings = tuple(str(s) for s in stop)

    def make() -> Env:
        env = factory()
        if dataclasses.is_dataclass(env) and any(f.name == "stop" for f in dataclasses.fields(env)):
            return dataclasses.replace(env, stop=strings)   # a frozen one too (the agent's AgentProgram)
        try:
            env.stop = strings
        except AttributeError:   # a read-only attribute: a plugin that cannot take env.stop
            raise TypeError(f"{type(env).__name__}.stop cannot be set, so env.stop cannot apply; make `stop` a "
                            "plain attribute") from None
        return env
    return make


@dataclass(frozen=True)
class EnvContext:
    """What turnrl hands a factory that declares a `context` parameter."""
    data_dir: Path | None = None   # the preprocess stage's output (data/processed): files prepare_data wrote
    max_turns: int = 3             # rollout.max_turns
    seed: int = 0


@dataclass(frozen=True)
class EnvSpec:
    """An environment plugin: `env.name` names one (or a bare factory, which is wrapped in one).

    factory       called once per trajectory with the validated `env.options` as keyword
                  arguments (and `context=EnvContext` if it takes one); returns an `Env`
    options       a pydantic model checking `env.options`; None: made from the factory's
                  signature (annotations and defaults; Annotated[int, Field(gt=0)] keeps its bounds)
    task          a `turnrl.data.synthetic.SyntheticTask`: rows for `data.train_set: synthetic`
                  and/or demonstrations for the tiny model's warm start (`model.path: tiny`)
    prepare_data  `prepare_data(rows, out_dir, **options)`: write files the environment reads
                  (under `context.data_dir` later) from every row of the data; run by preprocess,
                  and before the warm start; returns a dict for the manifest (or None)
    runner        how episodes are rolled out: a no-argument callable returning an
                  `turnrl.rollout.episodes.EpisodeRunner` class. None: the built-in step loop
                  (`reset`/`step` in turnrl.rollout.multi_turn), which every built-in uses;
                  `env.name: agent` plugs in the OpenAI-compatible gateway (turnrl.gateway)
    task_from_options  `(validated options) -> SyntheticTask | None`: a task that depends on the
                  options (the agent's demonstration hook); used instead of `task` where given
    eval_metrics  numeric `info` keys whose mean the evaluation's task block reports, overall,
                  greedy and per subject (a game's win, draw, loss, illegal_move_rate)
    """
    factory: Callable[..., Env]
    options: type[BaseModel] | None = None
    task: Any = None
    prepare_data: Callable[..., dict | None] | None = None
    name: str = ""
    runner: Callable[[], type] | None = None
    task_from_options: Callable[[dict], Any] | None = None
    eval_metrics: tuple[str, ...] = ()

    def task_for(self, options: dict) -> Any:
        """The synthetic task for these (validated) options."""
        return self.task_from_options(options) if self.task_from_options is not None else self.task

    @property
    def takes_context(self) -> bool:
        try:
            return "context" in inspect.signature(self.factory).parameters
        except (TypeError, ValueError):
            return False

    def options_model(self) -> type[BaseModel]:
        if self.options is not None:
            return self.options
        from turnrl.plugins import options_model
        return options_model(self.factory, reserved=("context",))

    def call_problem(self, options: dict[str, Any], key: str = "env.options") -> str | None:
        """Why the factory cannot be called with these (validated) options, as `bind` calls it (an
        options model whose fields are not the factory's parameters), or None."""
        kwargs = {**options, **({"context": None} if self.takes_context else {})}
        try:
            signature = inspect.signature(self.factory)
        except (TypeError, ValueError):   # a builtin without a signature: trust it
            return None
        try:
            signature.bind(**kwargs)
        except TypeError as exc:
            name = getattr(self.factory, "__qualname__", repr(self.factory))
            return (f"{key}: the factory {name}{signature} cannot be called with the options {sorted(options)} "
                    f"({exc}); make the options model's fields the factory's keyword arguments")
        return None

    def bind(self, options: dict[str, Any], context: EnvContext | None = None) -> Callable[[], Env]:
        """A no-argument factory of fresh environments with these (validated) options."""
        kwargs = dict(options)
        if self.takes_context:
            kwargs["context"] = context or EnvContext()
        factory = self.factory
        return lambda: factory(**kwargs)
