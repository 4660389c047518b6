"""Does dynamic sampling (algorithm.dynamic_sampling) pay on the embedded default, and what does
it cost? The same run with and without it, in sync and in async mode, on seeds 0 1 2, through
`dvc exp run` as a user runs it (the benchmarks/learning.py machinery: one scratch copy of the
committed project shared by the rows, so a seed's preprocess, warm start and baseline are made once;
results after every run, an interrupted benchmark resumes), 20 steps each:

    python benchmarks/dynamic_sampling.py                      # 4 rows x 3 seeds -> benchmarks/DYNAMIC_SAMPLING.md
    python benchmarks/dynamic_sampling.py --rows sync sync_ds --seeds 0

Per run: held-out accuracy before and after, the trajectories generated (the batches' and the
refills'), wall time, the share of groups without signal that were trained on
(`groups_all_same_frac` of the trained batches; target 0 with dynamic sampling), the groups dropped
and how often the budget ran out. The embedded default's warm start leaves many groups
all-correct or all-wrong, the case dynamic sampling is for.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.learning import (Row, commits_line, flags_text, mean_sd, result_section, run_one,  # noqa: E402
                                 run_rows, seeds_text, with_notes)

STEPS = ["train.steps=20"]   # as the README's plain GRPO rows: most of the gain, half the time of 40
DS = "algorithm.dynamic_sampling.enabled=true"
ASYNC = ["train.mode=async", "algorithm.policy_loss=decoupled"]
ROWS = [Row("sync", "code_tool", "grpo", sets=STEPS), Row("sync_ds", "code_tool", "grpo", sets=[*STEPS, DS]),
        Row("async", "code_tool", "grpo", sets=[*STEPS, *ASYNC]),
        Row("async_ds", "code_tool", "grpo", sets=[*STEPS, *ASYNC, DS])]


def run(project: Path, row: Row, seed: int, extra: list[str]) -> dict:
    result = run_one(project, row, seed, extra)
    if "failed" in result:
        return result
    import pandas as pd
    import yaml
    curve = pd.read_csv(project / "plots/train.csv")
    params = yaml.safe_load((project / "params.yaml").read_text())
    batch = params["train"]["prompts_per_step"] * params["rollout"]["n"]
    extra_trajs = curve["dynamic_extra_trajectories"].sum() if "dynamic_extra_trajectories" in curve else 0.0
    result.update(
        trajectories=int(batch * len(curve) + extra_trajs),
        no_signal_trained_frac=round(float(curve["groups_all_same_frac"].mean()), 4),
        train_s=round(float(curve["step_s"].sum()), 1))
    for key in ("dynamic_dropped_groups", "dynamic_budget_hit", "dynamic_signal_frac"):
        if key in curve:
            result[key] = round(float(curve[key].mean()), 4)
    return result


def report(results: list[dict], seeds: list[int]) -> str:
    lines = ["| row | gain, mean ± sd | trained accuracy (mean) | trajectories (mean) | train s (mean) | "
             "no-signal groups trained on | dropped groups per step | budget hit (share of steps) |",
             "|---|---|---|---|---|---|---|---|"]
    figures: dict[str, dict] = {}
    for row in ROWS:
        done = sorted((r for r in results if r["row"] == row.name and "gain_pts" in r), key=lambda r: r["seed"])
        if not done:
            continue
        avg = lambda key: statistics.mean(r.get(key, 0.0) for r in done)  # noqa: E731
        gains = [r["gain_pts"] for r in done]
        figures[row.name] = {"done": done, "gain": mean_sd(gains), "mean": statistics.mean(gains),
                             "sd": statistics.stdev(gains) if len(gains) > 1 else None,
                             "trajectories": f"{avg('trajectories'):.0f}", "train_s": f"{avg('train_s'):.0f}"}
        lines.append(f"| {row.name} | {mean_sd(gains)} | {avg('trained'):.3f} | "
                     f"{avg('trajectories'):.0f} | {avg('train_s'):.0f} | {avg('no_signal_trained_frac'):.3f} | "
                     f"{avg('dynamic_dropped_groups'):.2f} | {avg('dynamic_budget_hit'):.2f} |")
    headline = "Not run yet."
    off, on = figures.get("sync"), figures.get("sync_ds")
    if off and on:
        # on pays only if its gain is beyond the seeds' spread of the run without it
        pays = off["sd"] is not None and on["mean"] - off["mean"] > off["sd"]
        headline = (f"**Recommended on this task: dynamic sampling {'on' if pays else 'off (the default)'}.** In sync, "
                    f"with it (`sync_ds`) the gain was {on['gain']} points for {on['trajectories']} trajectories and "
                    f"{on['train_s']} s of training; without it (`sync`) {off['gain']} for {off['trajectories']} and "
                    f"{off['train_s']} s, on {seeds_text(off['done'])}"
                    + ("." if pays else ": no more than the seeds' spread, at a multiple of the cost."))
        if "async" in figures and "async_ds" in figures:
            a, b = figures["async"], figures["async_ds"]
            headline += f" In async, on {seeds_text(a['done'])}: {b['gain']} with it against {a['gain']} without."
    table, lines = lines, ["# Dynamic sampling on the embedded default", "",
                           *result_section(headline, lines, "python benchmarks/dynamic_sampling.py",
                                           "dynamic_sampling.json"),
                           "", "## What was measured", "",
                           "Generated by `python benchmarks/dynamic_sampling.py`: the embedded default (`dvc exp run`, "
                           "`eval.benchmarks=[]`, `train.steps=20`) with and without "
                           "`algorithm.dynamic_sampling.enabled`, sync and async, on the seeds each row's gain counts "
                           "(asked: " + ", ".join(map(str, seeds)) + "). Held-out accuracy (task block), gain in points; "
                           "trajectories generated over the run; training seconds (the sum of the steps)."]
    lines += ["", "## Per seed", "", "| row | seed | baseline | trained | gain | trajectories | train s | health flags |",
              "|---|---|---|---|---|---|---|---|"]
    for r in sorted(results, key=lambda r: (r["row"], r["seed"])):
        if "failed" in r:
            lines.append(f"| {r['row']} | {r['seed']} | - | - | failed: {r['failed'][-200:]!r} | - | - | - |")
            continue
        lines.append(f"| {r['row']} | {r['seed']} | {r['baseline']:.3f} | {r['trained']:.3f} | {r['gain_pts']:+.1f} | "
                     f"{r['trajectories']} | {r['train_s']:.0f} | {flags_text(r.get('health', {}))} |")
    return "\n".join(lines + ["", commits_line(results)]) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--rows", nargs="+", choices=[r.name for r in ROWS])
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/turnrl_dynamic_sampling_bench"))
    parser.add_argument("--results", type=Path, default=ROOT / "benchmarks/dynamic_sampling.json")
    parser.add_argument("--report", type=Path, default=ROOT / "benchmarks/DYNAMIC_SAMPLING.md")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    rows = [row for row in ROWS if not args.rows or row.name in args.rows]
    results = run_rows(rows, args.seeds, lambda row: args.work_dir, args.results, run, args.set,
                       lambda done: args.report.write_text(with_notes(report(done, args.seeds), args.report)))
    print(args.report.read_text() if args.report.exists() else "nothing run")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
