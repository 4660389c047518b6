"""Reward functions: plain callables over response text (and a reference), returning floats.

- :mod:`turnrl.rewards.math`: math answers checked with math-verify (``math_reward``, ``grade_math``).
- :mod:`turnrl.rewards.qa`: SQuAD-style exact match and token F1 for short-answer QA.
- :mod:`turnrl.rewards.format`: tag well-formedness, answer-tag presence, tool-call counts.
"""

from turnrl.rewards.format import (
    DEFAULT_TAGS,
    format_reward,
    has_answer_tag,
    tool_call_count,
    xml_wellformed,
)
from turnrl.rewards.math import MathGrade, extract_answer, grade_math, is_equivalent, last_boxed, math_reward
from turnrl.rewards.qa import contains_answer, exact_match, f1, normalize_answer

__all__ = [
    "DEFAULT_TAGS",
    "MathGrade",
    "contains_answer",
    "exact_match",
    "extract_answer",
    "f1",
    "format_reward",
    "grade_math",
    "has_answer_tag",
    "is_equivalent",
    "last_boxed",
    "math_reward",
    "normalize_answer",
    "tool_call_count",
    "xml_wellformed",
]
