"""`math_answer`: one plain answer, graded by a benchmark's grader (math-verify by default). The
single-turn protocol used to evaluate benchmarks (MATH-500, a user's file, ...) when the
training environment's own protocol does not apply."""
from __future__ import annotations

from typing import Any, Callable

from turnrl.data import synthetic
from turnrl.envs.base import EnvSpec, StepResult
from turnrl.rewards.graders import Grade, for_row, grader as resolve_grader

SYSTEM_PROMPT = "Solve the problem. Put the final answer in \\boxed{} or between <answer> and </answer>."


class SingleAnswerEnv:
    observation_role = "user"
    stop = ("</answer>",)

    def __init__(self, system_prompt: str = SYSTEM_PROMPT, grader: str | Callable[[str, dict], Grade] = "math"):
        """`grader`: "math" (math-verify against any of the row's answers), "exact" (normalized
        exact match of the extracted answer), or an import path / callable `(completion, answers) ->
        bool or float` (see `turnrl.rewards.graders`). A row naming its own grader (reasoning-gym
        rows) is graded by it: its partial credit is the reward, full credit the outcome."""
        self.system_prompt = system_prompt
        self.grade = resolve_grader(grader) if isinstance(grader, str) else grader
        self.example: dict = {}

    def reset(self, example: dict) -> str:
        self.example = example
        return example["prompt"]

    def step(self, text: str) -> StepResult:
        grade = for_row(self.grade, self.example)(text, self.example)
        outcome = 1.0 if grade.correct else 0.0   # accuracy: full credit only; the reward may be partial
        info: dict[str, Any] = {"outcome": outcome, "reason": "answer" if grade.extracted is not None else "no_action",
                                "extracted": grade.extracted, "grade": grade.reason}
        if grade.score is not None:   # what training maximizes (Trajectory.reward); accuracy stays full credit
            info["partial_credit"] = grade.score
        return StepResult(None, grade.reward, True, info)


ENV = EnvSpec(factory=SingleAnswerEnv, task=synthetic.ANSWER_TASK, name="math_answer")
