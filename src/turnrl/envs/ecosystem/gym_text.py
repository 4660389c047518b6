"""`gym_text`: a text game from the ecosystem, run unchanged as a turnrl environment.

    env:
      name: gym_text
      options: {make: "textarena:GuessTheNumber-v0", kwargs: {}}
    data:
      train_set: synthetic        # data.train_examples seeded episodes; the held-out split other seeds

`make` names the game:
- `textarena:<env id>`: TextArena's `ta.make(id, **kwargs)`, one player. `reset(num_players=1,
  seed=)` starts the episode; `get_observation()` is the game log so far, of which each turn's
  observation is the part after the previous one; `step(action) -> (done, info)`; at the end
  `close() -> (rewards, game_info)` gives player 0's reward.
- `module:factory`: any object with gymnasium's `reset(seed=) -> (observation, info)` and
  `step(action) -> (observation, reward, terminated, truncated, info)` (GEM's `gem.make(...)`
  through a factory of one's own, or a game of one's own).

The library's semantics are kept: each step's reward is the turn's reward, `terminated or
truncated` ends the episode (`reason`: terminated | truncated), and the outcome is the episode's
return (the sum of its rewards; accuracy counts a positive return). An episode still running at
rollout.max_turns ends there with its return so far (`reason: max_turns`). The episode's seed is the
row's `game_seed`. The library is imported on first use; without it the error names the extra.
"""
from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from turnrl.data.synthetic import SyntheticTask, split_numbers
from turnrl.envs.base import EnvContext, EnvSpec, StepResult
from turnrl.envs.ecosystem.glue import import_library, numeric_info
from turnrl.errors import one_line
from turnrl.plugins import PluginError, is_import_path, load_object

SYSTEM_PROMPT = "You are playing a text game. Read the game's messages and reply with your move."


class GymTextOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    make: str = Field(min_length=1, description=(
        "textarena:<env id> (e.g. textarena:GuessTheNumber-v0) or module:factory of a gymnasium-style text "
        "environment (reset(seed=) -> (obs, info), step(action) -> (obs, reward, terminated, truncated, info))"))
    kwargs: dict[str, Any] = Field(default_factory=dict, description="keyword arguments of the make call")
    system_prompt: str = SYSTEM_PROMPT


def _textarena(env_id: str, kwargs: dict[str, Any]):
    textarena = import_library("textarena", where=f"env.options.make = textarena:{env_id}")
    try:
        return textarena.make(env_id, **kwargs)
    except Exception as exc:   # noqa: BLE001 - the library's own "unknown id" error, on one line
        hint = _download_hint(exc)
        raise PluginError(f"env.options.make = textarena:{env_id}: the game cannot start: "
                          f"{one_line(exc).rstrip('.') if hint else one_line(exc)}{hint}") from None


def _download_hint(exc: BaseException) -> str:
    """What to run for a data file a library looks up and does not find (NLTK's word lists)."""
    found = re.search(r"nltk\.download\(['\"]([\w.-]+)['\"]\)", str(exc))
    if found is None:
        return ""
    return (f"; NLTK's {found.group(1)!r} data is missing: download it once where the network is reachable "
            f"(python -m nltk.downloader {found.group(1)}), or copy an nltk_data folder holding it")


def make_game(make: str, kwargs: dict[str, Any] | None = None) -> tuple[str, Any]:
    """(protocol, a fresh game) for `make`: ("textarena", env) or ("gym", env)."""
    kwargs = dict(kwargs or {})
    if make.startswith("textarena:"):
        return "textarena", _textarena(make.split(":", 1)[1], kwargs)
    if not is_import_path(make):
        raise PluginError(f"env.options.make = {make!r}: use textarena:<env id> or an import path module:factory")
    return "gym", load_object(make, "env.options.make")(**kwargs)


class GymTextEnv:
    observation_role = "user"
    stop: tuple[str, ...] = ()

    def __init__(self, make: str, kwargs: dict[str, Any] | None = None, system_prompt: str = SYSTEM_PROMPT,
                 context: EnvContext | None = None):
        self.make, self.kwargs, self.system_prompt = make, dict(kwargs or {}), system_prompt
        self.max_turns = (context or EnvContext()).max_turns   # rollout.max_turns
        self.protocol, self.game = "", None
        self.seen = ""        # textarena: the game log already shown to the policy
        self.total = 0.0      # the episode's return so far
        self.turns = 0

    def reset(self, example: dict) -> str:
        self.protocol, self.game = make_game(self.make, self.kwargs)
        seed = int(example["game_seed"])
        self.total, self.turns = 0.0, 0
        if self.protocol == "textarena":
            self.game.reset(num_players=1, seed=seed)
            self.seen = self.game.get_observation()[1]
            return self.seen
        observation, _info = self.game.reset(seed=seed)
        return str(observation)

    def step(self, text: str) -> StepResult:
        result = self._textarena_step(text) if self.protocol == "textarena" else self._gym_step(text)
        self.turns += 1
        if not result.done and self.turns >= self.max_turns:
            # rollout.max_turns ends the episode before the game does: its return so far is the outcome
            return StepResult(None, result.reward, True, {**result.info, "outcome": self.total, "reason": "max_turns"})
        return result

    def _gym_step(self, text: str) -> StepResult:
        observation, reward, terminated, truncated, info = self.game.step(text)
        self.total += float(reward)
        done = bool(terminated or truncated)
        extra = numeric_info(info)
        if done:
            return StepResult(None, float(reward), True, {"outcome": self.total, **extra,
                                                          "reason": "terminated" if terminated else "truncated"})
        return StepResult(str(observation), float(reward), False, extra)

    def _textarena_step(self, text: str) -> StepResult:
        done, _info = self.game.step(text)
        if not done:
            log = self.game.get_observation()[1]
            new, self.seen = log[len(self.seen):] if log.startswith(self.seen) else log, log
            return StepResult(new, 0.0, False, {})
        rewards, game_info = self.game.close()
        reward = float(rewards.get(0, 0.0)) if rewards else 0.0
        self.total += reward
        invalid = bool((game_info or {}).get(0, {}).get("invalid_move", False))
        return StepResult(None, reward, True, {"outcome": self.total, "reason": "terminated",
                                               "invalid_move": float(invalid)})


def episode_rows(count: int, *, seed: int, split: str, exclude: set, make: str = "game") -> list[dict]:
    """Seeded episodes: row i of a split plays game seed 2 * (seed * 10**6 + i) + (0 held-out, 1 train)."""
    return [{"id": f"episode-{split}-{game_seed}", "prompt": f"episode seed {game_seed}", "answer": "", "answers": [],
             "subject": None, "level": None, "source": "gym_text", "game_seed": game_seed}
            for game_seed in split_numbers(count, split=split, exclude=exclude, start=seed * 10 ** 6)]


TASK = SyntheticTask(name="gym_text", rows=episode_rows, key=lambda r: r["game_seed"])
ENV = EnvSpec(factory=GymTextEnv, options=GymTextOptions, task=TASK, name="gym_text")
