"""`preprocess`: the training and held-out sets, the search corpus and the benchmarks, as
parquet in the common schema (see `turnrl.data.sources`).

`data.train_set` / `data.heldout_set` are `synthetic` (the environment's generated task,
`turnrl.data.synthetic`), a registered data set or a file. When both name the same set it is
split with the seed; in every case a held-out prompt never appears in training.

An optional benchmark nobody can provide offline is not an error: the manifest records
`available: false` with the reason, a warning says so, and the evaluations report it.

A malformed row in any file read here stops the stage naming the file and line
(`data.bad_rows: fail`), or is skipped (`drop`): the manifest's `bad_rows` block counts the
dropped rows per file with the first reasons, and the log says so.
"""
from __future__ import annotations

import json
import logging
import random
from pathlib import Path

from turnrl.config import Config
from turnrl.data import sources, synthetic
from turnrl.stage import write_json

log = logging.getLogger(__name__)

DROP_HINT = "set data.bad_rows: drop in params.yaml to skip malformed rows and count them"
Dropped = dict[str, dict]   # file -> {"dropped": n, "first": ["line 3: empty prompt ...", ...]}


def preprocess(cfg: Config, out_dir: Path) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    dropped: Dropped = {}
    train, heldout, manifest = training_splits(cfg, dropped)
    sources.write_parquet(train, out_dir / "train.parquet")
    sources.write_parquet(heldout, out_dir / "heldout.parquet")
    if cfg.env.name == "search":
        corpus = search_corpus(cfg, train, heldout, dropped)
        sources.write_parquet(corpus, out_dir / "corpus.parquet")
        manifest["corpus"] = {"n": len(corpus)}

    for name in cfg.eval.benchmarks:
        manifest[name] = _benchmark(cfg, name, *_benchmark_path(cfg, name), out_dir, dropped)
    manifest["bad_rows"] = {"policy": cfg.data.bad_rows,
                            "dropped": sum(f["dropped"] for f in dropped.values()), "files": dropped}
    write_json(out_dir / "manifest.json", manifest)
    return manifest


def training_splits(cfg: Config, dropped: Dropped | None = None) -> tuple[list[dict], list[dict], dict]:
    """(train rows, held-out rows, a manifest saying where each came from and its size).
    Rows dropped as malformed (data.bad_rows: drop) are recorded in `dropped`."""
    d = cfg.data
    if d.train_set == d.heldout_set == "synthetic":
        train, heldout = synthetic.task(cfg.env.name).splits(d.train_examples, d.heldout_examples, cfg.seed)
        return train, heldout, {"train": {"n": len(train), "origin": "synthetic"},
                                "heldout": {"n": len(heldout), "origin": "synthetic"}}
    if d.train_set == d.heldout_set:
        rows, origin = _load(cfg, d.train_set, "data.train_set", dropped)
        if len(rows) < 2:
            raise sources.DataSourceError(f"data.train_set = {d.train_set}: {len(rows)} rows, too few to split into train and held-out")
        random.Random(f"{cfg.seed}:split").shuffle(rows)
        n_heldout = min(d.heldout_examples, len(rows) // 2)
        heldout, train = rows[:n_heldout], rows[n_heldout:n_heldout + d.train_examples]
        return train, heldout, {"train": {"n": len(train), "origin": origin},
                                "heldout": {"n": len(heldout), "origin": f"{origin} (split with seed {cfg.seed})"}}

    heldout, heldout_origin = _side(cfg, d.heldout_set, "data.heldout_set", "heldout", d.heldout_examples, dropped)
    train, train_origin = _side(cfg, d.train_set, "data.train_set", "train", d.train_examples, dropped)
    taken = {r["prompt"] for r in heldout}
    overlap = sum(r["prompt"] in taken for r in train)
    if overlap:
        log.warning("dropped %d training prompts that are also held out", overlap)
        train = [r for r in train if r["prompt"] not in taken]
    return train, heldout, {"train": {"n": len(train), "origin": train_origin, "dropped_heldout_overlap": overlap},
                            "heldout": {"n": len(heldout), "origin": heldout_origin}}


def _side(cfg: Config, name: str, key: str, split: str, count: int,
          dropped: Dropped | None) -> tuple[list[dict], str]:
    if name == "synthetic":
        rows = synthetic.task(cfg.env.name).rows(count, seed=cfg.seed, split=split, exclude=set())
        return rows, "synthetic"
    rows, origin = _load(cfg, name, key, dropped)
    random.Random(f"{cfg.seed}:{split}").shuffle(rows)
    return rows[:count], origin


def _load(cfg: Config, name: str, key: str, dropped: Dropped | None) -> tuple[list[dict], str]:
    result = sources.load(name, fields=cfg.data.fields or None, params_key=key,
                          on_bad_row=cfg.data.bad_rows, drop_hint=DROP_HINT)
    _record_dropped(result, dropped)
    if not result.rows:
        why = f" ({result.n_dropped} malformed rows dropped)" if result.n_dropped else ""
        raise sources.DataSourceError(f"{key} = {name}: the set has no rows{why}")
    return list(result.rows), result.origin


def _record_dropped(result: sources.LoadResult, dropped: Dropped | None) -> None:
    if not result.n_dropped:
        return
    first = [f"line {line}: {why}" for line, why in result.dropped[:10]]
    log.warning("%s: dropped %d malformed rows (data.bad_rows: drop); first: %s",
                result.origin, result.n_dropped, "; ".join(first[:3]))
    if dropped is not None:
        dropped[result.origin] = {"dropped": result.n_dropped, "first": first}


def search_corpus(cfg: Config, train: list[dict], heldout: list[dict],
                  dropped: Dropped | None = None) -> list[dict]:
    """The passages the search index is built over: `env.search.corpus` if given, else the
    synthetic entities' passages or the data's gold passages (nq_open)."""
    if cfg.env.search.corpus:
        from turnrl.envs.search import load_corpus
        return load_corpus(cfg.env.search.corpus)
    rows = heldout + train
    if all("entity" in r for r in rows):
        return synthetic.lookup_corpus(heldout, train)
    if all(r.get("passages") for r in rows):
        # every passage of the sets, not only those of the sampled rows: the corpus must not
        # shrink (and retrieval get easier) with data.train_examples
        names = sorted({cfg.data.train_set, cfg.data.heldout_set} - {"synthetic"})
        return sources.load_search_corpus([r for name in names
                                           for r in _load(cfg, name, "data.train_set", dropped)[0]])
    raise sources.DataSourceError("env.name = search: the data has no passages to search (only synthetic rows and "
                     "nq_open-shaped rows do); set env.search.corpus to a passages file or data set")


def _benchmark_path(cfg: Config, name: str) -> tuple[str, str]:
    """(explicit path or "", the params key that sets it) for a benchmark of `eval.benchmarks`."""
    if cfg.eval.paths.get(name):
        return cfg.eval.paths[name], f"eval.paths.{name}"
    if name == "math500" and cfg.data.math500_path:
        return cfg.data.math500_path, "data.math500_path"
    return "", "data.math500_path" if name == "math500" else f"eval.paths.{name}"


def _benchmark(cfg: Config, name: str, explicit_path: str, params_key: str, out_dir: Path,
               dropped: Dropped | None = None) -> dict:
    """Write benchmark `name` to `out_dir/<name>.parquet`; its manifest entry. Not found
    anywhere: `available: false` with the reason, and a warning (never a silent skip)."""
    try:
        result = sources.load(name, path=explicit_path or None, params_key=params_key,
                              on_bad_row=cfg.data.bad_rows, drop_hint=DROP_HINT)
    except sources.DataSourceError as exc:
        if explicit_path or isinstance(exc, sources.MalformedDataError):
            # the user named a file, or the file found is malformed: an error, not a skip
            raise
        reason = str(exc)
        log.warning("benchmark %s is not available, its metrics will say so: %s", name, reason)
        return {"available": False, "reason": reason}
    _record_dropped(result, dropped)
    sources.write_parquet(result.rows, out_dir / f"{name}.parquet")
    return {"available": True, "n": len(result.rows), "dropped": result.n_dropped, "origin": result.origin}


def load_split(data_dir: Path, name: str) -> list[dict]:
    return sources.read_parquet(data_dir / f"{name}.parquet")


def manifest(data_dir: Path) -> dict:
    return json.loads((data_dir / "manifest.json").read_text())
