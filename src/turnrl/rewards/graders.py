"""Benchmark graders: is a response right, given a row's acceptable answers?

    eval.benchmarks: [{name: olympiad, path: ..., grader: math}]   # math | exact | module:function

- `math`: the final answer (last `<answer>` or `\\boxed{}`) against each of the row's answers
  with math-verify (`turnrl.rewards.math.grade_any`).
- `exact`: that final answer (or, with none, the whole response) against each answer after
  SQuAD normalization (`turnrl.rewards.qa.exact_match`).
- an import path `my_pkg.grading:grade`: `grade(completion, answers) -> bool | float` (> 0 is
  right), `answers` the row's list of acceptable answers.

A grader is `(response text, row) -> Grade`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from turnrl.plugins import PluginError, check_call, is_import_path, load_object
from turnrl.rewards.math import extract_answer, grade_any, references
from turnrl.rewards.qa import exact_match

BUILTIN = ("math", "exact")


@dataclass(frozen=True)
class Grade:
    correct: bool
    extracted: str | None
    reason: str


def _math(text: str, example: dict) -> Grade:
    g = grade_any(text, example)
    return Grade(g.correct, g.extracted, g.reason)


def _exact(text: str, example: dict) -> Grade:
    extracted = extract_answer(text)
    prediction = extracted if extracted is not None else (text or "").strip() or None
    golds = references(example)
    ok = bool(exact_match(prediction, golds))
    return Grade(ok, prediction, f"{'exact match' if ok else 'no exact match'}: {prediction!r} against {golds!r}")


def _user(fn: Callable, path: str) -> Callable[[str, dict], Grade]:
    def grade(text: str, example: dict) -> Grade:
        value = fn(text, references(example))
        if isinstance(value, bool):
            ok = value
        elif isinstance(value, (int, float)) and math.isfinite(value):
            ok = value > 0
        else:
            raise TypeError(f"grader {path} returned {value!r}; it must return a bool or a finite number")
        return Grade(ok, extract_answer(text), f"{path}: {value!r}")
    return grade


def grader(name: str, key: str = "grader") -> Callable[[str, dict], Grade]:
    """The grader `name` stands for; PluginError naming `key` if it is unknown or unusable."""
    if name == "math":
        return _math
    if name == "exact":
        return _exact
    if not is_import_path(name):
        raise PluginError(f"{key} = {name!r}: must be math, exact or an import path module:function "
                          "(completion, answers) -> bool")
    fn = load_object(name, key)
    check_call(fn, key, "grade(completion, answers) -> bool", positional=2)
    return _user(fn, name)
