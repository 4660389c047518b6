"""The pipeline's MLflow runs: one parent run per pipeline run, one child run per stage
execution (`stage_run`), found by a pipeline key; the params that identify a run, and the
parent's headline accuracies (its description, with the report's table, is
turnrl.pipeline.report.log_headline's)."""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import subprocess
import time
from pathlib import Path
from typing import Any, Iterator

from turnrl.config import Config
from turnrl.tracking.logs import quiet_logs
from turnrl.tracking.recorder import MLFLOW_ENV_DEFAULTS, Recorder, clean_metrics, is_outage, mlflow_name, outage_reason
from turnrl.tracking.system import SystemMetrics

PIPELINE_KEY_TAG = "turnrl.pipeline_key"
log = logging.getLogger(__name__)


def project_root() -> Path:
    return Path(os.environ.get("DVC_ROOT") or os.getcwd()).resolve()


def local_uri(root: str | Path | None = None) -> str:
    """The project's own store: the sqlite file mlflow.db in `root` (default: the project)."""
    return f"sqlite:///{Path(root).resolve() if root else project_root()}/mlflow.db"


def tracking_uri(cfg: Config, root: str | Path | None = None) -> str:
    return cfg.tracking.uri or local_uri(root)


def ui_url(cfg: Config) -> str:
    """The MLflow UI's base address: tracking.ui_url, else tracking.uri when it is a server."""
    if cfg.tracking.ui_url:
        return cfg.tracking.ui_url.rstrip("/")
    if cfg.tracking.uri.startswith(("http://", "https://")):
        return cfg.tracking.uri.rstrip("/")
    return "http://127.0.0.1:5000"


def run_link(cfg: Config, experiment_id: str, run_id: str) -> str:
    return f"{ui_url(cfg)}/#/experiments/{experiment_id}/runs/{run_id}"


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


_recorder: Recorder | None = None
_stage: "StageRun | None" = None


def recorder() -> Recorder | None:
    """The active stage's Recorder (None outside `stage_run`)."""
    return _recorder


def current_run() -> "StageRun | None":
    """The active `stage_run` (None outside one)."""
    return _stage


# --------------------------------------------------------------------------- runs
def ensure_experiment(mlflow, name: str) -> str:
    """The id of experiment `name`, created (artifacts in the project's mlartifacts/ on sqlite) if new."""
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


def find_parent(client, experiment_id: str, key: str):
    found = client.search_runs([experiment_id], filter_string=f"tags.`{PIPELINE_KEY_TAG}` = '{key}'", max_results=1)
    return found[0] if found else None


def _parent_run_id(mlflow, experiment_id: str, key: str) -> str:
    found = find_parent(mlflow.MlflowClient(), experiment_id, key)
    if found:
        return found.info.run_id
    name = os.environ.get("DVC_EXP_NAME") or time.strftime("pipeline %Y-%m-%d %H:%M:%S")
    client = mlflow.MlflowClient()
    run = client.create_run(experiment_id, run_name=name,
                            tags={PIPELINE_KEY_TAG: key, "turnrl.git_commit": git_commit(),
                                  "mlflow.source.git.commit": git_commit()})
    return run.info.run_id


#: Params every pipeline run's parent carries, changed or not: what identifies a run.
IDENTIFYING = ("env.name", "algorithm.name", "model.path", "seed", "train.steps", "rollout.n", "rollout.max_turns",
               "rollout.engine", "train.lr", "train.prompts_per_step", "data.train_set", "data.heldout_set")


def identifying_params(cfg: Config) -> dict[str, str]:
    """The parent run's params: IDENTIFYING, plus every key whose value differs from its default
    (so two runs that differ in a knob show it in the compare view)."""
    flat, default = cfg.flat(), Config().flat()
    keys = [k for k in IDENTIFYING if k in flat] + sorted(k for k in flat if k not in IDENTIFYING
                                                         and flat[k] != default.get(k) and not k.startswith("tracking."))
    return {k: param_value(flat[k]) for k in keys}


class StageRun:
    """What `stage_run` yields: the stage's MLflow run, its pipeline parent, and the Recorder."""

    def __init__(self, run, parent_id: str, experiment_id: str, rec: Recorder, cfg: Config, stage: str) -> None:
        self.run, self.parent_id, self.experiment_id, self.recorder = run, parent_id, experiment_id, rec
        self.cfg, self.stage = cfg, stage

    @property
    def info(self):   # so `with stage_run(...) as run: run.info.run_id` keeps working
        return self.run.info

    @property
    def run_id(self) -> str:
        return self.run.info.run_id


FALLBACK_TAG = "turnrl.tracking_fallback"
RUN_EXPERIMENT_ENV = "TURNRL_MLFLOW_EXPERIMENT_ID"   # the stage's experiment, for the processes it starts


class TrackingUnavailable(RuntimeError):
    """The tracking store cannot be opened when a stage starts: the message is one line that
    names `tracking.uri` and the ways on."""


@dataclasses.dataclass
class _Store:
    """Where a stage records: the store's URI, the experiment and the pipeline's parent run;
    `fallback_from` is the tracking.uri that did not answer when this store is the local one."""
    uri: str
    experiment_id: str
    parent: str
    fallback_from: str | None = None


def _open(cfg: Config, uri: str) -> _Store:
    import mlflow
    mlflow.set_tracking_uri(uri)   # also MLFLOW_TRACKING_URI, for the processes the stage starts
    experiment_id = ensure_experiment(mlflow, cfg.tracking.experiment)
    # for an agent program's own traces (MLflow's autologging): they go to the run's experiment,
    # to be joined into turnrl's trace of the episode (turnrl.gateway.program.tracking_env)
    os.environ[RUN_EXPERIMENT_ENV] = experiment_id
    return _Store(uri, experiment_id, _parent_run_id(mlflow, experiment_id, pipeline_key()))


def open_store(cfg: Config, stage: str) -> _Store:
    """Open tracking.uri. A server that does not answer (refused, timed out, 5xx) with
    `tracking.on_unreachable: local` (the default): the project's own store instead, with one
    warning, so the pipeline finishes and its records are kept; with `fail`: TrackingUnavailable.
    Any other failure (a bad URI, a store that refuses): TrackingUnavailable."""
    uri = tracking_uri(cfg)
    try:
        return _open(cfg, uri)
    except Exception as exc:   # noqa: BLE001 - every failure becomes one line below
        failure = exc
    if not (uri.startswith(("http://", "https://")) and is_outage(failure)):
        text = " ".join(str(failure).split())[:300]
        raise TrackingUnavailable(
            f"MLflow at {uri} is not usable ({type(failure).__name__}: {text}). Check tracking.uri in params.yaml "
            "(empty = the sqlite file mlflow.db in the project)")
    why = outage_reason(failure)
    if cfg.tracking.on_unreachable == "fail":
        raise TrackingUnavailable(
            f"the tracking server tracking.uri={uri} does not answer ({why}). Start it (`mlflow server --host "
            "HOST --port PORT ...`) and rerun, or set tracking.on_unreachable: local to record to the project's "
            "mlflow.db instead")
    local = local_uri()
    try:
        store = _open(cfg, local)
    except Exception as exc:   # noqa: BLE001
        raise TrackingUnavailable(
            f"the tracking server tracking.uri={uri} does not answer ({why}), and the local store {local} "
            f"(tracking.on_unreachable: local) is not usable either ({type(exc).__name__}: "
            f"{' '.join(str(exc).split())[:200]}). Start the server, or fix the project folder")
    log.warning("tracking.uri %s does not answer (%s): the %s stage records to the project's local store %s "
                "instead (tracking.on_unreachable: local; its runs are tagged %s). Start the server to record "
                "there again, or set tracking.on_unreachable: fail to stop instead.",
                uri, why, stage, local, FALLBACK_TAG)
    store.fallback_from = uri
    return store


@contextlib.contextmanager
def stage_run(stage: str, cfg: Config, resume_run_id: str | None = None) -> Iterator[StageRun]:
    """Open the pipeline's parent run and a nested run for `stage`; log the config, params,
    git commit and DVC stage, start the Recorder and system metrics. On an exception both runs
    are marked FAILED; stopped by Ctrl-C or SIGTERM, KILLED. A store that cannot be opened: see `open_store`.

    `resume_run_id` (a stage continuing after a crash, e.g. train from a checkpoint): that
    run is reopened and continued, where it was, so its metrics stay one history; the
    pipeline's parent run gets a tag pointing at it. If it is not in this store, a new run
    is made and tagged `turnrl.resumed_from_run` instead."""
    global _recorder, _stage
    for key, value in MLFLOW_ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    quiet_logs()
    import mlflow
    store = open_store(cfg, stage)
    reopened = _existing_run(mlflow, resume_run_id, store.experiment_id)
    if reopened:   # the crashed pipeline's parent run never ended: say so
        crashed = reopened.data.tags.get("mlflow.parentRunId")
        client = mlflow.MlflowClient()
        if crashed and crashed != store.parent and client.get_run(crashed).info.status == "RUNNING":
            client.set_terminated(crashed, "KILLED")
    rec = Recorder(store.uri, retry_s=cfg.tracking.retry_s, stage=stage)
    system = None
    status = "FINISHED"
    try:
        run = _start_runs(mlflow, store, stage, cfg, reopened, resume_run_id)
        rec.run_id = run.info.run_id
        _recorder = rec
        if cfg.tracking.system_metrics:
            system = SystemMetrics(rec, run.info.run_id)
        _stage = StageRun(run, store.parent, store.experiment_id, rec, cfg, stage)
        yield _stage
    except KeyboardInterrupt:   # Ctrl-C, or SIGTERM where the stage asked for it (turnrl.errors.Terminated)
        status = "KILLED"
        raise
    except BaseException:
        status = "FAILED"
        raise
    finally:
        if system is not None:
            system.stop()
        _finish(rec, status)
        _recorder = _stage = None


def _start_runs(mlflow, store: _Store, stage: str, cfg: Config, reopened, resume_run_id: str | None):
    """Start the parent run (adding the identifying params it lacks) and the stage's nested run
    (a new one, or `reopened` continued); log params, tags and the config. Returns the stage run."""
    client = mlflow.MlflowClient()
    fallback = {FALLBACK_TAG: store.fallback_from} if store.fallback_from else {}
    mlflow.start_run(run_id=store.parent, experiment_id=store.experiment_id)
    mlflow.set_tags({f"turnrl.pipeline.stage.{stage}": f"resumed run {reopened.info.run_id}" if reopened else "ran",
                     **fallback})
    parent_params = client.get_run(store.parent).data.params
    new = {k: v for k, v in identifying_params(cfg).items() if k not in parent_params}
    if new:
        mlflow.log_params(new)
    run = mlflow.start_run(run_id=reopened.info.run_id if reopened else None,
                           run_name=None if reopened else stage, nested=True, experiment_id=store.experiment_id)
    mlflow.set_tags({"turnrl.pipeline.stage": stage, "dvc.stage": os.environ.get("DVC_STAGE", stage),
                     "mlflow.source.git.commit": git_commit(),
                     "dvc.exp_name": os.environ.get("DVC_EXP_NAME", ""), **fallback})
    params = {k: param_value(v) for k, v in cfg.flat().items()}
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
    return run


def _finish(rec: Recorder, status: str) -> None:
    """Send what recording cost this stage (the Recorder thread's time, read when sent, last),
    close the Recorder, end the runs, release the tracer."""
    if rec.run_id:
        from mlflow.entities import Metric

        def cost(client, run_id=rec.run_id):
            stamp = int(time.time() * 1000)
            totals = [("thread_busy_s", rec.busy_s), ("thread_cpu_s", rec.cpu_s), ("items_sent", rec.sent)]
            by_kind = [(f"thread_cpu_s/{kind.replace(' ', '_')}", used) for kind, used in rec.cpu_by_kind.items()]
            client.log_batch(run_id, metrics=[Metric(f"timing/mlflow_{k}", float(v), stamp, 0)
                                              for k, v in totals + by_kind])
        rec.submit("metrics", "recording cost", cost, priority=9)
    rec.close()
    _end_runs(rec, status)
    _release_tracer()


def _release_tracer() -> None:
    """Drop MLflow's tracer provider once the stage's traces are sent (the next trace makes a
    new one). Its isolated id generator unregisters itself in `__del__` from a module global;
    collected at interpreter exit, after that global became None, it printed a traceback
    ("Exception ignored in ... __del__") at the end of every stage's log."""
    import mlflow.tracing.provider
    mlflow.tracing.provider.reset()


def _end_runs(rec: Recorder, status: str) -> None:
    """End the stage run and the parent (on a server that answers: one that went away is not
    waited for again, and the runs stay RUNNING there)."""
    from mlflow.tracking.fluent import _active_run_stack
    stack = _active_run_stack.get()
    while stack:
        run_id = stack.pop().info.run_id
        rec.now("run status", f"{run_id} {status}", lambda: rec.client.set_terminated(run_id, status))


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


def param_value(value: Any) -> str:
    """A config value as an MLflow param (JSON for non-strings, at most 500 characters)."""
    text = json.dumps(value) if not isinstance(value, str) else value
    return text[:500]

def log_metrics(metrics: dict[str, float], step: int | None = None, sections: bool = True):
    """Log the numeric entries (NaN and non-numbers skipped) to the stage run, names made
    MLflow-safe and put in their section (`mlflow_name`); through the Recorder inside
    `stage_run` (returns the event set once they were sent), else directly to the active run."""
    if _recorder is not None:
        return _recorder.metrics(metrics, step, sections=sections)
    import mlflow
    clean = clean_metrics({mlflow_name(k) if sections else k: v for k, v in metrics.items()})
    if clean:
        mlflow.log_metrics(clean, step=step)


def backfill_steps(run: StageRun, history: list[dict], probe: str = "reward_mean") -> None:
    """Per-step metrics of `history` (a resumed checkpoint's) that the run does not have yet:
    a crashed stage may die with steps still queued. Which steps are there is read from the
    history of `probe` (queued, in the Recorder's thread)."""
    from mlflow.entities import Metric

    def fill(client):
        have = {m.step for m in client.get_metric_history(run.run_id, mlflow_name(probe))}
        stamp = int(time.time() * 1000)
        for row in history:
            step = row.get("step")
            if step is None or step in have:
                continue
            batch = [Metric(k, v, stamp, int(step)) for k, v in clean_metrics(
                {mlflow_name(k): v for k, v in row.items() if k != "step"}).items()]
            for i in range(0, len(batch), 900):
                client.log_batch(run.run_id, metrics=batch[i:i + 900])
    run.recorder.submit("metrics", "the checkpoint's steps", fill, priority=0)


def log_parent(run: StageRun, *, metrics: dict[str, float] | None = None, params: dict[str, Any] | None = None,
               tags: dict[str, str] | None = None) -> None:
    """Headline metrics, params or tags on the pipeline's parent run (queued)."""
    from mlflow.entities import Metric, Param, RunTag
    stamp = int(time.time() * 1000)
    batch_metrics = [Metric(k, v, stamp, 0) for k, v in clean_metrics(metrics or {}).items()]
    batch_params = [Param(k, param_value(v)) for k, v in (params or {}).items()]
    batch_tags = [RunTag(k, str(v)[:5000]) for k, v in (tags or {}).items()]
    if batch_metrics or batch_params or batch_tags:
        run.recorder.submit("parent run", ", ".join([*(metrics or {}), *(params or {}), *(tags or {})])[:200],
                            lambda c: c.log_batch(run.parent_id, metrics=batch_metrics, params=batch_params,
                                                  tags=batch_tags))


# --------------------------------------------------------------------------- the parent run's headline
def headline_metrics(baseline: dict | None, final: dict | None) -> dict[str, float]:
    """Per evaluation block: `eval/<block>/accuracy_baseline`, `..._final`, `..._diff`."""
    out: dict[str, float] = {}
    for block in dict.fromkeys([*(baseline or {}), *(final or {})]):
        values = {}
        for label, metrics in (("baseline", baseline), ("final", final)):
            value = ((metrics or {}).get(block) or {}).get("accuracy") if isinstance((metrics or {}).get(block),
                                                                                        dict) else None
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                values[label] = float(value)
                out[f"eval/{block}/accuracy_{label}"] = float(value)
        if len(values) == 2:
            out[f"eval/{block}/accuracy_diff"] = values["final"] - values["baseline"]
    return out
