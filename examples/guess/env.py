"""Guess the number: a multi-turn environment written as a user writes one.

The policy guesses a whole number in a range; after each wrong guess the environment says
"Higher." or "Lower.", until the guess is right or `max_guesses` run out. Binary search finds
any number from 1 to 16 in four guesses, so the feedback, not luck, is what pays.

    env.name: 'examples.guess.env:ENV'
    env.options: {max_guesses: 4}

A row is {prompt: "I picked a number from 1 to 16. ...", answer: "11"}: the range is in the
prompt, the secret in the answer. Turn reward: 1 if a guess lies within what the feedback so
far allows (a consistent guess), else 0: a turn-level signal for mt_grpo and friends.
"""
from __future__ import annotations

import random
import re

from pydantic import BaseModel, ConfigDict, Field

from turnrl.data.synthetic import Demonstration, SyntheticTask
from turnrl.envs import EnvSpec, StepResult

SYSTEM_PROMPT = "Find the number. Write one guess per turn as <guess>N</guess>; you are told higher or lower."
_RANGE = re.compile(r"from (\d+) to (\d+)")
_GUESS = re.compile(r"<guess>\s*(-?\d+)\s*</guess>")


class GuessOptions(BaseModel):
    """env.options of the guessing game."""
    model_config = ConfigDict(extra="forbid")
    max_guesses: int = Field(4, gt=0, description="guesses before the game is lost")


class GuessEnv:
    system_prompt = SYSTEM_PROMPT
    stop = ("</guess>",)
    observation_role = "user"

    def __init__(self, max_guesses: int = 4):
        self.max_guesses = max_guesses

    def reset(self, example: dict) -> str:
        found = _RANGE.search(example["prompt"])
        if found is None:
            raise ValueError(f"no 'from A to B' range in the prompt {example['prompt']!r}")
        self.low, self.high = int(found.group(1)), int(found.group(2))
        self.secret = int(example["answer"])
        self.guesses = 0
        return example["prompt"]

    def step(self, text: str) -> StepResult:
        found = _GUESS.search(text)
        if found is None:
            return StepResult(None, 0.0, True, {"outcome": 0.0, "reason": "no_action", "guesses": self.guesses,
                                                "grade": "no <guess>N</guess> in the turn"})
        guess = int(found.group(1))
        self.guesses += 1
        consistent = 1.0 if self.low <= guess <= self.high else 0.0
        if guess == self.secret:
            return StepResult(None, consistent, True, {"outcome": 1.0, "reason": "answer", "guesses": self.guesses,
                                                       "extracted": str(guess),
                                                       "grade": f"found {guess} in {self.guesses} guesses"})
        if self.guesses >= self.max_guesses:
            return StepResult(None, consistent, True, {"outcome": 0.0, "reason": "max_turns", "guesses": self.guesses,
                                                       "extracted": str(guess),
                                                       "grade": f"not found in {self.guesses} guesses (last {guess}, "
                                                                f"the number was {self.secret})"})
        if guess < self.secret:
            self.low = max(self.low, guess + 1)
            return StepResult("Higher.", consistent, False, {"guesses": self.guesses})
        self.high = min(self.high, guess - 1)
        return StepResult("Lower.", consistent, False, {"guesses": self.guesses})


# --------------------------------------------------------------------------- the warm start's demonstrations
def demonstration(row: dict, rng: random.Random, good: bool) -> Demonstration:
    """Good: binary search on the feedback. Otherwise: a few random guesses that ignore it (only
    the first guess is the habit the warm start's prior phase trains)."""
    low, high = (int(x) for x in _RANGE.search(row["prompt"]).groups())
    secret = int(row["answer"])
    turns = []
    for _ in range(4):
        guess = (low + high) // 2 if good else rng.randint(low, high)
        turns.append(f"<guess>{guess}</guess>")
        if guess == secret:
            break
        if good:
            low, high = (guess + 1, high) if guess < secret else (low, guess - 1)
    return Demonstration(turns, choice=None if good else (0, "<guess>"))


ENV = EnvSpec(factory=GuessEnv, options=GuessOptions,
              task=SyntheticTask("guess", demonstration=demonstration, skill_good_fraction=0.5))
