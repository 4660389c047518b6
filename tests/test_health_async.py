"""The asynchronous mode's health checks: stale groups thrown away, importance weights exploding."""
from turnrl.config import HealthCfg
from turnrl.training.health import HealthMonitor

HEALTHY = {"step": 1, "reward_mean": 0.5, "groups_all_same_frac": 0.0, "stale_groups_frac": 0.2,
           "is_raw_weight_max": 3.0, "is_ess": 0.9}


def _checks(**metrics) -> set[str]:
    failing, _, _ = HealthMonitor(HealthCfg()).check({**HEALTHY, **metrics})
    return {f.check for f in failing}


def test_a_healthy_async_step_raises_nothing():
    assert _checks() == set()


def test_most_groups_too_stale_is_a_staleness_flag_naming_the_keys():
    failing, _, _ = HealthMonitor(HealthCfg()).check({**HEALTHY, "stale_groups_frac": 0.75})
    assert [f.check for f in failing] == ["staleness"]
    assert "75%" in failing[0].message and "train.max_staleness" in failing[0].message


def test_exploding_weights_or_a_collapsed_sample_size_are_flagged():
    assert _checks(is_raw_weight_max=500.0) == {"importance_weights"}
    assert _checks(is_ess=0.05) == {"importance_weights"}
    assert _checks(is_raw_weight_max=50.0, is_ess=0.5) == set()
    metrics = {**HEALTHY, "is_ess": 0.05}
    HealthMonitor(HealthCfg(is_ess_min=0.01)).check(metrics)
    assert metrics["health_importance_weights"] == 0.0 and metrics["health_staleness"] == 0.0
