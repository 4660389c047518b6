"""Continuous rollouts for asynchronous training: the engine never waits for the trainer.

    driver  --feed(examples)-->  inbox  --admit-->  groups in flight (n trajectories each)
    each engine step: pending weights are loaded first (partial rollout: a turn in flight goes
        on under the new weights, its KV recomputed by them), answers that are back rejoin, the
        engine decodes
    a group whose n trajectories all ended  -->  finished  --take_groups()-->  driver

It is the multi-turn loop's core, `turnrl.rollout.multi_turn.TurnEngine` (its turns, budgets,
environments, stop strings and rejoin rule "ready"), run as a service: trajectories are admitted while fewer
than `max_groups` groups are in flight, and handed out a group at a time as soon as the group is
done, so a slow tool holds back its own group only.

Every policy turn keeps the engine's logprob of each sampled token and the policy version
the weights had when the turn started (`Trajectory.turn_versions`); a turn that straddles a
weight load is stamped with the older version (the logprobs stay exact: the engine reports
them under the weights that sampled each token). That bookkeeping is `TurnVersions`, pure (no
engine, no thread) and tested on its own.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import Callable, Mapping

from turnrl.envs.base import Env
from turnrl.rollout.chat import ChatFormat
from turnrl.rollout.multi_turn import Budgets, Engine, TurnEngine, Trajectory, start_trajectory


class TurnVersions:
    """The staleness bookkeeping of a stream: the policy version of the weights loaded now, the
    version each trajectory's current turn started under, and each finished turn stamped with the
    version it started under (a turn that straddles a weight load keeps the older one)."""

    def __init__(self, version: int = 0):
        self.current = version
        self._started: dict[int, int] = {}   # trajectory -> the version its current turn started under

    def load(self, version: int) -> None:
        """New weights: turns that start from now on are sampled by `version`."""
        self.current = version

    def turn_started(self, i: int) -> None:
        self._started[i] = self.current

    def stamp(self, i: int, t: Trajectory) -> None:
        """Trajectory i's finished turns that have no version yet get the version their turn
        started under (the current one for a trajectory never started here). Idempotent."""
        while len(t.turn_versions) < t.num_turns:
            t.turn_versions.append(self._started.get(i, self.current))

    def forget(self, i: int) -> None:
        """Trajectory i has left (its group is done)."""
        self._started.pop(i, None)


class Stream(TurnEngine):
    """A `TurnEngine` whose trajectories come and go: admitted a group at a time while there is
    room, released when their group is handed out. The driver's thread calls `feed`,
    `take_groups`, `load_weights` and `stop`; `run` is the generating thread's loop."""

    def __init__(self, engine: Engine | Mapping[str, Engine], make_env: Callable[[], Env], fmt: ChatFormat,
                 budgets: Budgets, *, n: int, max_groups: int, temperature: float, top_p: float,
                 env_workers: int = 4, version: int = 0):
        probe = make_env()   # the environment's stop strings and whether its step is a coroutine
        super().__init__(engine, fmt, budgets, probe, temperature=temperature, top_p=top_p, rejoin="ready")
        self.versions = TurnVersions(version)   # the policy version of the weights and of each turn
        self.pool = ThreadPoolExecutor(max_workers=env_workers)
        self.make_env, self.n, self.max_groups = make_env, n, max_groups
        self._pending_weights: tuple[int, Callable[[], None]] | None = None
        self._group_of: dict[int, int] = {}
        self._left: dict[int, int] = {}          # group -> trajectories not yet ended
        self._next_index = self._next_group = self._next_tag = 0
        self._inbox: deque = deque()             # (example, trajectories, tag): tag None for training groups
        self._tagged: dict[int, list[list[Trajectory]]] = {}   # roll_out's groups, by call
        self._tag_of: dict[int, int | None] = {}
        self._finished: deque = deque()
        self._lock = threading.Condition()
        self._stopped = False
        self.busy_s = 0.0   # seconds spent decoding (the engine's busy time)
        self.error: BaseException | None = None

    @property
    def version(self) -> int:
        """The policy version of the weights the engine holds now."""
        return self.versions.current

    # ------------------------------------------------------------------ the driver's side
    def feed(self, examples: list[dict]) -> None:
        """Queue examples; each becomes a group of n trajectories when there is room."""
        with self._lock:
            self._inbox.extend((example, self.n, None) for example in examples)
            self._lock.notify_all()

    def roll_out(self, examples: list[dict], n: int, timeout_s: float = 3600.0) -> list[Trajectory]:
        """`n` trajectories of each example under the current weights, ahead of the queued
        examples and beside the groups in flight (e.g. a held-out evaluation while training goes
        on); they never reach `take_groups`. Blocks until all are done; in the examples' order."""
        with self._lock:
            self._next_tag += 1
            tag = self._next_tag
            self._tagged[tag] = []
            self._inbox.extendleft((example, n, tag) for example in reversed(examples))
            self._lock.notify_all()
            done = self._lock.wait_for(lambda: len(self._tagged[tag]) == len(examples) or self.error is not None,
                                       timeout=timeout_s)
            groups = self._tagged.pop(tag)
        if self.error is not None:
            raise RuntimeError(f"the rollout stream stopped: {self.error!r}") from self.error
        if not done:
            raise TimeoutError(f"{len(examples) - len(groups)} of {len(examples)} examples not rolled out in {timeout_s}s")
        order = {id(example): k for k, example in enumerate(examples)}
        return [t for group in sorted(groups, key=lambda g: order[id(g[0].example)]) for t in group]

    def take_groups(self, max_groups: int, timeout_s: float) -> list[list[Trajectory]]:
        """Up to `max_groups` finished groups, waiting at most `timeout_s` for the first.
        Raises what ended the generating thread, if something did."""
        with self._lock:
            self._lock.wait_for(lambda: self._finished or self._stopped, timeout=timeout_s)
            if self.error is not None:
                raise RuntimeError(f"the rollout stream stopped: {self.error!r}") from self.error
            out = []
            while self._finished and len(out) < max_groups:
                out.append(self._finished.popleft())
            return out

    def load_weights(self, version: int, apply: Callable[[], None], weights=None) -> None:
        """New weights: `apply()` runs on the generating thread before its next engine step
        (`weights`, the same weights again, is not kept: the step loop has no use for them)."""
        with self._lock:
            self._pending_weights = (version, apply)
            self._lock.notify_all()

    def counts(self) -> dict[str, int]:
        """Training groups queued (inbox), rolling out (in_flight) and done, not yet taken (finished)."""
        with self._lock:
            return {"inbox": sum(tag is None for *_, tag in self._inbox), "in_flight": self._training_groups(),
                    "finished": len(self._finished)}

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            self._lock.notify_all()

    # ------------------------------------------------------------------ the generating thread
    def run(self, pool: ThreadPoolExecutor | None = None) -> None:
        try:
            while not self._stopped:
                self._apply_weights()
                self._admit()
                self.take_answers()
                busy = [s for s in self.steppers.values() if s.busy()]
                if busy:
                    start = time.perf_counter()
                    self.decode(busy)
                    self.busy_s += time.perf_counter() - start
                elif self.waiting:
                    wait_futures([e[3] for e in self.waiting], timeout=0.05, return_when=FIRST_COMPLETED)
                else:
                    with self._lock:
                        self._lock.wait_for(lambda: self._inbox or self._stopped or self._pending_weights,
                                            timeout=0.05)
        except BaseException as exc:   # the driver's next take_groups raises it
            with self._lock:
                self.error = exc
                self._lock.notify_all()
            raise
        finally:
            self.close()
            self.pool.shutdown(wait=False, cancel_futures=True)
            self.stop()

    def _apply_weights(self) -> None:
        with self._lock:
            pending, self._pending_weights = self._pending_weights, None
        if pending is not None:
            version, apply = pending
            apply()
            self.versions.load(version)

    def _admit(self) -> None:
        """Start the queued examples' groups while fewer than max_groups are in flight."""
        while True:
            with self._lock:
                # roll_out's examples (tagged, at the front) do not wait for room
                if not self._inbox or (self._inbox[0][2] is None and self._training_groups() >= self.max_groups):
                    return
                example, n, tag = self._inbox.popleft()
            group = self._next_group
            self._next_group += 1
            self._left[group], self._tag_of[group] = n, tag
            for _ in range(n):
                i = self._next_index
                self._next_index += 1
                self._group_of[i] = group
                self.admit(i, *start_trajectory(self.make_env, example, self.fmt))

    def start_turn(self, i: int) -> None:
        self.versions.turn_started(i)
        super().start_turn(i)

    def env_step(self, i: int, text: str):
        self.versions.stamp(i, self.trajs[i])   # the turn the engine just finished goes to the environment
        return super().env_step(i, text)

    def end(self, i: int, finish: str | None = None) -> None:
        super().end(i, finish)
        self.versions.stamp(i, self.trajs[i])   # a turn cut by the token limit ends here, not in env_step
        group = self._group_of[i]
        self._left[group] -= 1
        if self._left[group]:
            return
        del self._left[group]
        tag = self._tag_of.pop(group)
        members = sorted(k for k, g in self._group_of.items() if g == group)
        done = [self.release(k) for k in members]
        for k in members:
            del self._group_of[k]
            self.versions.forget(k)
        with self._lock:
            (self._finished if tag is None else self._tagged[tag]).append(done)
            self._lock.notify_all()

    def _training_groups(self) -> int:
        return sum(tag is None for tag in self._tag_of.values())
