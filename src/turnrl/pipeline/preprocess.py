"""`preprocess`: the training and held-out sets, the environment's data files (a search corpus)
and the benchmarks, as parquet in the common schema (see `turnrl.data.sources`).

`data.train_set` / `data.heldout_set` are `synthetic` (the environment's generated task, from
its EnvSpec), a registered data set or a file. A row's fields beyond the schema's (a file's
unmapped columns, a synthetic row's own keys) are kept: the parquet files hold them as JSON in
their `extra` column, and `load_split` gives them back, so `reset(example)` sees them. When both name the same set it is split with the
seed; in every case a held-out prompt never appears in training.

An environment with a `prepare_data` hook (search: its corpus) writes its files here from
every row of the data (the whole sets, not only the sampled rows: a corpus must not shrink with
data.train_examples).

Benchmarks go to `benchmarks/<name>.parquet`, each with its spec in the manifest (so an
evaluation can tell it was preprocessed from the spec it is asked for). A registered
benchmark nobody can provide offline is not an error: the manifest records `available: false`
with the reason, a warning says so, and the evaluations report it. A benchmark file the user
named must be there.

A malformed row in any file read here stops the stage naming the file and line
(`data.bad_rows: fail`), or is skipped (`drop`): the manifest's `bad_rows` block counts the
dropped rows per file with the first reasons, and the log says so.
"""
from __future__ import annotations

import json
import logging
import random
from pathlib import Path

from turnrl import envs
from turnrl.config import BenchmarkCfg, Config
from turnrl.data import sources
from turnrl.pipeline.stage import write_json

log = logging.getLogger(__name__)

DROP_HINT = "set data.bad_rows: drop in params.yaml to skip malformed rows and count them"
BENCHMARK_DIR = "benchmarks"   # data/processed/benchmarks/<name>.parquet
Dropped = dict[str, dict]   # file -> {"dropped": n, "first": ["line 3: empty prompt ...", ...]}


def preprocess(cfg: Config, out_dir: Path) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    dropped: Dropped = {}
    train, heldout, manifest, pool = training_splits(cfg, dropped)
    sources.write_rows(train, out_dir / "train.parquet")
    sources.write_rows(heldout, out_dir / "heldout.parquet")
    spec = envs.resolve(cfg.env.name)
    if spec.prepare_data is not None:   # the environment's own files (e.g. the search corpus)
        manifest.update(spec.prepare_data(pool, out_dir, **cfg.env.checked_options()) or {})

    bench_dir = out_dir / BENCHMARK_DIR
    bench_dir.mkdir(exist_ok=True)
    for stale in bench_dir.glob("*.parquet"):
        stale.unlink()
    manifest["benchmarks"] = {}
    for bench in cfg.eval.benchmarks:
        rows, info = load_benchmark(cfg, bench, dropped)
        if rows is not None:
            sources.write_rows(rows, bench_dir / f"{bench.name}.parquet")
        manifest["benchmarks"][bench.name] = {**info, "spec": benchmark_record(bench)}
    manifest["env"] = {"name": cfg.env.name, "options": dict(cfg.env.options)}   # whose rows these are (turnrl env)
    manifest["bad_rows"] = {"policy": cfg.data.bad_rows,
                            "dropped": sum(f["dropped"] for f in dropped.values()), "files": dropped}
    write_json(out_dir / "manifest.json", manifest)
    return manifest


def training_splits(cfg: Config, dropped: Dropped | None = None) -> tuple[list[dict], list[dict], dict, list[dict]]:
    """(train rows, held-out rows, a manifest saying where each came from and its size, every
    row of the data: the held-out rows first, then the rest of the named sets, unsampled).
    Rows dropped as malformed (data.bad_rows: drop) are recorded in `dropped`."""
    d = cfg.data
    if d.train_set == d.heldout_set == "synthetic":
        train, heldout = _task(cfg).splits(d.train_examples, d.heldout_examples, cfg.seed)
        return train, heldout, {"train": {"n": len(train), "origin": "synthetic"},
                                "heldout": {"n": len(heldout), "origin": "synthetic"}}, heldout + train
    if d.train_set == d.heldout_set:
        rows, origin = _load(cfg, d.train_set, "data.train_set", dropped)
        if len(rows) < 2:
            raise sources.DataSourceError(f"data.train_set = {d.train_set}: {len(rows)} rows, too few to split into train and held-out")
        random.Random(f"{cfg.seed}:split").shuffle(rows)
        n_heldout = min(d.heldout_examples, len(rows) // 2)
        heldout = rows[:n_heldout]
        train, overlap = _not_held_out(rows[n_heldout:], heldout)   # a prompt the file repeats stays held out
        train = train[:d.train_examples]
        return train, heldout, {"train": {"n": len(train), "origin": origin, "dropped_heldout_overlap": overlap},
                                "heldout": {"n": len(heldout), "origin": f"{origin} (split with seed {cfg.seed})"}}, rows

    heldout, heldout_origin, heldout_all = _side(cfg, d.heldout_set, "data.heldout_set", "heldout",
                                                 d.heldout_examples, dropped)
    train, train_origin, train_all = _side(cfg, d.train_set, "data.train_set", "train", None, dropped)
    train, overlap = _not_held_out(train, heldout)
    train = train[:d.train_examples]   # after the held-out prompts are out: train_examples of clean rows
    return train, heldout, {"train": {"n": len(train), "origin": train_origin, "dropped_heldout_overlap": overlap},
                            "heldout": {"n": len(heldout), "origin": heldout_origin}}, heldout_all + train_all


def _not_held_out(train: list[dict], heldout: list[dict]) -> tuple[list[dict], int]:
    """The training rows whose prompt is not held out, and how many were."""
    taken = {r["prompt"] for r in heldout}
    kept = [r for r in train if r["prompt"] not in taken]
    if len(kept) < len(train):
        log.warning("dropped %d training rows whose prompt is also held out", len(train) - len(kept))
    return kept, len(train) - len(kept)


def _task(cfg: Config):
    task = envs.resolve(cfg.env.name).task_for(cfg.env.checked_options())
    if task is None or task.rows is None:
        raise sources.DataSourceError(f"data.train_set = synthetic: the environment {cfg.env.name!r} has no synthetic "
                                      "task; set data.train_set and data.heldout_set to your data files")
    return task


def _side(cfg: Config, name: str, key: str, split: str, count: int | None,
          dropped: Dropped | None) -> tuple[list[dict], str, list[dict]]:
    """(the rows used: `count` of them, None: every row, shuffled; where they came from; every
    row of the set)."""
    if name == "synthetic":
        rows = _task(cfg).rows(count if count is not None else cfg.data.train_examples, seed=cfg.seed, split=split,
                               exclude=set())
        return rows, "synthetic", rows
    rows, origin = _load(cfg, name, key, dropped)
    random.Random(f"{cfg.seed}:{split}").shuffle(rows)
    return (rows[:count] if count is not None else list(rows)), origin, rows


def _load(cfg: Config, name: str, key: str, dropped: Dropped | None) -> tuple[list[dict], str]:
    # data.fields and answer_from read your own files: a registered set (gsm8k_test beside your training
    # file) keeps its own
    own = name not in sources.DATASETS
    fields = (cfg.data.fields or None) if own else None
    transform = answer_transform(cfg.data.answer_from) if own else None
    result = sources.load(name, fields=fields, answer_transform=transform, params_key=key,
                          on_bad_row=cfg.data.bad_rows, drop_hint=DROP_HINT)
    _record_dropped(result, dropped)
    if own and transform is None:
        _warn_worked_answers(result.rows, key)
    if not result.rows:
        why = f" ({result.n_dropped} malformed rows dropped)" if result.n_dropped else ""
        raise sources.DataSourceError(f"{key} = {name}: the set has no rows{why}")
    return list(result.rows), result.origin


def answer_transform(answer_from: str) -> str | None:
    """The sources transform reading an answer field held as `answer_from` (data.answer_from, a
    benchmark's answer_from); None: the field as it is."""
    return None if answer_from == "field" else answer_from


def _warn_worked_answers(rows: list[dict], key: str) -> None:
    """A file whose answers are worked solutions (GSM8K's '... #### 72', a solution's \\boxed{})
    graded as they are would score every sample 0: say which key reads the final answer."""
    answers = [str(r.get("answer", "")) for r in rows[:200]]
    for marker, choice in (("####", "gsm8k"), ("\\boxed{", "boxed")):
        share = sum(marker in a for a in answers) / max(len(answers), 1)
        if share >= 0.5:
            log.warning("%s: %.0f%% of the answers hold %r (worked solutions?); they are graded as they are. Set "
                        "data.answer_from: %s to take the final answer", key, 100 * share, marker, choice)
            return


def _record_dropped(result: sources.LoadResult, dropped: Dropped | None) -> None:
    if not result.n_dropped:
        return
    first = [f"line {line}: {why}" for line, why in result.dropped[:10]]
    log.warning("%s: dropped %d malformed rows (data.bad_rows: drop); first: %s",
                result.origin, result.n_dropped, "; ".join(first[:3]))
    if dropped is not None:
        dropped[result.origin] = {"dropped": result.n_dropped, "first": first}


# --------------------------------------------------------------------------- benchmarks
def benchmark_record(bench: BenchmarkCfg) -> dict:
    """What a preprocessed benchmark was made from (compared by the evaluation stages)."""
    return bench.model_dump()


def load_benchmark(cfg: Config, bench: BenchmarkCfg, dropped: Dropped | None = None) -> tuple[list[dict] | None, dict]:
    """(rows, info) of a benchmark of `eval.benchmarks`: from its `path` with its `fields` (a list
    answer accepts any element; `answer_from: boxed` takes the last \\boxed{}), or the registered
    set of its name from $TURNRL_DATA_DIR or the hub. A registered set found nowhere gives
    (None, {available: false, reason}) and a warning (never a silent skip); a file the user
    named that is missing or malformed raises."""
    key = f"eval.benchmarks[{[b.name for b in cfg.eval.benchmarks].index(bench.name)}]" \
        if bench in cfg.eval.benchmarks else "eval.benchmarks"
    transform = answer_transform(bench.answer_from)
    fields = bench.fields or None
    try:
        if bench.path:
            result = sources.load(bench.name, path=bench.path, fields=fields, answer_transform=transform,
                                  source=bench.name, params_key=f"{key}.path", on_bad_row=cfg.data.bad_rows,
                                  drop_hint=DROP_HINT)
        else:
            result = sources.load(bench.name, fields=fields, answer_transform=transform, params_key=f"{key}.path",
                                  on_bad_row=cfg.data.bad_rows, drop_hint=DROP_HINT)
    except sources.DataSourceError as exc:
        if bench.path or isinstance(exc, sources.MalformedDataError):
            raise   # the user named a file, or the file found is malformed: an error, not a skip
        reason = str(exc)
        log.warning("benchmark %s is not available, its metrics will say so: %s", bench.name, reason)
        return None, {"available": False, "reason": reason}
    _record_dropped(result, dropped)
    return list(result.rows), {"available": True, "n": len(result.rows), "dropped": result.n_dropped,
                               "origin": result.origin}


def load_split(data_dir: Path, name: str) -> list[dict]:
    return sources.read_parquet(data_dir / f"{name}.parquet")


def manifest(data_dir: Path) -> dict:
    return json.loads((data_dir / "manifest.json").read_text())
