"""Does every method learn on every seed? Each row of the README's algorithm table and every
preset in configs/ that runs on a CPU, for seeds 0, 1 and 2, through the real pipeline exactly
as a user runs it:

    dvc exp run $(python -m turnrl.presets NAME) -S seed=S        # a preset row
    dvc exp run -S env.name=E -S algorithm.name=A -S train.steps=20 -S seed=S   # a plain algorithm row

    python benchmarks/learning.py                      # every row, seeds 0 1 2 -> benchmarks/LEARNING.md
    python benchmarks/learning.py --rows mlmt mutis --seeds 0
    nohup python benchmarks/learning.py > learning.log 2>&1 &      # hours: run it in the background

One scratch copy of the project per environment (in --work-dir), of the commit checked out
(`git archive HEAD`: uncommitted edits are not measured), recorded with every result: DVC reuses
the seed's preprocess, warm start and baseline across the rows of that environment. The only key added to
a user's run is `eval.benchmarks=[]` (the held-out task is the measure here; MATH-500 is not
trained on and costs ~45 s per run). Per run it keeps the held-out task accuracy before and
after (sampled at T=1, and greedy), the health flags the run raised (metrics/train.json), and
the training curves (reward, KL to the start, entropy, truncation). Results go to a JSON file
after every run, so an interrupted benchmark resumes where it stopped (finished runs are
skipped); LEARNING.md is rewritten from it each time.

Target (issue 23): every row gains >= +10 points on every seed, and >= +20 on average.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any, Callable
from dataclasses import dataclass, field
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"
COMMON = ["eval.benchmarks=[]"]
CURVES = ("reward_mean", "kl_ref", "entropy", "response_tokens_mean", "finish_truncated_frac",
          "groups_all_same_frac")
TARGET_MIN, TARGET_MEAN = 10.0, 20.0   # points of held-out accuracy


@dataclass
class Row:
    name: str
    env: str
    algorithm: str
    preset: str | None = None              # configs/NAME.yaml, run as `$(python -m turnrl.presets NAME)`
    sets: list[str] = field(default_factory=list)

    def args(self, project: Path) -> list[str]:
        if self.preset:
            out = subprocess.run([sys.executable, "-m", "turnrl.presets", self.preset], cwd=project,
                                 env=_environ(project), capture_output=True, text=True, check=True).stdout.split()
            return out
        return [a for kv in self.sets for a in ("-S", kv)]


def preset_rows(folder: Path = CONFIGS) -> list[Row]:
    """Every preset that runs on a CPU (one asking for GPUs, like gpu_8, does not)."""
    rows = []
    for path in sorted(folder.glob("*.yaml")):
        keys = yaml.safe_load(path.read_text()) or {}
        cluster = keys.get("cluster", {})
        if any(cluster.get(k, 0) for k in ("trainer_gpus", "engine_gpus")):
            continue
        rows.append(Row(path.stem, keys.get("env", {}).get("name", "code_tool"),
                        keys.get("algorithm", {}).get("name", "grpo"), preset=path.stem))
    return rows


def plain_rows() -> list[Row]:
    """The README table's rows that no preset covers: outcome-reward GRPO variants on code_tool."""
    return [Row(alg, "code_tool", alg, sets=["env.name=code_tool", f"algorithm.name={alg}", "train.steps=20"])
            for alg in ("grpo", "dr_grpo", "rloo")]   # 20 steps, as the README's table


def all_rows() -> list[Row]:
    return preset_rows() + plain_rows()


def _environ(project: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(project / "src"), "DVC_NO_ANALYTICS": "1",
            "RAY_USAGE_STATS_ENABLED": "0", "MLFLOW_DISABLE_TELEMETRY": "true", "HF_HUB_OFFLINE": "1",
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}


def head_commit() -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.strip()


def copy_project(dest: Path) -> None:
    """The checked-out commit's files (what a clean clone of it holds) in a fresh git repo, and
    the commit in `dest/COMMIT`."""
    archive = subprocess.run(["git", "archive", "--format=tar", "HEAD"], cwd=ROOT, capture_output=True,
                             check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    (dest / "COMMIT").write_text(head_commit() + "\n")
    git = ["git", "-c", "user.name=turnrl-bench", "-c", "user.email=bench@turnrl.invalid"]
    subprocess.run(["git", "init", "-q"], cwd=dest, check=True)
    subprocess.run([*git, "add", "-A"], cwd=dest, check=True)
    subprocess.run([*git, "commit", "-q", "-m", "benchmark copy"], cwd=dest, check=True)


def run_one(project: Path, row: Row, seed: int, extra: list[str]) -> dict:
    # `dvc exp run` leaves the experiment's params in the workspace's params.yaml: start every run
    # from the committed file, or a row inherits the keys of the row before it (a LoRA row's
    # model.lora and train.lr stayed for the next full fine-tuning row, which DVC then skipped)
    subprocess.run(["git", "checkout", "HEAD", "--", "params.yaml"], cwd=project, check=True)
    cmd = ["dvc", "exp", "run", *row.args(project),
           *[a for kv in [f"seed={seed}", *COMMON, *extra] for a in ("-S", kv)]]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=project, env=_environ(project), capture_output=True, text=True)
    log = project / f"exp_{row.name}_{seed}.log"
    log.write_text(proc.stdout + proc.stderr)
    wall = round(time.perf_counter() - start, 1)
    read = lambda name: json.loads((project / "metrics" / name).read_text())  # noqa: E731
    commit = (project / "COMMIT").read_text().strip() if (project / "COMMIT").exists() else "unknown"
    result = {"row": row.name, "env": row.env, "algorithm": row.algorithm, "seed": seed, "wall_s": wall,
              "command": " ".join(cmd), "commit": commit}
    if proc.returncode != 0:   # e.g. train.on_unhealthy: stop; recorded, not retried
        return {**result, "failed": (proc.stdout + proc.stderr)[-1500:]}
    baseline, final, train = read("baseline.json")["task"], read("eval.json")["task"], read("train.json")
    import pandas as pd
    curve = pd.read_csv(project / "plots/train.csv")
    return {
        **result,
        "baseline": baseline["accuracy"], "trained": final["accuracy"],
        "gain_pts": round(100 * (final["accuracy"] - baseline["accuracy"]), 1),
        "baseline_greedy": baseline.get("accuracy_greedy"), "trained_greedy": final.get("accuracy_greedy"),
        "n": final["n"], "steps": train["steps"],
        "health": train.get("health", {}),
        "curves": {k: [round(float(v), 4) for v in curve[k]] for k in CURVES if k in curve},
    }


def run_rows(rows: list[Row], seeds: list[int], project_of: Callable[[Row], Path], results_path: Path,
             run: Callable[[Path, Row, int, list[str]], dict], extra: list[str],
             write_report: Callable[[list[dict]], Any]) -> list[dict]:
    """Every (row, seed) not yet in the results file, seed-major (a partial run has every row's
    first seed), in the row's scratch copy of the project (`project_of`, made on first use); the
    results file and the report rewritten after every run, so an interrupted benchmark resumes."""
    results = json.loads(results_path.read_text()) if results_path.exists() else []
    done = {(r["row"], r["seed"]) for r in results}
    for seed in seeds:
        for row in rows:
            if (row.name, seed) in done:
                continue
            project = project_of(row)
            if not (project / "dvc.yaml").exists():
                project.mkdir(parents=True, exist_ok=True)
                copy_project(project)
            print(f"{row.name} seed {seed} ...", flush=True)
            results.append(run(project, row, seed, extra))
            results_path.write_text(json.dumps(results, indent=1) + "\n")
            write_report(results)
            print(json.dumps({k: v for k, v in results[-1].items() if k != "curves"}), flush=True)
    return results


# --------------------------------------------------------------------------- report
NOTES = "## What these numbers are"   # a report's hand-written part, kept when its script rewrites it


def with_notes(report_text: str, path: Path) -> str:
    """The generated report followed by the hand-written notes of the existing file, if any."""
    old = path.read_text() if path.exists() else ""
    return report_text + ("\n" + old[old.index(NOTES):] if NOTES in old else "")


# Where the benchmarks in this folder ran (their notes say what else shared it during a run)
MACHINE = "2 CPU cores, no GPU"


def result_section(headline: str, table: list[str], command: str, record: str, machine: str = MACHINE) -> list[str]:
    """The section a results page opens with: what to use and what it gives against its baseline
    (`headline`, with the seeds), the current table, the machine, the one command that reproduces
    it, and where every run is kept (`record`: the results JSON, as a link relative to the page)."""
    return ["## Result", "", headline, "", *table, "",
            f"- **Machine**: {machine}.",
            f"- **Reproduce**: `{command}`.",
            f"- **Every run**: [{record}]({record}) (and this page's git history); the tables here are written "
            "from it."]


def row_figures(results: list[dict], name: str) -> tuple[list[dict], str, str]:
    """A row's finished runs by seed, its gain (mean ± sd) and its accuracy before → after (means)."""
    done = sorted((r for r in results if r.get("row") == name and "gain_pts" in r), key=lambda r: r["seed"])
    acc = (f"{statistics.mean(r['baseline'] for r in done):.3f} → {statistics.mean(r['trained'] for r in done):.3f}"
           if done else "-")
    return done, mean_sd([r["gain_pts"] for r in done]), acc


def seeds_text(done: list[dict]) -> str:
    seeds = [r["seed"] for r in done]
    return f"{len(seeds)} seed{'s' if len(seeds) != 1 else ''} ({', '.join(map(str, seeds))})"


def commits_line(results: list[dict]) -> str:
    commits = sorted({r.get("commit", "unknown") for r in results})
    return f"Measured at commit{'s' if len(commits) > 1 else ''} {', '.join(commits)}."


def mean_sd(values: list[float], fmt: str = "{:+.1f}", sd_fmt: str = "{:.1f}") -> str:
    if not values:
        return "-"
    if len(values) == 1:
        return fmt.format(values[0]) + " (1 seed)"
    return f"{fmt.format(statistics.mean(values))} ± {sd_fmt.format(statistics.stdev(values))}"


def verdict(gains: list[float], seeds: int) -> str:
    if len(gains) < seeds:
        return f"{len(gains)}/{seeds} seeds done"
    ok = min(gains) >= TARGET_MIN and statistics.mean(gains) >= TARGET_MEAN
    return "met" if ok else "**not met**"


def flags_text(health: dict) -> str:
    raised = health.get("flags", {}) if isinstance(health, dict) else {}
    return ", ".join(f"{k} (step {v['first_step']}, {v['steps']} steps)" for k, v in raised.items()) or "none"


RECOMMENDED = "grpo"   # params.yaml's algorithm on its environment: the row a user starts from


def report(results: list[dict], rows: list[Row], seeds: list[int]) -> str:
    table = ["| row | `env.name` | `algorithm.name` | command | gain, mean ± sd | per seed | baseline → trained (mean) "
             "| target |", "|---|---|---|---|---|---|---|---|"]
    met = 0
    for row in rows:
        done, gain, acc = row_figures(results, row.name)
        failed = [r for r in results if r["row"] == row.name and "failed" in r]
        gains = [r["gain_pts"] for r in done]
        how = f"`$(python -m turnrl.presets {row.preset})`" if row.preset else \
            "`" + " ".join(f"-S {s}" for s in row.sets) + "`"
        per_seed = ", ".join(f"{r['seed']}: {r['gain_pts']:+.1f}" for r in done) + \
            "".join(f", {r['seed']}: failed" for r in failed)
        met += verdict(gains, len(seeds)) == "met"
        table.append(f"| {row.name} | `{row.env}` | `{row.algorithm}` | {how} | {gain} | {per_seed or '-'} | "
                     f"{acc} | {verdict(gains, len(seeds))} |")
    done, gain, acc = row_figures(results, RECOMMENDED)
    headline = (f"{met} of {len(rows)} rows met the target (every seed >= +{TARGET_MIN:.0f} points of held-out "
                f"accuracy over the row's own warm start, mean >= +{TARGET_MEAN:.0f}).")
    not_run = [row.name for row in rows if not row_figures(results, row.name)[0]]
    if not_run:
        headline = headline[:-1] + f"; not run yet: {', '.join(not_run)}."
    if done:
        headline += (f" params.yaml's algorithm and environment, `{RECOMMENDED}` on `code_tool` (20 steps), gains "
                     f"**{gain}** points ({acc}) on {seeds_text(done)}.")
    lines = ["# Learning on every seed", "",
             *result_section(headline, table, "python benchmarks/learning.py", "learning.json"),
             "", "## What was measured", "",
             "Generated by `python benchmarks/learning.py` (issue 23): every row of the README's algorithm table and",
             "every CPU preset in `configs/`, through the real pipeline (`dvc exp run ... -S seed=S`, with",
             "`eval.benchmarks=[]`), on the embedded tiny model and its synthetic tasks. Held-out accuracy on 256",
             "problems, sampled at T=1 (greedy in the per-seed table). Gain in points: trained minus baseline, the",
             "baseline being the row's warm start before RL.",
             ]
    commits = sorted({r.get("commit", "unknown") for r in results})
    lines += ["", f"Measured at commit{'s' if len(commits) > 1 else ''} {', '.join(commits)}. Health flags are "
              "those each run raised under its commit's checks (until 6078e9d `kl_runaway` fired on a single "
              "step's KL; it now needs `train.health.window` steps in a row).",
              "", "## Per seed", "",
              "| row | seed | baseline | trained | greedy: baseline → trained | gain | health flags | run (s) |",
              "|---|---|---|---|---|---|---|---|"]
    order = {row.name: i for i, row in enumerate(rows)}
    for r in sorted(results, key=lambda r: (order.get(r["row"], 99), r["seed"])):
        if "failed" in r:
            lines.append(f"| {r['row']} | {r['seed']} | - | - | - | failed: {r['failed'][-200:]!r} | - | {r['wall_s']:.0f} |")
            continue
        greedy = (f"{r['baseline_greedy']:.3f} → {r['trained_greedy']:.3f}"
                  if r.get("trained_greedy") is not None else "-")
        lines.append(f"| {r['row']} | {r['seed']} | {r['baseline']:.3f} | {r['trained']:.3f} | {greedy} | "
                     f"{r['gain_pts']:+.1f} | {flags_text(r.get('health', {}))} | {r['wall_s']:.0f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--rows", nargs="+", help="rows to run (default: all): preset names and grpo, dr_grpo, rloo")
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/turnrl_learning"))
    parser.add_argument("--results", type=Path, default=ROOT / "benchmarks/learning.json")
    parser.add_argument("--report", type=Path, default=ROOT / "benchmarks/LEARNING.md")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="extra params for every run (changes what is measured: say so)")
    parser.add_argument("--report-only", action="store_true", help="rewrite the report from the results file")
    args = parser.parse_args(argv)

    rows = all_rows()
    unknown = set(args.rows or []) - {r.name for r in rows}
    if unknown:
        parser.error(f"unknown rows {sorted(unknown)}; rows: {', '.join(r.name for r in rows)}")
    chosen = [r for r in rows if not args.rows or r.name in args.rows]
    results = json.loads(args.results.read_text()) if args.results.exists() else []
    if not args.report_only:
        results = run_rows(chosen, args.seeds, lambda row: args.work_dir / row.env, args.results, run_one, args.set,
                           lambda done: args.report.write_text(report(done, rows, args.seeds)))
    args.report.write_text(report(results, rows, args.seeds))
    print(args.report.read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
