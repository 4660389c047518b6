"""`math_refine` (MLMT-RL): solve, get high-level feedback, refine; graded with math-verify.

Two levels act on one problem: a low-level solver and a high-level teacher that writes
feedback on the solver's attempt. ``feedback`` chooses who the teacher is.

``feedback="self"`` (the default; shared weights, one model with two role prompts): the whole
exchange is ONE conversation whose policy turns alternate between the levels::

    turn 0 (low, solve)    <answer>12</answer>              -> FEEDBACK_REQUEST (role user)
    turn 1 (high, teach)   <feedback>Check 3*4.</feedback>  -> REFINE_REQUEST (role user)
    turn 2 (low, refine)   <answer>12</answer>              -> done

``feedback="endpoint"``: the teacher is a frozen model behind an OpenAI-compatible chat
completions endpoint (``vllm serve``, a hosted model). After the attempt the environment
asks it for feedback (system: ``high_level_prompt``; user: the problem and the attempt, see
:func:`feedback_messages`) and answers with ONE observation holding that feedback and the
refine request (:data:`ENDPOINT_OBSERVATION`)::

    turn 0 (low, solve)    <answer>13</answer>   -> "<feedback>...</feedback>\\nUse the feedback ..."
    turn 1 (low, refine)   <answer>12</answer>   -> done

An endpoint failure (connection refused, timeout, HTTP error, empty reply) never raises in
the trainer: the feedback becomes ``"(no feedback: <reason>)"`` and ``info["feedback_error"]``
holds the reason. Clients are cached per (url, key) for the process, since an environment is
made per trajectory.

Grading: attempt and refinement are graded against ``example["answer"]`` with
:func:`turnrl.rewards.math.grade_math` (the last ``<answer>...</answer>`` or ``\\boxed{}``).
An attempt without an answer is simply wrong: the teacher still gives feedback. A feedback
turn without a complete ``<feedback>...</feedback>`` pair still counts as feedback (all of its
text); ``info["feedback_format"]`` (self mode) says whether the tags were there.

Turn rewards: the attempt's turn gets R1 (attempt correct, 0/1), the feedback turn 0.0, the
refinement R (final answer correct, 0/1). At the end ``info`` holds ``outcome`` (R),
``attempt_correct`` (R1), ``improvement`` (R - R1), ``extracted`` and ``attempt_extracted``
(the answers found, None if none), ``feedback`` (its text) and ``reason``: ``"answer"``, or
``"no_answer"`` when the refinement has no answer (outcome 0).

:meth:`MathRefineEnv.role` maps a policy turn index to ``"low"`` or ``"high"`` (the environment
protocol's hierarchy hook): `mlmt` reads it, and the `levels` params train one level only or give
the high level a model of its own (in endpoint mode every policy turn is the solver's).
"""
from __future__ import annotations

import os
import re
import threading
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from turnrl.data import synthetic
from turnrl.envs.base import EnvSpec, StepResult
from turnrl.errors import one_line
from turnrl.rewards.graders import ROW_GRADERS, for_row, grader
from turnrl.rewards.math import grade_any

__all__ = ["SYSTEM_PROMPT", "HIGH_LEVEL_PROMPT", "FEEDBACK_REQUEST", "REFINE_REQUEST",
           "ENDPOINT_OBSERVATION", "feedback_messages", "parse_feedback", "MathRefineEnv"]

SYSTEM_PROMPT = "Solve the problem. Put the final answer between <answer> and </answer>."

HIGH_LEVEL_PROMPT = (
    "You are a teacher. Read the problem and the student's attempt and write short feedback that "
    "helps the student fix mistakes. Do not give the final answer."
)

# The high-level role reads (problem, attempt), as MLMT's does: the request restates the
# problem next to the attempt it follows.
FEEDBACK_REQUEST = (
    "Review the attempt above as a teacher. Problem: {problem}\nWrite feedback for the solver between "
    "<feedback> and </feedback>."
)

REFINE_REQUEST = "Use the feedback to refine the solution. Put the final answer between <answer> and </answer>."

#: The observation after the attempt in endpoint mode: the teacher's feedback, then the request.
ENDPOINT_OBSERVATION = "<feedback>{feedback}</feedback>\n{refine_request}"

_FEEDBACK = re.compile(r"<feedback>(.*?)</feedback>", re.DOTALL)
_ERROR_CHARS = 200


def parse_feedback(text: str) -> tuple[str, bool]:
    """(feedback, well formed): the content of the first complete ``<feedback>...</feedback>``
    pair, or, without one, the whole turn (a lone opening tag removed)."""
    m = _FEEDBACK.search(text)
    if m:
        return m.group(1).strip(), True
    return text.replace("<feedback>", "").strip(), False


def feedback_messages(problem: str, attempt: str, high_level_prompt: str = HIGH_LEVEL_PROMPT) -> list[dict]:
    """The chat messages asking the high-level model for feedback on an attempt."""
    return [
        {"role": "system", "content": high_level_prompt},
        {"role": "user", "content": f"Problem:\n{problem}\n\nStudent's attempt:\n{attempt}\n\nFeedback:"},
    ]


# --------------------------------------------------------------------------- endpoint clients
_clients: dict[tuple[str, str], Any] = {}
_models: dict[tuple[str, str], str] = {}
_clients_lock = threading.Lock()


def _client(url: str, key: str):
    with _clients_lock:
        client = _clients.get((url, key))
        if client is None:
            from openai import OpenAI
            # No retries: an endpoint call costs at most about its timeout, and a failure is
            # reported as missing feedback rather than waited out.
            client = _clients[(url, key)] = OpenAI(base_url=url, api_key=key, max_retries=0)
        return client


def _error_reason(exc: BaseException) -> str:
    reason = one_line(exc, _ERROR_CHARS)
    return reason if len(reason) <= _ERROR_CHARS else reason[:_ERROR_CHARS - 3] + "..."


class MathRefineEnv:
    observation_role = "user"
    stop = ("</answer>", "</feedback>")

    def __init__(self, feedback: str = "self", *, system_prompt: str = SYSTEM_PROMPT,
                 high_level_prompt: str = HIGH_LEVEL_PROMPT, endpoint_url: str = "",
                 endpoint_model: str = "", api_key_env: str = "OPENAI_API_KEY",
                 feedback_max_tokens: int = 64, feedback_temperature: float = 0.0,
                 timeout_s: float = 30.0):
        if feedback not in ("self", "endpoint"):
            raise ValueError(f"feedback must be 'self' or 'endpoint', not {feedback!r}")
        if feedback == "endpoint" and not endpoint_url:
            raise ValueError("feedback='endpoint' needs endpoint_url (e.g. http://127.0.0.1:8000/v1)")
        if feedback_max_tokens < 1:
            raise ValueError("feedback_max_tokens must be >= 1")
        if timeout_s <= 0:
            raise ValueError("timeout_s must be > 0")
        self.feedback = feedback
        self.system_prompt = system_prompt
        self.high_level_prompt = high_level_prompt
        self.endpoint_url = endpoint_url.rstrip("/")
        self.endpoint_model = endpoint_model
        self.api_key_env = api_key_env
        self.feedback_max_tokens = feedback_max_tokens
        self.feedback_temperature = feedback_temperature
        self.timeout_s = timeout_s
        self.example: dict = {}
        self.turns: list[str] = []
        self._summary: dict[str, Any] = {}

    # ------------------------------------------------------------------ protocol
    @property
    def num_turns(self) -> int:
        """Policy turns in a full trajectory: 3 (self), 2 (endpoint)."""
        return 3 if self.feedback == "self" else 2

    def role(self, turn: int) -> str:
        """``"low"`` (solver) or ``"high"`` (feedback) for a policy turn index."""
        if turn < 0:
            raise ValueError("turn must be >= 0")
        return "high" if self.feedback == "self" and turn == 1 else "low"

    def reset(self, example: dict) -> str:
        self.example = example
        self.turns = []
        self._summary = {}
        return example["prompt"]

    def step(self, text: str) -> StepResult:
        turn = len(self.turns)
        if turn >= self.num_turns:
            raise RuntimeError("the trajectory has ended; call reset() first")
        self.turns.append(text)
        if turn == 0:
            return self._attempt(text)
        if self.feedback == "self" and turn == 1:
            fb, well_formed = parse_feedback(text)
            self._summary.update(feedback=fb, feedback_format=1 if well_formed else 0)
            return StepResult(REFINE_REQUEST, 0.0, False,
                              {"feedback": fb, "feedback_format": self._summary["feedback_format"]})
        return self._refinement(text)

    # ------------------------------------------------------------------ turns
    def _grade(self, text: str):
        if self.example.get("grader") in ROW_GRADERS:   # a reasoning-gym row: its task's own score_answer
            return for_row(grader("math"), self.example)(text, self.example)
        return grade_any(text, self.example)

    def _attempt(self, text: str) -> StepResult:
        grade = self._grade(text)
        r1 = 1.0 if grade.correct else 0.0
        self._summary.update(attempt_correct=r1, attempt_extracted=grade.extracted, attempt_grade=grade.reason)
        info = {"attempt_correct": r1, "attempt_extracted": grade.extracted}
        if self.feedback == "self":
            return StepResult(FEEDBACK_REQUEST.format(problem=self.example["prompt"]), r1, False, info)
        fb, error = self._endpoint_feedback(text)
        self._summary.update(feedback=fb, feedback_error=error)
        observation = ENDPOINT_OBSERVATION.format(feedback=fb, refine_request=REFINE_REQUEST)
        return StepResult(observation, r1, False, {**info, "feedback": fb, "feedback_error": error})

    def _refinement(self, text: str) -> StepResult:
        grade = self._grade(text)
        outcome = 1.0 if grade.correct else 0.0
        reason = "answer" if grade.extracted else "no_answer"
        info = {**self._summary, "outcome": outcome, "reason": reason, "extracted": grade.extracted,
                "grade": grade.reason, "improvement": outcome - self._summary["attempt_correct"]}
        return StepResult(None, outcome, True, info)

    # ------------------------------------------------------------------ endpoint
    def _endpoint_feedback(self, attempt: str) -> tuple[str, str]:
        """(feedback text, error reason or "") from the high-level endpoint; never raises."""
        try:
            key = os.environ.get(self.api_key_env) or "EMPTY"
            client = _client(self.endpoint_url, key)
            model = self.endpoint_model or self._first_model(client, key)
            reply = client.chat.completions.create(
                model=model,
                messages=feedback_messages(self.example["prompt"], attempt, self.high_level_prompt),
                max_tokens=self.feedback_max_tokens, temperature=self.feedback_temperature,
                timeout=self.timeout_s)
            content = (reply.choices[0].message.content or "").strip() if reply.choices else ""
            if not content:
                raise ValueError("empty response")
            return content, ""
        except Exception as exc:  # noqa: BLE001 - an endpoint problem must not stop training
            error = _error_reason(exc)
            return f"(no feedback: {error})", error

    def _first_model(self, client, key: str) -> str:
        cache_key = (self.endpoint_url, key)
        model = _models.get(cache_key)
        if model is None:
            listed = [m.id for m in client.models.list(timeout=self.timeout_s).data]
            if not listed:
                raise ValueError(f"{self.endpoint_url}/models lists no model; set endpoint_model")
            model = _models[cache_key] = listed[0]
        return model


class MathRefineOptions(BaseModel):
    """`env.options` of `math_refine`. Who plays the feedback turns with `feedback: self` (the
    policy, or a second trained model) is the `levels` section's choice, not the environment's."""
    model_config = ConfigDict(extra="forbid")
    feedback: Literal["self", "endpoint"] = Field("self", description=(
        "self: a policy turn writes the feedback (the high level: shared weights, or a second model with "
        "levels.high_model: separate); endpoint: a frozen model behind an OpenAI-compatible server"))
    endpoint_url: str = Field("", description="feedback: endpoint: e.g. http://127.0.0.1:8000/v1 (vllm serve)")
    endpoint_model: str = Field("", description="empty: the first model the endpoint lists")
    api_key_env: str = Field("OPENAI_API_KEY", min_length=1)
    feedback_max_tokens: int = Field(64, gt=0)
    feedback_temperature: float = Field(0.0, ge=0.0, description="the endpoint's sampling temperature (0: greedy)")
    timeout_s: float = Field(30.0, gt=0)
    system_prompt: str = SYSTEM_PROMPT
    high_level_prompt: str = HIGH_LEVEL_PROMPT

    @model_validator(mode="before")
    @classmethod
    def _moved(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("feedback") == "model":
            raise ValueError("feedback: model moved: a second trained model for the feedback turns is "
                             "levels.high_model: separate (with feedback: self)")
        return data

    @model_validator(mode="after")
    def _endpoint(self) -> "MathRefineOptions":
        if self.feedback == "endpoint" and not self.endpoint_url:
            raise ValueError("feedback: endpoint needs endpoint_url (e.g. http://127.0.0.1:8000/v1)")
        return self


ENV = EnvSpec(factory=MathRefineEnv, options=MathRefineOptions, task=synthetic.TASKS["math_refine"],
              name="math_refine")
