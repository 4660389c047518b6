"""Asynchronous training's scoring (turnrl.rollout.scored): each group is scored on a thread of
its own as it leaves the stream, so the trainer takes groups already scored. The stream here is a
scripted one (groups released on a clock), the code under test is the real ScoredStream."""
from __future__ import annotations

import threading
import time

import pytest

from turnrl.rollout.multi_turn import Trajectory
from turnrl.rollout.scored import ScoredStream


class ScriptedStream:
    """Releases group k (two trajectories) at `times[k]` seconds after it is made."""

    def __init__(self, times: list[float]):
        self.start, self.times, self.given = time.perf_counter(), times, 0
        self.cond = threading.Condition()

    def take_groups(self, max_groups: int, timeout_s: float) -> list[list[Trajectory]]:
        deadline = time.perf_counter() + timeout_s
        out = []
        while not out and time.perf_counter() < deadline:
            now = time.perf_counter() - self.start
            while self.given < len(self.times) and self.times[self.given] <= now and len(out) < max_groups:
                out.append([Trajectory(example={"id": f"g{self.given}"}, prompt_ids=[1]) for _ in range(2)])
                self.given += 1
            if not out:
                time.sleep(0.01)
        return out

    def counts(self) -> dict[str, int]:
        return {"inbox": 0, "in_flight": len(self.times) - self.given, "finished": 0}

    def stop(self) -> None:
        pass


def test_groups_are_scored_as_they_finish_not_when_the_trainer_takes_them():
    scored_at: dict[str, float] = {}

    def score(trajs):
        time.sleep(0.3)   # a judge's latency
        for t in trajs:
            t.rewards["judge"] = 1.0
            scored_at[t.example["id"]] = time.perf_counter()

    stream = ScoredStream(ScriptedStream([0.0, 0.1, 0.2]), score, poll_s=0.05)
    time.sleep(1.5)   # the trainer is busy updating; the judge works meanwhile
    taken_at = time.perf_counter()
    groups = stream.take_groups(3, timeout_s=0.01)
    assert [g[0].example["id"] for g in groups] == ["g0", "g1", "g2"]
    assert all(t.rewards == {"judge": 1.0} for g in groups for t in g)
    assert max(scored_at.values()) < taken_at     # scored before the trainer asked
    stream.stop()


@pytest.mark.parametrize("max_batches", [1, 4])
def test_a_group_ending_while_a_batch_waits_for_its_score_is_scored_at_once(max_batches):
    """g0's score takes 1 s (a judge's slowest answer), g1 ends at 0.2 s: with several batches
    at once g1 is scored without waiting for g0's; with one it waits (the former behaviour)."""
    scored_at: dict[str, float] = {}

    def score(trajs):
        time.sleep(1.0 if trajs[0].example["id"] == "g0" else 0.1)
        for t in trajs:
            t.rewards["judge"] = 1.0
            scored_at[t.example["id"]] = time.perf_counter()

    stream = ScoredStream(ScriptedStream([0.0, 0.2]), score, poll_s=0.05, max_batches=max_batches)
    groups = []
    while len(groups) < 2:
        groups += stream.take_groups(2, timeout_s=3.0)
    assert sorted(g[0].example["id"] for g in groups) == ["g0", "g1"]
    assert (scored_at["g1"] < scored_at["g0"]) == (max_batches > 1)
    stream.stop()


def test_a_take_waits_for_the_score_and_counts_what_is_being_scored():
    release = threading.Event()

    def score(trajs):
        release.wait(5)
    stream = ScoredStream(ScriptedStream([0.0]), score, poll_s=0.05)
    time.sleep(0.3)
    assert stream.counts()["scoring"] == 1 and stream.counts()["finished"] == 1   # taken from the stream, not scored
    assert stream.take_groups(1, timeout_s=0.2) == []                           # not handed out unscored
    release.set()
    assert len(stream.take_groups(1, timeout_s=2.0)) == 1
    assert stream.counts()["finished"] == 0
    stream.stop()


def test_a_scoring_failure_reaches_the_trainers_next_take():
    def score(trajs):
        raise RuntimeError("reward function my.rewards:strict raised ValueError")
    stream = ScoredStream(ScriptedStream([0.0]), score, poll_s=0.05)
    with pytest.raises(RuntimeError, match="my.rewards:strict"):
        for _ in range(20):
            stream.take_groups(1, timeout_s=0.1)
    stream.stop()


def test_a_sync_batch_is_scored_group_by_group_while_the_rest_generates():
    """scored_as_they_finish by group (a scorer that needs whole groups) with a runner that reports
    groups at 0.0, 0.3 and 0.6 s: the first groups are scored before the runner returns, each
    whole; a group it never reported is scored at the end."""
    from turnrl.rollout.scored import scored_as_they_finish
    scored_at: dict[str, float] = {}

    def score(trajs):
        for t in trajs:
            scored_at[t.example["id"]] = time.perf_counter()
            t.rewards["r"] = 1.0

    groups = [[Trajectory(example={"id": f"g{k}"}, prompt_ids=[1]) for _ in range(2)] for k in range(4)]
    returned_at = {}

    batches = []

    def score_batch(trajs):
        batches.append({t.example["id"] for t in trajs})
        score(trajs)

    def roll_out(on_group_done):
        for group in groups[:3]:
            on_group_done(group)
            time.sleep(0.3)
        returned_at["t"] = time.perf_counter()
        return [t for g in groups for t in g]   # g3: never reported
    trajs = scored_as_they_finish(roll_out, score_batch, unit="group")
    assert len(trajs) == 8 and all(t.rewards == {"r": 1.0} for t in trajs)
    assert scored_at["g0"] < returned_at["t"] and scored_at["g1"] < returned_at["t"]
    assert scored_at["g3"] >= returned_at["t"]
    assert {"g0"} in batches and {"g1"} in batches    # whole groups, one at a time


def test_a_sync_batch_is_scored_trajectory_by_trajectory_before_its_group_ends():
    """By trajectory (the default): a trajectory is scored while the other member of its group
    still generates; one the runner never reported is scored when it returns."""
    from turnrl.rollout.scored import scored_as_they_finish
    trajs = [Trajectory(example={"id": f"t{k}"}, prompt_ids=[1]) for k in range(4)]   # groups (t0, t1), (t2, t3)
    scored_at, reported_at = {}, {}

    def score(batch):
        for t in batch:
            scored_at[t.example["id"]] = time.perf_counter()

    def roll_out(on_trajectory_done):
        for t in trajs[:3]:
            reported_at[t.example["id"]] = time.perf_counter()
            on_trajectory_done(t)
            time.sleep(0.3)
        reported_at["end"] = time.perf_counter()
        return trajs                              # t3: never reported
    assert scored_as_they_finish(roll_out, score) is not None
    assert scored_at["t0"] < reported_at["t1"]    # before its group's other member ended
    assert scored_at["t2"] < reported_at["end"] <= scored_at["t3"]
    with pytest.raises(ValueError, match="trajectory or group"):
        scored_as_they_finish(roll_out, score, unit="episode")


def test_the_scoring_unit_is_the_group_only_where_a_scorer_or_the_runner_needs_it():
    from turnrl.config import Config
    from turnrl.rewards.functions import from_config
    from turnrl.rollout.episodes import StepRunner, scoring_unit

    def scorer(scope):
        cfg = Config.model_validate({"reward": {"judges": [{"base_url": "http://127.0.0.1:1/v1", "template": "{responses}" if scope == "group" else "{response}",
                                                            "scope": scope, "score": "json:scores"}]}})
        return from_config(cfg.reward, cfg.rollout)

    class GroupsOnly:   # a user's runner written before on_trajectory_done
        def run(self, engine, examples, make_env, fmt, budgets, *, n=1, on_group_done=None):
            return []
    assert not scorer("episode").by_group and scorer("group").by_group
    assert scoring_unit(StepRunner(), by_group=False) == "trajectory"
    assert scoring_unit(StepRunner(), by_group=True) == "group"
    assert scoring_unit(GroupsOnly(), by_group=False) == "group"


def test_the_step_loop_reports_each_trajectory_and_group_as_it_ends(tiny_model_dir):
    """run_rollouts' on_trajectory_done and on_group_done on a real engine: every trajectory and
    every group reported once, a group whole and after its members."""
    from transformers import AutoTokenizer
    from turnrl import envs
    from turnrl.rollout.chat import ChatFormat
    from turnrl.rollout.engines import make_engine
    from turnrl.rollout.multi_turn import Budgets, run_rollouts
    from turnrl.data.synthetic import product_rows
    engine = make_engine("hf", str(tiny_model_dir))
    fmt = ChatFormat(AutoTokenizer.from_pretrained(tiny_model_dir))
    reported = []
    rows = product_rows(3, seed=0, split="train", exclude=set())
    events = []
    trajs = run_rollouts(engine, rows, lambda: envs.make("code_tool"), fmt, Budgets(2, 8, 32, 1024), n=2,
                         on_group_done=lambda group: reported.append([id(t) for t in group]),
                         on_trajectory_done=lambda t: events.append((id(t), t.finish, len(reported))))
    by_id = {id(t): k for k, t in enumerate(trajs)}
    assert sorted(sorted(by_id[i] for i in group) for group in reported) == [[0, 1], [2, 3], [4, 5]]
    # each trajectory once, ended (its finish set), before its group was reported
    assert sorted(by_id[i] for i, _, _ in events) == list(range(6)) and all(finish for _, finish, _ in events)
    for i, _, groups_before in events:
        assert not any(i in group for group in reported[:groups_before])
