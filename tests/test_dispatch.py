"""Least-loaded, sticky dispatch of rollout work (turnrl.rollout.dispatch) by hand on scripted
loads, and the synchronous step's groups dispatched to fake rollout actors on a local Ray
(turnrl.training.cluster.RolloutGroup, rollout.dispatch): order, seeds, balance, engines that
die or raise mid-step, and the flush before a weight push."""
from __future__ import annotations

import os
import time

import pytest

from turnrl.rollout.dispatch import Dispatcher, NoEngineLeft


# --------------------------------------------------------------------------- the pure dispatcher
def test_the_least_loaded_engine_gets_the_next_item_and_ties_go_to_the_first_named():
    d = Dispatcher(["a", "b", "c"])
    assert [d.assign(i) for i in range(3)] == ["a", "b", "c"]       # all empty: first named first
    assert d.assign(3, work=5) == "a"                                # 1, 1, 1: a again
    assert d.loads() == {"a": 6, "b": 1, "c": 1}
    assert d.assign(4) == "b" and d.assign(5) == "c"                 # b and c at 2, a at 6
    d.done(1)                                                        # b drops to 1
    assert d.assign(6) == "b"
    assert d.completed["b"] == 1 and d.assigned["a"] == 6 and d.moved == 0


def test_capacity_keeps_one_item_in_flight_per_engine():
    d = Dispatcher([0, 1], capacity=1)
    assert d.assign("x") == 0 and d.assign("y") == 1
    assert d.assign("z") is None and "z" not in d.items              # nothing recorded: ask again later
    assert d.done("y") == 1 and d.assign("z") == 1                   # whoever finished first gets it
    d.capacity = None
    assert d.assign("w") == 0                                        # no limit: least loaded (ties: first)


def test_a_key_sticks_to_its_engine_until_the_engine_is_over_the_bound():
    d = Dispatcher(["a", "b"])                                       # bound 1.25
    assert d.assign("t1", key="ep") == "a"
    d.done("t1")
    d.assign("other", key="x")                                       # a: 1 (x), b: 0
    assert d.assign("t2", key="ep") == "a" and d.moved == 0          # 2 <= ceil(1.25 * 2 / 2) = 2: stays
    d.done("t2")
    d.assign("more", key="x")                                        # a: 2, b: 0
    assert d.assign("t3", key="ep") == "b" and d.moved == 1          # 3 > ceil(1.875) = 2: moves, counted
    d.done("t3")
    assert d.assign("t4", key="ep") == "b" and d.moved == 1          # and sticks to its new engine
    assert d.sticky == {"ep": "b", "x": "a"}


def test_the_bound_is_the_ceiling_of_bound_times_the_mean_with_the_item():
    d = Dispatcher(["a", "b"], bound=1.25)
    for i in range(3):
        d.items[f"a{i}"] = ("a", 1.0)
    d.items["b0"] = ("b", 1.0)                                       # loads (3, 1)
    assert not d.overloaded("a")                                     # 4 <= ceil(1.25 * 5 / 2) = 4
    d.items["a3"] = ("a", 1.0)                                       # (4, 1)
    assert d.overloaded("a") and not d.overloaded("b")               # 5 > ceil(3.75) = 4
    with pytest.raises(ValueError, match="bound >= 1"):
        Dispatcher(["a"], bound=0.5)
    lone = Dispatcher(["a"])
    lone.items["q"] = ("a", 100.0)
    assert not lone.overloaded("a")                                  # alone: never over its own mean


def test_a_sticky_engine_without_room_is_waited_for_not_left():
    d = Dispatcher(["a", "b"], capacity=1)
    d.sticky["ep"] = "a"
    d.assign("busy", key="other")                                    # other -> a (least loaded), a full
    assert d.assign("turn", key="ep") is None and d.moved == 0       # a is at capacity: not moved
    d.done("busy")
    assert d.assign("turn", key="ep") == "a"


def test_a_removed_engine_hands_back_its_items_counted_once_and_can_rejoin():
    d = Dispatcher(["a", "b", "c"])
    for item in range(6):
        d.assign(item)                                               # a: 0, 3; b: 1, 4; c: 2, 5
    d.assign("k", key="ep")                                          # the episode on a
    back = d.remove("a")
    assert sorted(back, key=str) == [0, 3, "k"] and d.moved == 3 and d.moved_work == 3
    assert d.assign(0) == "b" and d.assign(3) == "c"                 # re-sent to the others
    d.remove("b")                                                    # item 0 moves again ...
    assert d.moved == 5                                              # ... counted once: +1 (item 4) +0 (item 0)
    assert d.assign("k2", key="ep") == "c" and d.moved == 6          # its engine gone: the key moves
    d.add("a")                                                       # restarted: rejoins, empty
    assert d.assign("next") == "a" and d.loads()["a"] == 1
    d.remove("a")
    d.remove("c")
    with pytest.raises(NoEngineLeft):
        d.assign("last")


def test_an_item_is_outstanding_once():
    d = Dispatcher(["a"])
    d.assign("x")
    with pytest.raises(ValueError, match="already outstanding"):
        d.assign("x")


# --------------------------------------------------------------------------- on a local Ray
class FakeEngine:
    """A rollout actor that sleeps `cost` seconds per group (the examples' "cost") and returns
    trajectories naming their example, their index in the group, the generator seed and itself.
    `fail`: after that many calls, `die` (the process exits), `raise` (the call raises) or `hang`
    (the call never returns: a hung engine)."""

    def __init__(self, name: str, fail_after: int | None = None, how: str = "die"):
        self.name, self.fail_after, self.how, self.calls, self.log = name, fail_after, how, 0, []

    def timed_rollout(self, examples, n, generator_seed=None):
        self.calls += 1
        if self.fail_after is not None and self.calls > self.fail_after:
            if self.how == "die":
                os._exit(1)
            if self.how == "hang":
                time.sleep(3600)
            raise RuntimeError(f"{self.name}: the engine broke")
        start = time.perf_counter()
        time.sleep(sum(e.get("cost", 0.0) for e in examples))
        self.log.append(("rollout", [e["id"] for e in examples]))
        trajs = [{"id": e["id"], "i": i, "seed": generator_seed, "engine": self.name} for e in examples for i in range(n)]
        return trajs, time.perf_counter() - start

    def load_weight_buckets(self, buckets, level="low"):
        self.log.append(("load", None))

    def calls_log(self):
        return self.log


@pytest.fixture(scope="module")
def ray_local():
    """A local Ray whose workers import this module (FakeEngine) from tests/."""
    from conftest import local_ray
    yield from local_ray(num_cpus=2)


def _group(dispatch: str, engines: int = 2, engine_timeout_s: float | None = None, **fail):
    import ray

    from turnrl.training.cluster import RolloutGroup
    actor = ray.remote(FakeEngine).options(num_cpus=0)
    names = [f"rollout engine {e}" for e in range(engines)]
    handles = [actor.remote(name, **(fail if e == engines - 1 else {})) for e, name in enumerate(names)]
    return RolloutGroup(names, handles, seed=3, dispatch=dispatch, engine_timeout_s=engine_timeout_s)


def _examples(costs):
    return [{"id": k, "cost": c} for k, c in enumerate(costs)]


def test_least_loaded_keeps_the_examples_order_and_seeds_by_group_not_by_engine(ray_local):
    from turnrl.training.checkpoint import step_seed
    examples = _examples([0.0] * 16)
    group = _group("least_loaded")
    trajs, busy = group.rollout(examples, 2, step=5)
    assert [(t["id"], t["i"]) for t in trajs] == [(k, i) for k in range(16) for i in range(2)]
    # 2 engines x 4 chunks: chunks of 2 groups, seeded from their first group's index
    assert {t["id"]: t["seed"] for t in trajs} == {k: step_seed(3, 5, f"group {k - k % 2}") for k in range(16)}
    assert len(busy) == 2
    # the same step on engines that take different times gives the same seeds per group
    slow = _examples([0.0] * 16)
    slow[0]["cost"] = 0.3
    again, _ = _group("least_loaded").rollout(slow, 2, step=5)
    assert [(t["id"], t["i"], t["seed"]) for t in again] == [(t["id"], t["i"], t["seed"]) for t in trajs]
    metrics = group.take_dispatch_metrics()
    assert metrics["engine/0/groups"] + metrics["engine/1/groups"] == 16 and metrics["dispatch_moved"] == 0
    assert group.take_dispatch_metrics()["engine/0/groups"] == 0        # counters restart


def test_static_shares_are_kept_and_counted(ray_local):
    from turnrl.training.checkpoint import step_seed
    group = _group("static")
    trajs, busy = group.rollout(_examples([0.0] * 4), 1, step=2)
    assert [t["id"] for t in trajs] == [0, 1, 2, 3]
    assert [t["engine"] for t in trajs] == ["rollout engine 0"] * 2 + ["rollout engine 1"] * 2
    assert [t["seed"] for t in trajs] == [step_seed(3, 2, 0)] * 2 + [step_seed(3, 2, 1)] * 2
    metrics = group.take_dispatch_metrics()
    assert (metrics["engine/0/groups"], metrics["engine/1/groups"], metrics["dispatch_moved"]) == (2, 2, 0)
    # one engine under least_loaded: a single call, as static
    lone = _group("least_loaded", engines=1)
    assert {t["seed"] for t in lone.rollout(_examples([0.0] * 4), 1, step=2)[0]} == {step_seed(3, 2, 0)}


def test_the_long_episodes_no_longer_hold_up_one_engine(ray_local):
    """The long groups come first: static gives them all to engine 0 while engine 1 idles;
    least-loaded hands the next chunk to whichever engine is free."""
    costs = [0.15] * 8 + [0.01] * 8          # 1.2 s of work in the first half, 0.08 s in the second
    seconds = {}
    for dispatch in ("static", "least_loaded"):
        group = _group(dispatch)
        group.rollout(_examples([0.0] * 2), 1, step=0)     # actors started
        start = time.perf_counter()
        _, busy = group.rollout(_examples(costs), 1, step=1)
        seconds[dispatch] = (time.perf_counter() - start, busy)
    static_busy, ll_busy = seconds["static"][1], seconds["least_loaded"][1]
    assert static_busy[0] > 1.1 and static_busy[1] < 0.2
    assert min(ll_busy) > 0.25, seconds                  # both engines rolled out long groups (0.3 s a chunk)
    # (how much sooner the step ends is measured in docs/models-and-gpus.md, not asserted here)


@pytest.mark.parametrize("how", ["die", "raise"])
def test_an_engine_that_fails_mid_step_hands_its_groups_to_the_others(ray_local, how):
    from turnrl.training.cluster import ActorFailure, ObjectStoreSync
    # engine 2 fails on its first call: every engine's first chunk is sent at the start, so which
    # chunk fails does not depend on how fast the others are (a later call might never come)
    group = _group("least_loaded", engines=3, fail_after=0, how=how)
    trajs, _ = group.rollout(_examples([0.05] * 24), 2, step=1)
    assert [(t["id"], t["i"]) for t in trajs] == [(k, i) for k in range(24) for i in range(2)]   # nothing lost
    assert set(group.dead) == {2}
    metrics = group.take_dispatch_metrics()
    assert metrics["dispatch_moved"] == 2                     # one chunk of 2 groups, counted once
    assert sum(metrics[f"engine/{e}/groups"] for e in range(3)) == 24
    # the next step leaves it out, and so does a weight push
    trajs, busy = group.rollout(_examples([0.0] * 6), 1, step=2)
    assert len(trajs) == 6 and "rollout engine 2" not in {t["engine"] for t in trajs} and busy[2] == 0
    assert group.take_dispatch_metrics()["dispatch_moved"] == 0

    class Policy:
        def results(self, method, *args):
            return [[]]
    calls = ObjectStoreSync(Policy(), group, bucket_mb=1).push(wait=False)
    assert [name for name, _ in calls] == ["rollout engine 0", "rollout engine 1"]
    # every engine failed: a clear error naming them
    import ray
    for h in group.handles[:2]:
        ray.kill(h, no_restart=True)
    with pytest.raises(ActorFailure, match="every rollout engine failed .*rollout engine 0: .*rollout engine 2: "):
        group.rollout(_examples([0.0] * 4), 1, step=3)


def test_a_hung_engine_is_left_behind_and_its_groups_go_to_the_others(ray_local):
    # engine 1 never answers its first call: after engine_timeout_s without finishing anything it
    # is killed and its chunk re-sent; the step completes with every group, none twice
    import ray
    group = _group("least_loaded", engine_timeout_s=5.0, fail_after=0, how="hang")
    ray.get([h.calls_log.remote() for h in group.handles])   # started: an actor's start-up is not its work
    start = time.perf_counter()
    trajs, _ = group.rollout(_examples([0.05] * 16), 2, step=1)
    assert [(t["id"], t["i"]) for t in trajs] == [(k, i) for k in range(16) for i in range(2)]
    assert {t["engine"] for t in trajs} == {"rollout engine 0"}
    assert group.dead == {1: "no answer in 5 s (rollout.engine_timeout_s)"}
    assert group.take_dispatch_metrics()["dispatch_moved"] == 2    # its one chunk of 2 groups, once
    assert time.perf_counter() - start < 30                         # not the hour it would sleep


def test_a_static_rollout_with_a_hung_engine_stops_naming_it(ray_local):
    from turnrl.training.cluster import ActorFailure
    import ray
    group = _group("static", engine_timeout_s=1.5, fail_after=0, how="hang")
    ray.get([h.calls_log.remote() for h in group.handles])
    with pytest.raises(ActorFailure, match=r"rollout engine 1: no answer in \d+ s \(rollout.engine_timeout_s = 1.5\)"):
        group.rollout(_examples([0.0] * 4), 1, step=1)
    ray.kill(group.handles[1], no_restart=True)


def test_a_restarted_engine_rejoins(ray_local):
    import ray
    group = _group("least_loaded", fail_after=0)                      # engine 1 dies on its first call
    trajs, _ = group.rollout(_examples([0.0] * 8), 1, step=1)
    assert len(trajs) == 8 and set(group.dead) == {1}
    group.rejoin(1, ray.remote(FakeEngine).options(num_cpus=0).remote("rollout engine 1 (new)"))
    trajs, _ = group.rollout(_examples([0.05] * 8), 1, step=2)
    assert {t["engine"] for t in trajs} == {"rollout engine 0", "rollout engine 1 (new)"} and not group.dead


def test_a_push_during_an_overlapped_rollout_queues_behind_all_of_its_chunks(ray_local):
    """train.overlap_rollout: the next step's rollout is in flight while the update runs; the
    weight push sends every chunk not sent yet first, so the load runs after all of them."""
    import ray

    from turnrl.training.cluster import ObjectStoreSync

    class Policy:
        def results(self, method, *args):
            return [[]]
    group = _group("least_loaded")
    pending = group.submit(_examples([0.05] * 16), 1, step=1)
    time.sleep(0.05)                                                  # the first chunks are running
    loads = ObjectStoreSync(Policy(), group, bucket_mb=1).push(wait=False)
    trajs, _ = group.collect(pending)
    ray.get([ref for _, ref in loads])
    assert [t["id"] for t in trajs] == list(range(16))
    for h in group.handles:
        log = ray.get(h.calls_log.remote())
        assert log[-1] == ("load", None) and all(kind == "rollout" for kind, _ in log[:-1])
    assert sum(len(ids) for h in group.handles for kind, ids in ray.get(h.calls_log.remote()) if ids) == 16


# --------------------------------------------------------------------------- the real loop
TRAINING = ("reward_mean", "accuracy", "response_tokens_mean", "loss", "kl_ref", "logp_gap_max", "grad_norm")


@pytest.mark.slow
@pytest.mark.long
def test_two_engines_least_loaded_train_the_same_numbers_whichever_engine_took_a_group(tiny_model_dir, tmp_path):
    """Two trainings of two steps with two engines: which engine rolls out which chunk depends on
    timing, yet every training number repeats (each chunk is seeded by its groups, not by its
    engine), and each step reports its engines' groups, busy and idle seconds."""
    from conftest import train_two_steps
    rollout = {"n": 2, "max_tokens_per_turn": 16, "engine": "hf", "dispatch": "least_loaded"}
    runs = [train_two_steps(tiny_model_dir, tmp_path / name, {"name": "code_tool"}, {"name": "grpo"},
                            rollout=rollout, cluster={"rollout_engines": 2}, train=train)
            for name, train in (("first", {}), ("evaluated", {"eval_every": 1, "eval_examples": 4}))]
    for step in (0, 1):
        assert {k: runs[1][step][k] for k in TRAINING} == {k: runs[0][step][k] for k in TRAINING}
        for h in (runs[0][step], runs[1][step]):
            assert h["engine/0/groups"] + h["engine/1/groups"] == 4 and h["dispatch_moved"] == 0
            assert h["engine/0/groups"] > 0 and h["engine/1/groups"] > 0   # chunks of 1 group: one to each first
            assert all(h[f"engine/{e}/busy_s"] + h[f"engine/{e}/idle_s"] >= h["step_s"] - 1e-6
                       for e in (0, 1) if h[f"engine/{e}/busy_s"] <= h["step_s"])
