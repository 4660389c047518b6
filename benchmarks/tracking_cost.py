"""What MLflow tracking costs a training step: the train stage with tracing and the extra
logging off, then on, back to back, repeated (issue 24: at most 3%).

    python -m benchmarks.tracking_cost --repeats 3 --steps 12            # sqlite store (the default)
    python -m benchmarks.tracking_cost --server                          # a local `mlflow server`

Each run is the real `python stages/train.py` (Ray, DeepSpeed, vLLM) on the embedded default
task with a warm-started tiny model, in a scratch project; the variants:

- `off`: per-step metrics and sample tables only (what was logged before issue 24):
  `tracking.traces.every: 0`, `system_metrics: false`, `log_model: false`.
- `on`: the defaults (tracking.* of this checkout): traces of 4 trajectories every 10 steps (and
  of the first and last), system metrics every 10 s, data sets as inputs, the final model.
- `every`: traces of 4 trajectories at every step.

Per run it reads: the loop's step time (`step_s` in plots/train.csv, which the Recorder's
thread slows down if it takes CPU from the actors), the time `on_step` blocks the loop
(`timing/tracking_s` in MLflow), the Recorder thread's busy and CPU seconds, and the stage's
wall time. The cost of tracking per step, two ways:

- measured: (step_s + on_step) of `on` over `off`, medians over the steps after the first of
  all repeats (noisy on a shared machine: read the spread);
- paired: each repeat's (step_s + on_step) median against the `off` run just before it, mean +- std
  over the repeats (drift of the machine between repeats cancels);
- accounted: on_step + the Recorder thread's CPU per step, over `off`'s step: what tracking can
  add if every CPU second it uses were taken from the critical path (an upper bound on 2 cores);
  also at the trace cadence of a default-length run (`train.steps` 40: traces at steps 1, 10, 20,
  30, 40), from the thread's CPU by kind (a 12-step run traces 3 of its 12 steps, 2x the share).

Results: benchmarks/results/tracking-cost-<date>.json; RESULTS.md has the figures.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {
    "off": {"traces": {"every": 0}, "system_metrics": False, "log_model": False},
    "on": {},
    "every": {"traces": {"every": 1}},
}


def prepare(scratch: Path, steps: int, model: Path | None) -> Path:
    """data/processed and a warm-started models/initial, made once (preprocess + prepare_model),
    as models/sft too (what the train stage reads; the sft stage passes it through by default)."""
    base = scratch / "base"
    if (base / "models/sft/config.json").exists():
        return base
    base.mkdir(parents=True, exist_ok=True)
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["eval"]["benchmarks"] = []
    params["train"].update(steps=steps, checkpoint_every=0)
    (base / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    env = _env(base)
    subprocess.run([sys.executable, str(ROOT / "stages/preprocess.py")], cwd=base, env=env, check=True)
    if model:
        shutil.copytree(model, base / "models/initial")
    else:
        subprocess.run([sys.executable, str(ROOT / "stages/prepare_model.py")], cwd=base, env=env, check=True)
    shutil.copytree(base / "models/initial", base / "models/sft")
    return base


def _env(project: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "RAY_USAGE_STATS_ENABLED": "0",
           "MLFLOW_DISABLE_TELEMETRY": "true", "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1"}
    env.pop("TURNRL_PIPELINE_KEY", None)
    return env


def run_once(base: Path, scratch: Path, variant: str, steps: int, uri: str, index: int) -> dict:
    project = scratch / f"{variant}-{index}"
    shutil.rmtree(project, ignore_errors=True)
    project.mkdir(parents=True)
    shutil.copytree(base / "data", project / "data")
    shutil.copytree(base / "models", project / "models")
    params = yaml.safe_load((base / "params.yaml").read_text())
    params["train"].update(steps=steps, checkpoint_every=0)
    from turnrl.config import Config   # this checkout's defaults, whatever params.yaml the base was made with
    tracking = {**Config().tracking.model_dump(), "uri": uri, "experiment": f"tracking-cost-{variant}"}
    for key, value in VARIANTS[variant].items():
        tracking[key] = {**tracking[key], **value} if isinstance(value, dict) else value
    params["tracking"] = tracking
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    ray_tmp = tempfile.mkdtemp(prefix="ray", dir="/tmp")
    load = os.getloadavg()[0]
    start = time.perf_counter()
    done = subprocess.run([sys.executable, str(ROOT / "stages/train.py")], cwd=project,
                          env={**_env(project), "RAY_TMPDIR": ray_tmp}, capture_output=True, text=True)
    wall = time.perf_counter() - start
    shutil.rmtree(ray_tmp, ignore_errors=True)
    if done.returncode != 0:
        raise RuntimeError(f"{variant}: train stage failed\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    import csv

    import mlflow
    rows = list(csv.DictReader(open(project / "plots/train.csv")))
    step_s = [float(r["step_s"]) for r in rows]
    store = uri if uri.startswith("http") else f"sqlite:///{project / 'mlflow.db'}"
    mlflow.set_tracking_uri(store)
    client = mlflow.MlflowClient(store)
    run, = client.search_runs([client.get_experiment_by_name(tracking["experiment"]).experiment_id],
                              "tags.`turnrl.pipeline.stage` = 'train'")
    by_step = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "timing/tracking_s")}
    on_step = [by_step.get(s + 1, 0.0) for s in range(1, steps)]   # step s's callback is logged with step s+1
    metrics = run.data.metrics
    traces = len(mlflow.search_traces(locations=[run.info.experiment_id], run_id=run.info.run_id,
                                      return_type="list"))
    return {"variant": variant, "index": index, "tracking": tracking, "load_before": load,
            "load_after": os.getloadavg()[0],
            "wall_s": wall, "step_s": step_s, "on_step_s": on_step,
            "thread_busy_s": metrics.get("timing/mlflow_thread_busy_s"),
            "thread_cpu_s": metrics.get("timing/mlflow_thread_cpu_s"),
            "thread_cpu_s_by_kind": {k.split("/")[-1]: v for k, v in metrics.items()
                                     if k.startswith("timing/mlflow_thread_cpu_s/")},
            "items_sent": metrics.get("timing/mlflow_items_sent"), "traces": traces}


def traced_steps(steps: int, every: int) -> int:
    from turnrl.tracking.traces import traced_step
    return sum(traced_step(s, every, steps) for s in range(1, steps + 1))


def default_cadence_cpu(run: dict, steps: int, default_steps: int) -> float:
    """The Recorder's CPU per step of a run of `default_steps` (the default pipeline's length) at
    the run's trace cadence: a short run traces a larger share of its steps (the first and last
    always), so its per-step trace CPU overstates a default run's. Seconds per step."""
    by_kind = dict(run.get("thread_cpu_s_by_kind") or {})
    trace_cpu = by_kind.pop("traces", 0.0)
    every = run["tracking"]["traces"]["every"]
    per_traced = trace_cpu / max(traced_steps(steps, every), 1)
    return sum(by_kind.values()) / steps + per_traced * traced_steps(default_steps, every) / default_steps


def summarize(results: list[dict], steps: int, default_steps: int = 40) -> dict:
    out = {}
    for variant in VARIANTS:
        runs = [r for r in results if r["variant"] == variant]
        if not runs:
            continue
        step = [s for r in runs for s in r["step_s"][1:]]          # step 1 warms up
        on_step = [s for r in runs for s in r["on_step_s"][1:]]
        per_run = [statistics.median(r["step_s"][1:]) + statistics.median(r["on_step_s"][1:] or [0]) for r in runs]
        out[variant] = {
            "runs": len(runs), "step_s_median": statistics.median(step),
            "on_step_s_median": statistics.median(on_step) if on_step else 0.0,
            "on_step_s_mean": statistics.mean(on_step) if on_step else 0.0,
            "thread_cpu_s_per_step": statistics.mean((r["thread_cpu_s"] or 0) / steps for r in runs),
            "thread_cpu_s_by_kind": {k: statistics.mean((r.get("thread_cpu_s_by_kind") or {}).get(k, 0.0) for r in runs)
                                     for k in sorted({k for r in runs for k in r.get("thread_cpu_s_by_kind") or {}})},
            "thread_cpu_s_per_step_default_run": statistics.mean(default_cadence_cpu(r, steps, default_steps)
                                                                 for r in runs),
            "thread_busy_s_per_step": statistics.mean((r["thread_busy_s"] or 0) / steps for r in runs),
            "loop_s_per_run": per_run, "wall_s": [round(r["wall_s"], 1) for r in runs],
            "traces": [r["traces"] for r in runs],
            "load": [round(r["load_before"], 1) for r in runs],
        }
    if "off" in out:
        base = out["off"]["step_s_median"] + out["off"]["on_step_s_median"]
        for variant, s in out.items():
            s["measured_pct"] = 100 * ((s["step_s_median"] + s["on_step_s_median"]) / base - 1)
            s["accounted_pct"] = 100 * (s["on_step_s_mean"] + s["thread_cpu_s_per_step"]
                                        - out["off"]["on_step_s_mean"] - out["off"]["thread_cpu_s_per_step"]) / base
            s["accounted_default_run_pct"] = 100 * (
                s["on_step_s_mean"] + s["thread_cpu_s_per_step_default_run"]
                - out["off"]["on_step_s_mean"] - out["off"]["thread_cpu_s_per_step_default_run"]) / base
            # each repeat against the `off` run just before it: machine drift between repeats cancels
            pairs = [100 * (v / o - 1) for v, o in zip(s["loop_s_per_run"], out["off"]["loop_s_per_run"])]
            s["paired_pct"] = pairs
            s["paired_pct_mean"] = statistics.mean(pairs)
            s["paired_pct_std"] = statistics.stdev(pairs) if len(pairs) > 1 else 0.0
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--variants", nargs="+", default=["off", "on", "every"], choices=list(VARIANTS))
    ap.add_argument("--server", action="store_true", help="record to a local `mlflow server` instead of sqlite")
    ap.add_argument("--model", type=Path, default=None, help="a warm-started models/initial to reuse")
    ap.add_argument("--scratch", type=Path, default=Path(tempfile.gettempdir()) / "turnrl-tracking-cost")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args(argv)
    base = prepare(args.scratch, args.steps, args.model)
    server = None
    uri = ""
    if args.server:
        sys.path.insert(0, str(ROOT / "tests"))
        from mlflow_server import MlflowServer
        server = MlflowServer(args.scratch / "server").start()
        uri = server.uri
    results = []
    try:
        for i in range(args.repeats):          # back to back, alternating
            for variant in args.variants:
                r = run_once(base, args.scratch, variant, args.steps, uri, i)
                results.append(r)
                print(f"{variant} #{i}: step {statistics.median(r['step_s'][1:]):.3f} s, on_step "
                      f"{statistics.median(r['on_step_s'][1:] or [0]):.4f} s, thread cpu {r['thread_cpu_s'] or 0:.2f} s, "
                      f"{r['traces']} traces, wall {r['wall_s']:.0f} s, load {r['load_before']:.1f}", flush=True)
    finally:
        if server:
            server.kill()
    from turnrl.config import Config
    default_steps = Config().train.steps
    summary = summarize(results, args.steps, default_steps)
    stamp = datetime.date.today().isoformat()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"tracking-cost-{'server' if args.server else 'sqlite'}-{stamp}.json"
    path.write_text(json.dumps({"steps": args.steps, "repeats": args.repeats, "store": "server" if args.server
                                else "sqlite", "summary": summary, "runs": results,
                                "nproc": os.cpu_count()}, indent=1))
    for variant, s in summary.items():
        print(f"{variant:6s} step {s['step_s_median']:.3f} s + on_step {s['on_step_s_median']:.4f} s; thread cpu "
              f"{s['thread_cpu_s_per_step']:.4f} s/step; measured {s.get('measured_pct', 0):+.1f}%, paired "
              f"{s.get('paired_pct_mean', 0):+.1f} +- {s.get('paired_pct_std', 0):.1f}%, accounted "
              f"{s.get('accounted_pct', 0):+.2f}% ({s.get('accounted_default_run_pct', 0):+.2f}% at a "
              f"{default_steps}-step run's trace cadence)")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
