"""Turn-level credit against plain GRPO, the way MT-GRPO and RoSTE compare them: the same
warm start, data and budget per seed, only `algorithm.name` differs.

    python benchmarks/turn_credit.py --seeds 0 1 2            # writes benchmarks/TURN_CREDIT.md

For each environment and seed, a scratch copy of the project runs the real pipeline with
`dvc exp run -S env.name=E -S seed=S -S algorithm.name=A` for each algorithm in turn; DVC
reuses the seed's preprocess, warm start and baseline, so the algorithms of one seed start from
the same model. Per run it keeps the held-out task accuracy (sampled at the eval temperature),
the tool-call success rate on the held-out set, and the training curve's tool success.
Per run it also reads the training curve back from the run's MLflow store (the scratch
project's `mlflow.db`): the mean training reward over the first half of the steps, and the
first step where it reaches 0.5 (how fast the task is learned, which turn-level credit is
meant to speed up). Results go to a JSON file (resumable: finished runs
are skipped) and a markdown table.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMPARISONS = {
    "code_tool": ["grpo", "mt_grpo"],            # MT-GRPO: turn reward = the code ran
    "search": ["grpo", "ms_grpo", "ms_po"],      # RoSTE: step reward = search ran + answer retrieved
}
# Held-out task only (no MATH-500) and no greedy pass: the comparison is the sampled task accuracy.
# TURN_CREDIT.md was made with --set train.steps=20 --set model.warmstart.skill_steps=600 --set cluster.num_cpus=1.
COMMON = ["eval.benchmarks=[]", "eval.greedy=false"]


def copy_project(dest: Path) -> None:
    """The project's tracked and new files in a fresh git repo (what a clean clone holds)."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=ROOT, capture_output=True, check=True).stdout.decode().split("\0")
    for rel in filter(None, listed):
        if (ROOT / rel).is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, dest / rel)
    git = ["git", "-c", "user.name=turnrl-bench", "-c", "user.email=bench@turnrl.invalid"]
    subprocess.run(["git", "init", "-q"], cwd=dest, check=True)
    subprocess.run([*git, "add", "-A"], cwd=dest, check=True)
    subprocess.run([*git, "commit", "-q", "-m", "benchmark copy"], cwd=dest, check=True)


def run_one(project: Path, env: str, seed: int, algorithm: str, extra: list[str]) -> dict:
    sets = [f"env.name={env}", f"seed={seed}", f"algorithm.name={algorithm}", *COMMON, *extra]
    cmd = ["dvc", "exp", "run", *[a for kv in sets for a in ("-S", kv)]]
    environ = {**os.environ, "PYTHONPATH": str(project / "src"), "DVC_NO_ANALYTICS": "1",
               "RAY_USAGE_STATS_ENABLED": "0", "MLFLOW_DISABLE_TELEMETRY": "true",
               "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=project, env=environ, capture_output=True, text=True)
    (project / f"exp_{env}_{seed}_{algorithm}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    read = lambda name: json.loads((project / "metrics" / name).read_text())  # noqa: E731
    baseline, final, train = read("baseline.json")["task"], read("eval.json")["task"], read("train.json")
    import pandas as pd
    curve = pd.read_csv(project / "plots/train.csv")
    tail = curve.tail(5)
    return {
        "env": env, "seed": seed, "algorithm": algorithm, "wall_s": round(time.perf_counter() - start, 1),
        "baseline_accuracy": baseline["accuracy"], "accuracy": final["accuracy"], "n": final["n"],
        "baseline_tool_success": baseline.get("tool_success_rate"), "tool_success": final.get("tool_success_rate"),
        "tool_call_rate": final.get("tool_call_rate"),
        "train_reward_last5": float(tail["reward_mean"].mean()),
        "train_tool_ok_last5": float(tail["env_tool_ok_mean"].mean()) if "env_tool_ok_mean" in tail else None,
        "steps": train["steps"],
        **curve_summary(training_curve(project, seed, algorithm, "reward_mean")),
    }


def curve_summary(reward: list[float]) -> dict:
    """Mean training reward over the first half of the steps, and the first step it is >= 0.5."""
    half = reward[: max(1, len(reward) // 2)]
    return {"train_reward_first_half": sum(half) / len(half) if half else None,
            "steps_to_reward_0.5": next((i + 1 for i, v in enumerate(reward) if v >= 0.5), None)}


def training_curve(project: Path, seed: int, algorithm: str, metric: str) -> list[float]:
    """Per-step values of `metric` of the newest finished train run with this seed and algorithm."""
    import mlflow
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{project / 'mlflow.db'}")
    experiments = [e.experiment_id for e in client.search_experiments()]
    runs = [r for r in client.search_runs(experiments, order_by=["attributes.start_time DESC"], max_results=500)
            if r.info.run_name == "train" and r.info.status == "FINISHED"
            and r.data.params.get("seed") == str(seed) and r.data.params.get("algorithm.name") == algorithm]
    if not runs:
        return []
    from turnrl.tracking.recorder import mlflow_name   # metrics are logged in sections (rollout/reward_mean)
    history = (client.get_metric_history(runs[0].info.run_id, mlflow_name(metric))
               or client.get_metric_history(runs[0].info.run_id, metric))
    return [m.value for m in sorted(history, key=lambda m: m.step)]


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def mean_sd(values: list[float]) -> str:
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.3f} (1 seed)"
    return f"{statistics.mean(values):.3f} ± {statistics.stdev(values):.3f}"


def table(results: list[dict]) -> str:
    """Markdown: per environment and algorithm, mean ± sd over seeds, then the per-seed rows."""
    lines = []
    envs = list(dict.fromkeys(r["env"] for r in results))
    for env in envs:
        rows = [r for r in results if r["env"] == env]
        algorithms = list(dict.fromkeys(COMPARISONS.get(env, []) + [r["algorithm"] for r in rows]))
        if not rows:
            continue
        seeds = sorted({r["seed"] for r in rows})
        lines += [f"### `{env}` ({len(seeds)} seeds: {', '.join(map(str, seeds))})", "",
                  "| algorithm | held-out accuracy | gain over baseline | tool success (held-out) | tool calls (held-out) "
                  "| training reward, first half | steps to training reward 0.5 |",
                  "|---|---|---|---|---|---|---|"]
        for alg in algorithms:
            mine = [r for r in rows if r["algorithm"] == alg]
            if not mine:
                continue
            gains = [r["accuracy"] - r["baseline_accuracy"] for r in mine]
            lines.append(f"| `{alg}` | {mean_sd([r['accuracy'] for r in mine])} | {mean_sd(gains)} | "
                         f"{mean_sd([r['tool_success'] for r in mine if r['tool_success'] is not None])} | "
                         f"{mean_sd([r['tool_call_rate'] for r in mine if r['tool_call_rate'] is not None])} | "
                         f"{mean_sd([r['train_reward_first_half'] for r in mine if r.get('train_reward_first_half') is not None])} | "
                         f"{mean_sd([r['steps_to_reward_0.5'] for r in mine if r.get('steps_to_reward_0.5') is not None])} |")
        lines += ["", "| seed | algorithm | baseline acc | acc | tool success: baseline → trained | run (s) |",
                  "|---|---|---|---|---|---|"]
        for r in sorted(rows, key=lambda r: (r["seed"], algorithms.index(r["algorithm"]))):
            lines.append(f"| {r['seed']} | `{r['algorithm']}` | {r['baseline_accuracy']:.3f} | {r['accuracy']:.3f} | "
                         f"{_rate(r['baseline_tool_success'])} → {_rate(r['tool_success'])} | {r['wall_s']:.0f} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--envs", nargs="+", default=list(COMPARISONS), choices=list(COMPARISONS))
    parser.add_argument("--compare", action="append", default=[], metavar="ENV=ALG,ALG",
                        help="other pairs to run instead of --envs, e.g. --compare intervention=grpo,ppo")
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/turnrl_turn_credit"))
    parser.add_argument("--results", type=Path, default=ROOT / "benchmarks/turn_credit.json")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="extra params for every run, e.g. --set train.steps=30")
    args = parser.parse_args(argv)

    results = json.loads(args.results.read_text()) if args.results.exists() else []
    for r in results:   # runs recorded before the curve columns existed: read them now
        project = args.work_dir / r["env"]
        if "train_reward_first_half" not in r and (project / "mlflow.db").exists():
            r.update(curve_summary(training_curve(project, r["seed"], r["algorithm"], "reward_mean")))
    args.results.write_text(json.dumps(results, indent=2) + "\n")
    done = {(r["env"], r["seed"], r["algorithm"]) for r in results}
    plan = ({env: algs.split(",") for env, algs in (c.split("=", 1) for c in args.compare)}
            if args.compare else {env: COMPARISONS[env] for env in args.envs})
    for env, algorithms in plan.items():
        project = args.work_dir / env
        if not (project / "dvc.yaml").exists():
            project.mkdir(parents=True, exist_ok=True)
            copy_project(project)
        for seed in args.seeds:
            for algorithm in algorithms:
                if (env, seed, algorithm) in done:
                    continue
                print(f"{env} seed {seed} {algorithm} ...", flush=True)
                results.append(run_one(project, env, seed, algorithm, args.set))
                args.results.write_text(json.dumps(results, indent=2) + "\n")
                print(json.dumps(results[-1]), flush=True)
    print(table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
