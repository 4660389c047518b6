"""MLflow: one parent run per pipeline run, one child run per stage execution.

Stages run as separate processes under `dvc repro` (or a Prefect flow), so they find their
common parent run by a key: `$TURNRL_PIPELINE_KEY` if set (the Prefect flow sets it to its
flow run id), else the id and start time of the `dvc` process they run under, else their own
process (a stage run by hand gets a parent of its own).

Default store: a sqlite file `mlflow.db` and a folder `mlartifacts/` in the project; see them
with `mlflow ui --backend-store-uri sqlite:///mlflow.db`. `tracking.uri` selects any server.
"""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any, Iterator

from turnrl.config import Config

PIPELINE_KEY_TAG = "turnrl.pipeline_key"


def project_root() -> Path:
    return Path(os.environ.get("DVC_ROOT") or os.getcwd()).resolve()


def tracking_uri(cfg: Config) -> str:
    return cfg.tracking.uri or f"sqlite:///{project_root() / 'mlflow.db'}"


def pipeline_key() -> str:
    if os.environ.get("TURNRL_PIPELINE_KEY"):
        return os.environ["TURNRL_PIPELINE_KEY"]
    try:
        import psutil
        proc = psutil.Process().parent()
        while proc is not None:
            # `dvc ...` or `python .../bin/dvc ...`
            if any(Path(arg).name == "dvc" for arg in proc.cmdline()[:2]):
                return f"dvc:{proc.pid}:{int(proc.create_time())}"
            proc = proc.parent()
    except Exception:  # no psutil, no /proc: fall back to this process
        pass
    return f"proc:{os.getpid()}:{int(time.time())}"


def git_commit() -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
                             cwd=project_root()).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, timeout=10, cwd=project_root()).stdout.strip()
        return (sha or "unknown") + ("-dirty" if dirty else "")
    except Exception:
        return "unknown"


def _experiment_id(mlflow, name: str) -> str:
    exp = mlflow.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    location = None
    if mlflow.get_tracking_uri().startswith("sqlite:"):
        location = (project_root() / "mlartifacts").as_uri()
    try:
        return mlflow.create_experiment(name, artifact_location=location)
    except Exception:  # created concurrently
        return mlflow.get_experiment_by_name(name).experiment_id


def _parent_run_id(mlflow, experiment_id: str, key: str) -> str:
    found = mlflow.search_runs([experiment_id], filter_string=f"tags.`{PIPELINE_KEY_TAG}` = '{key}'",
                               max_results=1, output_format="list")
    if found:
        return found[0].info.run_id
    name = os.environ.get("DVC_EXP_NAME") or time.strftime("pipeline %Y-%m-%d %H:%M:%S")
    client = mlflow.MlflowClient()
    run = client.create_run(experiment_id, run_name=name,
                            tags={PIPELINE_KEY_TAG: key, "turnrl.git_commit": git_commit(),
                                  "mlflow.source.git.commit": git_commit()})
    return run.info.run_id


@contextlib.contextmanager
def stage_run(stage: str, cfg: Config, resume_run_id: str | None = None) -> Iterator[Any]:
    """Open the pipeline's parent run and a nested run for `stage`; log the config, params,
    git commit and DVC stage. On an exception both runs are marked FAILED.

    `resume_run_id` (a stage continuing after a crash, e.g. train from a checkpoint): that
    run is reopened and continued, where it was, so its metrics stay one history; the
    pipeline's parent run gets a tag pointing at it. If it is not in this store, a new run
    is made and tagged `turnrl.resumed_from_run` instead."""
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    import mlflow
    try:
        mlflow.set_tracking_uri(tracking_uri(cfg))
        experiment_id = _experiment_id(mlflow, cfg.tracking.experiment)
        parent = _parent_run_id(mlflow, experiment_id, pipeline_key())
    except Exception as exc:
        raise RuntimeError(
            f"MLflow at {tracking_uri(cfg)} is not usable ({type(exc).__name__}: {exc}). "
            "Check tracking.uri in params.yaml (empty = the sqlite file in the project) "
            "and that the server is running") from None
    reopened = _existing_run(mlflow, resume_run_id, experiment_id)
    if reopened:   # the crashed pipeline's parent run never ended: say so
        crashed = reopened.data.tags.get("mlflow.parentRunId")
        if crashed and crashed != parent and mlflow.MlflowClient().get_run(crashed).info.status == "RUNNING":
            mlflow.MlflowClient().set_terminated(crashed, "KILLED")
    with mlflow.start_run(run_id=parent, experiment_id=experiment_id):
        mlflow.set_tag(f"turnrl.stage.{stage}", f"resumed run {reopened.info.run_id}" if reopened else "ran")
        with mlflow.start_run(run_id=reopened.info.run_id if reopened else None,
                              run_name=None if reopened else stage, nested=True, experiment_id=experiment_id) as run:
            mlflow.set_tags({"turnrl.stage": stage, "dvc.stage": os.environ.get("DVC_STAGE", stage),
                             "mlflow.source.git.commit": git_commit(),
                             "dvc.exp_name": os.environ.get("DVC_EXP_NAME", "")})
            params = {k: _param(v) for k, v in cfg.flat().items()}
            if reopened:   # MLflow keeps a param's first value: record what changed as a tag
                logged = reopened.data.params
                changed = {k: v for k, v in params.items() if k in logged and logged[k] != v}
                params = {k: v for k, v in params.items() if k not in logged}
                if changed:
                    mlflow.set_tag("turnrl.params_changed_on_resume", json.dumps(changed)[:5000])
            elif resume_run_id:
                mlflow.set_tag("turnrl.resumed_from_run", resume_run_id)
            mlflow.log_params(params)
            mlflow.log_dict(cfg.model_dump(), "config.json")
            yield run


def _existing_run(mlflow, run_id: str | None, experiment_id: str):
    """The run `run_id` if this store has it (not deleted) in this experiment, else None."""
    if not run_id:
        return None
    try:
        run = mlflow.MlflowClient().get_run(run_id)
    except Exception:
        return None
    ok = run.info.experiment_id == experiment_id and run.info.lifecycle_stage == "active"
    return run if ok else None


def _param(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, str) else value
    return text[:500]


def log_metrics(metrics: dict[str, float], step: int | None = None) -> None:
    """Log the numeric entries (NaN and non-numbers skipped), names made MLflow-safe."""
    import re

    import mlflow
    clean = {re.sub(r"[^\w\-. :/]", "_", k): float(v) for k, v in metrics.items()
             if isinstance(v, (int, float)) and v == v}
    if clean:
        mlflow.log_metrics(clean, step=step)
