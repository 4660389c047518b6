"""`turnrl doctor`: each check says OK or what to fix (fast ones here), and the whole command
passes on this machine's stack with a local Ray (slow)."""
import socket

import pytest

from turnrl.models import doctor
from turnrl.config import Config


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]      # closed again when the block ends: nothing listens there


def test_an_unreachable_cluster_fails_with_how_to_start_one():
    result = doctor.check_ray(Config.model_validate({"cluster": {"address": f"127.0.0.1:{_closed_port()}"}}))
    assert result.status == "FAIL" and "nothing answers" in result.detail
    assert "ray start --head --port" in result.fix


def test_gpus_asked_for_but_not_seen_fail_on_a_local_run():
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the check passes here")
    assert doctor.check_gpus(Config()).status == "OK"
    result = doctor.check_gpus(Config.model_validate({"cluster": {"trainer_gpus": 1}}))
    assert result.status == "FAIL" and "cluster.*_gpus: 0" in result.fix


def test_mlflow_store_and_checkpoint_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("DVC_ROOT", raising=False)
    cfg = Config.model_validate({"train": {"checkpoint_dir": str(tmp_path / "ck")}})
    assert doctor.check_mlflow(cfg).status == "OK" and (tmp_path / "mlflow.db").exists()
    assert doctor.check_checkpoints(cfg).status in ("OK", "WARN")
    bad = Config.model_validate({"tracking": {"uri": "http://127.0.0.1:9"}})
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    result = doctor.check_mlflow(bad)
    assert result.status == "FAIL" and "tracking.uri" in result.fix


def test_bad_params_fail_first(tmp_path, capsys):
    (tmp_path / "params.yaml").write_text("train: {steps: -1}\n")
    assert doctor.main([str(tmp_path / "params.yaml")]) == 1
    assert "train.steps = -1" in capsys.readouterr().out


@pytest.mark.slow
def test_doctor_passes_on_this_stack(tmp_path, monkeypatch, capsys):
    """Every check on the real stack: vLLM's kernel, a DeepSpeed step, a local Ray, MLflow."""
    from pathlib import Path
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("DVC_ROOT", raising=False)
    params = Path(__file__).resolve().parents[1] / "params.yaml"
    code = doctor.main([str(params), "-S", f"train.checkpoint_dir={tmp_path / 'ck'}"])
    out = capsys.readouterr().out
    assert code == 0, out
    for name in ("versions", "gpus", "vllm", "deepspeed", "ray", "mlflow", "checkpoints"):
        assert any(line.split()[1:2] == [name] and line.split()[0] in ("OK", "WARN") for line in out.splitlines()), out
    assert "rms_norm kernel ran" in out and "one ZeRO-2 step ran" in out and "a local Ray" in out
