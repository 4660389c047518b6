"""Past selves: the snapshots behind the `past:<N>` and `past:<N>:<K>` opponents (`Past`).

    GameRunner.bind(model_dir)                    the policy's starting folder (the rollout actor's model)
    GameRunner.run(...)                           its first rollout opens a `League` per past: spec
                                                  the options name (opponent, eval_opponents)
    GameRunner.load_weights(v, apply, weights)    every N-th push: `weights()` into a snapshot

A snapshot is a transformers engine (CPU, float32, as a `checkpoint:` opponent's) holding its own
copy of the weights in host memory: a league keeps at most K, the oldest reloaded with the new
weights once K are held, and each table draws one with its own generator. The count is of
the policy's weight pushes since the run started (one per step that updates the policy); a push
that comes before the runner's first rollout is the weights the run starts from (a resumed
run's checkpoint): it becomes every league's first snapshot, push 0, and the count starts
there. Unbound (the evaluation stages, which push nothing) a past self is the pipeline's
starting checkpoint, models/initial.
"""
from __future__ import annotations

import random
from pathlib import Path
from typing import Any, Iterable

from turnrl.games.base import Past, parse_past
from turnrl.plugins import PluginError
from turnrl.rollout.episodes import Weights as Tensors   # a fresh iterable of (name, tensor) per call

#: where a past self starts when no runner was bound to a model folder
STARTING_CHECKPOINT = "models/initial"


def model_engine(folder: str, name: str, hint: str) -> Any:
    """A transformers engine (CPU) of a model folder, for the opponent `name`; a folder with no
    config.json is a one-line FileNotFoundError ending in `hint`."""
    from turnrl.rollout.engines import HFEngine
    if not (Path(folder) / "config.json").is_file():
        raise FileNotFoundError(f"{name}: no model folder there (config.json missing); {hint}")
    return HFEngine(folder)


class League:
    """The snapshots of one `past:` spec, oldest first, each (the push it holds, engine): push 0
    is the weights the run started from."""

    def __init__(self, spec: Past, folder: str, start: Tensors | None):
        self.spec, self.folder = spec, folder
        self.snapshots: list[tuple[int, Any]] = [(0, self._engine(start))]

    def _engine(self, weights: Tensors | None) -> Any:
        engine = model_engine(self.folder, self.spec.name, f"a past self starts from the weights in {self.folder} "
                              "(the policy's model folder in training; in the evaluation stages models/initial, "
                              "the starting checkpoint)")
        if weights is not None:
            engine.load_weights(weights())
        return engine

    def refresh(self, pushes: int, weights: Tensors) -> bool:
        """The policy's push `pushes` (counted from the run's start): a snapshot of `weights()`
        where it is a multiple of N, in a new engine while fewer than K are held, else in the
        oldest's."""
        if pushes <= 0 or pushes % self.spec.every:
            return False
        if len(self.snapshots) < self.spec.keep:
            engine = self._engine(weights)
        else:
            engine = self.snapshots.pop(0)[1]
            engine.load_weights(weights())
        self.snapshots.append((pushes, engine))
        return True

    def draw(self, rng: random.Random) -> tuple[int, Any]:
        """A table's snapshot, (the push it holds, its engine): one of those held, drawn by the
        table's generator."""
        return self.snapshots[rng.randrange(len(self.snapshots))] if len(self.snapshots) > 1 else self.snapshots[0]


class Leagues:
    """A runner's past selves: a `League` per past: spec, opened before the first rollout that
    names it (one that fails to open fails the tables that draw from it, not the batch)."""

    def __init__(self):
        self.folder: str | None = None        # the policy's starting folder (`bind`); None: models/initial
        self.by_spec: dict[Past, League | BaseException] = {}
        self.pushes = 0                       # the policy's pushes since the run's start
        self.start: Tensors | None = None     # the weights the run started from, until its first rollout
        self.opened = False

    def open(self, names: Iterable[str]) -> None:
        """Before a rollout: a league for each past: spec of `names` not open yet."""
        for name in names:
            if name.startswith("past:"):
                try:
                    self._league(parse_past(name))
                except PluginError:   # a bad spec: the table's own make_player reports it
                    pass
        self.opened, self.start = True, None

    def _league(self, spec: Past) -> League | BaseException:
        if spec not in self.by_spec:
            try:
                self.by_spec[spec] = League(spec, self.folder or STARTING_CHECKPOINT, self.start)
            except Exception as exc:   # noqa: BLE001 - kept, raised at each table that draws from it
                self.by_spec[spec] = exc
        return self.by_spec[spec]

    def draw(self, spec: Past, rng: random.Random) -> tuple[int, Any]:
        league = self._league(spec)
        if isinstance(league, BaseException):
            raise RuntimeError(str(league)) from league
        return league.draw(rng)

    def push(self, weights: Tensors) -> None:
        """New policy weights: before the first rollout the weights the run starts from; after
        it, a snapshot in each league whose N divides the pushes since then. (Counted here, not
        by the caller's version: a push of another model, the high level's, carries no weights
        and does not count.)"""
        if not self.opened:
            self.start = weights
            return
        self.pushes += 1
        for league in self.by_spec.values():
            if isinstance(league, League):
                league.refresh(self.pushes, weights)
