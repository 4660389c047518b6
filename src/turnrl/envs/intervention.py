"""`intervention` (MuTIS): answer early, or be told to; math graded with math-verify.

Each policy turn is read up to its FIRST answer marker, whichever starts first:

- a complete ``<answer>...</answer>`` pair (``marker="tag"``),
- an answer paragraph: a line starting with ``Answer:`` or ``Final Answer:`` (any case, optional
  markdown such as ``**Final Answer:**`` or ``### Answer:``), running to the next blank line or
  the end of the turn; when the marker line is empty the next paragraph is the answer
  (``marker="paragraph"``),
- the first balanced ``\\boxed{...}`` (nested braces handled, ``marker="boxed"``).

Markers with blank content are skipped. Only the text up to the end of that marker is graded
(against ``example["answer"]`` with :func:`turnrl.rewards.math.grade_math`, i.e. math-verify:
``\\frac{1}{2}`` equals ``0.5``); anything the policy wrote after it is ignored.

Cutting and the rollout loop: the engine stops at ``stop`` = ``("</answer>",)``; an answer
paragraph or a balanced ``\\boxed{}`` cannot be expressed as a stop string, so the turn runs on
to end of sequence (or the token limit) and :meth:`InterventionEnv.step` itself finds the first
marker. The rollout loop keeps the sampled tokens exactly as they were sampled (token in, token
out, text after the marker included); the environment only decides what is graded and whether
the trajectory ends. ``info["chars_after_answer"]`` says how much of the last turn was past
the marker.

If a turn has an answer: done, ``info["outcome"]`` = 1.0 if correct else 0.0, reason
``"answer"``. If not, and turns remain: the observation is the intervention message (role
``"user"``), turn reward 0, not done. After ``max_turns - 1`` interventions the next turn is the
last generation: with no answer there, done with outcome 0 and reason ``"max_turns"``.

Cost: the environment sees text, not tokens; every step's info holds ``turns_used`` and
``chars_used`` (policy characters up to the answer marker, or all of them when there is none).
Token counts per solved problem (MuTIS's efficiency measure) come from the rollout loop's
trajectories (``Trajectory.policy_tokens()``).

Turn rewards: every ``StepResult.reward`` is 0.0 except the answering turn's, which is the
outcome; MuTIS trains on the outcome alone (``info["outcome"]``).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict

from turnrl.data import synthetic
from turnrl.envs.base import EnvContext, EnvSpec, StepResult
from turnrl.rewards.graders import for_row, grader
from turnrl.rewards.math import balanced_close

__all__ = ["SYSTEM_PROMPT", "INTERVENTION", "AnswerMarker", "find_answer", "InterventionEnv"]

SYSTEM_PROMPT = (
    "Solve the problem. Reason step by step, then put the final answer between <answer> and "
    "</answer>."
)

INTERVENTION = (
    "My previous action is invalid. If I want to give the final answer, I should put the answer "
    "between <answer> and </answer>. Let me try again:"
)

_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_BOXED = re.compile(r"\\boxed\s*\{")
# A line that starts with "Answer:" / "Final Answer:", allowing markdown decoration around it.
_PARAGRAPH = re.compile(r"^[ \t>#*_]*(?:the\s+)?(?:final\s+)?answer[ \t]*(?:\*\*|__|\*|_)?[ \t]*:",
                        re.IGNORECASE | re.MULTILINE)
_BLANK_LINE = re.compile(r"\n[ \t]*\n")


@dataclass(frozen=True)
class AnswerMarker:
    kind: str       # "tag" | "paragraph" | "boxed"
    start: int      # where the marker starts in the turn text
    end: int        # the turn text is graded up to here (exclusive)
    content: str    # the answer itself, stripped


def _first_tag(text: str) -> AnswerMarker | None:
    for m in _TAG.finditer(text):
        if m.group(1).strip():
            return AnswerMarker("tag", m.start(), m.end(), m.group(1).strip())
    return None


def _first_boxed(text: str) -> AnswerMarker | None:
    for m in _BOXED.finditer(text):
        close = balanced_close(text, m.end() - 1)
        if close is None:
            return None            # unbalanced: no later \boxed can be complete either
        content = text[m.end():close].strip()
        if content:
            return AnswerMarker("boxed", m.start(), close + 1, content)
    return None


def _first_paragraph(text: str) -> AnswerMarker | None:
    for m in _PARAGRAPH.finditer(text):
        rest = text[m.end():]
        lead = len(rest) - len(rest.lstrip())
        start = m.end() + lead
        blank = _BLANK_LINE.search(text, start)
        end = blank.start() if blank else len(text)
        content = text[start:end].strip().strip("*_").strip()
        if content:
            return AnswerMarker("paragraph", m.start(), end, content)
    return None


def find_answer(text: str) -> AnswerMarker | None:
    """The first answer marker in a policy turn (the one that starts first), or None.

    A marker inside another one that started earlier belongs to it: in
    ``Final Answer: \\boxed{3}`` the paragraph is the marker and ``\\boxed{3}`` its content.
    """
    found = [m for m in (_first_tag(text), _first_paragraph(text), _first_boxed(text)) if m is not None]
    return min(found, key=lambda m: (m.start, -m.end)) if found else None


class InterventionEnv:
    observation_role = "user"
    stop = ("</answer>",)

    def __init__(self, max_turns: int = 3, intervention: str = INTERVENTION, system_prompt: str = SYSTEM_PROMPT):
        if max_turns < 1:
            raise ValueError("max_turns must be >= 1")
        self.max_turns = max_turns
        self.intervention = intervention
        self.system_prompt = system_prompt
        self.example: dict = {}
        self.turns: list[str] = []
        self.chars_used = 0

    def reset(self, example: dict) -> str:
        self.example = example
        self.turns = []
        self.chars_used = 0
        return example["prompt"]

    @property
    def interventions(self) -> int:
        """Intervention messages sent so far."""
        return max(0, len(self.turns) - 1)

    def step(self, text: str) -> StepResult:
        self.turns.append(text)
        marker = find_answer(text)
        if marker is not None:
            self.chars_used += marker.end
            # math-verify, or the row's own grader (reasoning-gym: its partial credit is the reward)
            grade = for_row(grader("math"), self.example)(f"<answer>{marker.content}</answer>", self.example)
            outcome = 1.0 if grade.correct else 0.0
            return StepResult(None, grade.reward, True, {
                "outcome": outcome, "reason": "answer", "marker": marker.kind, "extracted": grade.extracted,
                "grade": grade.reason, "turns_used": len(self.turns), "chars_used": self.chars_used,
                "chars_after_answer": len(text) - marker.end, "interventions": self.interventions,
                **({"partial_credit": grade.score} if grade.score is not None else {})})
        self.chars_used += len(text)
        info = {"turns_used": len(self.turns), "chars_used": self.chars_used}
        if len(self.turns) >= self.max_turns:
            return StepResult(None, 0.0, True, {"outcome": 0.0, "reason": "max_turns",
                                                "interventions": self.interventions, **info})
        return StepResult(self.intervention, 0.0, False, {"intervention": True,
                                                          "interventions": len(self.turns), **info})


class InterventionOptions(BaseModel):
    """`env.options` of `intervention` (its turn limit is rollout.max_turns)."""
    model_config = ConfigDict(extra="forbid")
    intervention: str = INTERVENTION
    system_prompt: str = SYSTEM_PROMPT


def make_intervention_env(*, context: EnvContext, intervention: str = INTERVENTION,
                          system_prompt: str = SYSTEM_PROMPT) -> InterventionEnv:
    return InterventionEnv(max_turns=context.max_turns, intervention=intervention, system_prompt=system_prompt)


ENV = EnvSpec(factory=make_intervention_env, options=InterventionOptions, task=synthetic.TASKS["intervention"],
              name="intervention")
