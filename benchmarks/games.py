"""Does self-play teach the tiny model a game? Self-play (`env.name: game`, `algorithm.name:
rae`, both roles trained from one game) from the warm start (random legal play replayed
through the real game), then win rates against the random legal player and against the
starting checkpoint (models/initial), as first and as second mover, on seeds 0 1 2, through
`dvc exp run` as a user runs it (the benchmarks/learning.py machinery: one scratch copy of the
committed project per row; results after every run, an interrupted benchmark resumes):

    python benchmarks/games.py                        # nim and tictactoe x 3 seeds -> benchmarks/GAMES.md
    python benchmarks/games.py --rows nim --seeds 0

Target (issue 52): on every seed, a score of 60% or more against the starting checkpoint (wins
plus half the draws, both movers) and illegal moves under 2% of the policy's moves.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.learning import Row, commits_line, result_section, run_one, run_rows, with_notes  # noqa: E402

CHECKPOINT = "checkpoint:models/initial"
COMMON = ["env.name=game", "algorithm.name=rae", "rollout.max_turns=8", "rollout.max_tokens_per_turn=8",
          "rollout.max_tokens_total=200", "data.heldout_examples=128", "eval.greedy=true"]
ROWS = [Row("nim", "game", "rae", sets=[*COMMON, "++env.options.game=nim"]),
        Row("tictactoe", "game", "rae", sets=[*COMMON, "++env.options.game=tictactoe"]),
        # 40 steps left seed 2 at 3.1% illegal moves, still falling: the same run, longer
        Row("tictactoe_60_steps", "game", "rae", sets=[*COMMON, "++env.options.game=tictactoe", "train.steps=60"])]
TARGET_SCORE, TARGET_ILLEGAL = 0.60, 0.02


def score(entry: dict) -> float:
    """Wins plus half the draws."""
    return entry.get("win", entry.get("accuracy", 0.0)) + 0.5 * entry.get("draw", 0.0)


def scores(block: dict) -> dict:
    """Per opponent: the score overall and as each mover, from a task block's by_subject."""
    by = block.get("by_subject", {})
    out = {}
    for opponent in sorted({s.split(" vs ", 1)[1] for s in by}):
        mine = {s.split(" vs ", 1)[0]: e for s, e in by.items() if s.endswith(f" vs {opponent}")}
        n = sum(e["n"] for e in mine.values())
        out[opponent] = {"score": round(sum(score(e) * e["n"] for e in mine.values()) / n, 4),
                         **{role: round(score(e), 4) for role, e in mine.items()}}
    return out


def run(project: Path, row: Row, seed: int, extra: list[str]) -> dict:
    result = run_one(project, row, seed, extra)
    if "failed" in result:
        return result
    read = lambda name: json.loads((project / "metrics" / name).read_text())["task"]  # noqa: E731
    before, after = read("baseline.json"), read("eval.json")
    result.update(before=scores(before), after=scores(after),
                  illegal_before=round(before.get("illegal_move_rate", float("nan")), 4),
                  illegal_after=round(after.get("illegal_move_rate", float("nan")), 4),
                  illegal_after_greedy=round(after.get("illegal_move_rate_greedy", float("nan")), 4))
    result["transcripts"] = {stage: transcript(project / f"eval/{stage}/task.parquet") for stage in ("baseline", "final")}
    return result


def transcript(parquet: Path) -> str:
    """The first sampled game against the starting checkpoint as the first mover, as the policy saw it."""
    import pandas as pd
    rows = pd.read_parquet(parquet)
    rows = rows[(rows["subject"] == f"first vs {CHECKPOINT}") & (rows["decoding"] != "greedy")]
    if rows.empty:
        return ""
    row = rows.iloc[0]
    said = " / ".join(f"{m['role']}: {m['content']}" for m in json.loads(row["messages"]) if m["role"] != "system")
    return f"{said} => reward {row['reward']:+g} ({row['finish']})"


def report(results: list[dict], seeds: list[int]) -> str:
    table = ["| game | seed | vs checkpoint: before → after | as first / second (after) | vs random: before → after "
             "| illegal moves: before → after | target |", "|---|---|---|---|---|---|---|"]
    met_rows = []
    for row in ROWS:
        done = sorted((r for r in results if r["row"] == row.name and "after" in r), key=lambda r: r["seed"])
        for r in done:
            b, a = r["before"].get(CHECKPOINT, {}), r["after"].get(CHECKPOINT, {})
            rb, ra = r["before"].get("random", {}), r["after"].get("random", {})
            movers = " / ".join(f"{a.get(role, float('nan')):.2f}" for role in sorted(k for k in a if k != "score"))
            ok = a.get("score", 0) >= TARGET_SCORE and r["illegal_after"] < TARGET_ILLEGAL
            table.append(f"| {row.name} | {r['seed']} | {b.get('score', float('nan')):.2f} → {a.get('score', float('nan')):.2f} | "
                         f"{movers} | {rb.get('score', float('nan')):.2f} → {ra.get('score', float('nan')):.2f} | "
                         f"{r['illegal_before']:.3f} → {r['illegal_after']:.3f} | {'met' if ok else 'not met'} |")
        for r in results:
            if r["row"] == row.name and "failed" in r:
                table.append(f"| {row.name} | {r['seed']} | failed: {r['failed'][-120:]!r} | | | | |")
        after = [r["after"].get(CHECKPOINT, {}).get("score", 0.0) for r in done]
        if after:
            sd = f" ± {statistics.stdev(after):.2f}" if len(after) > 1 else ""
            met = len(done) == len(seeds) and all(
                r["after"].get(CHECKPOINT, {}).get("score", 0) >= TARGET_SCORE and r["illegal_after"] < TARGET_ILLEGAL
                for r in done)
            met_rows.append(f"{row.name}: {statistics.mean(after):.2f}{sd} against the starting checkpoint over "
                            f"{len(done)} seed(s), target {'met' if met else '**not met**'}")
    headline = ("Self-play with `algorithm.name: rae` from the warm start. Score = wins + half the draws, both movers, "
                "sampled at T=1: " + ("; ".join(met_rows) if met_rows else "no run finished yet") + ".")
    lines = ["# Games: self-play", "",
             *result_section(headline, table, "python benchmarks/games.py", "games.json"),
             "", "## What was measured", "",
             "Generated by `python benchmarks/games.py` (issue 52): per game and seed, `dvc exp run -S seed=S` with",
             "`" + " ".join(f"-S {s}" for s in COMMON) + "` and the game. The held-out split plays each role against",
             f"each of env.options.eval_opponents (`random` and `{CHECKPOINT}`, the warm start) on 128 rows;",
             "`before` is the baseline_eval stage (the warm start itself), `after` the eval stage. Illegal moves:",
             "the share of the policy's moves the game refused (a cut-off turn counts as one).",
             "", commits_line(results), "", "## A game before and after", ""]
    for r in [r for r in results if "transcripts" in r][:2]:
        lines += [f"{r['row']}, seed {r['seed']}, as the first mover against the starting checkpoint:", "",
                  f"- before (the warm start): `{r['transcripts'].get('baseline', '')}`",
                  f"- after self-play: `{r['transcripts'].get('final', '')}`", ""]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--rows", nargs="+", choices=[r.name for r in ROWS])
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/turnrl_games"))
    parser.add_argument("--results", type=Path, default=ROOT / "benchmarks/games.json")
    parser.add_argument("--report", type=Path, default=ROOT / "benchmarks/GAMES.md")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="extra params for every run (changes what is measured: say so)")
    parser.add_argument("--report-only", action="store_true", help="rewrite the report from the results file")
    args = parser.parse_args(argv)
    rows = [r for r in ROWS if not args.rows or r.name in args.rows]
    write = lambda results: args.report.write_text(with_notes(report(results, args.seeds), args.report))  # noqa: E731
    if args.report_only:
        write(json.loads(args.results.read_text()))
        return 0
    run_rows(rows, args.seeds, lambda row: args.work_dir / row.name, args.results, run, args.set, write)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
