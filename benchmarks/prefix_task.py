"""The prefix-cache benchmark's task: episodes of 1 to 5 turns, long-tailed, whose every turn
re-sends the whole conversation so far (as a multi-turn agent's does).

    env.name: benchmarks.prefix_task:ENV

Each row's episode length is drawn from its prompt (P(1..5 turns) = 0.40, 0.20, 0.15, 0.10,
0.15: most short, a long tail), so every sample of a group runs as long, and a step's long
episodes land wherever the rows fall. After each policy turn the environment answers with a note of
about 90 tokens (other problems of the task and their products, text the tiny tokenizer knows), so
turn k's prompt holds the k turns before it. The reward is the share of digits in the last turn, a
graded signal that keeps GRPO's groups apart (the trainer does real work each step); what is
measured is the rollout, not learning.
"""
from __future__ import annotations

import hashlib
import random

from turnrl.data import synthetic
from turnrl.envs.base import EnvSpec, StepResult
from turnrl.envs.code_tool import SYSTEM_PROMPT

TURN_WEIGHTS = (0.40, 0.20, 0.15, 0.10, 0.15)   # P(an episode takes 1, 2, 3, 4, 5 turns)


def episode_turns(prompt: str) -> int:
    """The row's number of turns, a pure function of its prompt."""
    draw = int.from_bytes(hashlib.sha256(prompt.encode()).digest()[:8], "big") / 2 ** 64
    total = 0.0
    for turns, weight in enumerate(TURN_WEIGHTS, start=1):
        total += weight
        if draw < total:
            return turns
    return len(TURN_WEIGHTS)


def note(prompt: str, turn: int) -> str:
    """What the environment answers after turn `turn`: three other products, seeded by the row."""
    rng = random.Random(f"{prompt}|{turn}")
    facts = [(rng.randint(100, 999), rng.randint(100, 999)) for _ in range(3)]
    return " ".join(f"<output>Compute {a} * {b}. {a * b}</output>" for a, b in facts)


class PrefixEnv:
    system_prompt = SYSTEM_PROMPT
    # the benchmark's model is untrained (a fresh tiny one): it ends a turn at any of these, which
    # it writes within 32 tokens in most turns (a turn cut by the token limit would end its episode)
    stop = ("<", "*", ".")
    observation_role = "user"

    def reset(self, example: dict) -> str:
        self.prompt, self.turn = example["prompt"], 0
        self.turns = episode_turns(self.prompt)
        return self.prompt

    def step(self, text: str) -> StepResult:
        self.turn += 1
        if self.turn >= self.turns:
            digits = sum(ch.isdigit() for ch in text) / max(1, len(text))
            return StepResult(None, digits, True, {"outcome": float(digits > 0.5), "reason": "answer",
                                                   "episode_turns": self.turns})
        return StepResult(note(self.prompt, self.turn), 0.0, False, {})


ENV = EnvSpec(factory=PrefixEnv, name="prefix_task",
              task=synthetic.SyntheticTask("prefix_task", synthetic.product_rows))
