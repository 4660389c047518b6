"""Checkpoints and resume: the store's rules (fast), and on the real stack a training run
killed with SIGKILL and rerun ends with the same weights as one never interrupted (slow)."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest
import yaml

from turnrl.config import Config
from turnrl.training.checkpoint import CheckpointStore, run_fingerprint, step_seed, write_state

ROOT = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------- the store
def _write(store: CheckpointStore, step: int, payload: str = "weights") -> None:
    with store.writing(step) as folder:
        (folder / "policy").mkdir()
        (folder / "policy" / "shard.pt").write_text(f"{payload} {step}")
        write_state(folder, {"step": step, "fingerprint": store.fingerprint, "position": step * 4,
                             "history": [], "mlflow_run_id": "run"})


def test_only_the_newest_complete_checkpoints_are_kept(tmp_path):
    store = CheckpointStore(tmp_path, "abc", keep=2)
    for step in (2, 4, 6):
        _write(store, step)
    assert [s for s, _ in store.complete()] == [4, 6]
    resume = store.resumable(max_step=10)
    assert resume.step == 6 and resume.state["position"] == 24 and resume.mlflow_run_id == "run"


def test_a_crash_mid_write_leaves_the_previous_checkpoint(tmp_path):
    store = CheckpointStore(tmp_path, "abc", keep=2)
    _write(store, 2)
    with pytest.raises(KeyboardInterrupt):
        with store.writing(4) as folder:
            (folder / "policy").mkdir()
            raise KeyboardInterrupt   # e.g. killed while DeepSpeed writes its shards
    assert [s for s, _ in store.complete()] == [2] and not list(tmp_path.glob(".partial-*"))
    # a process killed with SIGKILL cannot clean up: its partial folder is never read ...
    (tmp_path / ".partial-step_000006").mkdir()
    (tmp_path / ".partial-step_000006" / "state.json").write_text('{"step": 6, "fingerp')
    assert store.resumable(max_step=10).step == 2
    _write(store, 4)                   # ... and the next write removes it
    assert not list(tmp_path.glob(".partial-*")) and [s for s, _ in store.complete()] == [2, 4]
    with pytest.raises(RuntimeError, match="state.json"):
        with store.writing(8):
            pass                       # a folder without state.json never becomes a checkpoint
    assert [s for s, _ in store.complete()] == [2, 4]


def test_resume_needs_the_same_fingerprint_and_a_step_within_train_steps(tmp_path):
    _write(CheckpointStore(tmp_path, "old", keep=3), 2)
    _write(CheckpointStore(tmp_path, "new", keep=3), 4)
    _write(CheckpointStore(tmp_path, "new", keep=3), 8)
    store = CheckpointStore(tmp_path, "new", keep=3)
    assert store.resumable(max_step=60).step == 8      # train.steps grew: continue
    assert store.resumable(max_step=5).step == 4       # shrank: the newest within it
    assert store.resumable(max_step=3) is None         # only another configuration's
    (tmp_path / "step_000008" / "state.json").write_text("not json")
    assert store.resumable(max_step=60).step == 4      # an unreadable one is skipped
    store.discard_all()
    assert store.complete() == []


def test_a_checkpoint_of_another_configuration_says_which_params_differ(tmp_path, caplog):
    """A rerun with train.lr changed starts afresh (removing the old checkpoints): the log names the
    param and both values, not two hashes."""
    from turnrl.training.checkpoint import shaping_params
    before, after = (Config.model_validate({"train": {"lr": lr}}) for lr in (5e-4, 3e-4))
    old = CheckpointStore(tmp_path, "old", keep=3, params=shaping_params(before))
    with old.writing(4) as folder:
        write_state(folder, {"step": 4, "fingerprint": "old", "params": old.params, "position": 16, "history": []})
    new = CheckpointStore(tmp_path, "new", keep=3, params=shaping_params(after))
    with caplog.at_level("WARNING"):
        assert new.resumable(max_step=10) is None
    assert "checkpoint step_000004 is from another configuration (train.lr 0.0005 -> 0.0003): not resuming" \
        in caplog.text
    same = CheckpointStore(tmp_path, "other-data", keep=3, params=shaping_params(before))
    assert same.difference({"params": old.params}) == "the same params; its model, data or another input differs"


def test_fingerprint_covers_what_shapes_training_and_not_how_long_or_where(tmp_path):
    base = Config()
    key = run_fingerprint(base)
    for same in ({"train": {"steps": 60}}, {"train": {"checkpoint_every": 3, "keep_checkpoints": 5}},
                 {"eval": {"limit": 10}}, {"tracking": {"experiment": "x"}},
                 {"cluster": {"num_cpus": 8, "address": "head:6379", "placement": "separate", "engine_cpus": 2}}):
        assert run_fingerprint(Config.model_validate(same)) == key, same
    for other in ({"train": {"lr": 1e-4}}, {"seed": 1}, {"rollout": {"n": 4}}, {"algorithm": {"name": "rloo"}},
                  {"data": {"train_examples": 100}}, {"model": {"dtype": "bfloat16"}},
                  {"cluster": {"trainer_ranks": 2}}, {"cluster": {"rollout_engines": 2}}):
        assert run_fingerprint(Config.model_validate(other)) != key, other
    weights = tmp_path / "model" / "w.bin"
    weights.parent.mkdir()
    weights.write_bytes(b"\x00" * 10)
    with_inputs = run_fingerprint(base, [weights.parent])
    assert with_inputs != key and run_fingerprint(base, [weights.parent]) == with_inputs
    weights.write_bytes(b"\x00" * 9 + b"\x01")
    assert run_fingerprint(base, [weights.parent]) != with_inputs


def test_step_seed_is_a_function_of_seed_step_and_engine_only():
    seeds = {step_seed(s, t, e) for s in range(3) for t in range(1, 50) for e in range(2)}
    assert len(seeds) == 3 * 49 * 2 and step_seed(0, 7, 1) == step_seed(0, 7, 1)


# --------------------------------------------------------------------------- on the real stack
PARAMS = {
    "data": {"train_examples": 32, "heldout_examples": 8}, "eval": {"benchmarks": []},
    # An untrained model earns no reward, so GRPO's advantages are 0; the entropy bonus makes
    # every step move the weights through the tokens it sampled.
    "algorithm": {"entropy_coef": 0.01},
    "train": {"steps": 5, "prompts_per_step": 2, "checkpoint_every": 2},
    "rollout": {"n": 2, "max_tokens_per_turn": 16, "max_tokens_total": 48},
}
TIMING = ("rollout_s", "advantage_s", "train_s", "sync_s", "step_s", "gen_tokens_per_s", "engine_idle_frac",
          "trainer_idle_frac", "wall_s", "engine/0/busy_s", "engine/0/idle_s")


def _project(root: Path, model_dir: Path) -> Path:
    """What the train stage reads: params.yaml, data/processed, models/sft."""
    from turnrl.pipeline.preprocess import preprocess
    root.mkdir()
    (root / "params.yaml").write_text(yaml.safe_dump(PARAMS))
    preprocess(Config.model_validate(PARAMS), root / "data" / "processed")
    shutil.copytree(model_dir, root / "models" / "sft")
    return root


def _run_train_stage(root: Path, kill_when: str | None = None, timeout: float = 600) -> tuple[int, str]:
    """`python stages/train.py` in `root` (what `dvc repro` runs); with `kill_when`, SIGKILL
    its whole process group (the driver and the Ray processes it started) when a log line
    contains it. Returns (exit code, log)."""
    ray_tmp = tempfile.mkdtemp(prefix="ray", dir="/tmp")   # short: Ray's socket paths have a length limit
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "RAY_TMPDIR": ray_tmp, "RAY_USAGE_STATS_ENABLED": "0",
           "MLFLOW_DISABLE_TELEMETRY": "true"}
    env.pop("TURNRL_PIPELINE_KEY", None)
    proc = subprocess.Popen([sys.executable, str(ROOT / "stages" / "train.py")], cwd=root, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    kill = lambda: os.killpg(proc.pid, signal.SIGKILL)  # noqa: E731
    timer = threading.Timer(timeout, kill)
    timer.start()
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if kill_when and kill_when in line:
                kill()
                break
        code = proc.wait(timeout=60)
    finally:
        timer.cancel()
        shutil.rmtree(ray_tmp, ignore_errors=True)
    return code, "".join(lines)


def _weights(folder: Path) -> dict:
    from safetensors.torch import load_file
    return load_file(folder / "model.safetensors")


@pytest.mark.slow
def test_a_run_killed_with_sigkill_resumes_to_the_same_weights(tiny_model_dir, tmp_path):
    import mlflow
    import pandas as pd
    import torch

    straight = _project(tmp_path / "straight", tiny_model_dir)
    code, out = _run_train_stage(straight)
    assert code == 0, out[-3000:]
    assert json.loads((straight / "metrics/train.json").read_text())["resumed_from_step"] == 0

    crashed = _project(tmp_path / "crashed", tiny_model_dir)
    code, out = _run_train_stage(crashed, kill_when="checkpoint saved at step 2")
    assert code == -signal.SIGKILL, out[-3000:]
    assert not (crashed / "models/final").exists()
    killed_run = json.loads((crashed / "checkpoints/step_000002/state.json").read_text())["mlflow_run_id"]

    code, out = _run_train_stage(crashed)
    assert code == 0, out[-3000:]
    resumed_at = json.loads((crashed / "metrics/train.json").read_text())["resumed_from_step"]
    assert resumed_at in (2, 4) and f"resuming from step {resumed_at}" in out   # 4 if the kill came late
    assert json.loads((crashed / "metrics/train.json").read_text())["steps"] == 5

    # the same weights, bit for bit, and they did move during training
    final, reference, initial = (_weights(straight / "models/final"), _weights(crashed / "models/final"),
                                 _weights(tiny_model_dir))
    assert final.keys() == reference.keys()
    assert all(torch.equal(final[k], reference[k]) for k in final)
    assert any(not torch.equal(final[k], initial[k]) for k in initial)
    # and the same rollouts and losses at every step (timings aside)
    a, b = pd.read_csv(straight / "plots/train.csv"), pd.read_csv(crashed / "plots/train.csv")
    assert list(b["step"]) == [1, 2, 3, 4, 5]
    pd.testing.assert_frame_equal(a.drop(columns=list(TIMING)), b.drop(columns=list(TIMING)))

    # one MLflow train run, continued: all five steps, finished
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{crashed / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("turnrl").experiment_id],
                              filter_string="tags.`turnrl.pipeline.stage` = 'train'")
    assert [r.info.run_id for r in runs] == [killed_run]
    assert runs[0].info.status == "FINISHED" and runs[0].data.tags["turnrl.resumed_from_step"] == str(resumed_at)
    # (a step the killed run logged after its last checkpoint is logged again, with the same value)
    assert {m.step for m in client.get_metric_history(killed_run, "rollout/reward_mean")} == {1, 2, 3, 4, 5}


@pytest.mark.slow
def test_an_unhealthy_run_stops_with_its_checkpoint_and_resumes_with_warn(tiny_model_dir, tmp_path):
    """An untrained model earns no reward: every group is all-zero, so `no_signal` fails at
    step 3 (no_signal_steps 3). With on_unhealthy: stop the stage exits 1 naming the check,
    keeps a checkpoint of that step and the curves so far; rerun with warn, it resumes there."""
    import mlflow
    import pandas as pd

    root = _project(tmp_path / "unhealthy", tiny_model_dir)
    params = {**PARAMS, "train": {**PARAMS["train"], "on_unhealthy": "stop", "health": {"no_signal_steps": 3}},
              "rollout": {**PARAMS["rollout"], "engine": "hf"}}   # spares a vLLM start (~50 s in CI) per run
    (root / "params.yaml").write_text(yaml.safe_dump(params))
    code, out = _run_train_stage(root)
    assert code == 1, out[-3000:]
    assert "training stopped at step 3 (train.on_unhealthy: stop): no_signal: every group's rewards were " \
           "identical for the last 3 steps" in out
    assert "Traceback" not in out
    assert json.loads((root / "checkpoints/step_000003/state.json").read_text())["step"] == 3
    curve = pd.read_csv(root / "plots/train.csv")
    assert list(curve["step"]) == [1, 2, 3] and list(curve["health_no_signal"]) == [0, 0, 1]
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")
    run, = client.search_runs([client.get_experiment_by_name("turnrl").experiment_id],
                              filter_string="tags.`turnrl.pipeline.stage` = 'train'")
    assert run.info.status == "FAILED" and "no_signal" in run.data.tags["turnrl.health"]

    params["train"]["on_unhealthy"] = "warn"
    (root / "params.yaml").write_text(yaml.safe_dump(params))
    code, out = _run_train_stage(root)
    assert code == 0, out[-3000:]
    assert "resuming from step 3" in out and "unhealthy training (no_signal)" not in out   # still failing: not new
    summary = json.loads((root / "metrics/train.json").read_text())
    assert summary["steps"] == 5 and summary["health"]["flags"]["no_signal"] == {
        "first_step": 3, "last_step": 5, "steps": 3}


def test_a_checkpoint_that_cannot_be_loaded_names_the_folder_to_delete(monkeypatch, tmp_path):
    """A checkpoint whose files were cut short loads with an error on every rerun: the message names
    the folder, what to delete and what the rerun then does; the stage exits 2 (a retry fails alike)."""
    import turnrl.training.loop as loop
    from turnrl.pipeline.stage import failure_exit
    from turnrl.training.checkpoint import DamagedCheckpoint, Resume
    from turnrl.training.cluster import ActorFailure

    def damaged(workers, folder):
        raise ActorFailure("policy rank 0 failed: RuntimeError: PytorchStreamReader failed reading zip archive")
    monkeypatch.setattr(loop, "load_checkpoint", damaged)
    resume = Resume(tmp_path / "step_000010", {"step": 10, "position": 40, "history": []})
    with pytest.raises(DamagedCheckpoint) as err:
        loop._begin(None, None, None, None, resume)
    assert f"the checkpoint {tmp_path / 'step_000010'} could not be loaded" in str(err.value)
    assert "delete that folder and rerun: the run resumes from the checkpoint before it" in str(err.value)
    assert failure_exit("train", err.value) == 2


def test_a_checkpoint_folder_that_cannot_be_made_is_a_params_problem(tmp_path):
    from turnrl.config.checks import checkpoint_problems, stage_problems
    (tmp_path / "afile").write_text("x")
    bad = Config.model_validate({"train": {"checkpoint_dir": str(tmp_path / "afile" / "ckpt")}})
    assert checkpoint_problems(bad) == [f"train.checkpoint_dir = '{tmp_path / 'afile' / 'ckpt'}': {tmp_path / 'afile'} "
                                        "is a file, so no folder can be made there; name another folder"]
    assert checkpoint_problems(bad)[0] in stage_problems(bad, "train")
    assert checkpoint_problems(Config.model_validate({"train": {"checkpoint_dir": str(tmp_path / "new" / "c")}})) == []
