"""The environment interface every multi-turn environment implements.

An environment is a small stateful object, one per trajectory:

    env = turnrl.envs.make("code_tool")
    first_message = env.reset(example)      # example: a dict with at least prompt and answer
    result = env.step(policy_turn_text)     # StepResult(observation, reward, done, info)

`observation` is text the environment adds to the conversation (a tool result, feedback, an
intervention) in the role `observation_role`; it is never trained on. `reward` is this turn's
reward; when `done`, `info["outcome"]` holds the trajectory's outcome reward (for example
answer correctness) and `info["reason"]` why it ended.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass
class StepResult:
    observation: str | None
    reward: float
    done: bool
    info: dict[str, Any] = field(default_factory=dict)


class Env(Protocol):
    system_prompt: str          # instructions for the policy (system message)
    stop: tuple[str, ...]       # a policy turn ends at the first of these strings
    observation_role: str       # chat role of observations: "tool" or "user"

    def reset(self, example: dict) -> str: ...

    def step(self, text: str) -> StepResult: ...
