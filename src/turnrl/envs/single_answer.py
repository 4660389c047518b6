"""`math_answer`: one plain answer, graded with math-verify. The single-turn protocol used to
evaluate on math benchmarks (MATH-500, ...) when the training environment's own protocol
does not apply."""
from __future__ import annotations

from turnrl.envs.base import StepResult
from turnrl.rewards.math import grade_math

SYSTEM_PROMPT = "Solve the problem. Put the final answer in \\boxed{} or between <answer> and </answer>."


class SingleAnswerEnv:
    observation_role = "user"
    stop = ("</answer>",)

    def __init__(self, system_prompt: str = SYSTEM_PROMPT):
        self.system_prompt = system_prompt
        self.example: dict = {}

    def reset(self, example: dict) -> str:
        self.example = example
        return example["prompt"]

    def step(self, text: str) -> StepResult:
        grade = grade_math(text, str(self.example["answer"]))
        outcome = 1.0 if grade.correct else 0.0
        return StepResult(None, outcome, True, {"outcome": outcome, "reason": "answer" if grade.extracted else "no_action",
                                                "extracted": grade.extracted, "grade": grade.reason})
