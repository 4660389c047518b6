"""Training health checks: they fire on collapsing runs' metrics and stay quiet on healthy ones."""
from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest

from turnrl.config import Config, HealthCfg
from turnrl.training.checkpoint import run_fingerprint
from turnrl.training.health import CHECKS, HealthMonitor, summarize_health


def healthy_step(step: int) -> dict:
    """Metrics of a run that learns: rewards rise, groups differ, entropy and KL stay moderate."""
    return {"step": step, "reward_mean": min(0.9, 0.1 + 0.02 * step), "groups_all_same_frac": 0.3,
            "entropy": 0.12 - 0.001 * step, "finish_truncated_frac": 0.02, "finish_token_budget_frac": 0.0,
            "kl_ref": 0.01 * step, "logp_gap_max": 3e-6, "logp_gap_p99": 1e-6, "loss": -0.01, "grad_norm": 0.4,
            "response_tokens_mean": 30.0}


def run(steps: list[dict], cfg: HealthCfg = HealthCfg()) -> tuple[HealthMonitor, list[tuple]]:
    monitor = HealthMonitor(cfg)
    reports = [monitor.check(m) for m in steps]
    return monitor, reports


def first_step(steps: list[dict], check: str) -> int | None:
    return next((int(m["step"]) for m in steps if m[f"health_{check}"]), None)


def test_a_healthy_run_raises_nothing():
    steps = [healthy_step(s) for s in range(1, 41)]
    run(steps)
    assert all(m["health_flags"] == 0 for m in steps)
    assert summarize_health(steps) == {"flags": {}, "healthy_last_step": True}


def test_the_committed_healthy_grpo_curve_raises_nothing():
    """plots/train.csv of the default pipeline (GRPO on code_tool, 40 steps): a real healthy run."""
    path = Path(__file__).resolve().parents[1] / "plots/train.csv"
    rows = [{k: float(v) for k, v in r.items() if v != ""} for r in csv.DictReader(path.open())]
    assert len(rows) >= 20
    run(rows)
    assert [m["step"] for m in rows if m["health_flags"]] == []


def test_no_signal_after_n_identical_steps():
    steps = [healthy_step(s) for s in range(1, 11)]
    for m in steps[4:]:
        m.update(groups_all_same_frac=1.0, reward_mean=0.0)
    run(steps, HealthCfg(no_signal_steps=5))
    assert first_step(steps, "no_signal") == 9       # steps 5..9 all-same
    assert steps[-1]["health_no_signal"] == 1.0
    # Four identical steps, then learning again: quiet.
    steps = [healthy_step(s) for s in range(1, 11)]
    for m in steps[2:6]:
        m["groups_all_same_frac"] = 1.0
    run(steps, HealthCfg(no_signal_steps=5))
    assert first_step(steps, "no_signal") is None


def test_no_signal_is_not_a_teachers_algorithm_concern():
    """opd learns from the teacher's logprobs: one sample per problem (rollout.n 1), or a solved task,
    makes every group's rewards equal with the signal intact (a 20-step run was flagged from step 5)."""
    from turnrl.algos.registry import resolve as resolve_algorithm
    steps = [{**healthy_step(s), "groups_all_same_frac": 1.0} for s in range(1, 11)]
    monitor = HealthMonitor(HealthCfg(no_signal_steps=5), reward_signal=not resolve_algorithm("opd").teacher)
    for m in steps:
        monitor.check(m)
    assert first_step(steps, "no_signal") is None and not resolve_algorithm("grpo").teacher


def test_entropy_collapse_and_explosion():
    collapsing = [healthy_step(s) for s in range(1, 21)]
    for m in collapsing:
        m["entropy"] = 0.25 * 0.8 ** m["step"]          # 0.2 -> 0.003
    run(collapsing)
    step = first_step(collapsing, "entropy_collapse")
    assert step is not None and collapsing[step - 1]["entropy"] < 0.1 * 0.25
    exploding = [healthy_step(s) for s in range(1, 21)]
    for m in exploding:
        m["entropy"] = 0.1 * 1.3 ** m["step"]
    _, reports = run(exploding)
    assert first_step(exploding, "entropy_explosion") is not None
    started = [f for _, new, _ in reports for f in new if f.check == "entropy_explosion"]
    assert len(started) == 1 and "above 5.0 x its start" in started[0].message


def test_truncation_needs_window_steps_in_a_row():
    steps = [healthy_step(s) for s in range(1, 11)]
    for m in steps[5:8]:
        m["finish_truncated_frac"] = 0.55
    steps[8]["finish_token_budget_frac"] = 0.6
    run(steps, HealthCfg(window=3))
    assert first_step(steps, "truncation") == 8
    assert steps[8]["health_truncation"] == 1.0      # 0.02 cut + 0.6 budget: still most
    assert steps[9]["health_truncation"] == 0.0


def test_kl_and_logprob_gap_running_away():
    steps = [healthy_step(s) for s in range(1, 10)]
    for m in steps[3:6]:
        m["kl_ref"] = 1.7                     # steps 4-6: three in a row (the default window)
    steps[6]["logp_gap_p99"] = 2.0
    _, reports = run(steps)
    assert first_step(steps, "kl_runaway") == 6 and first_step(steps, "logp_gap") == 7
    failing, started, recovered = reports[6]
    assert [f.check for f in started] == ["logp_gap"] and recovered == ["kl_runaway"]
    assert "kl_ref 1.700 > 1.0 for 3 steps in a row" in reports[5][0][0].message


def test_a_one_step_kl_spike_is_not_a_runaway():
    """mt_grpo's seeds 0 and 1 (benchmarks/LEARNING.md): kl_ref 0.07, 2.77, 0.07 -- one step --
    while the run gained +75 points; `on_unhealthy: stop` would have ended it."""
    steps = [healthy_step(s) for s in range(1, 10)]
    steps[4]["kl_ref"] = 2.77
    steps[7]["kl_ref"] = 3.15
    run(steps)
    assert first_step(steps, "kl_runaway") is None


@pytest.mark.parametrize("key", ["loss", "grad_norm", "kl_ref", "entropy"])
def test_non_finite_values(key):
    steps = [healthy_step(s) for s in range(1, 4)]
    steps[1][key] = math.nan if key != "grad_norm" else math.inf
    run(steps)
    assert [m["health_non_finite"] for m in steps] == [0.0, 1.0, 0.0]


def test_summary_and_replay_match_a_continuous_run():
    steps = [healthy_step(s) for s in range(1, 13)]
    for m in steps[3:]:
        m.update(groups_all_same_frac=1.0)
    run(steps)
    summary = summarize_health(steps)
    assert summary["flags"] == {"no_signal": {"first_step": 8, "last_step": 12, "steps": 5}}
    assert summary["healthy_last_step"] is False
    # A resumed run replays the checkpoint's history: step 9 fails as it did without the resume.
    resumed = HealthMonitor(HealthCfg())
    resumed.replay([{k: v for k, v in m.items() if not k.startswith("health_")} for m in steps[:8]])
    again = {k: v for k, v in steps[8].items() if not k.startswith("health_")}
    failing, started, _ = resumed.check(again)
    assert [f.check for f in failing] == ["no_signal"] and started == []
    assert set(CHECKS) <= {k.removeprefix("health_") for k in again}


def test_health_settings_do_not_change_the_checkpoint_fingerprint():
    base = Config()
    other = base.model_copy(deep=True)
    other.train.on_unhealthy = "stop"
    other.train.health.kl_ref_max = 0.3
    assert run_fingerprint(base) == run_fingerprint(other)
    other.train.lr = 1e-4
    assert run_fingerprint(base) != run_fingerprint(other)


def test_reward_collapse_against_the_runs_best_window():
    """The rewards of the async benchmark's `async_s2_mb4_half_lr` run, seed 0 (benchmarks/ASYNC.md):
    0.94-0.95 at steps 14-15, 0 at steps 19-20. No other check fired: no_signal needs 5 steps in a row,
    and kl_ref stayed under 1."""
    rewards = [0.148, 0.172, 0.367, 0.656, 0.875, 0.891, 0.898, 0.656, 0.82, 0.953, 0.812, 0.836, 0.703, 0.938,
               0.953, 0.867, 0.727, 0.125, 0.0, 0.0]
    steps = [healthy_step(s) for s in range(1, 21)]
    for m, reward in zip(steps, rewards):
        m["reward_mean"] = reward
    _, reports = run(steps)
    # steps 17-19 average 0.284, under half the best 3-step mean (steps 14-16: 0.919)
    assert first_step(steps, "reward_collapse") == 19
    assert [m["health_reward_collapse"] for m in steps[18:]] == [1.0, 1.0]
    assert "reward 0.284 (mean of the last 3 steps) is below 0.5 x the run's best 0.919" in reports[18][0][0].message
    assert [m["step"] for m in steps if m["health_flags"] and not m["health_reward_collapse"]] == []
    # resumed after step 18: the best (steps 14-16) is known only from the replayed history
    resumed = HealthMonitor(HealthCfg())
    resumed.replay([{k: v for k, v in m.items() if not k.startswith("health_")} for m in steps[:18]])
    after = [resumed.check({k: v for k, v in m.items() if not k.startswith("health_")})[0] for m in steps[18:]]
    assert [[f.check for f in failing] for failing in after] == [["reward_collapse"], ["reward_collapse"]]


def test_a_dip_or_a_run_that_never_earned_reward_is_no_collapse():
    steps = [healthy_step(s) for s in range(1, 13)]
    for m, reward in zip(steps, [0.2, 0.4, 0.6, 0.8, 0.3, 0.8, 0.8, 0.8, 0.8, 0.8, 0.8, 0.8]):
        m["reward_mean"] = reward                # one bad step (5): the 3-step means around it 0.57-0.63
    run(steps)
    assert first_step(steps, "reward_collapse") is None
    nothing = [healthy_step(s) for s in range(1, 13)]
    for m in nothing:
        m["reward_mean"] = 0.0
    run(nothing)
    assert first_step(nothing, "reward_collapse") is None
