"""Reward functions by import path (`reward.functions` in params), added to the environment's
outcome:

    def brevity(prompt: str, completion: str, answer: str, **info) -> float: ...

`completion` is the trajectory's response as text (policy turns and observations, special
tokens removed); `info` holds the environment's info of the trajectory plus `turns` (the policy
turns' texts), `observations`, `finish` (why it ended), `outcome`, `example` (the data row),
`response_tokens` (tokens after the prompt) and `policy_tokens` (those the policy sampled).
Built-in shaping configured in params (`reward.overlong`: turnrl.rewards.shaping) is such a
function too, given to `RewardFunctions` by name (`builtin`).
A trajectory's reward is its outcome (times `reward.outcome_weight`, 1 by default; 0 where a
judge or the functions are the whole reward) plus the weighted sum of the functions' values; each value
is also logged per step as `reward_<name>_mean` (True / False score 1 / 0). A function that
raises or returns NaN, None or a non-number stops the step with a `RewardFunctionError` naming it, or, with
`reward.on_error: zero`, scores 0 and is counted (`reward_<name>_errors`).

Each entry of `reward.functions` resolves through a `turnrl.plugins.Registry`, as environments
and algorithms do: an import path, or a name that `register` added.
"""
from __future__ import annotations

import asyncio
import contextlib
import decimal
import functools
import inspect
import logging
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

from turnrl.plugins import PluginError, Registry, check_call

log = logging.getLogger(__name__)

SIGNATURE = "fn(prompt, completion, answer, **info) -> float"


class RewardFunctionError(RuntimeError):
    """A reward function failed on a trajectory (reward.on_error: fail)."""


def _as_function(obj: Any, name: str, key: str) -> Callable[..., Any]:
    if inspect.isclass(obj):   # calling it would make an instance, not a score
        raise PluginError(f"{key} = {name!r}: {obj.__qualname__} is a class; name a function {SIGNATURE}, or an "
                          "instance of a class with __call__ (e.g. SCORER = MyScorer() in your module)")
    if not callable(obj):
        raise PluginError(f"{key} = {name!r}: {obj!r} is not a function {SIGNATURE}")
    check_call(obj, f"{key} = {name!r}", SIGNATURE, positional=3, extra_keywords=True)
    if inspect.iscoroutinefunction(obj) or inspect.iscoroutinefunction(getattr(obj, "__call__", None)):
        @functools.wraps(obj)
        def awaited(*args, **kwargs):   # an async reward function: run to its value on a loop of its own
            return _run(obj(*args, **kwargs))
        return awaited
    return obj


def _run(coroutine) -> Any:
    """A coroutine's value: on a new event loop, or, called where a loop already runs, on a thread's."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coroutine).result()


# name -> a reward function or its import path (none built in: an import path resolves as such)
_REGISTRY = Registry("reward function", "my_pkg.rewards:brevity", _as_function)


def register(name: str, fn: Callable[..., Any] | str) -> None:
    """Add a reward function under `name`, for `reward.functions: [name]`."""
    _REGISTRY.register(name, fn)


def resolve(name: str, key: str = "reward.functions") -> Callable[..., Any]:
    return _REGISTRY.resolve(name, key)


def from_config(reward: Any, rollout: Any, judges: bool = True) -> "RewardFunctions":
    """The scorer of params' `reward` section (`rollout`: its budgets, for length shaping);
    `judges`: with reward.judges (evaluation grades with the benchmark's grader and asks no judge)."""
    builtin: dict[str, Callable[..., Any]] = {}
    if reward.overlong.buffer > 0:
        from turnrl.rewards.shaping import overlong_reward
        builtin["overlong"] = overlong_reward(rollout.max_tokens_total, reward.overlong.buffer,
                                              reward.overlong.max_penalty)
    if reward.judges and judges:
        from turnrl.rewards.judge import Judge
        for k, judge in enumerate(reward.judges):
            key = f"reward.judges[{k}] ({judge.name})"
            if judge.name in builtin:   # the overlong penalty's name: it would be replaced
                raise PluginError(f"{key} and reward.{judge.name} are both scored as {judge.name!r} "
                                  f"(reward_{judge.name}_mean): give the judge another `name`")
            builtin[judge.name] = Judge(judge, key=key)
    return RewardFunctions(reward.functions, reward.weights, reward.on_error, builtin=builtin,
                           outcome_weight=reward.outcome_weight)


class RewardFunctions:
    """The functions of `reward.functions`, loaded and checked once per process."""

    def __init__(self, paths: Sequence[str], weights: Sequence[float] = (), on_error: str = "fail",
                 builtin: dict[str, Callable[..., Any]] | None = None, outcome_weight: float = 1.0):
        """`builtin`: scorers params configure (name -> a function, or a batch scorer with
        `batch = True` and `score_batch(trajs, decode) -> [value or Exception]`; its `weight`
        and `key` attributes, if any, are its weight and the params key errors name; `by_group`,
        that it must see whole groups; `new_step()`, called as each step's rollouts start).
        `outcome_weight`: the environment's outcome's weight in the reward."""
        self.outcome_weight = float(outcome_weight)
        self.paths = list(paths)
        self.weights = list(weights) or [1.0] * len(self.paths)
        if len(self.weights) != len(self.paths):   # (params' reward.weights is checked by the config as well)
            raise ValueError(f"{len(self.weights)} weights for {len(self.paths)} reward functions; give one each")
        self.on_error = on_error
        self.fns: list[Callable[..., Any]] = []
        for i, path in enumerate(self.paths):
            self.fns.append(resolve(path, f"reward.functions[{i}]"))
        self.names = _short_names(self.paths)
        for name, fn in (builtin or {}).items():
            self.paths.append(getattr(fn, "key", f"reward.{name}"))
            self.names.append(name)
            self.fns.append(fn)
            self.weights.append(float(getattr(fn, "weight", 1.0)))
        _check_names(self.names, self.paths)
        self._warned: set[str] = set()

    def __bool__(self) -> bool:
        return bool(self.fns) or self.outcome_weight != 1.0

    @property
    def by_group(self) -> bool:
        """Whether a scorer needs a group's trajectories together (a batch scorer with `by_group`
        set: a judge with scope: group): then a batch is scored group by group as groups end,
        otherwise trajectory by trajectory (turnrl.rollout.scored)."""
        return any(getattr(fn, "by_group", False) for fn in self.fns)

    def new_step(self) -> None:
        """A new policy version samples from here on: scorers that share answers across batches
        (a judge's identical prompts) forget the last step's."""
        for fn in self.fns:
            if callable(getattr(fn, "new_step", None)):
                fn.new_step()

    def score(self, trajs: Sequence, decode: Callable[[list[int]], str]) -> None:
        """Set each trajectory's `rewards` (name -> value), `extra_reward` (their weighted sum)
        and `outcome_weight`."""
        for t in trajs:
            t.outcome_weight = self.outcome_weight
        if not self.fns:
            return
        batched = {name: fn.score_batch(trajs, decode) for name, fn in zip(self.names, self.fns)
                   if getattr(fn, "batch", False)}
        for k, t in enumerate(trajs):
            completion = decode(t.response_ids)
            info = {**t.info, "turns": list(t.turn_texts), "observations": list(t.observations), "finish": t.finish,
                    "outcome": t.outcome, "example": t.example, "response_tokens": len(t.response_ids),
                    "policy_tokens": t.policy_tokens()}
            total = 0.0
            for name, path, fn, weight in zip(self.names, self.paths, self.fns, self.weights):
                if name in batched:
                    value = self._checked(name, path, t, lambda v=batched[name][k]: _given(v))
                else:
                    value = self._checked(name, path, t, lambda fn=fn: fn(
                        str(t.example.get("prompt", "")), completion, str(t.example.get("answer", "")), **info))
                t.rewards[name] = value
                total += weight * value
            t.extra_reward = total

    def _checked(self, name: str, path: str, t: Any, compute: Callable[[], Any]) -> float:
        prompt = t.example.get("id", t.example.get("prompt", ""))
        try:
            with _SLOW.watch(f"reward function {path} on the trajectory of prompt {prompt!r}"):
                value = compute()
            problem = _not_a_number(value)
        except Exception as exc:   # noqa: BLE001 - the user's function: name it, never a bare traceback
            problem = f"raised {type(exc).__name__}: {exc}"
        if problem is None:
            return float(value)
        where = path if path.startswith("reward.") else f"reward function {path} (reward.functions)"
        message = f"{where} {problem} on the trajectory of prompt {prompt!r}"
        if self.on_error == "fail":
            raise RewardFunctionError(message + "; fix it, or set reward.on_error: zero to score such cases 0")
        t.rewards[f"{name}_errors"] = t.rewards.get(f"{name}_errors", 0.0) + 1.0
        if name not in self._warned:
            self._warned.add(name)
            log.warning("%s; scored 0 (reward.on_error: zero), counted as reward_%s_errors", message, name)
        return 0.0


SLOW_CALL_S = 60.0   # a reward call running this long is said in the log (and again each time as long)


class _SlowCalls:
    """Names the reward calls that run past SLOW_CALL_S seconds, in a warning (again each
    SLOW_CALL_S): a function that hangs (an API call without a timeout) is named, instead of a run
    that stalls in silence. One watcher thread for the process, started at the first call. It
    cannot stop the call: Python cannot interrupt another thread, and a function may rely on its
    own (signal-based timeouts such as math-verify's work in the main thread only)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.running: dict[int, tuple[str, float, float]] = {}   # thread -> (what, started, said at)
        self.watcher: threading.Thread | None = None

    @contextlib.contextmanager
    def watch(self, what: str):
        key, now = threading.get_ident(), time.monotonic()
        with self.lock:
            self.running[key] = (what, now, now)
            if self.watcher is None:
                self.watcher = threading.Thread(target=self._loop, daemon=True, name="reward-slow-calls")
                self.watcher.start()
        try:
            yield
        finally:
            with self.lock:
                self.running.pop(key, None)

    def _loop(self) -> None:
        while True:
            time.sleep(min(1.0, SLOW_CALL_S / 4))
            now = time.monotonic()
            with self.lock:
                due = [(k, what, now - start) for k, (what, start, said) in self.running.items()
                       if now - said >= SLOW_CALL_S]
                for k, what, _ in due:
                    self.running[k] = (what, self.running[k][1], now)
            for _, what, seconds in due:
                log.warning("%s has run %.0f s and not returned; a function that can hang needs a timeout of its own",
                            what, seconds)


_SLOW = _SlowCalls()


def _given(value: Any) -> Any:
    """A batch scorer's value for one trajectory (an Exception it got is raised here)."""
    if isinstance(value, Exception):
        raise value
    return value


def _not_a_number(value: Any) -> str | None:
    if value is None:
        return "returned None"
    if isinstance(value, bool) or getattr(getattr(value, "dtype", None), "kind", "") == "b" \
            or isinstance(value, decimal.Decimal):
        return None   # True / False (numpy's too) score 1 / 0, as a grader's verdict does; a Decimal its value
    if not isinstance(value, (int, float)):
        try:   # numpy / torch scalars
            import numbers
            if isinstance(value, numbers.Real) and not isinstance(value, bool):
                value = float(value)
            else:
                return f"returned {type(value).__name__} {value!r:.80}, not a number"
        except Exception:   # noqa: BLE001
            return f"returned {type(value).__name__}, not a number"
    if not math.isfinite(float(value)):
        return f"returned {value}"
    return None


def _check_names(names: Sequence[str], paths: Sequence[str]) -> None:
    """PluginError where two scorers would log under one name (reward_<name>_mean, and the
    <name>_errors counter): a judge named like the overlong penalty replaced it, a function named
    like a judge logged one value for both."""
    taken: dict[str, str] = {}
    for name, path in zip(names, paths):
        where = path if path.startswith("reward.") else f"reward.functions ({path})"
        for key in (name, f"{name}_errors"):
            if key in taken:
                raise PluginError(f"{where} and {taken[key]} are both scored as {key!r} (reward_{key}_mean): rename "
                                  "one (a judge's `name`, a function's own name)")
        taken[name] = taken[f"{name}_errors"] = where


def _short_names(paths: Sequence[str]) -> list[str]:
    """Metric names: each function's own name, qualified by its module where two share one."""
    bare = [p.rpartition(":")[2].split(".")[-1] for p in paths]
    return [b if bare.count(b) == 1 else p.replace(":", ".").replace(".", "_") for b, p in zip(bare, paths)]
