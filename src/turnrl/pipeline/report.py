"""The evaluation report: baseline against trained, per benchmark, as Markdown with PNG plots.

    render(baseline, trained, out_dir, baseline_gens=..., trained_gens=..., curves=...)

writes `out_dir/report.md` and the images it shows (`accuracy.png`, `efficiency.png`,
`math500_breakdown.png` when MATH-500 was evaluated, `training.png` when a training curve is
given), all side by side so the folder opens offline in any Markdown viewer. Inputs are the
evaluation's outputs: two metrics dicts of the same shape (metrics/baseline.json,
metrics/eval.json), optionally the folders of per-problem generations (eval/baseline,
eval/final) for what changed problem by problem, and plots/train.csv.

The `report` DVC stage renders the pipeline's own files (stages/report.py), and the evaluation
stages put the report's summary table on the MLflow pipeline run (`log_headline`: the headline
accuracies and the run's description); any two evaluations compare the same way:

    python -m turnrl.pipeline.report eval/qwen/metrics.json eval/mine/metrics.json --out report/qwen-vs-mine \\
        --labels qwen mine --gens eval/qwen eval/mine
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import sys
from pathlib import Path
from typing import Any

#: Training curves drawn from plots/train.csv, when present: (column, title).
CURVES = [("reward_mean", "reward"), ("accuracy", "rollout accuracy"),
          ("response_tokens_mean", "response tokens"), ("kl_ref", "KL(policy || initial)")]
COLORS = ("#8c8c8c", "#1f77b4")


# --------------------------------------------------------------------------- formatting
def _pct(x: Any) -> str:
    return "—" if not isinstance(x, (int, float)) or isinstance(x, bool) else f"{100 * x:.1f}%"


def _num(x: Any, digits: int = 1) -> str:
    if not isinstance(x, (int, float)) or isinstance(x, bool) or (isinstance(x, float) and math.isnan(x)):
        return "—"
    return f"{x:,.{digits}f}" if isinstance(x, float) else f"{x:,}"


def _delta(a: Any, b: Any) -> str:
    if not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (a, b)):
        return "—"
    return f"{100 * (b - a):+.1f} pt"


def _cell(text: Any, limit: int = 120) -> str:
    if text is None:
        return "—"
    s = " ".join(str(text).split())
    s = s if len(s) <= limit else s[: limit - 1] + "…"
    return s.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;") or " "


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|",
            *("| " + " | ".join(r) + " |" for r in rows), ""]


def _group_order(g: str) -> tuple:
    """Levels numerically, subjects alphabetically."""
    return (0, int(g), "") if g.isdigit() else (1, 0, g)


def _pass_key(block: dict) -> str | None:
    return next((k for k in block if k.startswith("pass_at_")), None)


def _available(block: dict | None) -> bool:
    return bool(block) and block.get("available", True) is not False and block.get("accuracy") is not None


def _decoding(block: dict) -> str:
    parts = [f"protocol **{block.get('protocol', '?')}**"]
    if block.get("env"):
        parts.append(f"env `{block['env']}`")
    if block.get("max_turns") is not None:
        parts.append(f"max_turns {block['max_turns']}")
    if block.get("max_tokens") is not None:
        parts.append(f"max_tokens {block['max_tokens']}")
    t = block.get("temperature")
    parts.append("greedy" if t == 0 else f"temperature {t}, top_p {block.get('top_p', 1.0)}")
    parts.append(f"{block.get('samples_per_problem', 1)} sample(s) per problem")
    if block.get("seed") is not None:
        parts.append(f"seed {block['seed']}")
    return ", ".join(parts)


# --------------------------------------------------------------------------- data
def read_generations(folder: str | Path | None, block: str) -> list[dict] | None:
    if folder is None:
        return None
    path = Path(folder) / f"{block}.parquet"
    if not path.exists():
        return None
    import pyarrow.parquet as pq
    return pq.read_table(path).to_pylist()


def read_curves(path: str | Path | None) -> list[dict]:
    if path is None or not Path(path).exists():
        return []
    with Path(path).open(newline="") as f:
        rows = list(csv.DictReader(f))
    out = []
    for r in rows:
        row = {}
        for k, v in r.items():
            try:
                row[k] = float(v)
            except (TypeError, ValueError):
                row[k] = float("nan")
        out.append(row)
    return out


def _per_problem(rows: list[dict]) -> dict[str, float]:
    """Problem id -> fraction of its (non-greedy-extra) samples judged correct."""
    primary = [r for r in rows if r.get("decoding") != "greedy"] or rows
    seen: dict[str, list[bool]] = {}
    for r in primary:
        seen.setdefault(str(r["id"]), []).append(bool(r["correct"]))
    return {k: sum(v) / len(v) for k, v in seen.items()}


# --------------------------------------------------------------------------- plots
def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _bars(ax, groups: list[str], series: list[tuple[str, list[float]]], ylabel: str, pct: bool) -> None:
    width = 0.8 / max(1, len(series))
    for j, (label, values) in enumerate(series):
        xs = [i + (j - (len(series) - 1) / 2) * width for i in range(len(groups))]
        vals = [v if isinstance(v, (int, float)) and v is not None else float("nan") for v in values]
        bars = ax.bar(xs, [100 * v if pct else v for v in vals], width, label=label, color=COLORS[j % len(COLORS)])
        for b, v in zip(bars, vals):
            if not math.isnan(v):
                ax.annotate(f"{100 * v:.0f}" if pct else f"{v:.0f}", (b.get_x() + b.get_width() / 2, b.get_height()),
                            ha="center", va="bottom", fontsize=7)
    long = any(len(g) > 8 for g in groups) and len(groups) > 3
    ax.set_xticks(range(len(groups)), groups, rotation=20 if long else 0, ha="right" if long else "center")
    ax.set_ylabel(ylabel)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)


def _save(fig, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    _plt().close(fig)
    return path.name


def plot_accuracy(blocks: list[str], a: dict, b: dict, labels: tuple[str, str], out: Path) -> str:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(max(5, 1.4 * len(blocks) + 2), 3.6))
    _bars(ax, blocks, [(labels[0], [a.get(x, {}).get("accuracy") for x in blocks]),
                       (labels[1], [b.get(x, {}).get("accuracy") for x in blocks])], "accuracy (%)", True)
    ax.set_ylim(0, 105)
    ax.set_title("accuracy (mean@k) per benchmark")
    return _save(fig, out / "accuracy.png")


def plot_efficiency(blocks: list[str], a: dict, b: dict, labels: tuple[str, str], out: Path) -> str:
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(max(8, 2.2 * len(blocks) + 3), 3.6))
    for ax, key, title in [(axes[0], "mean_response_tokens", "mean response tokens"),
                           (axes[1], "tokens_per_correct", "tokens per correct answer")]:
        _bars(ax, blocks, [(labels[0], [a.get(x, {}).get(key) for x in blocks]),
                           (labels[1], [b.get(x, {}).get(key) for x in blocks])], "tokens", False)
        ax.set_title(title)
        values = [d.get(x, {}).get(key) for d in (a, b) for x in blocks]
        values = [v for v in values if isinstance(v, (int, float)) and v > 0]
        if values and max(values) > 20 * min(values):   # benchmarks of very different lengths
            ax.set_yscale("log")
            ax.set_ylabel("tokens (log scale)")
    return _save(fig, out / "efficiency.png")


def plot_breakdown(a: dict, b: dict, labels: tuple[str, str], out: Path, name: str) -> str:
    plt = _plt()
    keys = [k for k in ("by_subject", "by_level") if k in a or k in b]
    fig, axes = plt.subplots(1, len(keys), figsize=(6 * len(keys), 3.8), squeeze=False)
    for ax, key in zip(axes[0], keys):
        groups = sorted(set(a.get(key, {})) | set(b.get(key, {})), key=_group_order)
        _bars(ax, groups, [(labels[0], [a.get(key, {}).get(g, {}).get("accuracy") for g in groups]),
                           (labels[1], [b.get(key, {}).get(g, {}).get("accuracy") for g in groups])], "accuracy (%)", True)
        ax.set_title(f"{name} {key.replace('_', ' ')}")
        ax.set_ylim(0, 105)
    return _save(fig, out / f"{name}_breakdown.png")


def plot_training(curves: list[dict], out: Path) -> str | None:
    present = [(k, t) for k, t in CURVES if any(k in r for r in curves)]
    if not curves or not present:
        return None
    plt = _plt()
    fig, axes = plt.subplots(1, len(present), figsize=(3.6 * len(present), 3.2), squeeze=False)
    steps = [r.get("step", i + 1) for i, r in enumerate(curves)]
    for ax, (key, title) in zip(axes[0], present):
        ax.plot(steps, [r.get(key, float("nan")) for r in curves], marker=".", linewidth=1, color=COLORS[1])
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    return _save(fig, out / "training.png")


# --------------------------------------------------------------------------- sections
# What makes two evaluations of a block comparable: the same problems, protocol, grader and decoding
COMPARABLE = ("n", "protocol", "env", "grader", "temperature", "top_p", "samples_per_problem", "max_turns",
              "max_tokens")


def incomparable(x: dict, y: dict) -> str:
    """How two evaluations of a block differ in what COMPARABLE names ("" when they do not)."""
    return ", ".join(f"{key} {x[key]} vs {y[key]}" for key in COMPARABLE
                     if key in x and key in y and x[key] != y[key])


def _compared(x: dict, y: dict, key: str = "accuracy", group: tuple[str, str] | None = None) -> str:
    """The Δ of `key` (of a `group`'s block), or "not comparable: ..." where the evaluations differ."""
    differ = incomparable(x, y)
    if group is not None:
        x, y = x.get(group[0], {}).get(group[1], {}), y.get(group[0], {}).get(group[1], {})
    return f"not comparable: {differ}" if differ else _delta(x.get(key), y.get(key))


def _summary(blocks: list[str], a: dict, b: dict, labels: tuple[str, str]) -> list[str]:
    la, lb = labels
    header = ["benchmark", "protocol", "n", f"accuracy {la}", f"accuracy {lb}", "Δ", "pass@k " + la, "pass@k " + lb,
              f"tokens {la}", f"tokens {lb}", f"tokens/correct {la}", f"tokens/correct {lb}"]
    rows = []
    for name in blocks:
        x, y = a.get(name) or {}, b.get(name) or {}
        if not (_available(x) or _available(y)):
            rows.append([f"`{name}`", "not available", "0", *["—"] * 9])
            continue
        px, py = _pass_key(x), _pass_key(y)
        rows.append([f"`{name}`", str(y.get("protocol") or x.get("protocol") or "?"), _num(y.get("n") or x.get("n")),
                     _pct(x.get("accuracy")), _pct(y.get("accuracy")), _compared(x, y),
                     f"{_pct(x.get(px))} ({px.removeprefix('pass_at_')})" if px else "—",
                     f"{_pct(y.get(py))} ({py.removeprefix('pass_at_')})" if py else "—",
                     _num(x.get("mean_response_tokens")), _num(y.get("mean_response_tokens")),
                     _num(x.get("tokens_per_correct")), _num(y.get("tokens_per_correct"))])
    return _table(header, rows)


def summary_table(baseline: dict, trained: dict, labels: tuple[str, str] = ("baseline", "trained")) -> list[str]:
    """The report's summary table (Markdown lines): per benchmark, accuracy of both and the
    difference, pass@k, tokens. Used for the MLflow pipeline run's description."""
    blocks = [k for k in dict.fromkeys([*baseline, *trained]) if isinstance(baseline.get(k, trained.get(k)), dict)]
    return _summary(blocks, baseline, trained, labels)


def _block_section(name: str, x: dict, y: dict, labels: tuple[str, str], gens: tuple[list | None, list | None],
                   image: str | None) -> list[str]:
    la, lb = labels
    lines = [f"## `{name}`", ""]
    if not (_available(x) or _available(y)):
        reason = (y or {}).get("reason") or (x or {}).get("reason") or "not evaluated"
        return lines + [f"Not available: {_cell(reason, 600)}", ""]
    lines += [f"{la}: {_decoding(x)}  " if x else f"{la}: not evaluated  ",
              f"{lb}: {_decoding(y)}" if y else f"{lb}: not evaluated", ""]
    keys = [k for k in ("accuracy", "accuracy_greedy", "correct", "mean_response_tokens", "mean_response_tokens_greedy",
                        "tokens_per_correct", "tokens_per_correct_greedy", "mean_turns") if k in x or k in y]
    keys += sorted({k for k in (*x, *y) if k.startswith("pass_at_")})
    rows = [[k, *(_pct(d.get(k)) if k.startswith(("accuracy", "pass_at"))
                  else _num(d.get(k), 2 if k == "mean_turns" else 1) for d in (x, y))] for k in keys]
    lines += _table(["metric", la, lb], rows)
    for key in ("by_subject", "by_level"):
        if key in x or key in y:
            groups = sorted(set(x.get(key, {})) | set(y.get(key, {})), key=_group_order)
            lines += [f"**{key.replace('_', ' ')}**", ""]
            lines += _table([key.removeprefix("by_"), "n", la, lb, "Δ"], [
                [g, _num((y.get(key, {}).get(g) or x.get(key, {}).get(g) or {}).get("n")),
                 _pct(x.get(key, {}).get(g, {}).get("accuracy")), _pct(y.get(key, {}).get(g, {}).get("accuracy")),
                 _compared(x, y, group=(key, g))]
                for g in groups])
    if image:
        lines += [f"![{name} breakdown]({image})", ""]
    lines += _generations(gens, labels)
    return lines


def _generations(gens: tuple[list | None, list | None], labels: tuple[str, str]) -> list[str]:
    ga, gb = gens
    if not ga and not gb:
        return []
    la, lb = labels
    lines = []
    if ga and gb:
        pa, pb = _per_problem(ga), _per_problem(gb)
        common = set(pa) & set(pb)
        fixed = sorted(i for i in common if pb[i] > pa[i])
        broken = sorted(i for i in common if pb[i] < pa[i])
        lines += [f"Problem by problem ({len(common)} in both): **{len(fixed)}** better with {lb}, "
                  f"**{len(broken)}** worse, {len(common) - len(fixed) - len(broken)} unchanged.", ""]
        by_id = {}
        for r in gb:
            if r.get("decoding") != "greedy" and str(r["id"]) not in by_id:
                by_id[str(r["id"])] = r
        examples = [by_id[i] for i in fixed[:3] if i in by_id]
        if examples:
            lines += [f"Examples {lb} now gets right:", ""]
            lines += _table(["id", "problem", "reference", "extracted", "reason"],
                            [[_cell(r["id"], 40), _cell(r.get("prompt"), 100), _cell(r.get("answer"), 30),
                              _cell(r.get("extracted"), 30), _cell(r.get("reason"), 60)] for r in examples])
    for label, g in ((la, ga), (lb, gb)):
        if not g:
            continue
        primary = [r for r in g if r.get("decoding") != "greedy"] or g
        counts: dict[str, int] = {}
        for r in primary:
            verdict = r.get("reason") or r.get("finish") or "?"
            if verdict.startswith(("not equivalent", "parse failed", "exact match", "no exact match")):
                verdict = verdict.split(":")[0]                 # "not equivalent: got 3, expected 4" -> the kind
            counts[verdict] = counts.get(verdict, 0) + 1
        top = sorted(counts.items(), key=lambda kv: -kv[1])[:6]
        lines += [f"Grading verdicts, {label} ({len(primary)} trajectories): "
                  + "; ".join(f"{_cell(k, 70)} ×{v}" for k, v in top), ""]
    return lines


# --------------------------------------------------------------------------- the MLflow headline
def description(cfg: Any, baseline: dict | None, final: dict | None, extra: str = "") -> str:
    """The pipeline run's description (Markdown): what ran, and the report's summary table.
    `cfg`: the validated params (turnrl.config.Config)."""
    lines = [f"**{cfg.algorithm.name}** on **{cfg.env.name}**, {cfg.train.steps} steps from `{cfg.model.path}` "
             f"(seed {cfg.seed}, group size {cfg.rollout.n}, up to {cfg.rollout.max_turns} turns).", ""]
    if baseline or final:
        lines += summary_table(baseline or {}, final or {}, ("baseline", "trained"))
    if extra:
        lines += ["", extra]
    return "\n".join(lines)


def log_headline(run: Any, baseline: dict | None, final: dict | None, extra: str = "") -> None:
    """The evaluation's headline on the pipeline's parent run (`run`: the stage's
    turnrl.tracking.runs.StageRun): accuracies (baseline, final, diff per block) and the
    description with the summary table."""
    from turnrl.tracking.runs import headline_metrics, log_parent
    log_parent(run, metrics=headline_metrics(baseline, final),
               tags={"mlflow.note.content": description(run.cfg, baseline, final, extra)})


# --------------------------------------------------------------------------- entry point
def render(baseline: dict, trained: dict, out_dir: str | Path, *, labels: tuple[str, str] = ("baseline", "trained"),
           baseline_gens: str | Path | None = None, trained_gens: str | Path | None = None,
           curves: str | Path | None = None, sources: tuple[str, str] | None = None) -> Path:
    """Write `out_dir/report.md` and its images; return the path of the Markdown file."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.png"):
        old.unlink()
    blocks = list(dict.fromkeys([*baseline, *trained]))
    blocks = [k for k in blocks if isinstance(baseline.get(k, trained.get(k)), dict)]
    shown = [k for k in blocks if _available(baseline.get(k)) or _available(trained.get(k))]

    lines = ["# turnrl evaluation report", "",
             f"{labels[0]} against {labels[1]}."
             + (f" Sources: `{sources[0]}`, `{sources[1]}`." if sources else ""),
             "Accuracy is mean@k over k samples per problem; pass@k uses the unbiased estimator; tokens are "
             "the policy's response tokens (observations excluded); tokens/correct = all response tokens "
             "over correct answers.", "", "## Summary", ""]
    lines += _summary(blocks, baseline, trained, labels)
    if shown:
        lines += [f"![accuracy]({plot_accuracy(shown, baseline, trained, labels, out)})", "",
                  "## Token efficiency", "",
                  f"![token efficiency]({plot_efficiency(shown, baseline, trained, labels, out)})", ""]
    for name in blocks:
        x, y = baseline.get(name) or {}, trained.get(name) or {}
        image = None
        if any(k in d for d in (x, y) for k in ("by_subject", "by_level")):
            image = plot_breakdown(x, y, labels, out, name)
        gens = (read_generations(baseline_gens, name), read_generations(trained_gens, name))
        lines += _block_section(name, x, y, labels, gens, image)
    rows = read_curves(curves)
    image = plot_training(rows, out)
    if image:
        last = rows[-1]
        lines += ["## Training", "", f"![training curves]({image})", "",
                  f"{len(rows)} steps; last step: "
                  + ", ".join(f"{t} {_num(last.get(k), 3)}" for k, t in CURVES if k in last), ""]
    path = out / "report.md"
    path.write_text("\n".join(lines))
    return path


def _metrics_file(path: Path) -> dict:
    """An evaluation's metrics json (block -> its metrics); ValueError saying what is wrong."""
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise ValueError(f"{path}: cannot be read ({exc.strerror or exc}); give the metrics json an evaluation "
                         "wrote (metrics/baseline.json, metrics/eval.json)") from None
    except ValueError as exc:
        raise ValueError(f"{path}: not JSON ({exc})") from None
    if not isinstance(data, dict) or not any(isinstance(v, dict) and ("accuracy" in v or "available" in v)
                                             for v in data.values()):
        raise ValueError(f"{path}: not an evaluation's metrics (an object of blocks such as task: {{accuracy, n, "
                         "...}}); give metrics/baseline.json or metrics/eval.json")
    return data


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="turnrl report", description="Compare two evaluations.")
    p.add_argument("baseline", type=Path, help="metrics json of the first evaluation")
    p.add_argument("trained", type=Path, help="metrics json of the second evaluation")
    p.add_argument("--out", type=Path, required=True, help="the folder the report (report.md, plots) goes to")
    p.add_argument("--labels", nargs=2, default=("baseline", "trained"), help="the two columns' names")
    p.add_argument("--gens", nargs=2, type=Path, default=(None, None), help="the two generations folders")
    p.add_argument("--curves", type=Path, help="a training curve csv (plots/train.csv)")
    args = p.parse_args(argv)
    try:
        baseline, trained = (_metrics_file(path) for path in (args.baseline, args.trained))
        if args.out.exists() and not args.out.is_dir():
            raise ValueError(f"--out {args.out}: a file, not a folder; name a folder for the report")
        missing = [f"{flag} {path}" for flag, path in (("--curves", args.curves), *(("--gens", g) for g in args.gens))
                   if path is not None and not path.exists()]
        if missing:
            raise ValueError(f"{', '.join(missing)}: no such file or folder")
    except ValueError as exc:
        print(f"turnrl report: {exc}", file=sys.stderr)
        return 2
    path = render(baseline, trained, args.out,
                  labels=tuple(args.labels), baseline_gens=args.gens[0], trained_gens=args.gens[1],
                  curves=args.curves, sources=(str(args.baseline), str(args.trained)))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
