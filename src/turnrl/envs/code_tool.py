"""`code_tool` (MT-GRPO): the policy may run Python in a sandbox before it answers.

Protocol, one policy turn at a time:
    <code>print(347 * 8215)</code>      -> observation <output>2850605</output>
    <answer>2850605</answer>            -> done, outcome = 1.0 if correct

Turn reward: 1.0 when the tool call ran without error, else 0.0 (MT-GRPO's turn-level
signal). Errors, timeouts and limits come back to the policy as text in <output>, never as
an exception in the trainer.
"""
from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict, Field

from turnrl.data import synthetic
from turnrl.envs.base import EnvSpec, StepResult
from turnrl.envs.sandbox import SandboxLimits, run_python
from turnrl.rewards.math import grade_any

SYSTEM_PROMPT = (
    "Solve the problem. You can run Python by writing <code>...</code>; its printed output "
    "comes back in <output>...</output>. Give the final answer as <answer>...</answer>."
)

_CODE = re.compile(r"<code>(.*?)</code>", re.DOTALL)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def parse_action(text: str) -> tuple[str, str | None]:
    """('answer', content) | ('code', source) | ('none', None), by the first complete tag."""
    answer, code = _ANSWER.search(text), _CODE.search(text)
    if answer and (not code or answer.start() < code.start()):
        return "answer", answer.group(1).strip()
    if code:
        return "code", code.group(1).strip()
    return "none", None


class CodeToolEnv:
    observation_role = "tool"
    stop = ("</code>", "</answer>")

    def __init__(self, timeout_s: float = 5.0, memory_mb: int = 256, max_output_chars: int = 200,
                 max_processes: int = 8, system_prompt: str = SYSTEM_PROMPT):
        self.system_prompt = system_prompt
        # memory_mb is per process: max_processes x memory_mb bounds a call's memory (2 GiB here)
        self.limits = SandboxLimits(timeout_s=timeout_s, cpu_s=max(1, int(timeout_s) + 1),
                                    memory_mb=memory_mb, max_output_chars=max_output_chars,
                                    max_processes=max_processes)
        self.example: dict = {}
        self.tool_calls = 0

    def reset(self, example: dict) -> str:
        self.example = example
        self.tool_calls = 0
        return example["prompt"]

    def step(self, text: str) -> StepResult:
        kind, content = parse_action(text)
        if kind == "answer":
            grade = grade_any(f"<answer>{content}</answer>", self.example)
            outcome = 1.0 if grade.correct else 0.0
            return StepResult(None, outcome, True, {"outcome": outcome, "reason": "answer",
                                                    "extracted": grade.extracted,
                                                    "tool_calls": self.tool_calls})
        if kind == "code":
            self.tool_calls += 1
            result = run_python(content, self.limits)
            body = result.output.strip() if result.ok else f"Error: {result.error}\n{result.output.strip()}".strip()
            return StepResult(f"<output>{body}</output>", 1.0 if result.ok else 0.0, False,
                              {"tool_ok": result.ok, "tool_error": result.error})
        return StepResult(None, 0.0, True, {"outcome": 0.0, "reason": "no_action",
                                            "tool_calls": self.tool_calls})


class CodeToolOptions(BaseModel):
    """`env.options` of `code_tool`."""
    model_config = ConfigDict(extra="forbid")
    timeout_s: float = Field(5.0, gt=0, description="wall-clock seconds per call")
    memory_mb: int = Field(256, ge=32, description="address space per process of a call")
    max_output_chars: int = Field(200, gt=0, description="printed output kept (the rest cut)")
    max_processes: int = Field(8, ge=2, description=(
        "processes and threads of one call, the sandbox's helper included (RLIMIT_NPROC); with memory_mb it "
        "bounds a call's memory: max_processes x memory_mb"))
    system_prompt: str = SYSTEM_PROMPT


ENV = EnvSpec(factory=CodeToolEnv, options=CodeToolOptions, task=synthetic.TASKS["code_tool"], name="code_tool")
