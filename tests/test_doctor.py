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


def test_judges_and_a_teacher_at_their_servers_are_checked(tmp_path, monkeypatch):
    """A key not set, a server not answering, a model it does not serve, a teacher of another
    tokenizer: each its line; a teacher of the policy's tokenizer passes."""
    from judge_server import TeacherServer
    from turnrl.models.miniatures import FAMILIES, build_tokenizer
    policy = tmp_path / "policy"
    build_tokenizer(FAMILIES["qwen2"], 512).save_pretrained(policy)
    (policy / "config.json").write_text("{}")
    assert doctor.check_endpoints(Config()) == []   # nothing configured
    monkeypatch.delenv("TURNRL_TEST_JUDGE_KEY", raising=False)
    judges = [{"name": "keyed", "base_url": "http://127.0.0.1:1/v1", "template": "{response}",
               "api_key_env": "TURNRL_TEST_JUDGE_KEY"},
              {"name": "down", "base_url": f"http://127.0.0.1:{_closed_port()}/v1", "template": "{response}"}]
    keyed, down = doctor.check_endpoints(Config.model_validate({"reward": {"judges": judges}}))
    assert keyed.status == "FAIL" and "TURNRL_TEST_JUDGE_KEY" in keyed.detail and "export" in keyed.fix
    assert down.status == "FAIL" and "start the server" in down.fix
    for served, status, said in ((build_tokenizer(FAMILIES["qwen2"], 300), "FAIL", "tokenizes differently"),
                                 (build_tokenizer(FAMILIES["qwen2"], 512), "OK", "answers, serving ['teacher']")):
        server = TeacherServer(tokenizer=served)
        try:
            params = {"model": {"path": str(policy)}, "reward": {"teacher": {"base_url": server.url}}}
            [check] = doctor.check_endpoints(Config.model_validate(params))
            params["reward"]["teacher"]["model"] = "other"
            [unknown] = doctor.check_endpoints(Config.model_validate(params))
        finally:
            server.close()
        assert check.name == "teacher" and check.status == status and said in check.detail, check
        assert unknown.status == "WARN" and "'other' is not among them" in unknown.detail
    build_tokenizer(FAMILIES["qwen2"], 300).save_pretrained(tmp_path / "other")
    [served] = doctor.check_endpoints(Config.model_validate(
        {"model": {"path": str(policy)}, "reward": {"teacher": {"serve": str(tmp_path / "other")}}}))
    assert served.status == "FAIL" and "reward.teacher.tokenizer=" in served.detail


def test_bad_params_fail_first(tmp_path, capsys):
    (tmp_path / "params.yaml").write_text("train: {steps: -1}\n")
    assert doctor.main([str(tmp_path / "params.yaml")]) == 2
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
