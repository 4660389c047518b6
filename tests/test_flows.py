"""The Prefect layer (flows/pipeline.py, prefect.yaml).

Fast tests: the params.yaml override writer, the retry rule, and the flow on a toy DVC project
(real `dvc repro`, a temporary Prefect server from prefect_test_harness). The slow test deploys
the real pipeline to a local Prefect server with a process work pool and runs it with overrides.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from conftest import copy_project  # noqa: E402
from flows import pipeline as pl  # noqa: E402
from turnrl.config import ConfigError  # noqa: E402

STAGES = ["preprocess", "prepare_model", "sft", "baseline_eval", "train", "eval", "report"]


@pytest.fixture(scope="session")
def prefect_harness():
    from prefect.testing.utilities import prefect_test_harness

    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    with prefect_test_harness(server_startup_timeout=120):
        yield


# --------------------------------------------------------------------------- overrides
def test_parse_set_reads_yaml_values():
    got = pl.parse_set(["train.steps=3", "algorithm.dual_clip=null", "eval.greedy=false",
                        "train.lr=1e-4", "model.path=some/dir", "model.template_type=", "x.y=a=b"])
    assert got == {"train.steps": 3, "algorithm.dual_clip": None, "eval.greedy": False,
                   "train.lr": 1e-4, "model.path": "some/dir", "model.template_type": "",
                   "x.y": "a=b"}
    assert isinstance(got["train.lr"], float)
    with pytest.raises(ConfigError, match="key.path=value"):
        pl.parse_set(["train.steps"])


def test_overrides_write_dotted_keys_and_keep_the_rest(tmp_path):
    params = tmp_path / "params.yaml"
    shutil.copy(ROOT / "params.yaml", params)
    before_text = params.read_text()
    before = yaml.safe_load(before_text)

    applied = pl.apply_overrides(params, {"train.steps": 3, "model": {"warmstart": {"skill_steps": 1}},
                                          "algorithm.dual_clip": 3.0, "eval.greedy": False})
    assert applied == {"train.steps": 3, "model.warmstart.skill_steps": 1, "algorithm.dual_clip": 3.0,
                       "eval.greedy": False}
    after = yaml.safe_load(params.read_text())
    expected = json.loads(json.dumps(before))
    expected["train"]["steps"] = 3
    expected["model"]["warmstart"]["skill_steps"] = 1      # a nested mapping merges key by key
    expected["algorithm"]["dual_clip"] = 3.0
    expected["eval"]["greedy"] = False
    assert after == expected                           # every other value and type unchanged
    assert isinstance(after["model"]["warmstart"]["lr"], float)
    assert after["tracking"]["uri"] == ""
    # comments survive, as with `dvc exp run -S`
    comments = [line.split("#", 1)[1] for line in before_text.splitlines() if "#" in line]
    text = params.read_text()
    assert all(c in text for c in comments)


def test_overrides_without_changes_leave_the_file_byte_identical(tmp_path):
    params = tmp_path / "params.yaml"
    shutil.copy(ROOT / "params.yaml", params)
    assert pl.apply_overrides(params, None) == {}
    assert pl.apply_overrides(params, {}) == {}
    assert params.read_text() == (ROOT / "params.yaml").read_text()


def test_overrides_create_missing_sections(tmp_path):
    params = tmp_path / "params.yaml"
    params.write_text("seed: 1  # the seed\n")
    pl.apply_overrides(params, {"train.steps": 5, "model.warmstart.skill_steps": 2})
    data = yaml.safe_load(params.read_text())
    assert data == {"seed": 1, "train": {"steps": 5}, "model": {"warmstart": {"skill_steps": 2}}}
    assert "# the seed" in params.read_text()


@pytest.mark.parametrize("overrides, message", [
    ({"train.steps": -3}, r"train\.steps = -3: must be greater than 0"),
    ({"train.stepz": 3}, r"train\.stepz: unknown key \(did you mean 'steps'\?\)"),
    ({"rollout.engine": "tgi"}, r"rollout\.engine = 'tgi': must be one of"),
    ({"seed.x": 1}, r"override seed\.x: 'seed' is a value, not a section"),
])
def test_bad_overrides_name_the_key_and_leave_params_untouched(tmp_path, overrides, message):
    params = tmp_path / "params.yaml"
    shutil.copy(ROOT / "params.yaml", params)
    with pytest.raises(ConfigError, match=message):
        pl.apply_overrides(params, overrides)
    assert params.read_text() == (ROOT / "params.yaml").read_text()


# --------------------------------------------------------------------------- retry rule
@pytest.mark.parametrize("exc, retry", [
    (pl.StageFailed("train", 2), False),      # bad input: params, data, model path
    (pl.StageFailed("train", 251), False),    # DVC configuration error
    (pl.StageFailed("train", 1), True),       # the stage crashed
    (pl.StageFailed("train", 255), True),     # DVC failed otherwise (a lock held, ...)
    (pl.StageFailed("train", -9), True),      # killed
    (OSError("no such file"), True),
])
def test_retry_condition(exc, retry):
    from prefect.states import Failed

    state = Failed(data=exc, message=repr(exc))
    assert pl.retry_unless_bad_input(pl.dvc_stage, None, state) is retry


def test_stage_exit_code_is_read_from_dvc_output():
    out = "ERROR: failed to reproduce 'train': failed to run: python stages/train.py, exited with 2"
    assert pl._stage_exit_code(255, out) == 2
    assert pl._stage_exit_code(255, "ERROR: Unable to acquire lock") == 255
    assert pl._stage_exit_code(253, "ERROR: you are not inside of a DVC repository") == 253


def test_stage_failed_survives_pickling():
    import pickle

    exc = pickle.loads(pickle.dumps(pl.StageFailed("eval", 2, "the tail")))
    assert (exc.stage, exc.exit_code, exc.detail) == ("eval", 2, "the tail")
    assert "exit code 2" in str(exc) and "not retried" in str(exc)


def test_dvc_and_prefect_config_agree():
    deployment = yaml.safe_load((ROOT / "prefect.yaml").read_text())["deployments"][0]
    assert deployment["name"] == "turnrl-pipeline"
    assert deployment["entrypoint"] == "flows/pipeline.py:pipeline"
    assert deployment["work_pool"]["name"] == "turnrl-local"
    assert pl.pipeline.name == "turnrl-pipeline"
    assert pl.dvc_stages(ROOT) == STAGES


# --------------------------------------------------------------------------- a toy DVC project
STEP_SCRIPT = """\
import json, os, sys
from pathlib import Path

name, mode = sys.argv[1], sys.argv[2]
runs = Path("runs.txt")
runs.write_text((runs.read_text() if runs.exists() else "") + name + "\\n")
count = runs.read_text().split().count(name)
print(f"step {name}: attempt {count}", flush=True)
Path(f"{name}.json").write_text(json.dumps({
    "python": sys.executable, "key": os.environ.get("TURNRL_PIPELINE_KEY"),
    "pythonpath": os.environ.get("PYTHONPATH", "")}))
if mode == "bad":
    print("invalid params", file=sys.stderr)
    sys.exit(2)
if mode in ("baseline", "eval"):   # what the evaluation stages leave for the flow's result artifact
    Path("metrics").mkdir(exist_ok=True)
    accuracy = 0.25 if mode == "baseline" else 0.75
    Path(f"metrics/{mode}.json").write_text(json.dumps({
        "task": {"accuracy": accuracy, "n": 32, "protocol": "multi", "mean_response_tokens": 20.0},
        "math500": {"available": False, "reason": "offline", "accuracy": None, "n": 0}}))
if mode == "broken" or (mode == "flaky" and count == 1):
    sys.exit(1)
"""


def make_toy_project(root: Path, modes: dict[str, str]) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "params.yaml").write_text("seed: 0\ntrain:\n  steps: 40  # steps\n")
    (root / "step.py").write_text(STEP_SCRIPT)
    (root / "src").mkdir()
    stages = {name: {"cmd": f"python step.py {name} {mode}", "deps": ["step.py"],
                     "params": ["train.steps"], "outs": [{f"{name}.json": {"cache": False}}]}
              for name, mode in modes.items()}
    (root / "dvc.yaml").write_text(yaml.safe_dump({"stages": stages}, sort_keys=False))
    env = {**os.environ, "DVC_NO_ANALYTICS": "1"}
    subprocess.run([sys.executable, "-m", "dvc", "init", "--no-scm", "-q"], cwd=root, env=env, check=True)
    return root


def runs(project: Path) -> list[str]:
    path = project / "runs.txt"
    return path.read_text().split() if path.exists() else []


@pytest.fixture
def fast_retries(monkeypatch):
    monkeypatch.setattr(pl, "dvc_stage", pl.dvc_stage.with_options(retry_delay_seconds=0))


def test_stage_task_runs_dvc_with_the_flow_environment(tmp_path):
    from prefect.logging import disable_run_logger

    project = make_toy_project(tmp_path / "toy", {"a": "ok"})
    with disable_run_logger():
        result = pl.dvc_stage.fn("a", str(project), "prefect:test-key")
    assert result["stage"] == "a" and result["status"] == "ran"
    seen = json.loads((project / "a.json").read_text())
    assert Path(seen["python"]).parent == Path(sys.executable).parent   # this venv's python
    assert seen["key"] == "prefect:test-key"
    assert seen["pythonpath"].split(os.pathsep)[0] == str(project / "src")
    assert (project / "dvc.lock").exists()
    with disable_run_logger():       # nothing changed: DVC skips it
        assert pl.dvc_stage.fn("a", str(project), "prefect:test-key")["status"] == "unchanged"
    assert runs(project) == ["a"]


def test_stage_task_reports_the_stage_exit_code(tmp_path):
    from prefect.logging import disable_run_logger

    project = make_toy_project(tmp_path / "toy", {"a": "bad"})
    with disable_run_logger(), pytest.raises(pl.StageFailed) as info:
        pl.dvc_stage.fn("a", str(project), "prefect:test-key")
    assert info.value.exit_code == 2 and info.value.stage == "a"
    assert "invalid params" in info.value.detail


def test_flow_runs_stages_in_dvc_order_and_writes_overrides(prefect_harness, tmp_path):
    project = make_toy_project(tmp_path / "toy", {"a": "ok", "b": "ok", "c": "ok"})
    state = pl.pipeline(overrides={"train.steps": 3}, stages=["c", "a"], project_dir=str(project),
                        return_state=True)
    assert state.is_completed(), state.message
    assert [r["stage"] for r in state.result()] == [pl.CHECK, "a", "c"]   # the params check first
    assert runs(project) == ["a", "c"]
    assert yaml.safe_load((project / "params.yaml").read_text())["train"]["steps"] == 3
    assert "# steps" in (project / "params.yaml").read_text()
    lock = yaml.safe_load((project / "dvc.lock").read_text())
    assert lock["stages"]["a"]["params"]["params.yaml"]["train.steps"] == 3
    keys = {json.loads((project / f"{s}.json").read_text())["key"] for s in ("a", "c")}
    assert len(keys) == 1 and re.fullmatch(r"prefect:[0-9a-f-]{36}", keys.pop())


def test_flow_fails_on_a_bad_override_before_any_stage(prefect_harness, tmp_path):
    project = make_toy_project(tmp_path / "toy", {"a": "ok"})
    before = (project / "params.yaml").read_text()
    state = pl.pipeline(overrides={"train.steps": -3}, project_dir=str(project), return_state=True)
    assert state.is_failed()
    with pytest.raises(ConfigError, match=r"train\.steps = -3"):
        state.result()
    assert runs(project) == []
    assert (project / "params.yaml").read_text() == before


def test_flow_checks_the_files_params_name_before_any_stage(prefect_harness, fast_retries, tmp_path):
    """A data file that is not there: the flow's first task (turnrl config) fails in seconds,
    exit 2, not retried, and no stage runs."""
    project = make_toy_project(tmp_path / "toy", {"a": "ok"})
    state = pl.pipeline(overrides={"data.train_set": "missing.jsonl"}, project_dir=str(project), return_state=True)
    assert state.is_failed()
    with pytest.raises(pl.StageFailed) as info:
        state.result()
    assert info.value.stage == pl.CHECK and info.value.exit_code == 2
    assert "data.train_set = 'missing.jsonl': no such file" in info.value.detail
    assert runs(project) == []
    text = _artifacts(state)[pl.RESULTS_KEY].data
    assert f"**Failed at stage `{pl.CHECK}`**: exit code 2 (bad input" in text


def test_flow_rejects_unknown_stages(prefect_harness, tmp_path):
    project = make_toy_project(tmp_path / "toy", {"a": "ok"})
    state = pl.pipeline(stages=["trian"], project_dir=str(project), return_state=True)
    assert state.is_failed()
    with pytest.raises(ValueError, match="unknown stage"):
        state.result()
    assert runs(project) == []


def test_flow_retries_a_transient_failure(prefect_harness, fast_retries, tmp_path):
    project = make_toy_project(tmp_path / "toy", {"a": "flaky", "b": "ok"})
    state = pl.pipeline(project_dir=str(project), return_state=True)
    assert state.is_completed(), state.message
    assert runs(project) == ["a", "a", "b"]


def test_flow_gives_up_after_retries(prefect_harness, fast_retries, tmp_path):
    project = make_toy_project(tmp_path / "toy", {"a": "broken", "b": "ok"})
    state = pl.pipeline(project_dir=str(project), return_state=True)
    assert state.is_failed()
    assert runs(project) == ["a"] * (1 + pl.STAGE_RETRIES)     # and b never ran


def test_flow_does_not_retry_bad_input(prefect_harness, fast_retries, tmp_path):
    project = make_toy_project(tmp_path / "toy", {"a": "bad", "b": "ok"})
    state = pl.pipeline(project_dir=str(project), return_state=True)
    assert state.is_failed()
    with pytest.raises(pl.StageFailed) as info:
        state.result()
    assert info.value.exit_code == 2
    assert runs(project) == ["a"]


def _artifacts(state) -> dict:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    with get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=[state.state_details.flow_run_id])))
    return {a.key: a for a in found}


def test_a_flow_run_leaves_the_result_table_as_an_artifact(prefect_harness, tmp_path):
    project = make_toy_project(tmp_path / "toy", {"preprocess": "ok", "baseline_eval": "baseline", "eval": "eval"})
    state = pl.pipeline(project_dir=str(project), return_state=True)
    assert state.is_completed(), state.message
    found = _artifacts(state)
    assert set(found) == {pl.RESULTS_KEY}            # no MLflow store in the toy project: no link
    text = found[pl.RESULTS_KEY].data
    assert found[pl.RESULTS_KEY].type == "markdown"
    assert "| `task` | multi | 32 | 25.0% | 75.0% | +50.0 pt |" in text      # baseline, trained, the difference
    assert "| `math500` | not available |" in text
    assert "| `eval` | ran |" in text and "Failed" not in text


def test_a_failed_stage_artifact_says_which_and_why(prefect_harness, fast_retries, tmp_path):
    project = make_toy_project(tmp_path / "toy", {"a": "ok", "b": "bad", "c": "ok"})
    state = pl.pipeline(project_dir=str(project), return_state=True)
    assert state.is_failed()
    text = _artifacts(state)[pl.RESULTS_KEY].data
    assert text.splitlines()[2] == ("**Failed at stage `b`**: exit code 2 (bad input: params, data or model path; "
                                    "not retried).")
    assert "invalid params" in text and "| `a` | ran |" in text and "| `b` | **failed** |" in text
    assert "`c`" not in text

    project = make_toy_project(tmp_path / "toy2", {"a": "broken"})
    state = pl.pipeline(project_dir=str(project), return_state=True)
    text = _artifacts(state)[pl.RESULTS_KEY].data
    assert f"**Failed at stage `a`**: exit code 1 (failed {1 + pl.STAGE_RETRIES} attempts)." in text


# --------------------------------------------------------------------------- end to end
SHORT = {
    "train.steps": 2, "train.prompts_per_step": 4, "rollout.n": 4,
    "data.train_examples": 256, "data.heldout_examples": 32,
    "model.warmstart.demonstrations": 100, "model.warmstart.skill_steps": 20,
    "model.warmstart.prior_steps": 5,
    "eval.limit": 20,
    "rollout.engine": "hf",   # spares a vLLM start (~50 s in CI): the test is about the deployment
}
TERMINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _api(url: str, body: dict | None = None):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method="POST" if body is not None else "GET",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read() or b"null")


def _kill_tree(proc: subprocess.Popen | None) -> None:
    """Hard: a backgrounded worker ignores SIGTERM, and its flow run has children (Ray, vLLM)."""
    if proc is None:
        return
    import psutil

    try:
        family = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        family = []
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for child in family:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass
    proc.wait(timeout=30)


@pytest.mark.slow
@pytest.mark.long   # ~230 s with two workers: a Prefect server, a worker and three stages; the flow itself is tested above
def test_deployment_run_with_overrides(tmp_path):
    """prefect.yaml deployed to a local server and a process work pool; one run with overrides
    and a subset of the stages."""
    project = tmp_path / "project"
    project.mkdir()
    copy_project(project)
    logs = tmp_path / "logs"
    logs.mkdir()

    port = _free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update({
        "PREFECT_HOME": str(tmp_path / "prefect_home"), "PREFECT_API_URL": api,
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
        "PYTHONPATH": str(project / "src"),     # the copy's turnrl, not the editable install's
        "RAY_USAGE_STATS_ENABLED": "0", "MLFLOW_DISABLE_TELEMETRY": "true", "DVC_NO_ANALYTICS": "1",
    })
    # the stages up to train: the evaluations are the same stage scripts the repro test runs
    ran = ["preprocess", "prepare_model", "train"]
    prefect = [str(Path(sys.executable).parent / "prefect")]

    def cli(*args: str, timeout: float = 180) -> str:
        done = subprocess.run([*prefect, *args], cwd=project, env=env, capture_output=True,
                              text=True, timeout=timeout)
        assert done.returncode == 0, f"prefect {' '.join(args)}:\n{done.stdout}\n{done.stderr}"
        return done.stdout

    server = worker = None
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    try:
        server = subprocess.Popen([*prefect, "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                                  cwd=tmp_path, env=env, stdout=open(logs / "server.log", "w"),
                                  stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 120
        while True:
            try:
                if _api(f"{api}/health") is True:
                    break
            except OSError:
                pass
            assert server.poll() is None, (logs / "server.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "Prefect server not healthy after 120 s"
            time.sleep(1)
        timings["server"] = time.perf_counter() - t0

        cli("work-pool", "create", "turnrl-local", "--type", "process")
        cli("--no-prompt", "deploy", "--all")
        worker = subprocess.Popen([*prefect, "worker", "start", "--pool", "turnrl-local"],
                                  cwd=project, env=env, stdout=open(logs / "worker.log", "w"),
                                  stderr=subprocess.STDOUT, start_new_session=True)
        out = cli("deployment", "run", "turnrl-pipeline/turnrl-pipeline",
                  "--param", f"overrides={json.dumps(SHORT)}", "--param", f"stages={json.dumps(ran)}")
        run_id = re.search(r"UUID: ([0-9a-f-]{36})", out).group(1)
        timings["deployed"] = time.perf_counter() - t0

        timeout = float(os.environ.get("TURNRL_E2E_TIMEOUT", 1200))
        deadline = time.monotonic() + timeout
        while True:
            state = _api(f"{api}/flow_runs/{run_id}")["state"]
            if state["type"] in TERMINAL:
                break
            if time.monotonic() > deadline:
                pytest.fail(f"flow run still {state['type']} after {timeout:.0f} s; worker log:\n"
                            + (logs / "worker.log").read_text()[-4000:])
            time.sleep(5)
        timings["flow"] = time.perf_counter() - t0 - timings["deployed"]
        print("e2e timings (s):", {k: round(v, 1) for k, v in timings.items()})

        task_runs = _api(f"{api}/task_runs/filter", {"flow_runs": {"id": {"any_": [run_id]}}})
        flow_logs = _api(f"{api}/logs/filter", {"logs": {"flow_run_id": {"any_": [run_id]}},
                                                 "sort": "TIMESTAMP_ASC", "limit": 200})
        assert state["type"] == "COMPLETED", (
            f"flow run {state['type']}: {state.get('message')}\n"
            + "\n".join(entry["message"] for entry in flow_logs[-80:]))

        by_name = {t["name"]: t for t in task_runs}
        # the params check first (its own task, never retried), then only the stages asked for
        assert set(by_name) == {pl.CHECK, *ran}, sorted(by_name)
        assert all(by_name[s]["state_type"] == "COMPLETED" for s in [pl.CHECK, *ran])
        stage_logs = _api(f"{api}/logs/filter", {"logs": {"task_run_id": {"any_": [by_name["train"]["id"]]}},
                                                  "limit": 200})
        assert any("stages/train.py" in entry["message"] for entry in stage_logs)   # the stage's own output

        lock = yaml.safe_load((project / "dvc.lock").read_text())      # DVC recorded the override
        locked = lock["stages"]["train"]["params"]["params.yaml"]
        steps = locked["train"]["steps"] if "train" in locked else locked["train.steps"]
        assert steps == SHORT["train.steps"]

        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=f"sqlite:///{project / 'mlflow.db'}")
        experiments = [e.experiment_id for e in client.search_experiments()]
        runs = client.search_runs(experiments, f"params.`train.steps` = '{SHORT['train.steps']}'")
        stage_runs = [r for r in runs if "turnrl.pipeline.stage" in r.data.tags]
        assert {r.data.tags["turnrl.pipeline.stage"] for r in stage_runs} == set(ran)
        parents = {r.data.tags.get("mlflow.parentRunId") for r in stage_runs}
        assert len(parents) == 1
        parent = client.get_run(parents.pop())
        # the parent carries the identifying params too (it is the one other run that matched)
        assert [r.info.run_id for r in runs if r not in stage_runs] == [parent.info.run_id]
        assert parent.data.tags["turnrl.pipeline_key"] == f"prefect:{run_id}"

        # the flow run's artifacts: the result, and the way to the MLflow run
        artifacts = {a["key"]: a for a in _api(f"{api}/artifacts/filter",
                                               {"artifacts": {"flow_run_id": {"any_": [run_id]}}})}
        assert set(artifacts) == {pl.RESULTS_KEY, pl.LINK_KEY}
        link = artifacts[pl.LINK_KEY]
        # create_link_artifact stores a markdown link (Prefect 3.7: type "markdown", data "[text](url)")
        assert link["data"].startswith("[MLflow pipeline run ") and link["data"].endswith(")")
        assert f"#/experiments/{parent.info.experiment_id}/runs/{parent.info.run_id}" in link["data"]
        result = artifacts[pl.RESULTS_KEY]["data"]
        assert "## Training" in result and f"{SHORT['train.steps']} steps in" in result
        assert all(f"| `{stage}` | ran |" in result for stage in ran) and parent.info.run_id in result
    finally:
        _kill_tree(worker)
        _kill_tree(server)
