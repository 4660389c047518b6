"""Does an agent program learn through the gateway, as well and as fast as the same task as a
built-in environment? Three seeds of each, through the real pipeline as a user runs it:

    gateway   dvc exp run $(python -m turnrl.presets agent) -S seed=S
              examples/agents/calculator_agent.py (the openai SDK only: two tools it runs itself,
              its own stop rule) through the OpenAI-compatible gateway
    builtin   dvc exp run -S env.name=benchmarks.agent_task:ENV -S '++env.options.functions=[...]' -S seed=S:
              the `tools` environment with the same two functions, warm-started on the agent's own
              demonstration hook (benchmarks/agent_task.py), so the prompt, the tool results, the stop
              rule (a reply without a tool call is the answer) and the warm start are the same

    python benchmarks/agent.py                       # both rows, seeds 0 1 2 -> benchmarks/AGENT.md
    python benchmarks/agent.py --rows gateway --seeds 0

Per run: held-out accuracy before and after (256 problems, T=1, and greedy), the gain, samples and
calls per episode, health flags, and the mean seconds per training step (rollout and whole step),
whose ratio gateway / builtin is the gateway's cost. Like benchmarks/learning.py (whose machinery
it uses): one scratch copy of the committed project per row, results after every run in a JSON
file (an interrupted benchmark resumes), the report rewritten each time.

Targets (the issue): +10 points or more on every seed through the gateway; a like accuracy through
both paths; the gateway's cost per step under 1.2x the built-in's.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.learning import (Row, flags_text, mean_sd, result_section, row_figures, run_one,  # noqa: E402
                                 run_rows, seeds_text, with_notes)

FUNCTIONS = "[examples.agents.calculator_agent:calculator,examples.agents.calculator_agent:count_digits]"
ROWS = [
    Row("gateway", "agent", "grpo", preset="agent"),
    Row("builtin", "tools", "grpo", sets=["env.name=benchmarks.agent_task:ENV", f"++env.options.functions={FUNCTIONS}"]),
]
TARGET_GAIN, TARGET_COST = 10.0, 1.2


def run(project: Path, row: Row, seed: int, extra: list[str]) -> dict:
    result = run_one(project, row, seed, extra)
    if "failed" in result:
        return result
    import pandas as pd
    curve = pd.read_csv(project / "plots/train.csv")
    result["step_s"] = round(float(curve["step_s"].mean()), 2)
    result["rollout_s"] = round(float(curve["rollout_s"].mean()), 2)
    for key in ("samples_per_episode", "calls_per_episode", "merged_frac", "turns_mean"):
        if key in curve:
            result[key] = round(float(curve[key].mean()), 3)
    return result


def report(results: list[dict], seeds: list[int]) -> str:
    by_row = {row.name: sorted((r for r in results if r["row"] == row.name and "gain_pts" in r),
                               key=lambda r: r["seed"]) for row in ROWS}
    lines = ["| row | gain, mean ± sd | per seed | baseline → trained (mean) | samples / calls per episode | "
             "s per step (rollout) |", "|---|---|---|---|---|---|"]
    for name, done in by_row.items():
        gains = [r["gain_pts"] for r in done]
        per_seed = ", ".join(f"{r['seed']}: {r['gain_pts']:+.1f}" for r in done) or "-"
        acc = (f"{statistics.mean(r['baseline'] for r in done):.3f} → {statistics.mean(r['trained'] for r in done):.3f}"
               if done else "-")
        per_episode = (f"{statistics.mean(r.get('samples_per_episode', 1.0) for r in done):.2f} / "
                       f"{statistics.mean(r.get('calls_per_episode', r.get('turns_mean', 0.0)) for r in done):.2f}"
                       if done else "-")
        cost = (f"{statistics.mean(r['step_s'] for r in done):.1f} ({statistics.mean(r['rollout_s'] for r in done):.1f})"
                if done else "-")
        lines.append(f"| {name} | {mean_sd(gains)} | {per_seed} | {acc} | {per_episode} | {cost} |")
    gate, built = by_row["gateway"], by_row["builtin"]
    headline = "Not run yet."
    if gate:
        headline = (f"An agent program trained through the gateway (`gateway`) gains **{row_figures(results, 'gateway')[1]}** "
                    f"points of held-out accuracy ({row_figures(results, 'gateway')[2]}) on {seeds_text(gate)}")
        headline += (f", against **{row_figures(results, 'builtin')[1]}** ({row_figures(results, 'builtin')[2]}) for the "
                     f"same task as a built-in environment (`builtin`), on {seeds_text(built)}." if built else ".")
    overhead = ROOT / "benchmarks" / "agent_overhead.json"   # benchmarks/agent_overhead.py: the cost, measured cleanly
    if overhead.exists():
        cost = json.loads(overhead.read_text())
        headline += (" Its cost, measured alone (`python benchmarks/agent_overhead.py --model <the gateway run's "
                     "models/initial>`, [agent_overhead.json](agent_overhead.json)): one batch of "
                     f"{cost['episodes_per_batch']} episodes rolled out in {cost['median_s']['gateway']} s through the "
                     f"gateway against {cost['median_s']['builtin']} s built in (median of {cost['rounds']} rounds, "
                     f"{cost['ratio_gateway_builtin']}x); the step times in the table ran at different machine loads "
                     "and do not compare.")
    table, lines = lines, ["# An agent program trained through the gateway", "",
                           *result_section(headline, lines, "python benchmarks/agent.py", "agent.json"),
                           "", "## What was measured", "",
                           "Generated by `python benchmarks/agent.py`: examples/agents/calculator_agent.py (the `openai` "
                           "SDK only)",
                           "through turnrl's gateway (`gateway`), and the same task and tools as the built-in `tools` "
                           "environment",
                           "(`builtin`), each on seeds " + ", ".join(map(str, seeds)) + " through `dvc exp run` with",
                           "`eval.benchmarks=[]`, the embedded tiny model, its defaults otherwise (40 steps of GRPO, 16 "
                           "prompts x 8).",
                           "Held-out accuracy on 256 products, sampled at T=1; gain in points."]
    lines += ["", "## Against the targets", ""]
    if gate:
        lines.append(f"- +{TARGET_GAIN:.0f} points on every seed through the gateway: "
                     f"{'met' if min(r['gain_pts'] for r in gate) >= TARGET_GAIN else '**not met**'} "
                     f"(lowest {min(r['gain_pts'] for r in gate):+.1f}).")
    pairs = [(g, b) for g in gate for b in built if g["seed"] == b["seed"]]
    if pairs:
        gaps = [100 * (g["trained"] - b["trained"]) for g, b in pairs]
        ratios = [g["step_s"] / b["step_s"] for g, b in pairs]
        lines.append(f"- Trained accuracy, gateway minus builtin, per seed: "
                     + ", ".join(f"{g['seed']}: {d:+.1f}" for (g, _), d in zip(pairs, gaps))
                     + f" points (mean {statistics.mean(gaps):+.1f}).")
        lines.append(f"- Seconds per step, gateway / builtin: " + ", ".join(f"{r:.2f}x" for r in ratios)
                     + f" (mean {statistics.mean(ratios):.2f}x; target under {TARGET_COST}x).")
    lines += ["", "## Per seed", "", "| row | seed | baseline | trained | greedy: baseline → trained | gain | "
              "health flags | s per step | run (s) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(results, key=lambda r: (r["row"], r["seed"])):
        if "failed" in r:
            lines.append(f"| {r['row']} | {r['seed']} | - | - | - | failed: {r['failed'][-200:]!r} | - | - | "
                         f"{r['wall_s']:.0f} |")
            continue
        greedy = (f"{r['baseline_greedy']:.3f} → {r['trained_greedy']:.3f}" if r.get("trained_greedy") is not None
                  else "-")
        lines.append(f"| {r['row']} | {r['seed']} | {r['baseline']:.3f} | {r['trained']:.3f} | {greedy} | "
                     f"{r['gain_pts']:+.1f} | {flags_text(r.get('health', {}))} | {r['step_s']:.1f} | {r['wall_s']:.0f} |")
    commits = sorted({r.get("commit", "unknown") for r in results})
    lines += ["", f"Measured at commit{'s' if len(commits) > 1 else ''} {', '.join(commits)}."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--rows", nargs="+", choices=[r.name for r in ROWS])
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/turnrl_agent_bench"))
    parser.add_argument("--results", type=Path, default=ROOT / "benchmarks/agent.json")
    parser.add_argument("--report", type=Path, default=ROOT / "benchmarks/AGENT.md")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    rows = [row for row in ROWS if not args.rows or row.name in args.rows]
    results = run_rows(rows, args.seeds, lambda row: args.work_dir / row.name, args.results, run, args.set,
                       lambda done: args.report.write_text(with_notes(report(done, args.seeds), args.report)))
    args.report.write_text(with_notes(report(results, args.seeds), args.report))
    print(args.report.read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
