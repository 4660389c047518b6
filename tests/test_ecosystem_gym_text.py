"""gym_text: a TextArena game run through turnrl gives the library's own rewards and termination."""
from __future__ import annotations

import pytest

ta = pytest.importorskip("textarena", reason="pip install textarena==0.7.4")

from turnrl import envs   # noqa: E402
from turnrl.envs.ecosystem.gym_text import TASK   # noqa: E402
from turnrl.plugins import PluginError   # noqa: E402
from turnrl.rollout.multi_turn import Trajectory   # noqa: E402

# A recorded game: GuessTheNumber-v0 (1..20, 10 turns), episode seed 3, target 8.
RECORDED = ["[10]", "I'd say [5]", "[7]", "no bracket here", "[8]"]


def _library(actions: list[str], seed: int) -> tuple[list[tuple[bool, str]], dict]:
    env = ta.make("GuessTheNumber-v0")
    env.reset(num_players=1, seed=seed)
    steps = []
    for action in actions:
        done, _ = env.step(action)
        steps.append((done, "" if done else env.get_observation()[1]))
        if done:
            return steps, env.close()[0]
    return steps, {}


def test_replayed_game_has_the_librarys_rewards_and_termination():
    steps, rewards = _library(RECORDED, 3)
    env = envs.make("gym_text", envs.EnvContext(max_turns=10), make="textarena:GuessTheNumber-v0")
    row = {"prompt": "episode", "game_seed": 3}
    first = env.reset(row)
    assert "Guess The Number" in first
    traj, shown = Trajectory(example=row, prompt_ids=[1]), first
    for (lib_done, lib_log), action in zip(steps, RECORDED):
        result = env.step(action)
        assert result.done == lib_done
        done = traj.record(result)
        if not done:
            shown += result.observation
            assert shown == lib_log   # each observation is exactly the game's new messages
    assert traj.outcome == pytest.approx(rewards[0], abs=1e-9) and rewards[0] == 1.0
    assert traj.turn_rewards == [0.0] * (len(steps) - 1) + [rewards[0]]
    assert traj.finish == "terminated" and len(traj.turn_rewards) == len(steps) == 5


def test_episodes_come_from_disjoint_seeds():
    train, heldout = TASK.splits(50, 20, seed=1)
    assert len(train) == 50 and len(heldout) == 20
    assert not {r["game_seed"] for r in train} & {r["game_seed"] for r in heldout}


def test_unknown_game_is_a_one_line_error_naming_the_key():
    env = envs.make("gym_text", make="textarena:NoSuchGame-v0")
    with pytest.raises(PluginError) as err:
        env.reset({"game_seed": 1})
    assert str(err.value).startswith("env.options.make = textarena:NoSuchGame-v0:") and "\n" not in str(err.value)


class Countdown:
    """A gymnasium-style text game for the adapter's other protocol: say the seed's number minus
    one each turn; +0.5 per right step, terminated at 0, truncated after 3 steps."""

    def __init__(self, limit: int = 3):
        self.limit = limit

    def reset(self, seed=None):
        self.n, self.steps = seed, 0
        return f"start at {self.n}", {}

    def step(self, action):
        self.steps += 1
        right = action.strip() == str(self.n - 1)
        self.n -= right
        reward = 0.5 if right else -0.25
        return f"now {self.n}", reward, self.n == 0, self.steps >= self.limit, {"right": float(right)}


def test_gymnasium_style_factory_keeps_rewards_and_truncation():
    env = envs.make("gym_text", envs.EnvContext(max_turns=10), make="test_ecosystem_gym_text:Countdown",
                    kwargs={"limit": 3})
    traj = Trajectory(example={"game_seed": 5}, prompt_ids=[1])
    assert env.reset(traj.example) == "start at 5"
    results = [env.step(a) for a in ("4", "x", "3")]
    assert [r.reward for r in results] == [0.5, -0.25, 0.5] and [r.done for r in results] == [False, False, True]
    assert results[0].observation == "now 4" and results[0].info == {"right": 1.0}
    for r in results:
        traj.record(r)
    assert traj.finish == "truncated" and traj.outcome == pytest.approx(0.75)


def test_rollout_max_turns_ends_a_running_game_with_its_return_so_far():
    """The game would run 5 steps; rollout.max_turns 2 ends it after the second, its outcome the
    return so far (0.5 - 0.25), not 0."""
    env = envs.make("gym_text", envs.EnvContext(max_turns=2), make="test_ecosystem_gym_text:Countdown",
                    kwargs={"limit": 5})
    traj = Trajectory(example={"game_seed": 5}, prompt_ids=[1])
    env.reset(traj.example)
    results = [env.step(a) for a in ("4", "x")]
    assert [r.done for r in results] == [False, True] and results[1].observation is None
    assert results[1].reward == -0.25 and results[1].info["right"] == 0.0
    for r in results:
        traj.record(r)
    assert traj.finish == "max_turns" and traj.outcome == pytest.approx(0.25)
    env.reset(traj.example)                   # a new episode counts its turns afresh
    assert not env.step("4").done
