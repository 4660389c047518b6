"""Pure functions that shape benchmark measurements: medians over steps, fits, ratios, the
breakdown of a step, and the summary line `run.py` prints last. No I/O, no frameworks."""
from __future__ import annotations

import math
from typing import Iterable, Mapping, Sequence

# Parts of a turnrl step measured in-process (turnrl_side.run_parts), in the order a step runs.
TURNRL_PARTS = ("generate_s", "env_s", "assembly_s", "advantage_s", "old_logprobs_s", "ref_logprobs_s",
                "update_s", "weights_gather_s", "weights_load_s")
# Model compute: what a step cannot avoid on any framework (the rest is environment, glue, overhead).
MODEL_COMPUTE = ("generate_s", "old_logprobs_s", "ref_logprobs_s", "update_s")


def median(values: Iterable[float]) -> float:
    ordered = sorted(v for v in values if v is not None and not math.isnan(v))
    if not ordered:
        return float("nan")
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def measured(steps: Sequence[Mapping], warmup: int) -> list[Mapping]:
    """The steps after the first `warmup` ones (engine warm-up, first allocations); an error if
    none are left, since a median of nothing would be a silent zero."""
    kept = [s for s in steps if s["step"] > warmup]
    if not kept:
        raise ValueError(f"no measured steps: {len(steps)} step(s) recorded, {warmup} warm-up; "
                         "raise --steps or lower --warmup")
    return kept


def summarize(steps: Sequence[Mapping], warmup: int) -> dict[str, float]:
    """Median of every numeric per-step key over the measured steps, plus `n_steps`."""
    kept = measured(steps, warmup)
    keys = sorted({k for s in kept for k, v in s.items() if isinstance(v, (int, float)) and k != "step"})
    out = {k: median(s.get(k, float("nan")) for s in kept) for k in keys}
    out["n_steps"] = len(kept)
    return out


def ratio(slower: float, faster: float) -> float:
    """How many times faster `faster` is than `slower` (seconds per step each)."""
    if not faster or math.isnan(faster) or math.isnan(slower):
        return float("nan")
    return slower / faster


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> dict[str, float]:
    """Least-squares y = slope * x + intercept, with r^2. Needs two distinct x values."""
    if len(xs) != len(ys) or len(set(xs)) < 2:
        raise ValueError(f"a line needs at least two distinct x values, got x = {list(xs)}")
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    slope = sxy / sxx
    intercept = my - slope * mx
    ss_tot = sum((y - my) ** 2 for y in ys)
    ss_res = sum((y - (slope * x + intercept)) ** 2 for x, y in zip(xs, ys))
    return {"slope": slope, "intercept": intercept, "r2": 1.0 - ss_res / ss_tot if ss_tot else 1.0}


def shares(parts: Mapping[str, float], total: float) -> dict[str, float]:
    """Each part as a fraction of `total` (a step's seconds)."""
    return {k: (v / total if total else float("nan")) for k, v in parts.items()}


def overhead(loop: Mapping[str, float], parts: Mapping[str, float]) -> dict[str, float]:
    """Where a Ray-loop step goes, from the loop's medians and the in-process parts' medians.

    outside_work: the loop's own measure (with the loop's `outside_work_s`): the step's wall
    time in neither actor's work call (rollout, update). It does not compare two processes
    run minutes apart, so the machine's drift between them (10-20% here) does not enter it.

    compute: model compute (generation, old and reference logprobs, update) measured in-process;
    environment: env steps (sandbox runs); sync: the loop's weight push; overhead: the rest of
    the loop's wall time per step (Ray calls and object transfers, token assembly, batching,
    idle between steps). Fractions of the loop's wall time per step."""
    step = loop["step_s"]
    direct = {}
    if "outside_work_s" in loop:
        # measured in the loop itself: no comparison across processes, so no machine drift in it
        direct = {"outside_work_s": loop["outside_work_s"], "outside_work_frac": loop["outside_work_s"] / step,
                  "engine_busy_s": loop["engine_busy_s"], "trainer_busy_s": loop["trainer_busy_s"]}
    compute = sum(parts.get(k, 0.0) for k in MODEL_COMPUTE)
    env = parts.get("env_s", 0.0)
    sync = loop.get("sync_s", 0.0)
    rest = max(0.0, step - compute - env - sync)
    return {"step_s": step, "compute_s": compute, "env_s": env, "sync_s": sync, "overhead_s": rest,
            "compute_frac": compute / step, "env_frac": env / step, "sync_frac": sync / step,
            "overhead_frac": rest / step,
            # the reading: everything that is not model compute or the environment
            # (Ray calls, data movement including the weight push, glue, idle)
            "non_compute_frac": (sync + rest) / step,
            # each Ray actor's share of the step spent working (the rest it idles: the roles take turns)
            "rollout_role_busy_frac": loop.get("rollout_s", float("nan")) / step,
            "policy_role_busy_frac": (loop.get("train_s", float("nan")) + sync) / step, **direct}


def parse_grid(text: str) -> list[tuple[int, int]]:
    """'4x4,8x8' -> [(4, 4), (8, 8)]: prompts x group size per point of a scaling sweep."""
    points = []
    for item in filter(None, (p.strip() for p in text.split(","))):
        try:
            prompts, group = (int(v) for v in item.lower().split("x"))
        except ValueError:
            raise ValueError(f"sweep point {item!r}: expected PROMPTSxGROUP, e.g. 8x4") from None
        if prompts < 1 or group < 2:
            raise ValueError(f"sweep point {item!r}: prompts must be >= 1 and group >= 2 (GRPO needs a group)")
        points.append((prompts, group))
    if not points:
        raise ValueError("empty sweep: give points like 4x4,8x4,8x8")
    return points


def parse_ints(text: str, name: str, minimum: int = 1) -> list[int]:
    """'1,2,4' -> [1, 2, 4], each at least `minimum`; `name` names the option in errors."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{name} = {text!r}: expected comma-separated integers, e.g. 1,2,4") from None
    if not values or min(values) < minimum:
        raise ValueError(f"{name} = {text!r}: give integers >= {minimum}")
    return values


def headline(results: Mapping) -> dict[str, float]:
    """The one-line summary: median seconds per step of each framework on the same work, and
    the ratios against the targets (2x single-turn GRPO, 3x 3-turn tool use)."""
    out: dict[str, float] = {}
    pairs = results.get("pairs", {})
    for name, prefix in (("grpo", ""), ("tool", "tool_"), ("grpo_overlap", "overlap_"), ("tool_overlap", "tool_overlap_")):
        pair = pairs.get(name)
        if pair:
            t, p = pair["turnrl"]["step_s"], pair["trl"]["step_s"]
            out[f"{prefix}turnrl_step_s"] = round(t, 3)
            out[f"{prefix}trl_step_s"] = round(p, 3)
            out[f"{prefix}speedup"] = round(ratio(p, t), 2)
            if "cpu_s" in pair["turnrl"] and "cpu_s" in pair["trl"]:
                out[f"{prefix}cpu_speedup"] = round(ratio(pair["trl"]["cpu_s"], pair["turnrl"]["cpu_s"]), 2)
        vllm = pairs.get(f"{name}_trl_vllm")   # TRL with vLLM colocated, beside its default
        if vllm:
            out[f"{prefix}trl_vllm_step_s"] = round(vllm["trl"]["step_s"], 3)
            out[f"{prefix}speedup_vs_trl_vllm"] = round(ratio(vllm["trl"]["step_s"], vllm["turnrl"]["step_s"]), 2)
    if "grpo" in pairs:
        out["speedup_target"] = 2.0
    if "tool" in pairs:
        out["tool_speedup_target"] = 3.0
    loop = pairs.get("grpo", {}).get("turnrl", {})
    if "outside_work_s" in loop:     # framework overhead as the loop itself measures it
        out["outside_work_frac"] = round(loop["outside_work_s"] / loop["step_s"], 3)
    breakdown = results.get("breakdown", {}).get("grpo")
    if breakdown:
        out["overhead_frac"] = round(breakdown["overhead_frac"], 3)
        out["sync_frac"] = round(breakdown["sync_frac"], 4)
        out["non_compute_frac"] = round(breakdown["non_compute_frac"], 3)
    sweep = results.get("sweep", {})
    if sweep.get("turnrl_fit"):
        out["slope_s_per_sample"] = round(sweep["turnrl_fit"]["slope"], 4)
    if sweep.get("turnrl_cpu_fit"):
        out["slope_cpu_s_per_sample"] = round(sweep["turnrl_cpu_fit"]["slope"], 4)
    return out


def turns(case: Mapping) -> float:
    """Mean turns per trajectory: turnrl records them; for TRL a trajectory is one turn plus
    one per tool call."""
    if "turns_mean" in case:
        return case["turns_mean"]
    return 1.0 + case.get("tool_calls_mean", 0.0)


def _fmt(value, digits: int = 2) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def markdown(report: Mapping) -> str:
    """Tables of a results.json report, for RESULTS.md: the cases, the pairs, the breakdown,
    the sweep fit and the rollout points."""
    lines = ["| case | s/step (median) | CPU s/step | gen tokens/step | tokens/s of step | turns | peak RSS MiB "
             "| load 1-min |", "|---|---|---|---|---|---|---|---|"]
    for name, c in report.get("cases", {}).items():
        if "step_s" not in c:
            continue
        load = (c.get("load_avg_before") or [float("nan")])[0], (c.get("load_avg_after") or [float("nan")])[0]
        lines.append(f"| {name} | {_fmt(c['step_s'])} | {_fmt(c.get('cpu_s'))} | {_fmt(c.get('gen_tokens'), 0)} | "
                     f"{_fmt(c.get('gen_tokens_per_s_of_step'), 0)} | {_fmt(turns(c))} | "
                     f"{_fmt(c.get('peak_rss_mib'), 0)} | {_fmt(load[0], 1)}-{_fmt(load[1], 1)} |")
    pairs = report.get("pairs", {})
    if pairs:
        lines += ["", "| work | turnrl s/step | TRL s/step | TRL generation | turnrl speedup (wall) | turnrl CPU s "
                  "| TRL CPU s | speedup (CPU) |", "|---|---|---|---|---|---|---|---|"]
        for name, p in pairs.items():
            t, q = p["turnrl"], p["trl"]
            lines.append(f"| {name.split('_trl_')[0]} | {_fmt(t['step_s'])} | {_fmt(q['step_s'])} | "
                         f"{p.get('trl_engine', '-')} | {_fmt(p['speedup'])}x | {_fmt(t.get('cpu_s'))} | "
                         f"{_fmt(q.get('cpu_s'))} | {_fmt(ratio(q.get('cpu_s', float('nan')), t.get('cpu_s', float('nan'))))}x |")
    for name, b in report.get("breakdown", {}).items():
        lines += ["", f"Breakdown of a turnrl `{name}` step (loop {_fmt(b['step_s'])} s; parts measured in-process):",
                  "", "| part | s | share of the loop step |", "|---|---|---|"]
        for part, seconds in b["parts"].items():
            lines.append(f"| {part.removesuffix('_s')} | {_fmt(seconds, 3)} | {_fmt(100 * seconds / b['step_s'], 1)}% |")
        lines.append(f"| sync (loop) | {_fmt(b['sync_s'], 3)} | {_fmt(100 * b['sync_frac'], 1)}% |")
        lines.append(f"| framework overhead (loop - parts) | {_fmt(b['overhead_s'], 3)} | "
                     f"{_fmt(100 * b['overhead_frac'], 1)}% |")
        lines.append(f"| not model compute (sync + overhead) | {_fmt(b['sync_s'] + b['overhead_s'], 3)} | "
                     f"{_fmt(100 * b['non_compute_frac'], 1)}% |")
        if "outside_work_s" in b:
            lines.append(f"| outside both actors' work calls (measured in the loop) | {_fmt(b['outside_work_s'], 3)} | "
                         f"{_fmt(100 * b['outside_work_frac'], 1)}% |")
        lines.append(f"\nIdle per role: the rollout actor works {_fmt(100 * b['rollout_role_busy_frac'], 0)}% of the "
                     f"step, the policy actor {_fmt(100 * b['policy_role_busy_frac'], 0)}% (they take turns).")
    sweep = report.get("sweep", {})
    for name, tag, what in (("turnrl", "", "step_s"), ("trl", "", "step_s"),
                            ("turnrl", "_cpu", "cpu_s"), ("trl", "_cpu", "cpu_s")):
        fit = sweep.get(f"{name}{tag}_fit")
        if fit:
            points = ", ".join(f"{x}: {_fmt(y)} s" for x, y in sweep[f"{name}{tag}_points"])
            lines += ["", f"{name}: {what} = {fit['slope']:.4f} s x (prompts x group) + {fit['intercept']:.2f} s "
                          f"(r^2 {fit['r2']:.2f}; {points})"]
    if report.get("rollout"):
        lines += ["", "| engine | group | max turns | turns | gen tokens | rollout s | tokens/s |",
                  "|---|---|---|---|---|---|---|"]
        for r in report["rollout"]:
            lines.append(f"| {r['engine']} | {r['group']} | {r['max_turns']} | {_fmt(r['turns_mean'])} | "
                         f"{_fmt(r['gen_tokens'], 0)} | {_fmt(r['rollout_s'])} | {_fmt(r['tokens_per_s'], 0)} |")
    return "\n".join(lines) + "\n"
