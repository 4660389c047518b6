"""Which rollout engine gets the next piece of work: the least-loaded one, or the one an
episode stuck to while it is not overloaded. Pure bookkeeping (no Ray, no clock), so it can be
driven by hand on scripted loads; turnrl.training.cluster drives it with Ray's calls.

    assign(item, work, key)   the engine for `item` (a group, a chunk of groups, a request)
                              carrying `work` units (groups, requests or queued tokens):
                                key given, its engine live and not overloaded   -> that engine
                                otherwise                                       -> the least loaded
                              ties go to the engine named first (deterministic); a key whose
                              engine was overloaded or removed moves (counted in `moved`) and
                              sticks to its new engine from then on
    done(item)                the item's work left its engine (counted in `completed`)
    remove(engine)            the engine died: its outstanding items come back, to be assigned
                              again to the others (each item counted once in `moved`, however
                              often it is re-sent)
    add(engine)               an engine (re)joins, with no outstanding work

Overloaded (the stated bound, "bounded loads"): an engine may take a keyed item while its
outstanding work with the item stays within ceil(bound x the mean outstanding work of the live
engines with the item): load + work <= ceil(bound x (total + work) / live engines). With the
default bound 1.25 and two engines of loads (1, 0) a sticky item stays (2 <= ceil(1.25)); at
(2, 0) it moves (3 > ceil(1.875) = 2); at (3, 1) it stays (4 <= ceil(3.125)). Stickiness matters where the calls of one
episode reach the engines one by one (the agent gateway: each call re-sends the episode's
context, and only the engine that served its last call holds that prefix in its cache). The
built-in step loop rolls out a whole episode, every turn, inside one rollout worker, so its
turns stick to one engine already; there the dispatch unit is a group of n trajectories.

`capacity` (items an engine may hold at once; None: no limit) lets a caller keep only one
piece of work in flight per engine and hand the next one to whichever engine finishes first.
"""
from __future__ import annotations

import math
from collections import Counter
from typing import Hashable, Iterable


class NoEngineLeft(RuntimeError):
    """Every engine was removed: nothing can take the work."""


class Dispatcher:
    def __init__(self, engines: Iterable[Hashable], bound: float = 1.25, capacity: int | None = None):
        if bound < 1:
            raise ValueError(f"bound = {bound}: an engine is overloaded above bound x the mean load, so bound >= 1")
        self.order: list[Hashable] = list(dict.fromkeys(engines))   # tie-break order
        if not self.order:
            raise ValueError("a dispatcher needs at least one engine")
        self.live: set[Hashable] = set(self.order)
        self.bound, self.capacity = bound, capacity
        self.items: dict[Hashable, tuple[Hashable, float]] = {}     # outstanding: item -> (engine, work)
        self.sticky: dict[Hashable, Hashable] = {}                  # episode key -> its engine
        self.completed: Counter = Counter()                         # work done per engine
        self.assigned: Counter = Counter()                          # work handed to each engine
        self.moved = 0                                              # items re-sent + keys moved
        self.moved_work = 0.0                                       # their work
        self._resent: set[Hashable] = set()                         # items counted in `moved`

    # ------------------------------------------------------------------ state
    def load(self, engine: Hashable) -> float:
        return sum(work for e, work in self.items.values() if e == engine)

    def loads(self) -> dict[Hashable, float]:
        """Outstanding work of every live engine, in engine order."""
        return {e: self.load(e) for e in self.order if e in self.live}

    def held(self, engine: Hashable) -> int:
        return sum(1 for e, _ in self.items.values() if e == engine)

    def overloaded(self, engine: Hashable, work: float = 1.0) -> bool:
        """Whether `engine` taking `work` more would hold more than the bound allows."""
        loads = self.loads()
        limit = math.ceil(self.bound * (sum(loads.values()) + work) / len(loads) - 1e-9)   # (float noise)
        return loads.get(engine, 0.0) + work > limit

    def has_room(self, engine: Hashable) -> bool:
        return engine in self.live and (self.capacity is None or self.held(engine) < self.capacity)

    # ------------------------------------------------------------------ choices
    def least_loaded(self) -> Hashable | None:
        """The live engine with room and the least outstanding work (first named on a tie);
        None when every live engine is at capacity."""
        if not self.live:
            raise NoEngineLeft("no rollout engine is left: every one was removed")
        loads = self.loads()
        candidates = [e for e in loads if self.has_room(e)]
        return min(candidates, key=lambda e: (loads[e], self.order.index(e))) if candidates else None

    def assign(self, item: Hashable, work: float = 1.0, key: Hashable | None = None) -> Hashable | None:
        """The engine that takes `item` (recorded as its outstanding work), or None when every
        live engine is at capacity (nothing recorded: ask again after a `done`)."""
        if item in self.items:
            raise ValueError(f"item {item!r} is already outstanding on {self.items[item][0]!r}")
        engine = None
        previous = self.sticky.get(key) if key is not None else None
        if previous is not None and previous in self.live and not self.overloaded(previous, work):
            if not self.has_room(previous):
                return None   # it stays sticky: wait for room on its engine rather than lose the prefix
            engine = previous
        if engine is None:
            engine = self.least_loaded()
            if engine is None:
                return None
            if previous is not None and engine != previous:
                self._count_move(item, work)
        if key is not None:
            self.sticky[key] = engine
        self.items[item] = (engine, work)
        self.assigned[engine] += work
        return engine

    def _count_move(self, item: Hashable, work: float) -> None:
        if item not in self._resent:
            self._resent.add(item)
            self.moved += 1
            self.moved_work += work

    def done(self, item: Hashable) -> Hashable:
        """`item` finished: its work leaves its engine's load. Returns that engine."""
        engine, work = self.items.pop(item)
        self.completed[engine] += work
        return engine

    # ------------------------------------------------------------------ engines coming and going
    def remove(self, engine: Hashable) -> list[Hashable]:
        """`engine` is gone: the items it held, to assign again (each counted once as moved).
        The keys stuck to it move on their next `assign` (counted then)."""
        self.live.discard(engine)
        back = [item for item, (e, _) in self.items.items() if e == engine]
        for item in back:
            self._count_move(item, self.items.pop(item)[1])
        return back

    def add(self, engine: Hashable) -> None:
        """`engine` (re)joins the dispatch with no outstanding work."""
        if engine not in self.order:
            self.order.append(engine)
        self.live.add(engine)
