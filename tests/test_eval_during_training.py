"""`train.eval_every`: held-out accuracy during training, against step and wall time, without
touching what training samples or computes."""
import pytest

from conftest import train_two_steps

# long (~100 s in CI: two trainings): CI checks held-out scoring during training in test_async
pytestmark = [pytest.mark.slow, pytest.mark.long]

TRAINING = ("reward_mean", "accuracy", "response_tokens_mean", "loss", "kl_ref", "logp_gap_max", "grad_norm")


def test_heldout_accuracy_is_scored_every_n_steps_and_changes_no_training_number(tiny_model_dir, tmp_path):
    # the transformers engine spares two vLLM starts (~50 s each in CI); the held-out rollouts go
    # through the same engine interface either way
    rollout = {"n": 2, "max_tokens_per_turn": 16, "engine": "hf"}
    plain = train_two_steps(tiny_model_dir, tmp_path / "plain", {"name": "code_tool"}, {"name": "grpo"},
                            rollout=rollout)
    scored = train_two_steps(tiny_model_dir, tmp_path / "scored", {"name": "code_tool"}, {"name": "grpo"},
                             train={"eval_every": 1, "eval_examples": 4}, rollout=rollout)
    for step in (0, 1):   # the held-out rollouts draw from their own seeded streams
        assert {k: scored[step][k] for k in TRAINING} == {k: plain[step][k] for k in TRAINING}
        assert "heldout_accuracy" not in plain[step]
        assert 0.0 <= scored[step]["heldout_accuracy"] <= 1.0
        assert scored[step]["heldout_accuracy"] * 4 == round(scored[step]["heldout_accuracy"] * 4)   # of 4 problems
        assert scored[step]["eval_s"] > 0
    assert 0 < scored[0]["wall_s"] < scored[1]["wall_s"]
