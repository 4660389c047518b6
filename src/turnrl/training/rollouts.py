"""Where a training step's trajectories come from (`train.mode`): the loop asks for a batch,
trains on it, and hands the weight pushes back; how rollouts and updates overlap is decided here.

    SyncRollouts   each step rolls out its own prompts, seeded from (seed, step, engine), on the
                   weights of the last update; with train.overlap_rollout the next step's
                   rollout runs during this step's update (one step off-policy)
    AsyncRollouts  every engine rolls out continuously (turnrl.rollout.stream): the trainer
                   takes the first prompts_per_step groups that are done, drops (and rolls out
                   again) a group with a turn more than train.max_staleness versions old, and
                   pushes its weights after every update without waiting for the engines

Both filter groups without signal when algorithm.dynamic_sampling is on
(turnrl.training.dynamic_sampling): sync refills the batch in rounds, async as groups arrive.
"""
from __future__ import annotations

import math
import time
from itertools import zip_longest
from typing import Any, Protocol, Sequence

from turnrl.config import Config
from turnrl.rewards.judge import judge_metrics
from turnrl.rollout.multi_turn import Trajectory
from turnrl.training.checkpoint import step_seed
from turnrl.training.dynamic_sampling import StepFilter, fill_up, filter_batch, min_groups_for
from turnrl.training.cluster import RolloutGroup, wait_all


class Rollouts(Protocol):
    def next_batch(self, step: int) -> tuple[list[Trajectory], list[float], dict[str, float]]:
        """(the step's trajectories, each engine's busy seconds for them, metrics of the source: the
        judges' calls over every trajectory judged this step, those dynamic sampling dropped too)."""
    def push(self, pushes: Sequence) -> None:
        """The weight syncs of this step's update."""
    def unused_prompts(self, step: int) -> int:
        """Prompts handed out and not trained on yet: a resumed run samples them again."""
    def close(self) -> None: ...


class SampleSource(Protocol):
    position: int
    def next(self, count: int) -> list[dict]: ...


def make_rollouts(cfg: Config, rollout: RolloutGroup, sampler: SampleSource, version: int) -> Rollouts:
    """The source for `train.mode`; `version`: the policy version the engines hold (updates
    pushed so far, a resumed run's included)."""
    if cfg.train.mode == "async":
        return AsyncRollouts(cfg, rollout, sampler, version)
    return SyncRollouts(cfg, rollout, sampler)


class SyncRollouts:
    def __init__(self, cfg: Config, rollout: RolloutGroup, sampler: SampleSource):
        self.rollout, self.sampler = rollout, sampler
        self.n, self.prompts, self.steps = cfg.rollout.n, cfg.train.prompts_per_step, cfg.train.steps
        self.dynamic = cfg.algorithm.dynamic_sampling
        self.min_groups = min_groups_for(cfg.cluster.trainer_ranks, cfg.algorithm.mini_batches, self.n)
        self.overlap = cfg.train.overlap_rollout
        self.next: list = []      # overlap: this step's rollout, started during the last step's update
        self.loading: list = []   # overlap: the last weight pushes, which the engines run after that rollout

    def next_batch(self, step: int) -> tuple[list[Trajectory], list[float], dict[str, float]]:
        if not self.next:
            self.next = self.rollout.submit(self.sampler.next(self.prompts), self.n, step)
        trajs, engine_busy = self.rollout.collect(self.next)
        wait_all(self.loading)
        self.next, self.loading = [], []
        if self.overlap and step < self.steps:   # sampled during this step's update, by the weights before it
            self.next = self.rollout.submit(self.sampler.next(self.prompts), self.n, step + 1)
        if self.dynamic.enabled:
            return self.refilled(trajs, engine_busy, step)
        return trajs, engine_busy, judge_metrics(trajs)

    def refilled(self, trajs: list[Trajectory], engine_busy: list[float], step: int):
        """Dynamic sampling: the batch's groups with signal, refilled with new prompts' groups
        until there are prompts_per_step of them or the budget is spent."""
        step_filter, kept = StepFilter(self.dynamic, self.prompts, self.n, self.min_groups), []
        filter_batch(trajs, step_filter, kept)
        while len(kept) < self.prompts and step_filter.left() > 0:
            more, busy = self.rollout.rollout(self.sampler.next(step_filter.refill_size(len(kept))), self.n, step)
            # (a refill of fewer prompts than engines leaves some engines out: their busy time adds 0)
            engine_busy = [a + b for a, b in zip_longest(engine_busy, busy, fillvalue=0.0)]
            filter_batch(more, step_filter, kept)
        batch = [t for group in fill_up(kept, step_filter) for t in group]
        return batch, engine_busy, step_filter.metrics(batch)

    def push(self, pushes: Sequence) -> None:
        for sync in pushes:   # with overlap, the engines load after the rollout in flight
            self.loading += sync.push(wait=not self.overlap)

    def unused_prompts(self, step: int) -> int:
        return self.prompts if self.next else 0

    def close(self) -> None:
        wait_all(self.loading)
        self.loading = []


def default_groups_in_flight(prompts_per_step: int) -> int:
    """One batch and a quarter: the spare groups let a batch go without its slowest (a long tool
    call) while the engines are never further ahead than the next batch. More in flight made
    every batch as stale as the bound allows and threw a quarter of the rollouts away as too stale
    (benchmarks/ASYNC.md, prompts_per_step x (max_staleness + 1) at max_staleness 2)."""
    return prompts_per_step + math.ceil(prompts_per_step / 4)


class AsyncRollouts:
    POLL_S = 0.5   # how long one take waits on an engine before the others are asked

    def __init__(self, cfg: Config, rollout: RolloutGroup, sampler: SampleSource, version: int):
        t = cfg.train
        self.rollout, self.sampler, self.version = rollout, sampler, version
        self.prompts, self.max_staleness = t.prompts_per_step, t.max_staleness
        self.n, self.dynamic = cfg.rollout.n, cfg.algorithm.dynamic_sampling
        self.min_groups = min_groups_for(cfg.cluster.trainer_ranks, cfg.algorithm.mini_batches, self.n)
        self.budget = t.groups_in_flight or default_groups_in_flight(t.prompts_per_step)
        self.outstanding = 0      # groups fed and not yet taken
        self.buffer: list[list[Trajectory]] = []   # taken, fresh, beyond the last batch
        self.unjudged: list[list[Trajectory]] = []   # taken after a step's sampling budget was spent
        self.busy_before = [0.0] * len(rollout.handles)
        self.stale_total = 0
        per_engine = math.ceil(self.budget / len(rollout.handles))
        rollout.call("start_stream", cfg.rollout.n, per_engine, step_seed(cfg.seed, version, 0), version)
        self._top_up()

    def _top_up(self) -> None:
        """Feed the engines new prompts, round robin, up to `groups_in_flight` outstanding."""
        need = self.budget - self.outstanding - len(self.buffer) - len(self.unjudged)
        if need <= 0:
            return
        examples = self.sampler.next(need)
        self._feed(examples)

    def _feed(self, examples: list[dict]) -> None:
        count = len(self.rollout.handles)
        wait_all([(name, h.feed.remote(examples[e::count]))
                  for e, (name, h) in enumerate(zip(self.rollout.names, self.rollout.handles)) if examples[e::count]])
        self.outstanding += len(examples)

    def _admit(self, group: list[Trajectory], fresh: list[list[Trajectory]], step_filter: StepFilter | None) -> int:
        """Put an arrived group in `fresh` if it may be trained on; 1 if it was too stale."""
        if self.staleness(group) > self.max_staleness:   # too old: its prompt rolls out again
            self._feed([group[0].example])
            return 1
        if step_filter is None:
            fresh.append(group)
            return 0
        # dynamic sampling, as groups arrive: one without signal gives way to a new prompt
        step_filter.rolled += 1
        if step_filter.keep(group):
            fresh.append(group)
        elif not step_filter.spent():
            self._feed(self.sampler.next(1))
        return 0

    def staleness(self, group: list[Trajectory]) -> int:
        """Policy versions between the update about to happen and the group's oldest turn."""
        oldest = min((v for t in group for v in t.turn_versions), default=self.version)
        return self.version - oldest

    def next_batch(self, step: int) -> tuple[list[Trajectory], list[float], dict[str, float]]:
        fresh, stale, waited, states = self.buffer, 0, time.perf_counter(), {}
        step_filter = StepFilter(self.dynamic, self.prompts, self.n, self.min_groups) if self.dynamic.enabled else None
        arrived, self.unjudged = self.unjudged, []
        for group in arrived:
            stale += self._admit(group, fresh, step_filter)
        while len(fresh) < self.prompts and not (step_filter is not None and step_filter.spent()):
            calls = [(name, h.take_groups.remote(self.prompts - len(fresh), self.POLL_S))
                     for name, h in zip(self.rollout.names, self.rollout.handles)]
            for name, (groups, state) in zip(self.rollout.names, wait_all(calls)[0]):
                states[name] = state
                self.outstanding -= len(groups)
                for group in groups:
                    if step_filter is not None and step_filter.spent():   # past the budget: judged next step
                        self.unjudged.append(group)
                    else:
                        stale += self._admit(group, fresh, step_filter)
            self._top_up()
        if step_filter is not None:   # the budget spent: the groups with signal (made up to min_groups)
            fresh = fill_up(fresh, step_filter) + fresh[self.prompts:]
        batch, self.buffer = fresh[:self.prompts], fresh[self.prompts:]
        self._top_up()
        busy = [states[name]["busy_s"] if name in states else before   # an engine not asked this step
                for name, before in zip(self.rollout.names, self.busy_before)]
        engine_busy = [now - before for now, before in zip(busy, self.busy_before)]
        self.busy_before = busy
        self.stale_total += stale
        lags = [self.staleness(g) for g in batch]
        metrics: dict[str, Any] = {
            "staleness_mean": sum(lags) / len(lags), "staleness_max": float(max(lags)),
            **{f"staleness_{d}_frac": lags.count(d) / len(lags) for d in range(self.max_staleness + 1)},
            "stale_groups": float(stale), "stale_groups_total": float(self.stale_total),
            "stale_groups_frac": stale / (stale + len(batch)),
            "queue_groups": float(len(self.buffer) + sum(s["finished"] for s in states.values())),
            "in_flight_groups": float(sum(s["in_flight"] + s["inbox"] for s in states.values())),
            "batch_wait_s": time.perf_counter() - waited, "policy_version": float(self.version),
            **(step_filter.metrics([t for group in batch for t in group], len(step_filter.dropped))
               if step_filter is not None else judge_metrics([t for group in batch for t in group]))}
        return [t for group in batch for t in group], engine_busy, metrics

    def push(self, pushes: Sequence) -> None:
        for sync in pushes:   # the engines store the weights and load them between two engine steps
            sync.push(wait=True)
        self.version += 1

    def unused_prompts(self, step: int) -> int:
        return self.outstanding + len(self.buffer) + len(self.unjudged)

    def close(self) -> None:
        self.rollout.call("stop_stream")
