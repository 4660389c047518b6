"""Length shaping by hand: DAPO's soft overlong penalty (reward.overlong) as a reward function,
and train.mask_truncated leaving trajectories a token budget cut out of the loss."""
from __future__ import annotations

import pytest
import torch

from turnrl.config import Config, ConfigError
from turnrl.rewards.functions import from_config
from turnrl.rewards.shaping import cut_by_budget, soft_overlong_penalty
from turnrl.rollout.multi_turn import Trajectory


@pytest.mark.parametrize("length, expected", [(0, 0.0), (80, 0.0), (81, -0.05), (90, -0.5), (99, -0.95),
                                              (100, -1.0), (101, -1.0), (500, -1.0)])
def test_the_soft_overlong_penalty_is_zero_then_linear_over_the_buffer_then_the_maximum(length, expected):
    # limit 100, buffer 20: no penalty up to 80 tokens, -1 at the budget (DAPO eq. 13)
    assert soft_overlong_penalty(length, limit=100, buffer=20) == pytest.approx(expected)


def test_the_penalty_scales_with_max_penalty_and_is_off_without_a_buffer():
    assert soft_overlong_penalty(90, limit=100, buffer=20, max_penalty=0.5) == pytest.approx(-0.25)
    assert soft_overlong_penalty(10_000, limit=100, buffer=0) == 0.0


def _traj(response_tokens: int, finish: str, outcome: float = 1.0) -> Trajectory:
    t = Trajectory(example={"prompt": "p", "answer": "a"}, prompt_ids=[1, 2])
    t.add_turn(0, list(range(3, 3 + response_tokens)), [0.0] * response_tokens, "x")
    t.outcome, t.finish = outcome, finish
    return t


def test_reward_overlong_is_a_reward_function_added_to_the_reward_and_logged_by_name():
    cfg = Config.model_validate({"rollout": {"max_tokens_total": 100, "max_tokens_per_turn": 100},
                                 "reward": {"overlong": {"buffer": 20, "max_penalty": 0.5}}})
    scorer = from_config(cfg.reward, cfg.rollout)
    short, long_ = _traj(50, "answer"), _traj(90, "answer")
    scorer.score([short, long_], decode=lambda ids: "x" * len(ids))
    assert short.rewards == {"overlong": 0.0} and short.reward == pytest.approx(1.0)
    assert long_.rewards == {"overlong": pytest.approx(-0.25)} and long_.reward == pytest.approx(0.75)
    # the episode's budget ended it short of the limit (its next observation would not fit): the whole penalty
    cut = _traj(70, "token_budget", outcome=0.0)
    scorer.score([cut], decode=lambda ids: "x" * len(ids))
    assert cut.rewards == {"overlong": -0.5}


def test_no_buffer_no_overlong_function():
    assert not from_config(Config().reward, Config().rollout)


def test_a_buffer_as_long_as_the_budget_is_refused_naming_both_keys():
    with pytest.raises((ConfigError, ValueError), match=r"reward.overlong.buffer = 160 .* rollout.max_tokens_total"):
        Config.model_validate({"reward": {"overlong": {"buffer": 160}}})


def test_mask_truncated_zeroes_the_rows_a_budget_cut_and_no_other():
    from turnrl.training.loop import mask_cut_rows
    finishes = ["answer", "truncated", "token_budget", "max_turns", "env_error"]
    assert cut_by_budget(finishes) == [False, True, True, False, False]
    mask = torch.ones(5, 4)
    mask[:, 0] = 0   # the prompt's positions stay 0
    mask_cut_rows(mask, finishes)
    assert mask[[0, 3, 4]].sum().item() == 9 and mask[[1, 2]].sum().item() == 0


@pytest.mark.slow
def test_mask_truncated_and_the_overlong_penalty_through_the_real_loop(tiny_model_dir, tmp_path):
    """Two steps on the real stack: the untrained model rambles into its 16-token turns, so most
    trajectories are cut; those leave the loss (counted) and the penalty shows in the reward."""
    from conftest import train_two_steps
    history = train_two_steps(tiny_model_dir, tmp_path, {"name": "code_tool"}, {"name": "grpo"},
                              train={"mask_truncated": True}, reward={"overlong": {"buffer": 24}},
                              rollout={"n": 2, "max_tokens_per_turn": 16, "max_tokens_total": 32})
    batch = 4 * 2   # prompts_per_step x n
    for h in history:
        cut = h.get("finish_truncated_frac", 0.0) + h.get("finish_token_budget_frac", 0.0)
        assert h["truncated_masked"] == pytest.approx(cut * batch), h
        assert h["reward_overlong_mean"] < 0.0
        if h["truncated_masked"] == batch:
            assert h["trained_tokens"] == 0
    assert any(h["truncated_masked"] > 0 for h in history)
