"""MLflow tracking: parent run per pipeline key, child run per stage, safe metric names."""
import mlflow
import pytest

from turnrl import tracking
from turnrl.config import Config


@pytest.fixture
def cfg(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("DVC_ROOT", raising=False)
    return Config.model_validate({"tracking": {"experiment": "unit"}})


def test_stages_with_one_key_share_a_parent(cfg, tmp_path, monkeypatch):
    monkeypatch.setenv("TURNRL_PIPELINE_KEY", "unit:1")
    for stage in ["preprocess", "train"]:
        with tracking.stage_run(stage, cfg):
            tracking.log_metrics({"task.pass@1": 0.5, "nan": float("nan"), "text": "x"}, step=1)
    monkeypatch.setenv("TURNRL_PIPELINE_KEY", "unit:2")
    with tracking.stage_run("eval", cfg):
        pass
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("unit").experiment_id])
    parents = {r.info.run_id: r for r in runs if "mlflow.parentRunId" not in r.data.tags}
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    assert len(parents) == 2 and len(children) == 3
    by_stage = {r.data.tags["turnrl.stage"]: r for r in children}
    assert by_stage["preprocess"].data.tags["mlflow.parentRunId"] == by_stage["train"].data.tags["mlflow.parentRunId"]
    assert by_stage["eval"].data.tags["mlflow.parentRunId"] != by_stage["train"].data.tags["mlflow.parentRunId"]
    train = by_stage["train"].data
    assert train.metrics == {"task.pass_1": 0.5}          # '@' is not allowed by MLflow; NaN and text skipped
    assert train.params["train.steps"] == str(cfg.train.steps)
    assert (tmp_path / "mlartifacts").is_dir()


def test_a_failing_stage_marks_its_runs_failed(cfg, monkeypatch, tmp_path):
    monkeypatch.setenv("TURNRL_PIPELINE_KEY", "unit:3")
    with pytest.raises(RuntimeError):
        with tracking.stage_run("train", cfg):
            raise RuntimeError("boom")
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("unit").experiment_id])
    assert {r.info.status for r in runs} == {"FAILED"}


def test_an_unreachable_server_says_what_to_check(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    cfg = Config.model_validate({"tracking": {"uri": "http://127.0.0.1:9"}})
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    with pytest.raises(RuntimeError, match="tracking.uri"):
        with tracking.stage_run("train", cfg):
            pass


def test_a_resumed_stage_continues_its_run_under_a_new_pipeline(cfg, monkeypatch, tmp_path):
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.setenv("TURNRL_PIPELINE_KEY", "unit:crashed")
    with tracking.stage_run("train", cfg) as run:
        tracking.log_metrics({"reward_mean": 0.1}, step=1)
        first = run.info.run_id
    crashed_parent = client.get_run(first).data.tags["mlflow.parentRunId"]
    client.update_run(first, "RUNNING")            # as a kill -9 leaves them
    client.update_run(crashed_parent, "RUNNING")

    monkeypatch.setenv("TURNRL_PIPELINE_KEY", "unit:rerun")
    longer = Config.model_validate({"tracking": {"experiment": "unit"}, "train": {"steps": 60}})
    with tracking.stage_run("train", longer, resume_run_id=first) as run:
        assert run.info.run_id == first
        tracking.log_metrics({"reward_mean": 0.2}, step=2)
    resumed = client.get_run(first)
    assert resumed.info.status == "FINISHED" and resumed.data.params["train.steps"] == str(cfg.train.steps)
    assert resumed.data.tags["turnrl.params_changed_on_resume"] == '{"train.steps": "60"}'
    assert [m.step for m in client.get_metric_history(first, "reward_mean")] == [1, 2]
    assert client.get_run(crashed_parent).info.status == "KILLED"
    new_parent = client.search_runs([resumed.info.experiment_id], "tags.`turnrl.pipeline_key` = 'unit:rerun'")[0]
    assert new_parent.data.tags["turnrl.stage.train"] == f"resumed run {first}"

    # a run id this store does not have: a new run that names it
    with tracking.stage_run("train", cfg, resume_run_id="0" * 32) as run:
        assert run.info.run_id != first
    assert client.get_run(run.info.run_id).data.tags["turnrl.resumed_from_run"] == "0" * 32
