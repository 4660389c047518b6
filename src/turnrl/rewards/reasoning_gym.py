"""reasoning-gym's tasks, as the rewards need them: a set's name, the library's dataset object, and
the grade (`score`) the task's own `score_answer(answer, entry)` gives a row's answer.

A set is named by a string, `reasoning_gym:<task>` optionally followed by a JSON object of
`size`, `seed` and `config` (`reasoning_gym:chain_sum{"seed": 7, "size": 100}`), which is what a
params mapping `{name: reasoning_gym:<task>, size, seed, config}` becomes (:func:`canonical`). The
dataset is the library's own `reasoning_gym.create_dataset(task, size=, seed=, **config)`,
made once per process; a row generated from it (turnrl.data.reasoning_gym) keeps where it came
from (`reasoning_gym: {set, index}`), and `score` grades it against the library's item `index`
of that very set (never a JSON copy of it).

This is the rewards' floor: the `reasoning_gym` grader (turnrl.rewards.graders) scores with it,
and turnrl.data.reasoning_gym, which makes the rows, builds on it (data sits above rewards). The
library is imported lazily: turnrl works without it and says which extra installs it.
"""
from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from turnrl.errors import one_line
from turnrl.plugins import import_library

PREFIX = "reasoning_gym:"
DEFAULT_SIZE = 1000
DEFAULT_SEED = 0
PIN = "reasoning-gym==0.1.25"   # the library alone, for the install hint
_KEYS = ("name", "size", "seed", "config")


class ReasoningGymError(ValueError):
    """A reasoning_gym set that cannot be made or graded: the library missing, an unknown task or
    config, a row without its (set, index). A ValueError, so that params validation reports it
    under its key; turnrl.data.reasoning_gym raises it as a DataSourceError too."""


@dataclass(frozen=True)
class GymSet:
    task: str
    size: int = DEFAULT_SIZE
    seed: int = DEFAULT_SEED
    config: Mapping[str, Any] = field(default_factory=dict)

    def canonical(self) -> str:
        """The one string naming this set (params, manifests, row provenance)."""
        opts: dict[str, Any] = {}
        if self.size != DEFAULT_SIZE:
            opts["size"] = self.size
        if self.seed != DEFAULT_SEED:
            opts["seed"] = self.seed
        if self.config:
            opts["config"] = dict(self.config)
        return PREFIX + self.task + (json.dumps(opts, sort_keys=True) if opts else "")

    @property
    def source(self) -> str:
        return PREFIX + self.task


def is_spec(value: Any) -> bool:
    """Whether a data set name / benchmark value names a reasoning-gym set."""
    if isinstance(value, Mapping):
        return isinstance(value.get("name"), str) and value["name"].startswith(PREFIX)
    return isinstance(value, str) and value.startswith(PREFIX)


def _int(value: Any, what: str, key: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ReasoningGymError(f"{key}: {what} must be an integer >= {minimum}, got {value!r}")
    return value


def parse(value: str | Mapping[str, Any], key: str = "data.train_set") -> GymSet:
    """The set a string or mapping names; ReasoningGymError naming `key` if it is malformed."""
    if isinstance(value, Mapping):
        extra = sorted(set(value) - set(_KEYS))
        if extra:
            raise ReasoningGymError(f"{key}: unknown keys {extra} in a reasoning_gym set; use {list(_KEYS)}")
        name, opts = value.get("name"), {k: value[k] for k in _KEYS[1:] if k in value}
    else:
        name, opts = value, {}
        brace = value.find("{")
        if brace >= 0:
            name = value[:brace]
            try:
                opts = json.loads(value[brace:])
            except json.JSONDecodeError as exc:
                raise ReasoningGymError(f"{key} = {value!r}: the options after the task name are not a JSON "
                                        f"object ({exc.msg})") from None
            if not isinstance(opts, dict) or set(opts) - set(_KEYS[1:]):
                raise ReasoningGymError(f"{key} = {value!r}: options must be a JSON object of size, seed, config")
    if not isinstance(name, str) or not name.startswith(PREFIX) or not name[len(PREFIX):].strip():
        raise ReasoningGymError(f"{key} = {value!r}: name a task as reasoning_gym:<task>, e.g. "
                                "reasoning_gym:basic_arithmetic")
    config = opts.get("config") or {}
    if not isinstance(config, Mapping):
        raise ReasoningGymError(f"{key}: config must be a mapping of the task's settings, got {config!r}")
    return GymSet(name[len(PREFIX):].strip(), _int(opts.get("size", DEFAULT_SIZE), "size", key, 1),
                  _int(opts.get("seed", DEFAULT_SEED), "seed", key, 0), dict(config))


def canonical(value: str | Mapping[str, Any], key: str = "data.train_set") -> str:
    """A params value (string or mapping) as the one string that names the set."""
    return parse(value, key).canonical()


def _library(key: str):
    # turnrl.plugins' import guard, as the ecosystem adapters' (turnrl.envs.ecosystem.glue): rewards
    # sit below envs, so the guard lives on a floor both reach
    return import_library("reasoning_gym", where=key, what="reasoning-gym", pin=PIN, error=ReasoningGymError)


def task_names(key: str = "data.train_set") -> list[str]:
    """Every task the installed library registers."""
    _library(key)
    from reasoning_gym.factory import DATASETS
    return sorted(DATASETS)


def check(value: str | Mapping[str, Any], key: str = "data.train_set") -> GymSet:
    """The set, its task known to the library and its config accepted by the task (a one-line
    ReasoningGymError naming `key` otherwise)."""
    spec = parse(value, key)
    dataset(spec.canonical(), key)
    return spec


@functools.lru_cache(maxsize=64)
def _dataset_cached(name: str):
    spec = parse(name)
    return _library("reasoning_gym").create_dataset(spec.task, size=spec.size, seed=spec.seed, **spec.config)


def dataset(name: str, key: str = "data.train_set"):
    """The library's dataset object for a canonical set name (made once per process)."""
    spec = parse(name, key)
    known = task_names(key)
    if spec.task not in known:
        raise ReasoningGymError(f"{key}: reasoning_gym has no task {spec.task!r}; known tasks: {', '.join(known)}")
    try:
        return _dataset_cached(spec.canonical())
    except (TypeError, ValueError, AssertionError) as exc:
        msg = one_line(exc)
        raise ReasoningGymError(f"{key}: reasoning_gym task {spec.task!r} rejects config {dict(spec.config)}: "
                                f"{msg}") from None


def provenance(row: Mapping[str, Any]) -> tuple[str, int] | None:
    """(canonical set name, item index) of a reasoning_gym row, None for any other row."""
    info = row.get("reasoning_gym")
    if isinstance(info, str):   # a row read back from a file may hold it as JSON text
        try:
            info = json.loads(info)
        except json.JSONDecodeError:
            return None
    if not isinstance(info, Mapping) or not isinstance(info.get("set"), str):
        return None
    index = info.get("index")
    if isinstance(index, float) and index.is_integer():
        index = int(index)
    if isinstance(index, bool) or not isinstance(index, int):
        return None
    return info["set"], index


def score(row: Mapping[str, Any], answer: str | None) -> float:
    """The task's own `score_answer(answer, entry)` for a reasoning_gym row (entry regenerated by
    the library from the row's set and index). No extracted answer scores 0."""
    where = provenance(row)
    if where is None:
        raise ReasoningGymError(f"row {row.get('id')!r} has no reasoning_gym provenance (set, index) to grade with")
    if answer is None:
        return 0.0
    ds = dataset(where[0], "grader")
    return float(ds.score_answer(answer, ds[where[1]]))
