"""Guess the number as an OpenEnv environment (openenv-core's `Environment`, `Action`,
`Observation`), for `env.name: openenv` (docs/ecosystem-openenv.md).

The secret is drawn from 1..16 by the reset's `seed`. Each step's action is a guess (text, so
"I think 11" works: the last whole number in it counts); the observation says "Higher.",
"Lower." or "Correct!". Per-turn reward: 1.0 for the right guess, 0.0 for a wrong one, None for
text without a number (the library's "no reward"). The episode ends on the right guess or after
`MAX_GUESSES` guesses.

Serve it (any number of concurrent sessions, one per trajectory):

    uvicorn examples.openenv_guess.server:app --port 8000
"""
from __future__ import annotations

import random
import re
from typing import Any, Optional

from openenv.core.env_server import Action, Environment, Observation, State

MAX_GUESSES = 4
_NUMBER = re.compile(r"-?\d+")


class GuessAction(Action):
    guess: str


class GuessObservation(Observation):
    message: str = ""
    guesses_left: int = MAX_GUESSES


class GuessEnvironment(Environment[GuessAction, GuessObservation, State]):
    SUPPORTS_CONCURRENT_SESSIONS = True   # each session has its own instance and no shared state

    def __init__(self):
        super().__init__()
        self._state = State()
        self._secret = 1
        self._left = MAX_GUESSES

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None, **kwargs: Any) -> GuessObservation:
        self._secret = random.Random(seed).randint(1, 16)
        self._left = MAX_GUESSES
        self._state = State(episode_id=episode_id, step_count=0)
        return GuessObservation(message=f"I picked a number from 1 to 16. You have {MAX_GUESSES} guesses.",
                                guesses_left=self._left)

    def step(self, action: GuessAction, timeout_s: Optional[float] = None, **kwargs: Any) -> GuessObservation:
        self._state.step_count += 1
        self._left -= 1
        numbers = _NUMBER.findall(action.guess)
        if not numbers:
            return GuessObservation(message="Say a number.", guesses_left=self._left, reward=None,
                                    done=self._left <= 0)
        guess = int(numbers[-1])
        if guess == self._secret:
            return GuessObservation(message="Correct!", guesses_left=self._left, reward=1.0, done=True)
        hint = "Higher." if guess < self._secret else "Lower."
        return GuessObservation(message=hint, guesses_left=self._left, reward=0.0, done=self._left <= 0)

    @property
    def state(self) -> State:
        return self._state
