"""Continuous rollouts (turnrl.rollout.stream): groups come back as they finish (a slow
environment holds back only its own group), every policy turn carries the policy version that
sampled it and the engine's logprobs under those weights, and weights loaded mid-stream apply
to the turns that start after them. The engine is a stand-in whose logprobs tell which weights
produced them (the real engines run in the async pipeline test)."""
import threading
import time

import pytest
from transformers import AutoTokenizer

from turnrl.envs.base import StepResult
from turnrl.rollout.chat import ChatFormat
from turnrl.rollout.multi_turn import Budgets, Sample, Trajectory
from turnrl.rollout.stream import Stream, TurnVersions


class TwoTurns:
    """Two policy turns; the first step waits `delay_s` (a slow tool) for examples that say so."""
    system_prompt, stop, observation_role = "", [], "user"

    def reset(self, example):
        self.example = example
        self.turn = 0
        return example["prompt"]

    def step(self, text):
        self.turn += 1
        if self.turn == 1:
            time.sleep(self.example.get("delay_s", 0.0))
            return StepResult("go on", 0.0, False, {})
        return StepResult(None, 1.0, True, {"outcome": 1.0, "reason": "answer"})


class VersionedEngine:
    """Three tokens per turn, each with logprob -(1 + the version of the weights it holds)."""

    def __init__(self):
        self.version = 0

    def generate(self, prompts, *, max_tokens, stop, temperature, top_p, seeds):
        return [Sample([5, 6, 7], [-(1.0 + self.version)] * 3, "stop") for _ in prompts]


@pytest.fixture
def engine_and_format(tiny_model_dir):
    return VersionedEngine(), ChatFormat(AutoTokenizer.from_pretrained(tiny_model_dir))


def _stream(engine_and_format, **kw):
    engine, fmt = engine_and_format
    stream = Stream(engine, TwoTurns, fmt, Budgets(2, 8, 200), n=2, max_groups=kw.pop("max_groups", 4),
                    temperature=1.0, top_p=1.0, env_workers=4, **kw)
    thread = threading.Thread(target=stream.run, daemon=True)
    thread.start()
    return stream, thread


def _take(stream, count, timeout_s=120.0):
    groups, deadline = [], time.monotonic() + timeout_s
    while len(groups) < count and time.monotonic() < deadline:
        groups += stream.take_groups(count - len(groups), timeout_s=1.0)
    return groups


def test_a_slow_group_does_not_hold_back_the_others(engine_and_format):
    stream, thread = _stream(engine_and_format)
    try:
        stream.feed([{"prompt": "slow", "delay_s": 3.0}] + [{"prompt": f"fast {k}"} for k in range(3)])
        first = _take(stream, 3)
        assert [g[0].example["prompt"] for g in first] and all(g[0].example["prompt"] != "slow" for g in first)
        assert all(len(g) == 2 and all(t.finish == "answer" and t.num_turns == 2 for t in g) for g in first)
        last = _take(stream, 1)
        assert last[0][0].example["prompt"] == "slow"
    finally:
        stream.stop()
        thread.join(timeout=30)
    assert not thread.is_alive()


def test_turns_carry_the_version_that_sampled_them_and_weights_apply_mid_stream(engine_and_format):
    stream, thread = _stream(engine_and_format)
    applied = []
    try:
        stream.feed([{"prompt": "before"}])
        (before,) = _take(stream, 1)
        # the first turn starts under version 0; the slow tool answers after version 1 is loaded
        stream.feed([{"prompt": "straddles", "delay_s": 2.0}])
        time.sleep(0.5)
        engine = engine_and_format[0]
        stream.load_weights(1, lambda: (applied.append(time.monotonic()), setattr(engine, "version", 1)))
        (straddles,) = _take(stream, 1)
    finally:
        stream.stop()
        thread.join(timeout=30)
    assert [t.turn_versions for t in before] == [[0, 0], [0, 0]]
    assert len(applied) == 1
    assert [t.turn_versions for t in straddles] == [[0, 1], [0, 1]]   # partial rollout: turn 2 under the new weights
    for t in straddles:   # each turn's tokens keep the logprobs of the weights that sampled them
        policy = [(turn, lp) for turn, lp, m in zip(t.turn_ids, t.engine_logprobs, t.loss_mask) if m]
        assert policy == [(0, -1.0)] * 3 + [(1, -2.0)] * 3
        assert all(lp == 0.0 for lp, m in zip(t.engine_logprobs, t.loss_mask) if not m)


def test_groups_in_flight_are_bounded(engine_and_format):
    stream, thread = _stream(engine_and_format, max_groups=1)
    try:
        stream.feed([{"prompt": "a", "delay_s": 1.0}, {"prompt": "b"}])
        time.sleep(0.5)
        assert stream.counts() == {"inbox": 1, "in_flight": 1, "finished": 0}
        assert len(_take(stream, 2)) == 2
    finally:
        stream.stop()
        thread.join(timeout=30)


def test_roll_out_goes_ahead_of_the_queue_and_never_reaches_take_groups(engine_and_format):
    stream, thread = _stream(engine_and_format, max_groups=1)
    try:
        stream.feed([{"prompt": "training", "delay_s": 1.0}, {"prompt": "queued"}])
        time.sleep(0.3)
        held_out = stream.roll_out([{"prompt": "x"}, {"prompt": "y"}, {"prompt": "z"}], n=1)
        assert [t.example["prompt"] for t in held_out] == ["x", "y", "z"]
        assert all(t.finish == "answer" for t in held_out)
        taken = _take(stream, 2)
        assert sorted(g[0].example["prompt"] for g in taken) == ["queued", "training"]
        assert stream.take_groups(5, timeout_s=0.5) == []
    finally:
        stream.stop()
        thread.join(timeout=30)


def _turn(t: Trajectory) -> None:
    t.add_turn(t.num_turns, [5, 6], [-1.0, -1.0], "turn")


def test_turn_versions_stamp_each_turn_with_the_version_it_started_under():
    """The staleness bookkeeping alone (no engine, no thread): a turn that straddles a weight load
    keeps the version it started under; the next turn gets the new one; stamping twice adds nothing."""
    versions, t = TurnVersions(3), Trajectory(example={}, prompt_ids=[1])
    versions.turn_started(0)
    versions.load(4)                    # new weights while turn 0 is being sampled
    _turn(t)
    versions.stamp(0, t)
    assert t.turn_versions == [3] and versions.current == 4
    versions.stamp(0, t)
    assert t.turn_versions == [3]       # idempotent: the env step and the end may both stamp
    versions.turn_started(0)
    _turn(t)
    versions.load(5)
    versions.stamp(0, t)
    assert t.turn_versions == [3, 4]


def test_turn_versions_keep_trajectories_apart_and_forget_the_ones_that_left():
    versions = TurnVersions()
    a, b = Trajectory(example={}, prompt_ids=[1]), Trajectory(example={}, prompt_ids=[1])
    versions.turn_started(0)
    versions.load(1)
    versions.turn_started(1)
    _turn(a), _turn(b)
    versions.stamp(1, b)
    versions.stamp(0, a)
    assert (a.turn_versions, b.turn_versions) == ([0], [1])
    versions.forget(0)
    _turn(a)                            # a turn of a trajectory no longer tracked: the current version
    versions.stamp(0, a)
    assert a.turn_versions == [0, 1]
    versions.forget(0)                  # forgetting twice is harmless


def test_the_stream_and_the_batch_rollout_share_one_turn_engine(engine_and_format):
    """Both are a TurnEngine: the stream's turns stop where the batch rollout's do (an environment
    without stop strings: the chat template's end of turn), and an ended group leaves no state."""
    from turnrl.rollout.multi_turn import TurnEngine, stop_strings
    engine, fmt = engine_and_format
    stream, thread = _stream(engine_and_format)
    try:
        assert isinstance(stream, TurnEngine)
        (stepper,) = stream.steppers.values()
        assert stepper.options["stop"] == stop_strings(TwoTurns(), fmt) == (fmt.end_of_turn,)
        stream.feed([{"prompt": "a"}])
        (group,) = _take(stream, 1)
    finally:
        stream.stop()
        thread.join(timeout=30)
    assert len(group) == 2 and all(t.finish == "answer" for t in group)
    assert not (stream.trajs or stream.envs or stream.turn_of or stream.level_at or stream.asked_at)
