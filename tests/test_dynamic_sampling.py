"""Dynamic sampling (algorithm.dynamic_sampling) on scripted rewards: the filter by hand, then the
sync refill and the async filter through the real rollout sources on a real local Ray cluster,
whose rollout actor is scripted (a prompt's group has signal when its number says so)."""
from __future__ import annotations

import pytest

from turnrl.config import Config
from turnrl.config.sections import DynamicSamplingCfg
from turnrl.rollout.multi_turn import Trajectory
from turnrl.training.dynamic_sampling import StepFilter, fill_up, groups_of, has_signal, min_groups_for


def _traj(prompt: int, reward: float, version: int = 0, **rewards) -> Trajectory:
    t = Trajectory(example={"id": prompt, "prompt": f"p{prompt}"}, prompt_ids=[1])
    t.outcome, t.rewards, t.turn_versions = reward, dict(rewards), [version]
    return t


def test_a_group_has_signal_when_its_values_differ_by_the_stated_criterion():
    assert not has_signal([_traj(0, 1.0), _traj(0, 1.0)])
    assert has_signal([_traj(0, 1.0), _traj(0, 0.0)])
    near = [_traj(0, 0.50), _traj(0, 0.52)]                       # std 0.01
    assert has_signal(near) and not has_signal(near, min_std=0.05)
    assert has_signal(near, min_std=0.005)
    same_outcome = [_traj(0, 1.0, fmt=0.0), _traj(0, 1.0, fmt=1.0)]
    assert has_signal(same_outcome, "fmt") and not has_signal(same_outcome, "outcome")
    with pytest.raises(KeyError, match="no reward by that name .*'fmt'"):
        has_signal(same_outcome, "brevity")
    rounded = [_traj(0, 0.7), _traj(0, (0.7 + 0.7 + 0.7) / 3)]     # 0.7 and 0.6999999999999998: equal
    assert rounded[0].outcome != rounded[1].outcome and not has_signal(rounded)


def test_the_judges_calls_of_dropped_groups_count_in_the_step_and_a_budget_spent_on_nothing_says_so(caplog):
    """A judge answered every group's trajectories; the step's judge_<name>_calls counts the dropped
    groups' calls too (they were made and waited for). A budget spent without one group with signal
    is a warning naming what to check, not only a metric."""
    def judged(prompt, reward):
        t = _traj(prompt, reward)
        t.info["judge_q"] = [{"prompt": f"p{prompt}", "answer": "7", "score": 0.7, "seconds": 0.1, "tries": 1,
                              "cached": False, "unparsable": False, "hedged": False}]
        return t
    f = StepFilter(DynamicSamplingCfg(enabled=True, budget=1.0), prompts_per_step=2, n=2)
    flat = [[judged(k, 1.0), judged(k, 1.0)] for k in range(2)]
    f.rolled = 2
    assert not any(f.keep(g) for g in flat)
    with caplog.at_level("WARNING"):
        batch = [t for g in fill_up([], f) for t in g]
    assert len(batch) == 2 and "none of the 2 groups rolled out this step had signal" in caplog.text
    assert f.metrics(batch)["judge_q_calls"] == 4.0    # 2 trained on, 2 dropped


def test_the_step_filter_drops_groups_without_signal_until_its_budget_is_spent():
    f = StepFilter(DynamicSamplingCfg(enabled=True, budget=1.5), prompts_per_step=4, n=2)
    flat, mixed = [_traj(0, 1.0)] * 2, [_traj(1, 1.0), _traj(1, 0.0)]
    f.rolled = 4
    assert f.keep(mixed) and not f.keep(flat) and f.left() == 2
    assert f.refill_size(kept=1) == 2            # 3 missing at a signal rate of 1/2: 6, within the 2 left
    f.rolled = 6
    assert not f.keep(flat) and f.spent() and not f.budget_hit
    assert fill_up([mixed], f) == [mixed] and f.budget_hit   # spent: the one with signal alone, and said so
    m = f.metrics([*mixed])
    assert m == {"dynamic_dropped_groups": 2.0, "dynamic_extra_trajectories": 4.0, "dynamic_budget_hit": 1.0,
                 "dynamic_padded_groups": 0.0, "dynamic_signal_frac": pytest.approx(1 / 3)}


def test_groups_without_signal_make_up_only_what_the_trainer_ranks_need():
    assert min_groups_for(trainer_ranks=1, mini_batches=1, n=8) == 1
    assert min_groups_for(trainer_ranks=2, mini_batches=2, n=2) == 2     # 4 rows: one per rank per mini-batch
    assert min_groups_for(trainer_ranks=4, mini_batches=2, n=3) == 3     # 8 rows need 3 groups of 3
    f = StepFilter(DynamicSamplingCfg(enabled=True, budget=1.0), prompts_per_step=4, n=2, min_groups=2)
    flat = [[_traj(k, 0.0)] * 2 for k in range(3)]
    mixed = [_traj(9, 1.0), _traj(9, 0.0)]
    f.rolled = 4
    assert [f.keep(g) for g in [*flat, mixed]] == [False, False, False, True] and f.spent()
    assert fill_up([mixed], f) == [mixed, flat[0]]        # one with signal, one padded to the 2 needed
    assert f.metrics([])["dynamic_padded_groups"] == 1.0 and f.metrics([])["dynamic_dropped_groups"] == 2.0
    none = StepFilter(DynamicSamplingCfg(enabled=True), prompts_per_step=4, n=2, min_groups=9)
    assert none.min_groups == 4                            # never more than the batch


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray whose workers import this module (the scripted actor's class) from tests/."""
    from conftest import local_ray
    yield from local_ray(num_cpus=1)


class Scripted:
    """A rollout actor whose groups' rewards are scripted: prompt k's group is [1, 0, ...] (signal)
    when k % every == 0, else all 0."""

    def __init__(self, every: int):
        self.every, self.version, self.n, self.inbox = every, 0, 2, []

    def group(self, example: dict, n: int) -> list:
        k = example["id"]
        rewards = [1.0] + [0.0] * (n - 1) if self.every and k % self.every == 0 else [0.0] * n
        group = [_traj(k, r, self.version) for r in rewards]
        for t in group:   # a judge's call per trajectory
            t.info["judge_q"] = [{"prompt": f"p{k}", "answer": "7", "score": 0.7, "seconds": 0.1, "tries": 1}]
        return group

    def timed_rollout(self, examples, n, generator_seed=None):
        return [t for e in examples for t in self.group(e, n)], 0.01

    def start_stream(self, n, per_engine, seed, version):
        self.n, self.version = n, version

    def feed(self, examples):
        self.inbox += examples

    def take_groups(self, max_groups, timeout_s):
        out, self.inbox = self.inbox[:max_groups], self.inbox[max_groups:]
        return [self.group(e, self.n) for e in out], {"busy_s": 0.0, "finished": 0, "in_flight": 0,
                                                      "inbox": len(self.inbox)}

    def stop_stream(self):
        pass


def _source(mode: str, every: int, budget: float = 3.0, dynamic: bool = True):
    import ray

    from turnrl.training.cluster import RolloutGroup
    from turnrl.training.loop import PromptSampler
    from turnrl.training.rollouts import make_rollouts
    cfg = Config.model_validate({
        "train": {"mode": mode, "prompts_per_step": 4, **({"overlap_rollout": False} if mode == "sync" else {}),
                  "groups_in_flight": 4 if mode == "async" else 0},
        "algorithm": {"name": "grpo", "dynamic_sampling": {"enabled": dynamic, "budget": budget},
                      **({"policy_loss": "decoupled"} if mode == "async" else {})},
        "rollout": {"n": 2}})
    actor = ray.remote(Scripted).remote(every)
    sampler = PromptSampler([{"id": k, "prompt": f"p{k}"} for k in range(1000)], seed=0)
    sampler._order = lambda epoch: list(range(1000))   # prompts in order: the script knows which have signal
    return make_rollouts(cfg, RolloutGroup(["rollout-0"], [actor], seed=0), sampler, version=0), sampler


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_groups_without_signal_are_refilled_until_the_batch_has_its_prompts(ray_cluster, mode):
    rollouts, sampler = _source(mode, every=3)   # a third of the prompts have signal
    trajs, _, metrics = rollouts.next_batch(1)
    groups = groups_of(trajs, 2)
    assert len(groups) == 4 and all(has_signal(g) for g in groups)
    assert [g[0].example["id"] % 3 for g in groups] == [0, 0, 0, 0]
    assert metrics["dynamic_budget_hit"] == 0.0 and metrics["dynamic_dropped_groups"] >= 6
    assert metrics["dynamic_extra_trajectories"] >= 2 * 6
    if mode == "sync":
        assert sampler.position <= 3 * 4      # within the budget (async also keeps groups in flight)
    rollouts.close()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_the_source_counts_the_judges_calls_once_with_or_without_dynamic_sampling(ray_cluster, mode):
    """The judges' call metrics are the rollout source's: the trained groups' calls without dynamic
    sampling, the dropped groups' too with it (rollout_metrics no longer counts them a second time)."""
    from turnrl.training.loop import rollout_metrics
    rollouts, _ = _source(mode, every=3, dynamic=False)
    trajs, _, metrics = rollouts.next_batch(1)
    assert len(trajs) == 8 and metrics["judge_q_calls"] == 8.0 and "dynamic_dropped_groups" not in metrics
    assert not any(k.startswith("judge_") for k in rollout_metrics(trajs, 2))
    rollouts.close()
    rollouts, _ = _source(mode, every=3)   # a third of the prompts have signal: the rest judged and dropped
    trajs, _, metrics = rollouts.next_batch(1)
    assert metrics["judge_q_calls"] == len(trajs) + 2 * metrics["dynamic_dropped_groups"] > len(trajs)
    rollouts.close()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_budget_that_can_never_be_met_trains_on_what_there_is_and_says_so(ray_cluster, mode):
    rollouts, sampler = _source(mode, every=0, budget=2.0)   # no prompt ever has signal
    trajs, _, metrics = rollouts.next_batch(1)
    assert len(groups_of(trajs, 2)) == 1                      # never a hang: the step trains on the one group
    assert metrics["dynamic_budget_hit"] == 1.0 and metrics["dynamic_signal_frac"] == 0.0
    assert metrics["dynamic_padded_groups"] == 1.0            # the trainer's one rank needs one group
    assert metrics["dynamic_dropped_groups"] == 2 * 4 - 1     # the budget (2 x 4 prompts) judged, one trained on
    if mode == "sync":
        assert sampler.position == 2 * 4                       # async also keeps groups in flight for the next step
    rollouts.close()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_spent_budget_trains_on_the_groups_with_signal_alone(ray_cluster, mode):
    rollouts, _ = _source(mode, every=5, budget=1.5)   # prompts 0 and 5 of the 6 the budget allows have signal
    for step in (1, 2):
        trajs, _, metrics = rollouts.next_batch(step)
        groups = groups_of(trajs, 2)
        assert 1 <= len(groups) < 4 and all(has_signal(g) for g in groups), [g[0].example["id"] for g in groups]
        assert metrics["dynamic_budget_hit"] == 1.0 and metrics["dynamic_padded_groups"] == 0.0
    rollouts.close()


def test_dynamic_sampling_is_refused_where_the_advantage_is_not_a_group_baseline():
    from turnrl.config.loading import check_plugins
    ppo = {"algorithm": {"name": "ppo", "dynamic_sampling": {"enabled": True}}}
    problems = check_plugins(Config.model_validate(ppo))
    assert any("dynamic_sampling.enabled with algorithm.name = ppo" in p for p in problems), problems
    problems = check_plugins(Config.model_validate({"algorithm": {"dynamic_sampling": {"enabled": True,
                                                                                       "signal": "brevity"}}}))
    assert any("dynamic_sampling.signal = 'brevity'" in p for p in problems), problems


@pytest.mark.slow
def test_dynamic_sampling_through_the_real_loop(tiny_model_dir, tmp_path):
    """Two steps on the real stack: every step reports its filtering and rolls out no more than
    its budget (1.5 x 4 prompts); it trains on groups with signal only, unless none had any (then
    on the one group the single trainer rank needs)."""
    from conftest import train_two_steps
    history = train_two_steps(tiny_model_dir, tmp_path, {"name": "code_tool"},
                              {"name": "grpo", "dynamic_sampling": {"enabled": True, "budget": 1.5}})
    for h in history:
        assert 0.0 <= h["dynamic_signal_frac"] <= 1.0 and h["dynamic_extra_trajectories"] <= (6 - 4) * 2
        judged = 4 + h["dynamic_extra_trajectories"] / 2   # groups looked at
        assert h["dynamic_budget_hit"] == float(h["dynamic_signal_frac"] * judged < 4)   # fewer than 4 had signal
        assert h["trained_tokens"] > 0
        assert h["groups_all_same_frac"] == (1.0 if h["dynamic_padded_groups"] else 0.0)
