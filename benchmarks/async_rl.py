"""Synchronous against asynchronous training, to the same accuracy: wall time, not steps.

    python benchmarks/async_rl.py --quick          # seed 0: sync against the recommended async setting, as measured
    python benchmarks/async_rl.py --quick --list   # what it would run (and skip), running nothing, writing nothing
    python benchmarks/async_rl.py                  # seeds 0-2: sync, overlap_rollout, async at staleness 1, 2, 4
    python benchmarks/async_rl.py --task fast      # the default code_tool with its in-process sandbox
    python benchmarks/async_rl.py --task slow --quick --steps 40   # the quick pair on the first task's shorter tail
    python benchmarks/async_rl.py --task tail --steps 20 --modes sync async_s2_half_lr --report
        # rewrite the task's table from the runs already in its results file, running none
    python benchmarks/async_rl.py --task tail --steps 20 --eval-examples 256 --scoring-without-delay
        # held-out scoring without the tool delays (a measurement: it need not wait on them)

The same work for every mode: the embedded default's warm start (code_tool's, built once per
seed), then `train.steps` GRPO steps of train.prompts_per_step x rollout.n trajectories on
`examples.slow_tools.env:ENV` (task `slow`: code_tool whose every tool call first waits a
seeded lognormal delay, median 0.3 s, p99 5.5 s; task `tail`: sigma 1.75, p99 17.6 s, where the
slowest of a step's ~200 calls, not the compute, sets a synchronous step's length) or on
code_tool itself (task `fast`), through
the training loop on the real stack (Ray actors, DeepSpeed, vLLM), with held-out accuracy
scored every `train.eval_every` steps (64 problems, one sample each; `--eval-examples`) against the
wall time, which includes the scoring. With --scoring-without-delay the held-out rows' tool calls
skip the slow tool's delay (their answers are the same): every mode otherwise paid the slowest
of the evaluation's few hundred delays, 24-110 s per evaluation on task `tail`, which is
measurement, not training.

Per mode: `time_to_target_s` (wall seconds until its held-out accuracy first reaches the sync
run's final held-out accuracy; null if never; in the table also less the scoring's seconds, where
the runs recorded them: in async mode the rollouts go on while it scores, as far as the staleness
bound lets them, so that time favours async by what they made meanwhile), `final_accuracy`, `wall_s`, steps/s,
trajectories/s, the engines' and the trainer's busy fractions, staleness, the health flags
raised, a per-step `trace` (reward, kl_ref, importance weights, staleness, ...), and `cpu_probe_s`
(seconds of a fixed one-core workload just before the run: the machine's speed at the time), and
`micro_batch_rows` (the trainer's train.micro_batch_rows: a table compares only runs made with the
current default; runs from before the setting, which passed whole batches, count as 0). Async runs
use the decoupled-PPO correction (algorithm.policy_loss: decoupled) unless the mode names another.
Results go to benchmarks/results/async-<task>.json after every run (a rerun skips the runs it
has) and the task's table in benchmarks/ASYNC.md; the last line printed is one JSON object {"modes": {...}}
(quick: the one seed's numbers, its modes named "sync" and "async"; full: the mean over seeds).

--quick runs ASYNC.md's recommended setting, where it was measured: seed 0, `sync` against
`async_s4_mb4_quarter_lr` (staleness 4, four mini-batches per batch, train.lr 1.25e-4) on task
`tail`, 20 steps, 256 held-out problems scored without the tool's delay (its --task, --steps,
--eval-examples and --scoring-without-delay change that). Its runs go to their own file,
benchmarks/results/async-quick.json, and table (`quick`), so a quick check never replaces the
three-seed table it checks.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))   # examples.slow_tools, as the plugin loader finds it in a project


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for key, value in over.items():
        out[key] = _merge(out.get(key, {}), value) if isinstance(value, dict) else value
    return out


ASYNC = {"train": {"mode": "async"}, "algorithm": {"policy_loss": "decoupled"}}
BASE_MODES: dict[str, dict] = {
    "sync": {},
    "overlap": {"train": {"overlap_rollout": True}},
    **{f"async_s{k}": _merge(ASYNC, {"train": {"max_staleness": k}}) for k in (0, 1, 2, 4)},
    # the same staleness with the other corrections (their default thresholds)
    "async_s2_tis": _merge(ASYNC, {"train": {"max_staleness": 2}, "algorithm": {"policy_loss": "tis"}}),
    "async_s2_mis": _merge(ASYNC, {"train": {"max_staleness": 2}, "algorithm": {"policy_loss": "mis"}}),
    # decoupled PPO with pi_prox interpolated by version: a token one version old is clipped against mu itself,
    # where the recomputed pi_prox is the policy being updated (one update per batch: the clip never binds)
    **{f"async_s{k}_interp": _merge(ASYNC, {"train": {"max_staleness": k},
                                            "algorithm": {"policy_loss_options": {"proximal": "interpolate"}}})
       for k in (1, 2)},
}
# four optimizer steps per batch, as AReaL's decoupled PPO takes them: from the second on, the clip
# binds against the recomputed pi_prox (with one it never does); sync_mb4 is the control
MB4 = {f"{mode}_mb4": _merge(BASE_MODES[mode], {"algorithm": {"mini_batches": 4}})
       for mode in ("sync", "async_s1", "async_s2", "async_s4")}
# each at half params.yaml's train.lr (5e-4): smaller steps on off-policy samples (sync_half_lr: the control);
# the MB4 modes also at a quarter of it, so that their four steps go about as far as params.yaml's one
MODES = {**BASE_MODES, **MB4,
         **{f"{mode}_half_lr": _merge(over, {"train": {"lr": 2.5e-4}})
            for mode, over in {**BASE_MODES, **MB4}.items()},
         **{f"{mode}_quarter_lr": _merge(over, {"train": {"lr": 1.25e-4}}) for mode, over in MB4.items()}}
# the quarter-rate MB4 modes with a KL penalty to the starting model (params.yaml's algorithm.kl_coef is 0),
# e.g. async_s1_mb4_quarter_lr_kl0.1: four steps per batch collapsed near saturated reward without one
KL_COEFS = (0.1, 0.02)
MODES.update({f"{mode}_quarter_lr_kl{coef:g}": _merge(MODES[f"{mode}_quarter_lr"], {"algorithm": {"kl_coef": coef}})
              for mode in MB4 for coef in KL_COEFS})
# async with two threads per actor, not one each (cluster.threads_per_actor: 0 splits the 2 cores between
# the trainer and the engine while both are busy): the trainer, the bottleneck, may use the engine's core
# while the engine waits on tools; sync's actors have two already
MODES.update({f"{mode}_quarter_lr_2threads": _merge(MODES[f"{mode}_quarter_lr"], {"cluster": {"threads_per_actor": 2}})
              for mode in MB4 if mode.startswith("async")})
DEFAULT_MODES = ["sync", "overlap", "async_s1", "async_s2", "async_s4"]
# ASYNC.md's recommended setting (its "Result"): staleness 4, four mini-batches at a quarter of params.yaml's rate
RECOMMENDED = "async_s4_mb4_quarter_lr"
QUICK_RESULTS = ROOT / "benchmarks" / "results" / "async-quick.json"
QUICK_MODES = {"sync": "sync", RECOMMENDED: "async"}   # --quick's modes, and their names in its last line
# --quick's work: the task, length and scoring of the recommended setting's measurement (ASYNC.md's result table)
QUICK_WORK = {"task": "tail", "steps": 20, "eval_examples": 256, "scoring_without_delay": True}
# kept for every step, to see what happened before a collapse
TRACE = ("reward_mean", "kl_ref", "entropy", "grad_norm", "clip_fraction", "is_weight_mean", "is_weight_max",
         "is_truncated_frac", "is_masked_frac", "is_ess", "staleness_mean", "staleness_max", "tool_calls_mean",
         "finish_truncated_frac", "finish_answer_frac", "finish_max_turns_frac", "response_tokens_mean")
TASKS = {"slow": {"name": "examples.slow_tools.env:ENV"},
         "tail": {"name": "examples.slow_tools.env:ENV", "options": {"latency_sigma": 1.75}},
         "fast": {"name": "code_tool"}}
EVAL_EVERY, EVAL_EXAMPLES = 5, 64   # --eval-examples: more held-out problems, a finer and steadier target


def config(seed: int, task: str, mode: str, steps: int, eval_examples: int = EVAL_EXAMPLES):
    from turnrl.config import Config
    data = {"seed": seed, "env": TASKS[task], "eval": {"benchmarks": []},
            "rollout": {"rejoin": "ready"},
            "train": {"steps": steps, "eval_every": EVAL_EVERY, "eval_examples": eval_examples, "checkpoint_every": 0}}
    return Config.model_validate(_merge(data, MODES[mode]))


def prepare(seed: int, work: Path) -> tuple[Path, Path]:
    """The seed's data and warm start (code_tool's: the slow task shares its rows and demonstrations)."""
    from turnrl.config import Config
    from turnrl.pipeline.prepare_model import build_tiny
    from turnrl.pipeline.preprocess import preprocess
    data, model = work / f"seed{seed}" / "data", work / f"seed{seed}" / "initial"
    cfg = Config.model_validate({"seed": seed, "eval": {"benchmarks": []}})
    if not (data / "heldout.parquet").exists():
        preprocess(cfg, data)
    if not (model / "config.json").exists():
        build_tiny(cfg, model)
    return data, model


def cpu_probe_s(repeats: int = 3) -> float:
    """Seconds one core takes for a fixed piece of work (the best of `repeats`), taken before each
    run: this machine's speed moved by about 2x within one session (ASYNC.md), and two runs' times
    compare only at like speeds."""
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    x = torch.randn(256, 256, generator=torch.Generator().manual_seed(0))
    best = float("inf")
    try:
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(200):
                x = torch.tanh(x @ x / 16)
            best = min(best, time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    return best


def run(seed: int, task: str, mode: str, steps: int, work: Path, eval_examples: int = EVAL_EXAMPLES,
        scoring_delay: bool = True) -> dict[str, Any]:
    import ray

    from turnrl.pipeline.preprocess import load_split
    from turnrl.training.loop import train
    data, model = prepare(seed, work)
    cfg = config(seed, task, mode, steps, eval_examples)
    probe = cpu_probe_s()
    heldout = [row if scoring_delay else {**row, "tool_delay": False} for row in load_split(data, "heldout")]
    start = time.perf_counter()
    try:
        history = train(cfg, str(model), str(data), load_split(data, "train"), str(work / f"seed{seed}" / mode),
                        heldout_rows=heldout)
    finally:
        ray.shutdown()
    return {"seed": seed, "task": task, "mode": mode, "steps": steps, "eval_examples": eval_examples,
            "scoring_without_delay": not scoring_delay, "cpu_probe_s": probe,
            "micro_batch_rows": cfg.train.micro_batch_rows,
            "total_s": time.perf_counter() - start,
            "curve": [{"step": h["step"], "wall_s": h["wall_s"], "heldout_accuracy": h["heldout_accuracy"],
                       "eval_s": h.get("eval_s")}
                      for h in history if "heldout_accuracy" in h],
            "summary": summarize(history, cfg.train.prompts_per_step * cfg.rollout.n),
            "trace": [{"step": h["step"], **{k: h[k] for k in TRACE if k in h}} for h in history]}


def summarize(history: list[dict], trajectories_per_step: int) -> dict[str, float]:
    last = history[-1]
    mean = lambda key: statistics.fmean(h[key] for h in history if key in h) if any(key in h for h in history) \
        else None  # noqa: E731
    flags = sorted({k[len("health_"):] for h in history for k, v in h.items()
                    if k.startswith("health_") and k != "health_flags" and v})
    return {"final_accuracy": last.get("heldout_accuracy"), "wall_s": last["wall_s"],
            "steps_per_s": len(history) / last["wall_s"], "trajectories_per_s": len(history) * trajectories_per_step
            / last["wall_s"], "engine_busy_frac": 1 - mean("engine_idle_frac"),
            "trainer_busy_frac": 1 - mean("trainer_idle_frac"), "staleness_mean": mean("staleness_mean"),
            "stale_groups_total": last.get("stale_groups_total", 0.0), "health_flags": flags}


def time_to_target(curve: list[dict], target: float | None, scoring_excluded: bool = False) -> float | None:
    """Wall seconds at the first held-out evaluation whose accuracy reached `target` (None if none
    did). With `scoring_excluded`, less the seconds the evaluations up to it took (None where a
    point did not record them): the training's own time, the scoring being the benchmark's."""
    if target is None:
        return None
    scoring = 0.0
    for point in curve:
        if scoring_excluded:
            if point.get("eval_s") is None:
                return None
            scoring += point["eval_s"]
        if point["heldout_accuracy"] >= target:
            return point["wall_s"] - scoring
    return None


def mean_time(each: list[float | None]) -> float | None:
    """The mean of the seeds' times to target; None unless every seed got there."""
    return statistics.fmean(each) if each and None not in each else None


def modes_table(results: list[dict], modes: list[str]) -> dict[str, dict]:
    """Per mode, over the seeds run: time to the same seed's sync final accuracy and the rest."""
    sync_final = {r["seed"]: r["summary"]["final_accuracy"] for r in results if r["mode"] == "sync"}
    out = {}
    for mode in modes:
        runs = [r for r in results if r["mode"] == mode]
        if not runs:
            continue
        ttt = [time_to_target(r["curve"], sync_final.get(r["seed"])) for r in runs]
        unscored = [time_to_target(r["curve"], sync_final.get(r["seed"]), scoring_excluded=True) for r in runs]
        row: dict[str, Any] = {"seeds": [r["seed"] for r in runs], "time_to_target_s_each": ttt,
                               "unscored_time_to_target_s_each": unscored,
                               "curves": {r["seed"]: r["curve"] for r in runs},
                               "cpu_probes": {r["seed"]: r.get("cpu_probe_s") for r in runs},
                               "traces": {r["seed"]: r["trace"] for r in runs if r.get("trace")},
                               "time_to_target_s": mean_time(ttt)}
        for key in ("final_accuracy", "wall_s", "steps_per_s", "trajectories_per_s", "engine_busy_frac",
                    "trainer_busy_frac", "staleness_mean", "stale_groups_total"):
            values = [r["summary"][key] for r in runs if r["summary"].get(key) is not None]
            row[key] = statistics.fmean(values) if values else None
            if key == "final_accuracy" and len(values) > 1:
                row["final_accuracy_sd"] = statistics.stdev(values)
        row["health_flags"] = sorted({f for r in runs for f in r["summary"]["health_flags"]})
        out[mode] = row
    return out


def results_and_table(name: str, results: Path | None) -> tuple[Path, str]:
    """The results file of a set of runs and the name of its table in ASYNC.md: the task's own, or,
    for a set kept in another file (--results), a table named after that file, so that a second
    set of runs never overwrites the first's table."""
    default = ROOT / "benchmarks" / "results" / f"async-{name}.json"
    if results is None or results.resolve() == default.resolve():
        return default, name
    return results, results.stem.removeprefix("async-")


def write_report(path: Path, task: str, table: dict[str, dict], command: str, results: str | None = None) -> None:
    """The task's table in benchmarks/ASYNC.md, between its markers; the rest of the file (the
    other tasks, the text around them) is kept. `results`: the file the numbers come from."""
    begin, end = f"<!-- task {task}: written by benchmarks/async_rl.py -->", f"<!-- end of task {task} -->"
    block = "\n".join([begin, *report_lines(task, table, command, results), end])
    text = path.read_text() if path.exists() else "# Asynchronous RL: time to the synchronous run's accuracy\n"
    if begin in text and end in text:
        text = text[:text.index(begin)] + block + text[text.index(end) + len(end):]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    path.write_text(text)


def speedup(sync_row: dict | None, row: dict, times: str = "time_to_target_s_each") -> float | None:
    """Sync's time to its own final accuracy over the time this mode took to reach it, summed
    over this mode's seeds (the same seeds on both sides); None unless every seed got there.
    `times`: which times, with the scoring (`time_to_target_s_each`) or without it."""
    if not sync_row:
        return None
    sync_each = dict(zip(sync_row["seeds"], sync_row[times]))
    pairs = [(sync_each.get(seed), ttt) for seed, ttt in zip(row["seeds"], row[times])]
    if not pairs or any(a is None or b is None for a, b in pairs):
        return None
    return sum(a for a, _ in pairs) / sum(b for _, b in pairs)


def trace_summary(trace: list[dict]) -> dict[str, Any]:
    """What a run's per-step trace says about its stability: the best batch reward, the first
    step whose kl_ref (mean per-token KL to the starting model) exceeds 1, the largest kl_ref,
    and the smallest mean importance weight (None without async's weights)."""
    kl = [(h["step"], h["kl_ref"]) for h in trace if "kl_ref" in h]
    weights = [h["is_weight_mean"] for h in trace if "is_weight_mean" in h]
    return {"best_reward": max(h["reward_mean"] for h in trace),
            "first_kl_over_1": next((step for step, k in kl if k > 1), None),
            "max_kl_ref": max((k for _, k in kl), default=None), "min_is_weight_mean": min(weights, default=None)}


def _scoring_recorded(row: dict) -> bool:
    """Whether every evaluation of the row's runs recorded how long it took (runs from before
    `eval_s` existed did not)."""
    return all(p.get("eval_s") is not None for curve in row["curves"].values() for p in curve)


def _time_and_speedup(table: dict[str, dict], row: dict, times: str) -> str:
    """'mean time | speed-up' cells: the mean over the seeds, or how many seeds got there."""
    each, mean = row[times], mean_time(row[times])
    shown = f"{mean:.0f}" if mean is not None else f"- ({sum(t is not None for t in each)}/{len(each)} seeds)"
    ratio = speedup(table.get("sync"), row, times)
    return f"{shown} | {'-' if ratio is None else format(ratio, '.2f') + 'x'}"


def report_lines(task: str, table: dict[str, dict], command: str, results: str | None = None) -> list[str]:
    # the time to target without the held-out scoring, where the runs recorded the scoring's seconds
    unscored = any(_scoring_recorded(r) for r in table.values())
    results = results or f"benchmarks/results/async-{task}.json"
    lines = [f"## Task `{task}`", "",
             f"Rerun with `{command}` (benchmarks/async_rl.py; numbers from {results}).", "",
             "The speed-up compares the times to sync's final accuracy on the same seeds; the time column is "
             "the mean over the seeds, or how many of them got there."
             + (" Scoring excluded: the same, less the seconds the held-out evaluations up to that point took "
                "(- where a run did not record them)." if unscored else ""), "",
             "| mode | seeds | time to sync's final accuracy (s) | speed-up | "
             + ("scoring excluded: time (s) | speed-up | " if unscored else "")
             + "final held-out acc. | wall (s) | steps/s | traj/s | engine busy | trainer busy | staleness | "
             "stale groups | health flags |",
             "|---|---|---|---|" + ("---|---|" if unscored else "") + "---|---|---|---|---|---|---|---|---|"]
    for mode, r in table.items():
        acc = f"{r['final_accuracy']:.3f}" + (f" ± {r['final_accuracy_sd']:.3f}" if "final_accuracy_sd" in r else "")
        fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
        without = ("" if not unscored else "- | - | " if not _scoring_recorded(r)
                   else _time_and_speedup(table, r, "unscored_time_to_target_s_each") + " | ")
        lines.append(f"| {mode} | {r['seeds']} | {_time_and_speedup(table, r, 'time_to_target_s_each')} | "
                     f"{without}{acc} | {fmt(r['wall_s'], '.0f')} | "
                     f"{fmt(r['steps_per_s'], '.3f')} | {fmt(r['trajectories_per_s'], '.1f')} | "
                     f"{fmt(r['engine_busy_frac'], '.2f')} | {fmt(r['trainer_busy_frac'], '.2f')} | "
                     f"{fmt(r['staleness_mean'], '.2f')} | {fmt(r['stale_groups_total'], '.0f')} | "
                     f"{', '.join(r['health_flags']) or 'none'} |")
    probed = any(p is not None for r in table.values() for p in r.get("cpu_probes", {}).values())
    lines += ["", "Held-out accuracy during training (step: accuracy at wall seconds"
              + ("; the CPU probe, where a run took it: seconds of a fixed one-core piece of work before the run"
                 if probed else "") + "):", ""]
    for mode, r in table.items():
        for seed, curve in r["curves"].items():
            points = ", ".join(f"{p['step']}: {p['heldout_accuracy']:.3f} at {p['wall_s']:.0f} s"
                               + ("" if p.get("eval_s") is None else f" (scoring {p['eval_s']:.0f} s)") for p in curve)
            probe = r.get("cpu_probes", {}).get(seed)
            lines.append(f"- {mode}, seed {seed}" + ("" if probe is None else f" (CPU probe {probe:.2f} s)")
                         + f": {points}")
    traced = [(mode, seed, trace_summary(trace)) for mode, r in table.items() for seed, trace in r["traces"].items()]
    if traced:
        fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
        lines += ["", "Per-step traces, the runs that kept one (`trace` in the results JSON):", "",
                  "| mode | seed | best train reward | first step kl_ref > 1 | max kl_ref | min is_weight_mean |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {mode} | {seed} | {t['best_reward']:.2f} | {fmt(t['first_kl_over_1'], 'd')} | "
                  f"{fmt(t['max_kl_ref'], '.2f')} | {fmt(t['min_is_weight_mean'], '.3f')} |" for mode, seed, t in traced]
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help=f"seed 0, sync against the recommended {RECOMMENDED}, on the work it was measured on "
                        f"(task {QUICK_WORK['task']}, {QUICK_WORK['steps']} steps, {QUICK_WORK['eval_examples']} "
                        "held-out problems scored without the tool's delay); its own results file and table")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--modes", nargs="+", choices=list(MODES), default=DEFAULT_MODES)
    p.add_argument("--task", choices=list(TASKS), default=None,
                   help=f"default slow (--quick: {QUICK_WORK['task']})")
    p.add_argument("--steps", type=int, default=None, help=f"default 40 (--quick: {QUICK_WORK['steps']})")
    p.add_argument("--eval-examples", type=int, default=None,
                   help=f"held-out problems scored every {EVAL_EVERY} steps (default {EVAL_EXAMPLES}; --quick: "
                        f"{QUICK_WORK['eval_examples']}); other than {EVAL_EXAMPLES}, the runs go to their own "
                        "results file and table (async-<task>-eval<N>)")
    p.add_argument("--scoring-without-delay", action=argparse.BooleanOptionalAction, default=None,
                   help="the held-out rows' tool calls skip the slow tool's delay (default off; --quick: on); the runs "
                        "go to their own results file and table (async-<task>[-eval<N>]-nodelay)")
    p.add_argument("--work-dir", type=Path, default=ROOT / ".cache" / "async_rl")
    p.add_argument("--results", type=Path, default=None,
                   help="keep the runs in this file (a second set of the same runs): its own table in ASYNC.md, named "
                        f"after the file (--quick: {QUICK_RESULTS.relative_to(ROOT)})")
    p.add_argument("--report", action="store_true",
                   help="run nothing: write the table of the runs already in the results file")
    p.add_argument("--list", action="store_true",
                   help="run nothing and write nothing: print the runs this command would make and those it has")
    args = p.parse_args(argv)
    defaults = QUICK_WORK if args.quick else {"task": "slow", "steps": 40, "eval_examples": EVAL_EXAMPLES,
                                               "scoring_without_delay": False}
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    from turnrl.config import TrainCfg
    seeds, modes = ([0], list(QUICK_MODES)) if args.quick else (args.seeds, args.modes)
    name = args.task + ("" if args.eval_examples == EVAL_EXAMPLES else f"-eval{args.eval_examples}") \
        + ("-nodelay" if args.scoring_without_delay else "")
    results_path, table_name = results_and_table(name, args.results or (QUICK_RESULTS if args.quick else None))
    results = json.loads(results_path.read_text()) if results_path.exists() else []

    micro_batch_rows = TrainCfg().micro_batch_rows   # the trainer's passes (runs before it: whole batches)

    def same_work(r: dict) -> bool:   # a run of this length, scored on this many held-out problems, alike
        return (r["steps"] == args.steps and r.get("eval_examples", EVAL_EXAMPLES) == args.eval_examples
                and r.get("scoring_without_delay", False) == args.scoring_without_delay
                and r.get("micro_batch_rows", 0) == micro_batch_rows)

    if args.list:
        print(json.dumps({"results": str(results_path), "table": table_name, "task": args.task, "steps": args.steps,
                          "eval_examples": args.eval_examples, "scoring_without_delay": args.scoring_without_delay,
                          "runs": [{"seed": seed, "mode": mode,
                                    "has": any(r["seed"] == seed and r["mode"] == mode and same_work(r)
                                               for r in results)} for seed in seeds for mode in modes]}, indent=1))
        return 0
    for seed in seeds:
        for mode in modes:   # sync first: the others are measured against its accuracy
            if args.report or any(r["seed"] == seed and r["mode"] == mode and same_work(r) for r in results):
                continue
            print(f"async_rl: seed {seed}, {mode}, task {args.task}", flush=True)
            results.append(run(seed, args.task, mode, args.steps, args.work_dir, args.eval_examples,
                               scoring_delay=not args.scoring_without_delay))
            results_path.parent.mkdir(parents=True, exist_ok=True)
            results_path.write_text(json.dumps(results, indent=1) + "\n")
    chosen = [r for r in results if r["seed"] in seeds and same_work(r)]
    table = modes_table(chosen, modes)
    command = "python benchmarks/async_rl.py" + (" --quick" if args.quick else "") + \
        ("" if args.quick or seeds == [0, 1, 2] else " --seeds " + " ".join(map(str, seeds))) + \
        ("" if args.quick or modes == DEFAULT_MODES else " --modes " + " ".join(modes)) + \
        ("" if args.task == defaults["task"] else f" --task {args.task}") + \
        ("" if args.steps == defaults["steps"] else f" --steps {args.steps}") + \
        ("" if args.eval_examples == defaults["eval_examples"] else f" --eval-examples {args.eval_examples}") + \
        ("" if args.scoring_without_delay == defaults["scoring_without_delay"] else
         " --scoring-without-delay" if args.scoring_without_delay else " --no-scoring-without-delay")
    shown = str(results_path.resolve().relative_to(ROOT)) if results_path.resolve().is_relative_to(ROOT) \
        else str(results_path)
    if table_name != name and args.results is not None:
        command += f" --results {shown}"
    write_report(ROOT / "benchmarks" / "ASYNC.md", table_name, table, command, shown)
    print(json.dumps(last_line(table, args.quick)))
    return 0


def last_line(table: dict[str, dict], quick: bool) -> dict:
    """The JSON object printed last: per mode, time to target, final accuracy and wall seconds
    (over the seeds run). --quick names its two modes `sync` and `async`."""
    names = {mode: "sync" if mode == "sync" else "async" for mode in table} if quick else {}
    return {"modes": {names.get(mode, mode): {"time_to_target_s": r["time_to_target_s"],
                                              "final_accuracy": r["final_accuracy"], "wall_s": r["wall_s"]}
                      for mode, r in table.items()}}


if __name__ == "__main__":
    raise SystemExit(main())
