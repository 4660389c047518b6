"""The turnrl pipeline as a Prefect flow: the same DVC stages, one Prefect task per stage.

The flow does not reimplement any stage. It (1) writes the run's overrides into params.yaml the
way `dvc exp run -S key=value` does and validates the result before anything runs, (2) gives
every stage the same MLflow parent run through `TURNRL_PIPELINE_KEY=prefect:<flow run id>`,
and (3) runs `dvc repro --single-item <stage>` for each stage in dvc.yaml order, so dvc.lock
stays the record of what ran with which params and unchanged stages are skipped by DVC.

Before the stages, the task `check-params` runs `turnrl config` on the result in the project:
data and benchmark files, field mappings, stdio MCP commands, plugins (turnrl.config.checks),
so a bad value fails the flow in seconds, with exit code 2, never retried.

Each stage is a task run named after the stage; its output is streamed into the Prefect run
logs. A failed stage is retried (transient failures: a worker died, a lock was busy), except
when the stage exited with 2: the stage scripts use 2 for bad input (params, data, model
path), which no retry can fix.

Local run (starts a temporary Prefect server unless PREFECT_API_URL is set):

    python flows/pipeline.py --set train.steps=3 --set rollout.n=4
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml
from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run

from turnrl.config import ConfigError, load_config, parse_config
from turnrl.pipeline.stage import BAD_INPUT_EXIT  # bad params / data / model path

PROJECT_DIR = Path(__file__).resolve().parent.parent
PARAMS_FILE = "params.yaml"


# DVC's own exit codes for problems no retry fixes: configuration error, not a DVC repository,
# bad command line. Any other failure (255 included: DVC reports a failed stage command as 255)
# is retried.
DVC_CONFIG_EXITS = {251, 253, 254}
NO_RETRY_EXITS = {BAD_INPUT_EXIT} | DVC_CONFIG_EXITS

STAGE_RETRIES = 2
STAGE_RETRY_DELAY_S = 15


class StageFailed(RuntimeError):
    """A DVC stage failed; `exit_code` is the stage command's exit code when DVC reports it,
    else the exit code of `dvc repro` itself."""

    def __init__(self, stage: str, exit_code: int, detail: str = "") -> None:
        super().__init__(stage, exit_code, detail)   # args round-trip through pickle
        self.stage, self.exit_code, self.detail = stage, exit_code, detail

    def __str__(self) -> str:
        kind = "bad input, not retried" if self.exit_code in NO_RETRY_EXITS else "retryable"
        text = f"stage {self.stage!r} failed with exit code {self.exit_code} ({kind})"
        return f"{text}\n{self.detail}" if self.detail else text


# --------------------------------------------------------------------------- params overrides
def _flatten(overrides: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"train": {"steps": 3}} and {"train.steps": 3} both mean train.steps=3 (merged key by key)."""
    flat: dict[str, Any] = {}
    for key, value in overrides.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(_flatten(value, dotted + "."))
        else:
            flat[dotted] = value
    return flat


def _round_trip_yaml():
    from ruamel.yaml import YAML   # what DVC edits params.yaml with: keeps comments and layout
    from ruamel.yaml.representer import RoundTripRepresenter

    class Representer(RoundTripRepresenter):   # a subclass: DVC's own dumper stays as it is
        pass

    Representer.add_representer(
        type(None), lambda rep, _: rep.represent_scalar("tag:yaml.org,2002:null", "null"))
    rt = YAML()
    rt.Representer = Representer
    rt.preserve_quotes = True
    rt.width = 4096
    return rt


def apply_overrides(params_path: str | Path, overrides: dict[str, Any] | None) -> dict[str, Any]:
    """Write dotted-key overrides into params.yaml, keeping everything else (comments included),
    after validating the result with turnrl's config schema. Raises ConfigError naming the key;
    params.yaml is left untouched then. Returns the flattened overrides applied."""
    import io

    from ruamel.yaml.comments import CommentedMap

    path = Path(params_path)
    if not path.exists():
        raise ConfigError(f"{path}: not found")
    flat = _flatten(overrides or {})
    rt = _round_trip_yaml()
    text = path.read_text()
    try:
        data = rt.load(text)
    except Exception as exc:
        raise ConfigError(f"{path.name}: not valid YAML: {exc}") from None
    data = data if data is not None else CommentedMap()
    if not isinstance(data, dict):
        raise ConfigError(f"{path.name}: the top level must be a mapping")

    for key, value in flat.items():
        parts = key.strip().split(".")
        if not all(parts):
            raise ConfigError(f"override {key!r}: expected a dotted key such as train.steps")
        node = data
        for i, part in enumerate(parts[:-1]):
            if part not in node:
                node[part] = CommentedMap()
            node = node[part]
            if not isinstance(node, dict):
                raise ConfigError(f"override {key}: '{'.'.join(parts[:i + 1])}' is a value, not a section")
        node[parts[-1]] = value

    out = io.StringIO()
    rt.dump(data, out)
    new_text = out.getvalue()
    source = f"{path.name} with overrides" if flat else path.name
    # read back as DVC will read it (ruamel's safe loader, YAML 1.2); raises ConfigError naming the key
    from ruamel.yaml import YAML
    parse_config(YAML(typ="safe").load(new_text), source=source)
    if new_text != text:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(new_text)
        tmp.replace(path)
    return flat


# --------------------------------------------------------------------------- stages
def dvc_stages(project_dir: str | Path) -> list[str]:
    """Stage names in dvc.yaml order."""
    spec = yaml.safe_load((Path(project_dir) / "dvc.yaml").read_text()) or {}
    return list(spec.get("stages") or {})


def stage_env(project_dir: str | Path, pipeline_key: str) -> dict[str, str]:
    """The environment of `dvc repro`: this interpreter's bin dir first on PATH (so `python` in
    dvc.yaml is the environment running the flow), the project's own src/ first on PYTHONPATH
    (the code DVC hashes is the code that runs), and one MLflow parent run for all stages."""
    env = os.environ.copy()
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    src = Path(project_dir) / "src"
    if src.is_dir():
        env["PYTHONPATH"] = os.pathsep.join(p for p in [str(src), env.get("PYTHONPATH", "")] if p)
    env["TURNRL_PIPELINE_KEY"] = pipeline_key
    env["PYTHONUNBUFFERED"] = "1"              # stage output reaches the logs as it happens
    env.setdefault("DVC_NO_ANALYTICS", "1")
    env.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    env.setdefault("TQDM_MININTERVAL", "5")     # progress bars: a log line every 5 s, not every tick
    return env


def _stage_exit_code(dvc_exit: int, output: str) -> int:
    """DVC exits 255 when a stage command fails and says `..., exited with N`: use N."""
    found = re.findall(r"failed to run: .*, exited with (-?\d+)", output)
    return int(found[-1]) if found else dvc_exit


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=wait)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


def retry_unless_bad_input(task, task_run, state) -> bool:
    """Prefect retry condition: retry a failed stage unless it failed on bad input (exit 2) or
    DVC itself reported a configuration problem."""
    exc = state.data if isinstance(state.data, BaseException) else None
    if exc is None:
        try:
            exc = state.result(raise_on_failure=False)
        except Exception:
            return True
    return getattr(exc, "exit_code", None) not in NO_RETRY_EXITS


@task(name="dvc-stage", task_run_name="{stage}", retries=STAGE_RETRIES,
      retry_delay_seconds=STAGE_RETRY_DELAY_S, retry_condition_fn=retry_unless_bad_input,
      cache_policy=NO_CACHE)
def dvc_stage(stage: str, project_dir: str, pipeline_key: str) -> dict[str, Any]:
    """`dvc repro --single-item <stage>`, its output streamed into this task run's logs."""
    logger = get_run_logger()
    cmd = [sys.executable, "-m", "dvc", "repro", "--single-item", stage]
    logger.info("$ %s  (in %s)", " ".join(["dvc", *cmd[3:]]), project_dir)
    start = time.perf_counter()
    tail: collections.deque[str] = collections.deque(maxlen=40)
    seen_unchanged = seen_run_cache = False
    proc = subprocess.Popen(cmd, cwd=project_dir, env=stage_env(project_dir, pipeline_key),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            text=True, errors="replace", bufsize=1, start_new_session=True)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:          # text mode: a tqdm '\r' update counts as a line
            line = line.rstrip()
            if not line:
                continue
            logger.info("%s", line)
            tail.append(line)
            seen_unchanged |= "didn't change, skipping" in line
            seen_run_cache |= "run-cache" in line
        dvc_exit = proc.wait()
    finally:
        _stop(proc)                        # cancelled or interrupted: no orphaned stage
    seconds = round(time.perf_counter() - start, 1)
    if dvc_exit != 0:
        code = _stage_exit_code(dvc_exit, "\n".join(tail))
        if code in NO_RETRY_EXITS:
            logger.error("stage %s: exit code %d means bad input (params, data or model path); "
                         "not retrying: fix the input and run again", stage, code)
        raise StageFailed(stage, code, "\n".join(list(tail)[-10:]))
    status = "unchanged" if seen_unchanged else "restored from run-cache" if seen_run_cache else "ran"
    logger.info("stage %s: %s in %.1f s", stage, status, seconds)
    return {"stage": stage, "status": status, "seconds": seconds}


CHECK = "check-params"   # the flow's first task: `turnrl config` on params.yaml in the project


@task(name=CHECK, task_run_name=CHECK, retries=0, cache_policy=NO_CACHE)
def check_params(project_dir: str, pipeline_key: str) -> dict[str, Any]:
    """What the stages would check before their heavy work (turnrl.config.checks: data and
    benchmark files, their field mappings, stdio MCP commands, plugins), run as `python -m
    turnrl.config --quiet` in the project with the stages' environment: a bad value fails the
    flow in seconds, before any stage, and is not retried (exit 2)."""
    logger = get_run_logger()
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "turnrl.config", PARAMS_FILE, "--quiet"], cwd=project_dir,
                          env=stage_env(project_dir, pipeline_key), capture_output=True, text=True,
                          stdin=subprocess.DEVNULL)
    seconds = round(time.perf_counter() - start, 1)
    if proc.returncode != 0:
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        for line in lines[-40:]:
            logger.error("%s", line)
        raise StageFailed(CHECK, proc.returncode, "\n".join(lines[-40:]))
    logger.info("params checked in %.1f s: the files and commands they name are there", seconds)
    return {"stage": CHECK, "status": "ok", "seconds": seconds}


# --------------------------------------------------------------------------- artifacts
RESULTS_KEY, LINK_KEY = "turnrl-results", "turnrl-mlflow-run"


def mlflow_parent(project: Path, key: str) -> dict[str, str] | None:
    """The pipeline's MLflow parent run for `key` in the project's tracking store (params.yaml
    tracking.uri, else its mlflow.db): {run_id, name, experiment_id, link}, or None."""
    from turnrl.tracking.runs import find_parent, run_link, tracking_uri
    cfg = load_config(project / PARAMS_FILE)
    uri = tracking_uri(cfg, project)
    if uri.startswith("sqlite:///") and not Path(uri.removeprefix("sqlite:///")).exists():
        return None
    for name, value in (("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0"), ("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")):
        os.environ.setdefault(name, value)
    from mlflow import MlflowClient
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name(cfg.tracking.experiment)
    run = experiment and find_parent(client, experiment.experiment_id, key)
    if not run:
        return None
    return {"run_id": run.info.run_id, "name": run.info.run_name, "experiment_id": experiment.experiment_id,
            "link": run_link(cfg, experiment.experiment_id, run.info.run_id), "uri": uri}


def results_markdown(project: Path, done: list[dict[str, Any]], failed: tuple[str, BaseException] | None,
                     parent: dict[str, str] | None) -> str:
    """The flow run's result: failure first (which stage, why), baseline against trained per
    benchmark (metrics/baseline.json, metrics/eval.json), training, stages, the MLflow run."""
    import json

    from turnrl.pipeline.report import summary_table
    lines = ["# turnrl pipeline", ""]
    if failed:
        stage, exc = failed
        code = getattr(exc, "exit_code", None)
        kind = ("bad input: params, data or model path; not retried" if code in NO_RETRY_EXITS
                else f"failed {STAGE_RETRIES + 1} attempts")
        why = f"exit code {code} ({kind})" if code is not None else type(exc).__name__
        lines += [f"**Failed at stage `{stage}`**: {why}.", ""]
        detail = getattr(exc, "detail", "") or str(exc)
        if detail:
            lines += ["```", *detail.splitlines()[-15:], "```", ""]
    metrics = {}
    for name in ("baseline", "eval", "train"):
        path = project / "metrics" / f"{name}.json"
        metrics[name] = json.loads(path.read_text()) if path.exists() else None
    ran = {d["stage"] for d in done}
    if metrics["baseline"] or metrics["eval"]:
        lines += ["## Baseline against trained", ""]
        if "eval" not in ran or "baseline_eval" not in ran:
            lines += ["(from the metrics files in the workspace; stages this flow run did not run kept DVC's "
                      "last results)", ""]
        lines += summary_table(metrics["baseline"] or {}, metrics["eval"] or {}, ("baseline", "trained")) + [""]
    if metrics["train"] and "train" in ran:
        t = metrics["train"]
        lines += ["## Training", "",
                  f"{t.get('steps')} steps in {t.get('wall_s', 0):.0f} s (mean step {t.get('step_s_mean') or 0:.2f} s); "
                  f"reward {t.get('reward_first', 0):.3f} at step 1, {t.get('reward_last5') or 0:.3f} over the last 5", ""]
    lines += ["## Stages", "", "| stage | status | seconds |", "|---|---|---|"]
    lines += [f"| `{d['stage']}` | {d['status']} | {d['seconds']} |" for d in done]
    if failed:
        lines += [f"| `{failed[0]}` | **failed** | |"]
    lines += [""]
    if parent:
        lines += [f"MLflow: [{parent['name']}]({parent['link']}) (run {parent['run_id']} in {parent['uri']})"]
    else:
        lines += ["MLflow: no pipeline run found for this flow run"]
    return "\n".join(lines)


def publish(project: Path, key: str, done: list[dict[str, Any]], failed: tuple[str, BaseException] | None) -> None:
    """The flow run's artifacts: the result as Markdown and a link to the MLflow parent run."""
    from prefect.artifacts import create_link_artifact, create_markdown_artifact
    logger = get_run_logger()
    try:
        parent = mlflow_parent(project, key)
    except Exception as exc:   # noqa: BLE001 - the artifacts must not fail the flow
        logger.warning("MLflow run of this flow run not found: %s: %s", type(exc).__name__, str(exc)[:300])
        parent = None
    what = f"stage {failed[0]} failed" if failed else "baseline against trained, per benchmark"
    create_markdown_artifact(results_markdown(project, done, failed, parent), key=RESULTS_KEY,
                             description=f"turnrl pipeline: {what}")
    if parent:
        create_link_artifact(parent["link"], link_text=f"MLflow pipeline run {parent['name']}", key=LINK_KEY,
                             description=f"the MLflow parent run ({parent['run_id']}) of this flow run")
        logger.info("MLflow pipeline run: %s", parent["link"])


# --------------------------------------------------------------------------- the flow
@flow(name="turnrl-pipeline")
def pipeline(overrides: dict[str, Any] | None = None, stages: list[str] | None = None,
             project_dir: str | None = None) -> list[dict[str, Any]]:
    """Run the turnrl DVC stages (default: all, in dvc.yaml order) with params.yaml overrides.

    overrides: dotted params.yaml keys and values, e.g. {"train.steps": 3, "rollout.n": 4};
        written into params.yaml as `dvc exp run -S` does, so dvc.lock records them.
    stages: a subset of the dvc.yaml stage names; None runs all of them.
    project_dir: the turnrl project (default: the folder holding flows/).

    Artifacts of the flow run: `turnrl-results` (Markdown: a failed stage and why, baseline
    against trained per benchmark, training, stages) and `turnrl-mlflow-run` (a link to the
    MLflow parent run).
    """
    logger = get_run_logger()
    project = Path(project_dir or PROJECT_DIR).resolve()

    known = dvc_stages(project)
    unknown = [s for s in (stages or []) if s not in known]
    if unknown:
        raise ValueError(f"unknown stage(s) {unknown}; dvc.yaml has: {', '.join(known)}")
    selected = [s for s in known if stages is None or s in stages]

    applied = apply_overrides(project / PARAMS_FILE, overrides)   # ConfigError: flow fails now
    if applied:
        logger.info("params.yaml overrides: %s", ", ".join(f"{k}={v!r}" for k, v in applied.items()))

    key = f"prefect:{flow_run.id or os.getpid()}"
    logger.info("stages %s in %s; MLflow pipeline key %s", selected, project, key)
    done: list[dict[str, Any]] = []
    failed = None
    try:
        for stage in [CHECK, *selected]:   # the params check first: a bad value fails before any stage
            try:
                done.append(check_params(str(project), key) if stage == CHECK else dvc_stage(stage, str(project), key))
            except BaseException as exc:
                failed = (stage, exc)
                raise
    finally:
        try:
            publish(project, key, done, failed)
        except Exception as exc:   # noqa: BLE001 - a missing artifact must not hide the stage's own result
            logger.warning("flow run artifacts not created: %s: %s", type(exc).__name__, str(exc)[:300])
    return done


# --------------------------------------------------------------------------- command line
def parse_set(items: list[str]) -> dict[str, Any]:
    """`key.path=value` strings to overrides; values are YAML 1.2 (1e-4 is a number), as with
    `dvc exp run -S`."""
    from ruamel.yaml import YAML

    load = YAML(typ="safe", pure=True).load
    out: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected key.path=value")
        key, raw = item.split("=", 1)
        out[key.strip()] = load(raw) if raw.strip() else ""
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Run the turnrl pipeline as a Prefect flow.")
    ap.add_argument("--set", "-S", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                    help="params.yaml override (repeatable), e.g. --set train.steps=3")
    ap.add_argument("--stages", nargs="+", default=None, metavar="STAGE",
                    help="only these stages (dvc.yaml order is kept)")
    ap.add_argument("--project-dir", default=None)
    args = ap.parse_args(argv)
    try:
        overrides = parse_set(args.sets)
    except Exception as exc:   # ConfigError or a YAML syntax error
        print(f"error: {exc}", file=sys.stderr)
        return BAD_INPUT_EXIT
    state = pipeline(overrides=overrides, stages=args.stages, project_dir=args.project_dir,
                     return_state=True)
    if state.is_completed():
        return 0
    exc = state.result(raise_on_failure=False)
    print(f"error: {exc}", file=sys.stderr)
    bad_input = isinstance(exc, ValueError) or getattr(exc, "exit_code", None) in NO_RETRY_EXITS
    return BAD_INPUT_EXIT if bad_input else 1


if __name__ == "__main__":
    raise SystemExit(main())
