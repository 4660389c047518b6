"""Does self-play teach the tiny model a game? Self-play (`env.name: game`, `algorithm.name:
rae`, both roles trained from one game) from the warm start (random legal play replayed
through the real game), then win rates against the random legal player and against the
starting checkpoint (models/initial), as first and as second mover, on seeds 0 1 2, through
`dvc exp run` as a user runs it (the benchmarks/learning.py machinery: one scratch copy of the
committed project per row; results after every run, an interrupted benchmark resumes):

    python benchmarks/games.py                        # nim and tictactoe x 3 seeds -> benchmarks/GAMES.md
    python benchmarks/games.py --rows nim --seeds 0
    python benchmarks/games.py --report-only          # GAMES.md and img/games_curves.png from games.json

Target (issue 52): on every seed, a score of 60% or more against the starting checkpoint (wins
plus half the draws, both movers) and illegal moves under 2% of the policy's moves.
"""
from __future__ import annotations

import argparse
import json
import math
import sqlite3
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
        Row("tictactoe_60_steps", "game", "rae", sets=[*COMMON, "++env.options.game=tictactoe", "train.steps=60"]),
        # longer at the same rate went unstable (seed 1: entropy 0.2 -> 0.85 over steps 48-60, kl_ref 1.5): four
        # clipped mini-batches per batch at a quarter of the rate, the setting ASYNC.md found steadier than sync's
        Row("tictactoe_mb4_quarter_lr", "game", "rae", sets=[*COMMON, "++env.options.game=tictactoe", "train.steps=60",
                                                             "algorithm.mini_batches=4", "train.lr=0.000125"])]
TARGET_SCORE, TARGET_ILLEGAL = 0.60, 0.02
# The games' own training curves, per step, from the run's plots/train.csv (MLflow keys: rollout/<name>)
GAME_CURVES = ("env_illegal_move_rate_mean", "env_game_moves_mean", "env_win_mean", "env_draw_mean")
CURVE_STEPS = (1, 10, 20, 40, 60)            # the illegal-move rate during training at these steps, in the page
IMAGE = "img/games_curves.png"               # next to the page


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
    result["game_curves"] = game_curves_csv(project / "plots/train.csv")
    return result


def game_curves_csv(path: Path) -> dict:
    """The self-play games' curves per training step, from a run's plots/train.csv."""
    import pandas as pd
    curve = pd.read_csv(path)
    return {"source": "train.csv", "step": [int(s) for s in curve["step"]],
            **{k: [round(float(v), 4) for v in curve[k]] for k in GAME_CURVES if k in curve}}


def game_curves_mlflow(db: Path, seed: int, steps: int, check: dict | None = None) -> dict | str:
    """The same curves read after the fact from a scratch project's MLflow store: the most recent
    finished run named 'train' with param seed=`seed`. A str says why not: no such run, a run
    with other than `steps` steps, or one whose response_tokens_mean curve is not `check`'s (the
    run the result was measured on kept its own in `curves`)."""
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        found = con.execute(
            "SELECT r.run_uuid FROM runs r JOIN params p ON p.run_uuid = r.run_uuid AND p.key = 'seed' "
            "WHERE r.name = 'train' AND r.status = 'FINISHED' AND r.lifecycle_stage = 'active' AND p.value = ? "
            "ORDER BY r.start_time DESC LIMIT 1", (str(seed),)).fetchone()
        if found is None:
            return f"no finished 'train' run with seed={seed} in {db}"
        series: dict[str, dict[int, float]] = {}
        for key, step, value in con.execute(
                "SELECT key, step, value FROM metrics WHERE run_uuid = ? AND key LIKE 'rollout/%' "
                "ORDER BY timestamp", (found[0],)):
            series.setdefault(key.removeprefix("rollout/"), {})[int(step)] = value   # the last logged value wins
    finally:
        con.close()
    wanted = series.get(GAME_CURVES[0], {})
    step_list = sorted(wanted)
    if step_list != list(range(1, steps + 1)):
        return f"run {found[0]} has steps {step_list[:1]}..{step_list[-1:]} ({len(step_list)}), not 1..{steps}"
    theirs = (check or {}).get("response_tokens_mean")
    ours = [series.get("response_tokens_mean", {}).get(s) for s in step_list]
    if theirs and (len(theirs) != len(ours) or any(o is None or abs(o - t) > 1e-3 for o, t in zip(ours, theirs))):
        return f"run {found[0]}'s response_tokens_mean is not the result's: another run"
    return {"source": "mlflow", "run_id": found[0], "step": step_list,
            **{k: [round(float(series[k][s]), 4) for s in step_list] for k in GAME_CURVES if k in series}}


def backfill(results: list[dict], work_dir: Path) -> list[str]:
    """`game_curves` for every finished result without them, from its row's scratch MLflow store
    (`work_dir/<row>/mlflow.db`); the results are changed in place. Returns what was done."""
    said = []
    for r in results:
        if "after" not in r or "game_curves" in r:
            continue
        db = work_dir / r["row"] / "mlflow.db"
        got = game_curves_mlflow(db, r["seed"], r["steps"], r.get("curves")) if db.exists() else f"no {db}"
        if isinstance(got, str):
            said.append(f"{r['row']} seed {r['seed']}: not backfilled: {got}")
        else:
            r["game_curves"] = got
            said.append(f"{r['row']} seed {r['seed']}: {len(got['step'])} steps from run {got['run_id']}")
    return said


def at_step(curves: dict, key: str, step: int) -> float | None:
    steps = curves.get("step", [])
    return curves[key][steps.index(step)] if step in steps and key in curves else None


def plot_curves(results: list[dict], path: Path) -> bool:
    """One panel per game row: the illegal-move rate of the policy's sampled self-play moves per
    training step, a line per seed, and the 2% target. False (nothing written) when no result has
    the curves."""
    rows = [row for row in ROWS if any(r["row"] == row.name and "game_curves" in r for r in results)]
    if not rows:
        return False
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(rows), figsize=(4.2 * len(rows), 3.4), sharey=True, squeeze=False)
    for ax, row in zip(axes[0], rows):
        for r in sorted((r for r in results if r["row"] == row.name and "game_curves" in r), key=lambda r: r["seed"]):
            c = r["game_curves"]
            ax.plot(c["step"], c[GAME_CURVES[0]], lw=1.2, color=f"C{r['seed'] % 10}", label=f"seed {r['seed']}")
        ax.axhline(TARGET_ILLEGAL, color="black", ls="--", lw=1, label="2% target")
        steps = max(len(r["game_curves"]["step"]) for r in results if r["row"] == row.name and "game_curves" in r)
        ax.set_title(f"{row.name} ({steps} steps)", fontsize=10)
        ax.legend(fontsize=7)
        ax.set_xlabel("training step")
        ax.set_xlim(left=0)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("illegal-move rate (self-play, sampled)")
    axes[0][0].set_ylim(bottom=0)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(fig)
    return True


def curve_lines(results: list[dict]) -> list[str]:
    """The image's paragraph and a table of the illegal-move rate during training at CURVE_STEPS."""
    have = [r for r in results if "game_curves" in r]
    if not have:
        return []
    backfilled = [f"{r['row']} seed {r['seed']}" for r in have if r["game_curves"].get("source") == "mlflow"]
    mlflow = ("read after the fact from the metrics (`rollout/env_illegal_move_rate_mean` per step) of the run's "
              "MLflow run named `train` in the benchmark's scratch project (`--backfill-curves`: the most recent "
              "finished one with the run's seed, checked to be the measured run by its step count and its "
              "response_tokens_mean curve in games.json)")
    source = ("They were read from each run's plots/train.csv when it finished." if not backfilled else
              f"They were {mlflow}." if len(backfilled) == len(have) else
              f"They were read from each run's plots/train.csv when it finished, except for {', '.join(backfilled)}: "
              f"{mlflow}.")
    lines = ["", f"![illegal-move rate per training step]({IMAGE})", "",
             f"[The curves]({IMAGE}) are the illegal-move rate of the policy's own moves in the self-play games of "
             "each training step (sampled, both roles, `env_illegal_move_rate_mean`), one line per seed, against the "
             "2% target; they are not the held-out games of the table above. " + source + " At some steps (one "
             "step's games each, mean over the seeds):", "",
             "| game | seeds | " + " | ".join(f"step {s}" for s in CURVE_STEPS) + " |",
             "|---|---|" + "---|" * len(CURVE_STEPS)]
    for row in ROWS:
        mine = [r["game_curves"] for r in have if r["row"] == row.name]
        if not mine:
            continue
        cells = []
        for s in CURVE_STEPS:
            values = [v for v in (at_step(c, GAME_CURVES[0], s) for c in mine) if v is not None and not math.isnan(v)]
            cells.append(f"{statistics.mean(values):.3f}" if values else "-")
        lines.append(f"| {row.name} | {len(mine)} | " + " | ".join(cells) + " |")
    return lines + prefix_lines(have)


def prefix_lines(have: list[dict]) -> list[str]:
    """Where a longer row's curve starts with a shorter row's on the same seed (training is
    deterministic: the longer run repeats the shorter one, then goes on), say so."""
    curve = {(r["row"], r["seed"]): {**r.get("curves", {}), **r["game_curves"]} for r in have}
    lines = []
    for short in ROWS:
        for long in ROWS:
            seeds = [s for (name, s), c in curve.items() if name == short.name and (long.name, s) in curve
                     and len(curve[long.name, s]["step"]) > len(c["step"])
                     and all(curve[long.name, s].get(k, [])[:len(c["step"])] == c[k] for k in c if k not in ("source", "run_id", "step"))]
            if seeds:
                n = len(curve[short.name, seeds[0]]["step"])
                lines.append(f"On seed{'s' if len(seeds) > 1 else ''} {', '.join(map(str, sorted(seeds)))}, "
                             f"{long.name}'s first {n} steps are {short.name}'s, every logged curve value for value (the same seed, "
                             f"deterministic training): its later steps continue that run.")
    return ["", *lines] if lines else []


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
    met_rows, recommended = [], []
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
            if met:
                own = [s for s in row.sets if s not in COMMON]
                recommended.append(f"`{row.name}` (" + " ".join(f"`-S {s}`" for s in own) + ")")
    headline = ("Self-play with `algorithm.name: rae` from the warm start. Score = wins + half the draws, both movers, "
                "sampled at T=1: " + ("; ".join(met_rows) if met_rows else "no run finished yet") + "."
                + (" **Recommended, the target met on every seed**: " + ", ".join(recommended) + "." if recommended else ""))
    lines = ["# Games: self-play", "",
             *result_section(headline, table, "python benchmarks/games.py", "games.json"),
             "", "## What was measured", "",
             "Generated by `python benchmarks/games.py` (issue 52): per game and seed, `dvc exp run -S seed=S` with",
             "`" + " ".join(f"-S {s}" for s in COMMON) + "` and the game. The held-out split plays each role against",
             f"each of env.options.eval_opponents (`random` and `{CHECKPOINT}`, the warm start) on 128 rows;",
             "`before` is the baseline_eval stage (the warm start itself), `after` the eval stage. Illegal moves:",
             "the share of the policy's moves the game refused (a cut-off turn counts as one).",
             *curve_lines(results),
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
    parser.add_argument("--report-only", action="store_true",
                        help=f"rewrite the report and its {IMAGE} (next to it) from the results file")
    parser.add_argument("--backfill-curves", action="store_true",
                        help="add game_curves to the results without them, from each row's scratch MLflow store "
                             "(--work-dir/<row>/mlflow.db), then rewrite the report")
    args = parser.parse_args(argv)
    rows = [r for r in ROWS if not args.rows or r.name in args.rows]

    def write(results: list[dict]) -> None:
        plot_curves(results, args.report.parent / IMAGE)
        args.report.write_text(with_notes(report(results, args.seeds), args.report))

    if args.backfill_curves:
        results = json.loads(args.results.read_text())
        for line in backfill(results, args.work_dir):
            print(line)
        args.results.write_text(json.dumps(results, indent=1) + "\n")
        write(results)
        return 0
    if args.report_only:
        write(json.loads(args.results.read_text()))
        return 0
    run_rows(rows, args.seeds, lambda row: args.work_dir / row.name, args.results, run, args.set, write)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
