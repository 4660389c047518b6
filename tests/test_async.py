"""Asynchronous training (`train.mode: async`) on the real stack (Ray actors, DeepSpeed, vLLM):
the engines roll out continuously, every batch's staleness stays within train.max_staleness,
the off-policy correction's stats are measured every step, held-out accuracy is scored beside
the stream, and a run resumes from its checkpoint (queued groups are rolled out again).
Bad settings fail before any work."""
import pytest

from turnrl.config import ConfigError, parse_config

ASYNC = {"mode": "async", "max_staleness": 1, "steps": 3, "prompts_per_step": 4}


@pytest.mark.slow
def test_async_training_keeps_staleness_bounded_and_measures_the_correction(tiny_model_dir, tmp_path):
    import ray

    from turnrl.config import Config
    from turnrl.pipeline.preprocess import load_split, preprocess
    from turnrl.training.checkpoint import CheckpointStore
    from turnrl.training.loop import train

    cfg = Config.model_validate({
        "env": {"name": "code_tool"}, "algorithm": {"name": "grpo", "policy_loss": "decoupled"},
        "data": {"train_examples": 32, "heldout_examples": 8}, "eval": {"benchmarks": []},
        "train": {**ASYNC, "eval_every": 3, "eval_examples": 4, "checkpoint_every": 2},
        "rollout": {"n": 2, "max_tokens_per_turn": 16}})
    preprocess(cfg, tmp_path / "data")
    rows, heldout = load_split(tmp_path / "data", "train"), load_split(tmp_path / "data", "heldout")
    store = CheckpointStore(tmp_path / "checkpoints", "async-test", keep=3)
    try:
        history = train(cfg, str(tiny_model_dir), str(tmp_path / "data"), rows, str(tmp_path / "final"),
                        checkpoints=store, heldout_rows=heldout)
        assert [h["step"] for h in history] == [1, 2, 3]
        for h in history:
            assert 0 <= h["staleness_max"] <= 1 and h["staleness_0_frac"] + h["staleness_1_frac"] == pytest.approx(1)
            assert h["policy_version"] == h["step"] - 1 and h["updates_pushed"] == h["step"]
            assert 0 < h["is_ess"] <= 1 and h["is_weight_max"] >= h["is_weight_mean"] > 0
            assert h["trained_tokens"] > 0 and h["engine_idle_frac"] <= 1
        assert history[0]["staleness_max"] == 0            # the first batch: nothing pushed yet
        assert 0 <= history[-1]["heldout_accuracy"] <= 1   # scored beside the stream
        assert (tmp_path / "final" / "config.json").exists()

        # Resume: a 4-step run picks up the checkpoint of step 3 and trains step 4 only.
        longer = cfg.model_copy(update={"train": cfg.train.model_copy(update={"steps": 4})})
        resume = store.resumable(4)
        assert resume is not None and resume.step == 3
        again = train(longer, str(tiny_model_dir), str(tmp_path / "data"), rows, str(tmp_path / "final2"),
                      checkpoints=store, resume=resume, heldout_rows=heldout)
        assert [h["step"] for h in again] == [1, 2, 3, 4]
        assert again[:3] == history   # the steps before the checkpoint, as they were
        assert again[3]["policy_version"] == 3 and again[3]["staleness_max"] <= 1
    finally:
        ray.shutdown()


@pytest.mark.parametrize("train, algorithm, words", [
    ({"mode": "async"}, {"policy_loss": "clipped"}, "choose an off-policy correction"),
    ({"mode": "async", "max_staleness": -1}, {"policy_loss": "tis"}, "train.max_staleness"),
    ({"mode": "async", "groups_in_flight": 2, "prompts_per_step": 4}, {"policy_loss": "tis"}, "cannot hold one batch"),
    ({"mode": "async", "overlap_rollout": True}, {"policy_loss": "tis"}, "overlap_rollout"),
])
def test_bad_async_settings_fail_in_one_line_naming_the_key(train, algorithm, words):
    with pytest.raises(ConfigError) as err:
        parse_config({"train": train, "algorithm": algorithm})
    assert words in str(err.value) and "\n" not in str(err.value).strip()
