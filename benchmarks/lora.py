"""LoRA against full fine-tuning on the embedded default (issue 21, part 3), through the real
pipeline as a user runs it, in one scratch copy of the project (`git archive HEAD`, as
benchmarks/learning.py makes them):

    dvc exp run -S seed=S -S eval.benchmarks=[] -S train.steps=20                  # full fine-tuning
    dvc exp run -S seed=S -S eval.benchmarks=[] -S train.steps=20 -S model.lora.r=8 -S model.lora.alpha=16 -S train.lr=LR

    python benchmarks/lora.py                                  # the rows below, seeds 0 1 2 -> benchmarks/LORA.md
    python benchmarks/lora.py --rows full lora_lr5e-3 --seeds 0
    nohup python benchmarks/lora.py > lora.log 2>&1 &          # hours on 2 cores: run it in the background

env code_tool, algorithm grpo, 20 steps (as the README's code_tool rows), everything else the
default. DVC reuses a seed's preprocess, warm start and baseline across the rows (the warm
start does not depend on model.lora), so every row of a seed starts from the same model and is
scored against the same baseline. Results go to a JSON file after every run (an interrupted benchmark resumes where it
stopped); LORA.md is rewritten from it each time.

Margin (stated before the runs): LoRA's mean gain over the seeds is within 10 points of full
fine-tuning's, and every LoRA seed gains at least +10 points (learning.py's per-seed floor).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from learning import Row, copy_project, result_section, row_figures, run_one, seeds_text  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MARGIN_PTS, FLOOR_PTS = 10.0, 10.0
BASE = ["env.name=code_tool", "algorithm.name=grpo", "train.steps=20"]   # as the README's code_tool rows


def lora_row(lr: str, r: int = 8, alpha: int = 16) -> Row:
    return Row(f"lora_lr{lr}" + (f"_r{r}_a{alpha}" if (r, alpha) != (8, 16) else ""), "code_tool", "grpo",
               sets=BASE + [f"model.lora.r={r}", f"model.lora.alpha={alpha}", f"train.lr={lr}"])


ROWS = [Row("full", "code_tool", "grpo", sets=BASE)] + [lora_row(lr) for lr in ("2e-3", "5e-3", "1e-2")]


def _extra(project: Path) -> dict:
    """What metrics/train.json says about the run's cost (kept beside learning.py's fields)."""
    try:
        train = json.loads((project / "metrics/train.json").read_text())
    except (OSError, ValueError):
        return {}
    return {k: train.get(k) for k in ("step_s_mean", "train_s_mean", "sync_s_mean", "rollout_s_mean", "wall_s",
                                      "logp_gap_max")}


def report(results: list[dict], rows: list[Row], seeds: list[int]) -> str:
    full = {r["seed"]: r for r in results if r["row"] == "full" and "gain_pts" in r}
    lines = ["| row | params | gain, mean ± sd | per seed | baseline → trained (mean) | vs full (mean gain) | "
             "step s (mean) | sync s (mean) | margin |",
             "|---|---|---|---|---|---|---|---|---|"]
    verdicts: dict[str, tuple[str, float]] = {}
    for row in rows:
        done = sorted((r for r in results if r["row"] == row.name and "gain_pts" in r), key=lambda r: r["seed"])
        if not done:
            continue
        gains = [r["gain_pts"] for r in done]
        per_seed = ", ".join(f"{r['seed']}: {r['gain_pts']:+.1f}" for r in done)
        mean = statistics.mean(gains)
        sd = f" ± {statistics.stdev(gains):.1f}" if len(gains) > 1 else " (1 seed)"
        paired = [full[r["seed"]]["gain_pts"] for r in done if r["seed"] in full]
        versus = f"{mean - statistics.mean(paired):+.1f}" if row.name != "full" and len(paired) == len(done) else "-"
        if row.name == "full":
            verdict = "-"
        elif len(done) < len(seeds) or len(paired) < len(done):
            verdict = f"{len(done)}/{len(seeds)} seeds"
        else:
            ok = mean >= statistics.mean(paired) - MARGIN_PTS and min(gains) >= FLOOR_PTS
            verdict = "met" if ok else "**not met**"
        verdicts[row.name] = (verdict, mean)
        step = [r["step_s_mean"] for r in done if r.get("step_s_mean")]
        sync = [r["sync_s_mean"] for r in done if r.get("sync_s_mean") is not None]
        params = " ".join(f"`{s}`" for s in row.sets[len(BASE):]) or "(defaults)"
        lines.append(f"| {row.name} | {params} | {mean:+.1f}{sd} | {per_seed} | "
                     f"{statistics.mean(r['baseline'] for r in done):.3f} → "
                     f"{statistics.mean(r['trained'] for r in done):.3f} | {versus} | "
                     f"{statistics.mean(step):.2f} | {statistics.mean(sync):.3f} | {verdict} |" if step and sync else
                     f"| {row.name} | {params} | {mean:+.1f}{sd} | {per_seed} | - | {versus} | - | - | {verdict} |")
    table, lines = lines, ["# LoRA against full fine-tuning", ""]
    met = sorted((mean, name) for name, (verdict, mean) in verdicts.items() if verdict == "met")
    by_name = {row.name: row for row in rows}
    if met and full:
        best = met[-1][1]
        done, gain, _ = row_figures(results, best)
        headline = (f"**Recommended: `{best}`** ({' '.join(f'`{s}`' for s in by_name[best].sets[len(BASE):])}): "
                    f"**{gain}** points of held-out accuracy against full fine-tuning's "
                    f"**{row_figures(results, 'full')[1]}**, on {seeds_text(done)}; the margin is met.")
        missed = [f"`{name}` {row_figures(results, name)[1]}" for name, (verdict, _) in verdicts.items()
                  if verdict == "**not met**"]
        if missed:
            headline += " Not met: " + ", ".join(missed) + "."
    else:
        headline = "No LoRA row has met the margin yet."
    lines += result_section(headline, table, "python benchmarks/lora.py", "lora.json")
    lines += ["", "## What was measured", "",
              "Generated by `python benchmarks/lora.py`: `env.name=code_tool`, `algorithm.name=grpo`, 20 steps, the",
              "defaults otherwise, through `dvc exp run` in a scratch copy of the project (with `eval.benchmarks=[]`).",
              "Held-out accuracy on 256 problems sampled at T=1; gain in points. Every row of a seed starts from the",
              "same warm start and is scored against the same baseline.", "",
              f"Margin (stated before the runs): LoRA's mean gain within {MARGIN_PTS:.0f} points of full "
              f"fine-tuning's, and every LoRA seed at least +{FLOOR_PTS:.0f}."]
    lines += ["", "## Per seed", "", "| row | seed | baseline | trained | greedy: baseline → trained | gain | "
              "health flags | run (s) |", "|---|---|---|---|---|---|---|---|"]
    order = {row.name: i for i, row in enumerate(rows)}
    for r in sorted(results, key=lambda r: (r["seed"], order.get(r["row"], 99))):
        if "failed" in r:
            lines.append(f"| {r['row']} | {r['seed']} | - | - | - | failed: {r['failed'][-200:]!r} | - | "
                         f"{r['wall_s']:.0f} |")
            continue
        greedy = (f"{r['baseline_greedy']:.3f} → {r['trained_greedy']:.3f}"
                  if r.get("trained_greedy") is not None else "-")
        flags = ", ".join(r.get("health", {}).get("flags", {})) or "none"
        lines.append(f"| {r['row']} | {r['seed']} | {r['baseline']:.3f} | {r['trained']:.3f} | {greedy} | "
                     f"{r['gain_pts']:+.1f} | {flags} | {r['wall_s']:.0f} |")
    commits = sorted({r.get("commit", "unknown") for r in results})
    lines += ["", f"Measured at commit{'s' if len(commits) > 1 else ''} {', '.join(commits)}. The step and sync times "
              "come from runs at different machine loads (some beside other benchmarks): they do not compare the "
              "rows' speed."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--rows", nargs="+", help="rows to run (default: all): full, lora_lr2e-3, ... or "
                                                  "lora:LR[:R:ALPHA] for another setting")
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/turnrl_lora"))
    parser.add_argument("--results", type=Path, default=ROOT / "benchmarks/lora.json")
    parser.add_argument("--report", type=Path, default=ROOT / "benchmarks/LORA.md")
    parser.add_argument("--report-only", action="store_true", help="rewrite the report from the results file")
    args = parser.parse_args(argv)

    rows = list(ROWS)
    for name in args.rows or []:
        if name.startswith("lora:"):
            lr, *rest = name.split(":")[1:]
            rows.append(lora_row(lr, *map(int, rest)) if rest else lora_row(lr))
    wanted = {r.name for r in rows} if not args.rows else \
        {n for n in args.rows if not n.startswith("lora:")} | {r.name for r in rows[len(ROWS):]}
    unknown = wanted - {r.name for r in rows}
    if unknown:
        parser.error(f"unknown rows {sorted(unknown)}; rows: {', '.join(r.name for r in rows)}")
    chosen = [r for r in rows if r.name in wanted]
    results = json.loads(args.results.read_text()) if args.results.exists() else []
    rows += [Row(n, "code_tool", "grpo") for n in dict.fromkeys(r["row"] for r in results) if n not in
             {r.name for r in rows}]
    done = {(r["row"], r["seed"]) for r in results}
    project = args.work_dir / "code_tool"
    if not args.report_only:
        for seed in args.seeds:
            for row in chosen:
                if (row.name, seed) in done:
                    continue
                if not (project / "dvc.yaml").exists():
                    project.mkdir(parents=True, exist_ok=True)
                    copy_project(project)
                print(f"{row.name} seed {seed} ...", flush=True)
                result = run_one(project, row, seed, [])
                result.update(_extra(project) if "failed" not in result else {})
                results.append(result)
                args.results.write_text(json.dumps(results, indent=1) + "\n")
                args.report.write_text(report(results, rows, args.seeds))
                print(json.dumps({k: v for k, v in result.items() if k != "curves"}), flush=True)
    args.report.write_text(report(results, rows, args.seeds))
    print(args.report.read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
