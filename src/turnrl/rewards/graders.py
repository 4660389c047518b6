"""Benchmark graders: is a response right, given a row's acceptable answers?

    eval.benchmarks: [{name: olympiad, path: ..., grader: math}]   # math | exact | module:function

- `math`: the final answer (last `<answer>` or `\\boxed{}`) against each of the row's answers
  with math-verify (`turnrl.rewards.math.grade_any`).
- `exact`: that final answer (or, with none, the whole response) against each answer after
  SQuAD normalization (`turnrl.rewards.qa.exact_match`).
- `reasoning_gym`: a reasoning-gym row (`data.train_set: reasoning_gym:<task>`) scored by the
  task's own `score_answer(final answer, entry)`; the score (partial credit) is `Grade.score`,
  full credit is correct. A row that names its grader (`grader: reasoning_gym`) is graded by it
  whatever grader the environment or benchmark was given (:func:`for_row`).
- an import path `my_pkg.grading:grade`: `grade(completion, answers) -> bool | float` (> 0 is
  right), `answers` the row's list of acceptable answers.

A grader is `(response text, row) -> Grade`. Built-ins and plugins resolve through one
`turnrl.plugins.Registry`: a name is a registered `Grader` (the built-ins, or what `register`
added) or an import path to a `Grader` or to a plain `grade(completion, answers)` function.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from turnrl.plugins import PluginError, Registry, check_call
from turnrl.rewards.math import extract_answer, grade_any, references
from turnrl.rewards.qa import exact_match

#: The built-in graders' names (what `names()` lists before anything is registered).
BUILTIN = ("math", "exact", "reasoning_gym")
#: Graders a row may name for itself (its `grader` field), overriding the environment's.
ROW_GRADERS = ("reasoning_gym",)


@dataclass(frozen=True)
class Grade:
    correct: bool
    extracted: str | None
    reason: str
    score: float | None = None   # partial credit in [0, 1] where the grader gives one; None: 1 if correct else 0

    @property
    def reward(self) -> float:
        return float(self.score) if self.score is not None else (1.0 if self.correct else 0.0)


def _math(text: str, example: dict) -> Grade:
    g = grade_any(text, example)
    return Grade(g.correct, g.extracted, g.reason)


def _exact(text: str, example: dict) -> Grade:
    extracted = extract_answer(text)
    prediction = extracted if extracted is not None else (text or "").strip() or None
    golds = references(example)
    ok = bool(exact_match(prediction, golds))
    return Grade(ok, prediction, f"{'exact match' if ok else 'no exact match'}: {prediction!r} against {golds!r}")


def _reasoning_gym(text: str, example: dict) -> Grade:
    from turnrl.rewards import reasoning_gym   # the library, imported when a row asks for it
    extracted = extract_answer(text)
    value = reasoning_gym.score(example, extracted)
    return Grade(value >= 1.0, extracted, f"reasoning_gym score_answer: {value!r}", value)


def _user(fn: Callable, path: str) -> Callable[[str, dict], Grade]:
    def grade(text: str, example: dict) -> Grade:
        value = fn(text, references(example))
        if type(value).__module__ == "numpy" and hasattr(value, "item"):   # np.isclose's np.bool_, np.float64
            value = value.item()
        if isinstance(value, bool):
            ok = value
        elif isinstance(value, (int, float)) and math.isfinite(value):
            ok = value > 0
        else:
            raise TypeError(f"grader {path} returned {value!r}; it must return a bool or a finite number")
        return Grade(ok, extract_answer(text), f"{path}: {value!r}")
    return grade


@dataclass(frozen=True)
class Grader:
    """A grader with the whole row: grade(response text, row) -> Grade."""
    grade: Callable[[str, dict], Grade]
    name: str = ""

    def __call__(self, text: str, example: dict) -> Grade:
        return self.grade(text, example)


def _as_grader(obj: object, name: str, key: str) -> Grader:
    if isinstance(obj, Grader):
        check_call(obj.grade, f"{key} = {name!r}", "grade(text, row) -> Grade", positional=2)
        return obj if obj.name else Grader(obj.grade, name)
    if not callable(obj):
        raise PluginError(f"{key} = {name!r}: {obj!r} is neither a Grader nor a function "
                          "grade(completion, answers) -> bool")
    check_call(obj, f"{key} = {name!r}", "grade(completion, answers) -> bool", positional=2)
    return Grader(_user(obj, name), name)


# name -> Grader (the built-ins), a grade function, or the import path of either
_REGISTRY = Registry("grader", "my_pkg.grading:grade", _as_grader,
                     {"math": Grader(_math, "math"), "exact": Grader(_exact, "exact"),
                      "reasoning_gym": Grader(_reasoning_gym, "reasoning_gym")})


def register(name: str, grader: Grader | Callable | str) -> None:
    """Add a grader under `name`: a Grader, a grade(completion, answers) function or an import path."""
    _REGISTRY.register(name, grader)


def names() -> list[str]:
    return _REGISTRY.names()


def grader(name: str, key: str = "grader") -> Grader:
    """The grader `name` stands for; PluginError naming `key` if it is unknown or unusable."""
    return _REGISTRY.resolve(name, key)


def for_row(default: Callable[[str, dict], Grade], example: dict) -> Callable[[str, dict], Grade]:
    """The grader of `example`: the one the row names (`grader: reasoning_gym`), else `default`."""
    name = example.get("grader") if isinstance(example, dict) else None
    return grader(name, "row grader") if name in ROW_GRADERS else default
