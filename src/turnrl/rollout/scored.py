"""Trajectories scored as they finish.

    stream (Stream, or an agent runner's)  --each finished group-->  scoring thread  -->  scored
    take_groups()  <--  scored

The reward functions (a judge among them: seconds of HTTP per batch) run on threads of their
own as groups come out of the stream, while the engine goes on generating: a slow judge holds
no engine slot and no trainer wait, unless the trainer has caught up with it. What is finished
when the stream is looked at is scored as one batch (a judge's calls run concurrently over it),
and up to `max_batches` batches are scored at once: a group that ends while an earlier batch
waits for the judge's slowest answer is asked about at once, not after it. (So reward functions
may be called from several threads at once; a judge's `max_concurrency` holds across them,
turnrl.rewards.endpoint.Session.)

Asynchronous training wraps its stream in a `ScoredStream` (group by group, as the stream hands
groups out); a synchronous batch goes through `scored_as_they_finish`: the runner reports each
trajectory as it ends (`on_trajectory_done`) into a `FinishedQueue`, and the same thread scores it
while the rest of the batch generates. So a judge's calls start as each answer is in, not when
its group's slowest member is: in a synchronous step the judge's time left after the last
trajectory ends is that of the last few answers' calls, not of the last groups' (a scorer that
judges a group together, RULER-style, has the runner report whole groups: `unit="group"`).
"""
from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from turnrl.rollout.multi_turn import Trajectory


class ScoredStream:
    """`stream`'s finished groups, each passed through `score` (sets the trajectories' rewards)
    before `take_groups` hands it out, in the order their scores come back. A failure of the
    stream or of `score` (e.g. a RewardFunctionError with reward.on_error: fail) is raised by the
    next `take_groups`."""

    def __init__(self, stream: Any, score: Callable[[list[Trajectory]], None], poll_s: float = 0.25,
                 max_batches: int = 4):
        self.stream, self.score, self.poll_s, self.max_batches = stream, score, poll_s, max_batches
        self._scored: deque = deque()
        self._scoring = 0              # groups taken from the stream, their scores not yet back
        self._batches = 0              # batches being scored
        self._cond = threading.Condition()
        self._stopped = False
        self.error: BaseException | None = None
        self._pool = ThreadPoolExecutor(max_batches, thread_name_prefix="turnrl-scoring")
        self._thread = threading.Thread(target=self._run, name="turnrl-scoring", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            with self._cond:   # a free scorer first: a batch taken waits for none
                self._cond.wait_for(lambda: self._stopped or self.error is not None
                                    or self._batches < self.max_batches)
                if self._stopped or self.error is not None:
                    return
            try:
                groups = self.stream.take_groups(1 << 30, self.poll_s)
            except BaseException as exc:   # noqa: BLE001 - handed to the trainer's next take
                self._failed(exc, 0)
                return
            if groups:
                with self._cond:
                    self._scoring += len(groups)
                    self._batches += 1
                self._pool.submit(self._score, groups)

    def _score(self, groups: list[list[Trajectory]]) -> None:
        try:
            self.score([t for group in groups for t in group])
        except BaseException as exc:   # noqa: BLE001 - handed to the trainer's next take
            self._failed(exc, len(groups))
            return
        with self._cond:
            self._scored.extend(groups)
            self._scoring -= len(groups)
            self._batches -= 1
            self._cond.notify_all()

    def _failed(self, exc: BaseException, groups: int) -> None:
        with self._cond:
            if self.error is None:
                self.error = exc
            self._scoring -= groups
            self._batches -= 1 if groups else 0
            self._cond.notify_all()

    def take_groups(self, max_groups: int, timeout_s: float) -> list[list[Trajectory]]:
        """Up to `max_groups` scored groups, waiting at most `timeout_s` for the first."""
        with self._cond:
            self._cond.wait_for(lambda: self._scored or self.error is not None or self._stopped, timeout=timeout_s)
            if not self._scored and self.error is not None:
                raise self.error
            out = []
            while self._scored and len(out) < max_groups:
                out.append(self._scored.popleft())
            return out

    def counts(self) -> dict[str, int]:
        """The stream's counts; `finished` includes the groups being scored or scored, not yet taken."""
        counts = dict(self.stream.counts())
        with self._cond:
            counts["scoring"] = self._scoring
            counts["finished"] = counts.get("finished", 0) + len(self._scored) + self._scoring
        return counts

    def stop(self, wait: bool = True) -> None:
        """Stop taking from the stream; `wait`: until the taking thread has ended (it may be
        waiting up to poll_s for the stream). A batch still being scored ends on its own."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        if wait:
            self._thread.join(timeout=self.poll_s * 4 + 1)
        self._pool.shutdown(wait=False)


class FinishedQueue:
    """Trajectories pushed as they finish, one at a time (`put_one`, a runner's
    `on_trajectory_done`) or a group at a time (`put`, its `on_group_done`), taken like a stream's
    groups (a trajectory pushed alone is taken as a list of one)."""

    def __init__(self):
        self._groups: deque = deque()
        self._cond = threading.Condition()
        self.pushed = 0

    def put(self, group: list[Trajectory]) -> None:
        with self._cond:
            self._groups.append(list(group))
            self.pushed += 1
            self._cond.notify_all()

    def put_one(self, t: Trajectory) -> None:
        self.put([t])

    def take_groups(self, max_groups: int, timeout_s: float) -> list[list[Trajectory]]:
        with self._cond:
            self._cond.wait_for(lambda: self._groups, timeout=timeout_s)
            out = []
            while self._groups and len(out) < max_groups:
                out.append(self._groups.popleft())
            return out

    def counts(self) -> dict[str, int]:
        with self._cond:
            return {"finished": len(self._groups)}

    def stop(self) -> None:
        pass


SYNC_SCORING_BATCHES = 16   # batches scored at once in a synchronous step: each trajectory is one as it ends


def scored_as_they_finish(roll_out: Callable[..., list[Trajectory]], score: Callable[[list[Trajectory]], None],
                          unit: str = "trajectory") -> list[Trajectory]:
    """`roll_out(**hook)`'s trajectories, scored on threads of their own as soon as the runner
    reports them done. `hook` is the runner's keyword: `on_trajectory_done` (unit "trajectory":
    each is scored as it ends) or `on_group_done` (unit "group": for scorers that need the whole
    group). What the runner never reported (a runner without the hook) is scored when it
    returns. A scoring failure is raised here."""
    if unit not in ("trajectory", "group"):
        raise ValueError(f"unit = {unit!r}: trajectory or group")
    queue = FinishedQueue()
    scored = ScoredStream(queue, score, poll_s=0.05, max_batches=SYNC_SCORING_BATCHES)
    done: set[int] = set()
    hook = {"on_group_done": queue.put} if unit == "group" else {"on_trajectory_done": queue.put_one}
    try:
        trajs = roll_out(**hook)
        taken = 0
        while taken < queue.pushed:
            groups = scored.take_groups(1 << 30, timeout_s=1.0)
            taken += len(groups)
            done.update(id(t) for group in groups for t in group)
    finally:   # everything reported was taken: no need to wait for the thread's last poll (poll_s)
        scored.stop(wait=False)
    rest = [t for t in trajs if id(t) not in done]
    if rest:
        score(rest)
    return trajs
