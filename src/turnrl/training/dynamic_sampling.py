"""DAPO's dynamic sampling (Yu et al., 2025): a group whose rewards are all equal has zero
advantage under a group baseline (GRPO, RLOO, Dr. GRPO, the turn-level algorithms' outcome
term): it costs a generation and an update and teaches nothing. With
`algorithm.dynamic_sampling.enabled` such groups are dropped and new prompts rolled out in their
place until the batch holds `train.prompts_per_step` groups with signal, or the step has rolled
out `budget` x prompts_per_step prompts; then it trains on the groups with signal it has, a smaller
batch, and says so (`dynamic_budget_hit`). Only where fewer rows have signal than the trainer can
split (cluster.trainer_ranks x algorithm.mini_batches) is the batch made up to that with groups
without (`dynamic_padded_groups`; their group advantage is 0). Padding to the full batch, as
before, trained on a third of such groups once the policy got most problems right, and their
zero-advantage tokens shrank every token-mean update (benchmarks/DYNAMIC_SAMPLING.md).

    sync   the step's batch is filtered; refills roll out ceil(missing / signal rate so far)
           prompts at a time (turnrl.training.rollouts.SyncRollouts)
    async  each group is filtered as it arrives and a new prompt fed in its place, so the trainer
           never waits for a refill round; staleness is checked first (AsyncRollouts)

Algorithms whose advantages do not come from the group (PPO's critic, MLMT's levels) refuse it.
Metrics each step: dynamic_dropped_groups, dynamic_extra_trajectories, dynamic_budget_hit,
dynamic_padded_groups, dynamic_signal_frac (the share of the groups looked at that had signal).
"""
from __future__ import annotations

import logging
import math
import statistics
from typing import Sequence

from turnrl.config.sections import DynamicSamplingCfg
from turnrl.rewards.judge import judge_metrics
from turnrl.rollout.multi_turn import Trajectory

log = logging.getLogger(__name__)
SAME = 1e-9   # values closer than this are equal (0.7 and a mean of three 0.7s, 0.6999999999999998)


def signal_of(t: Trajectory, signal: str) -> float:
    """The value whose spread within a group is the group's learning signal."""
    if signal == "reward":
        return t.reward
    if signal == "outcome":
        return t.outcome
    if signal not in t.rewards:
        raise KeyError(f"algorithm.dynamic_sampling.signal = {signal!r}: the trajectories have no reward by that name "
                       f"(they have {sorted(t.rewards) or 'none'}); use reward, outcome or a reward function's name")
    return t.rewards[signal]


def has_signal(group: Sequence[Trajectory], signal: str = "reward", min_std: float = 0.0) -> bool:
    """Whether the group's values differ: their (population) standard deviation above `min_std`,
    or, with min_std 0, not all equal (to rounding)."""
    values = [signal_of(t, signal) for t in group]
    if min_std == 0.0:
        return max(values) - min(values) > SAME
    return len(values) > 1 and statistics.pstdev(values) > min_std


def groups_of(trajs: Sequence[Trajectory], n: int) -> list[list[Trajectory]]:
    """A batch (n trajectories per prompt, in order) as its groups."""
    return [list(trajs[i:i + n]) for i in range(0, len(trajs), n)]


class StepFilter:
    """One step's filtering: which groups are kept, and the prompts rolled out against the budget."""

    def __init__(self, cfg: DynamicSamplingCfg, prompts_per_step: int, n: int, min_groups: int = 1):
        """`min_groups`: the fewest groups the trainer can take (min_groups_for)."""
        self.cfg, self.prompts, self.n = cfg, prompts_per_step, n
        self.min_groups = max(1, min(min_groups, prompts_per_step))
        self.limit = math.floor(cfg.budget * prompts_per_step)   # prompts this step may roll out
        self.rolled = 0        # prompts rolled out (or taken) for this step
        self.looked = 0        # groups judged
        self.with_signal = 0   # of them, those with signal
        self.dropped: list[list[Trajectory]] = []
        self.padded = 0        # groups without signal trained on, to make up min_groups
        self.budget_hit = False

    def keep(self, group: list[Trajectory]) -> bool:
        """Judge a group: kept if it has signal, else dropped (fill_up may still take it)."""
        self.looked += 1
        if has_signal(group, self.cfg.signal, self.cfg.min_std):
            self.with_signal += 1
            return True
        self.dropped.append(group)
        return False

    def spent(self) -> bool:
        return self.left() == 0

    def left(self) -> int:
        return max(0, self.limit - self.rolled)

    def refill_size(self, kept: int) -> int:
        """How many prompts to roll out next for `kept` groups with signal so far: the missing
        ones over the signal rate seen (at least a quarter), within the budget."""
        missing = self.prompts - kept
        rate = max(0.25, self.with_signal / max(1, self.looked))
        return min(self.left(), math.ceil(missing / rate))

    def metrics(self, batch: Sequence[Trajectory], extra_groups: int | None = None) -> dict[str, float]:
        """`batch`: the trajectories trained on; `extra_groups`: groups generated beyond the batch
        (default: the prompts rolled out past prompts_per_step, as in sync mode; async passes the
        dropped ones, whose prompts were fed anew). The judges' call metrics count the dropped
        groups' calls too (they were made this step); they replace the batch's own."""
        extra = max(0, self.rolled - self.prompts) if extra_groups is None else extra_groups
        return {"dynamic_dropped_groups": float(len(self.dropped)),   # judged without signal and not trained on
                "dynamic_extra_trajectories": float(extra * self.n),
                "dynamic_budget_hit": float(self.budget_hit),
                "dynamic_padded_groups": float(self.padded),
                "dynamic_signal_frac": self.with_signal / max(1, self.looked),
                **judge_metrics([*batch, *(t for group in self.dropped for t in group)])}


def filter_batch(trajs: Sequence[Trajectory], step_filter: StepFilter, kept: list[list[Trajectory]]) -> None:
    """Judge the groups of a rolled-out batch into `kept`, each counted against the budget."""
    for group in groups_of(trajs, step_filter.n):
        step_filter.rolled += 1
        if step_filter.keep(group):
            kept.append(group)


def fill_up(kept: list[list[Trajectory]], step_filter: StepFilter) -> list[list[Trajectory]]:
    """The batch's groups: at most prompts_per_step of those kept. Where the budget ran out before
    that many had signal (the budget marked hit), the ones with signal alone, made up to
    `min_groups` with dropped ones only where they are fewer."""
    if len(kept) < step_filter.prompts:
        step_filter.budget_hit = True
        if not step_filter.with_signal:   # the whole budget paid for a batch that teaches nothing
            log.warning("dynamic sampling: none of the %d groups rolled out this step had signal (%s differing by "
                        "more than min_std %g); it trains on %d without. If every step says so, the task is solved "
                        "or never rewarded here: check reward_mean, or lower algorithm.dynamic_sampling.min_std",
                        step_filter.looked, step_filter.cfg.signal, step_filter.cfg.min_std,
                        min(step_filter.min_groups, len(step_filter.dropped)))
        missing = step_filter.min_groups - len(kept)
        if missing > 0:
            reused, step_filter.dropped = step_filter.dropped[:missing], step_filter.dropped[missing:]
            step_filter.padded = len(reused)
            kept = kept + reused
    return kept[:step_filter.prompts]


def min_groups_for(trainer_ranks: int, mini_batches: int, n: int) -> int:
    """The fewest groups of n trajectories whose rows every trainer rank gets a share of in every
    mini-batch."""
    return max(1, math.ceil(trainer_ranks * mini_batches / n))
