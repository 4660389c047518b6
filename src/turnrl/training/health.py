"""Training health checks: every step's metrics against the signs of a run going wrong.

    monitor = HealthMonitor(cfg.train.health)
    failing, started, recovered = monitor.check(metrics)   # also written into metrics as health_*

| check | fails when | why it matters |
|---|---|---|
| `no_signal` | every group's rewards identical (`groups_all_same_frac` 1) for `no_signal_steps` steps in a row (not for opd, whose signal is the teacher's) | group-relative advantages are all 0: nothing is learned |
| `reward_collapse` | the mean reward of the last `window` steps < `reward_drop` x the run's best `window`-step mean (a best above 0) | the policy unlearned what it had learned (a run that reached 0.95 and answers wrong from one step to the next) |
| `entropy_collapse` | entropy's mean over the last `window` steps < `entropy_low` x its mean over the first `window` | the policy stopped exploring |
| `entropy_explosion` | that mean > `entropy_high` x the first `window`'s | the policy is falling apart into noise |
| `truncation` | more than `truncated_frac` of trajectories cut by a token budget, `window` steps in a row | responses pinned at the budget: no answer, reward 0 |
| `kl_runaway` | `kl_ref` (mean per-token KL to the starting model) > `kl_ref_max`, `window` steps in a row | the policy drifted far from its start (a one-step spike is not a drift) |
| `logp_gap` | the p99 of abs(logp engine - logp trainer) over sampled tokens > `logp_gap_p99_max` | the engine samples from another policy than the one trained (a broken weight push, or stale weights) |
| `non_finite` | NaN or Inf in a loss, gradient norm, KL or entropy | the update is garbage |
| `staleness` | asynchronous training: more than `stale_frac_max` of the groups that came back at a step were older than `train.max_staleness` (dropped, rolled out again) | the engines run too far ahead of the trainer: rollout work is thrown away (raise `max_staleness`, lower `groups_in_flight`) |
| `importance_weights` | an off-policy correction's largest raw weight pi_prox / mu > `is_weight_max`, or its effective sample size < `is_ess_min` | a few tokens carry the update: the behaviour policy is far from the trained one |
| `tool_errors` | a tool's `tools/<name>/error_frac` (its calls that raised, timed out or could not reach it) > `tool_error_frac_max` at a step | a dead or broken tool: every call is an error observation and the reward loses what the tool gave (the message names the tool) |

Each check writes `health_<check>` (1 failing, 0 not) into the step's metrics, so every run's
plots/train.csv and MLflow run have them; `health_flags` counts the failing ones. The loop warns
when a check starts failing (naming the step and the numbers) and when it recovers, and with
`train.on_unhealthy: stop` ends the run (after a checkpoint) with `UnhealthyTraining`.

Pure functions of the metrics: a resumed run rebuilds its monitor from the checkpoint's history
(`HealthMonitor.replay`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable

CHECKS = ("no_signal", "reward_collapse", "entropy_collapse", "entropy_explosion", "truncation", "kl_runaway",
          "logp_gap", "non_finite", "tool_errors", "staleness", "importance_weights")
#: Metrics whose non-finite value means the update itself went wrong.
FINITE_KEYS = ("loss", "grad_norm", "kl_ref", "entropy", "value_loss", "high_loss", "high_grad_norm")


class UnhealthyTraining(RuntimeError):
    """Raised with `train.on_unhealthy: stop`; the message names the checks, step and numbers,
    `history` holds the metrics of the steps run so far."""

    def __init__(self, message: str, history: list[dict] | None = None):
        super().__init__(message)
        self.history = history or []


@dataclass
class Flag:
    check: str
    step: int
    message: str


def _mean(values: Iterable[float]) -> float:
    values = list(values)
    return sum(values) / len(values) if values else float("nan")


class HealthMonitor:
    def __init__(self, cfg: Any, reward_signal: bool = True):
        """`cfg`: `train.health` (no_signal_steps, window, reward_drop, entropy_low, entropy_high,
        truncated_frac, kl_ref_max, logp_gap_p99_max, tool_error_frac_max, stale_frac_max,
        is_weight_max, is_ess_min). `reward_signal`: the algorithm learns from the rewards (False:
        a teacher's logprobs are its signal, opd; groups of equal rewards then still teach, so
        `no_signal` is not checked)."""
        self.cfg = cfg
        self.reward_signal = reward_signal
        self.history: list[dict] = []
        self.failing: set[str] = set()
        self.best_reward = -math.inf   # the best mean reward over `window` steps so far (reward_collapse)

    def replay(self, history: Iterable[dict]) -> None:
        """Feed earlier steps' metrics (a resumed run's) without reporting them again."""
        for metrics in history:
            self._evaluate(dict(metrics))

    def check(self, metrics: dict) -> tuple[list[Flag], list[Flag], list[str]]:
        """(the checks failing at this step, those of them that were not failing at the step
        before, the checks that failed then and pass now). Adds `health_<check>` and
        `health_flags` to `metrics`."""
        before = set(self.failing)
        flags = self._evaluate(metrics)
        for check in CHECKS:
            metrics[f"health_{check}"] = float(any(f.check == check for f in flags))
        metrics["health_flags"] = float(len(flags))
        return flags, [f for f in flags if f.check not in before], sorted(before - self.failing)

    # ------------------------------------------------------------------ the checks
    def _evaluate(self, metrics: dict) -> list[Flag]:
        self.history.append(metrics)
        c, h = self.cfg, self.history
        step = int(metrics.get("step", len(h)))
        flags: list[Flag] = []

        def flag(check: str, message: str) -> None:
            flags.append(Flag(check, step, message))

        bad = [k for k in FINITE_KEYS if k in metrics and not math.isfinite(float(metrics[k]))]
        if bad:
            flag("non_finite", "non-finite " + ", ".join(f"{k} = {metrics[k]}" for k in bad))

        same = [m.get("groups_all_same_frac", 0.0) for m in h[-c.no_signal_steps:]]
        if self.reward_signal and len(same) == c.no_signal_steps and min(same) >= 1.0:
            flag("no_signal", f"every group's rewards were identical for the last {c.no_signal_steps} steps "
                              f"(reward {metrics.get('reward_mean', float('nan')):.3f}): all advantages are 0")

        rewards = [m["reward_mean"] for m in h[-c.window:] if math.isfinite(m.get("reward_mean", math.nan))]
        if len(rewards) == c.window:
            now = _mean(rewards)
            if self.best_reward > 0 and now < c.reward_drop * self.best_reward:
                flag("reward_collapse", f"reward {now:.3f} (mean of the last {c.window} steps) is below "
                                        f"{c.reward_drop} x the run's best {self.best_reward:.3f}")
            self.best_reward = max(self.best_reward, now)

        entropy = [m["entropy"] for m in h if "entropy" in m and math.isfinite(m["entropy"])]
        if len(entropy) >= 2 * c.window:
            start, now = _mean(entropy[:c.window]), _mean(entropy[-c.window:])
            if start > 0 and now < c.entropy_low * start:
                flag("entropy_collapse", f"entropy {now:.4f} (mean of the last {c.window} steps) is below "
                                         f"{c.entropy_low} x its start {start:.4f}")
            if start > 0 and now > c.entropy_high * start:
                flag("entropy_explosion", f"entropy {now:.4f} (mean of the last {c.window} steps) is above "
                                          f"{c.entropy_high} x its start {start:.4f}")

        cut = [m.get("finish_truncated_frac", 0.0) + m.get("finish_token_budget_frac", 0.0) for m in h[-c.window:]]
        if len(cut) == c.window and min(cut) > c.truncated_frac:
            flag("truncation", f"{cut[-1]:.0%} of trajectories cut by a token budget (over {c.truncated_frac:.0%} "
                               f"for {c.window} steps; response tokens {metrics.get('response_tokens_mean', 0):.1f})")

        kl = [m.get("kl_ref", math.nan) for m in h[-c.window:]]
        if len(kl) == c.window and all(math.isfinite(k) and k > c.kl_ref_max for k in kl):
            flag("kl_runaway", f"kl_ref {kl[-1]:.3f} > {c.kl_ref_max} for {c.window} steps in a row "
                               f"(mean per-token KL to the starting model)")

        gap = metrics.get("logp_gap_p99")
        if gap is not None and math.isfinite(gap) and gap > c.logp_gap_p99_max:
            flag("logp_gap", f"p99 |logp engine - logp trainer| {gap:.3g} > {c.logp_gap_p99_max} "
                             f"(max {metrics.get('logp_gap_max', float('nan')):.3g})")
        failing_tools = _failing_tools(metrics, getattr(c, "tool_error_frac_max", 0.5))
        if failing_tools:
            flag("tool_errors", "tool " + ", ".join(f"{name}: {frac:.0%} of its calls failed" for name, frac in
                                                    failing_tools) +
                 f" (over {getattr(c, 'tool_error_frac_max', 0.5):.0%}; raised, timed out or unreachable): "
                 "is it up? the error observations are in the trajectories")
        for check, message in _off_policy_problems(metrics, c):
            flag(check, message)
        self.failing = {f.check for f in flags}
        return flags


def _off_policy_problems(metrics: dict, c: Any) -> list[tuple[str, str]]:
    """The asynchronous checks: too many stale groups, importance weights exploding."""
    out = []
    stale_frac, most = metrics.get("stale_groups_frac"), getattr(c, "stale_frac_max", 0.5)
    if stale_frac is not None and stale_frac > most:
        out.append(("staleness", f"{stale_frac:.0%} of the groups back at this step were older than "
                                 f"train.max_staleness (over {most:.0%}) and were rolled out again: raise "
                                 "train.max_staleness or lower train.groups_in_flight"))
    raw, ess = metrics.get("is_raw_weight_max"), metrics.get("is_ess")
    top, low = getattr(c, "is_weight_max", 100.0), getattr(c, "is_ess_min", 0.2)
    if (raw is not None and raw > top) or (ess is not None and ess < low):
        out.append(("importance_weights", f"importance weight max {raw if raw is not None else float('nan'):.3g} "
                                          f"(bound {top:g}), effective sample size {ess if ess is not None else 1:.2f} "
                                          f"(bound {low:g}): the behaviour policy is far from the trained one"))
    return out


def _failing_tools(metrics: dict, most: float) -> list[tuple[str, float]]:
    """(tool, error_frac) of the tools whose `tools/<name>/error_frac` is over `most`."""
    out = []
    for key, value in sorted(metrics.items()):
        if key.startswith("tools/") and key.endswith("/error_frac") and isinstance(value, (int, float)) \
                and value > most:
            out.append((key[len("tools/"):-len("/error_frac")], float(value)))
    return out


def summarize_health(history: Iterable[dict]) -> dict[str, Any]:
    """From the `health_*` metrics of a run's steps: {"flags": {check: {first_step, last_step,
    steps}}, "healthy_last_step": bool}, for metrics/train.json."""
    flags: dict[str, dict] = {}
    last = {}
    for m in history:
        last = m
        for check in CHECKS:
            if m.get(f"health_{check}", 0.0) > 0:
                entry = flags.setdefault(check, {"first_step": int(m["step"]), "last_step": 0, "steps": 0})
                entry["last_step"] = int(m["step"])
                entry["steps"] += 1
    return {"flags": flags, "healthy_last_step": not last.get("health_flags", 0.0)}
