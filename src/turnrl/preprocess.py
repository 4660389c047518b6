"""`preprocess`: the training and held-out sets, the search corpus and the benchmarks, as
parquet in the common schema (see `turnrl.data.sources`).

`data.train_set` / `data.heldout_set` are `synthetic` (the environment's generated task,
`turnrl.data.synthetic`), a registered data set or a file. When both name the same set it is
split with the seed; in every case a held-out prompt never appears in training.

An optional benchmark nobody can provide offline is not an error: the manifest records
`available: false` with the reason, a warning says so, and the evaluations report it.
"""
from __future__ import annotations

import json
import logging
import random
from pathlib import Path

from turnrl.config import Config
from turnrl.data import sources, synthetic

log = logging.getLogger(__name__)


def preprocess(cfg: Config, out_dir: Path) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    train, heldout, manifest = training_splits(cfg)
    sources.write_parquet(train, out_dir / "train.parquet")
    sources.write_parquet(heldout, out_dir / "heldout.parquet")
    if cfg.env.name == "search":
        corpus = search_corpus(cfg, train, heldout)
        sources.write_parquet(corpus, out_dir / "corpus.parquet")
        manifest["corpus"] = {"n": len(corpus)}

    for name in cfg.eval.benchmarks:
        manifest[name] = _benchmark(name, *_benchmark_path(cfg, name), out_dir)
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return manifest


def training_splits(cfg: Config) -> tuple[list[dict], list[dict], dict]:
    """(train rows, held-out rows, a manifest saying where each came from and its size)."""
    d = cfg.data
    if d.train_set == d.heldout_set == "synthetic":
        train, heldout = synthetic.task(cfg.env.name).splits(d.train_examples, d.heldout_examples, cfg.seed)
        return train, heldout, {"train": {"n": len(train), "origin": "synthetic"},
                                "heldout": {"n": len(heldout), "origin": "synthetic"}}
    if d.train_set == d.heldout_set:
        rows, origin = _load(cfg, d.train_set, "data.train_set")
        if len(rows) < 2:
            raise sources.DataSourceError(f"data.train_set = {d.train_set}: {len(rows)} rows, too few to split into train and held-out")
        random.Random(f"{cfg.seed}:split").shuffle(rows)
        n_heldout = min(d.heldout_examples, len(rows) // 2)
        heldout, train = rows[:n_heldout], rows[n_heldout:n_heldout + d.train_examples]
        return train, heldout, {"train": {"n": len(train), "origin": origin},
                                "heldout": {"n": len(heldout), "origin": f"{origin} (split with seed {cfg.seed})"}}

    heldout, heldout_origin = _side(cfg, d.heldout_set, "data.heldout_set", "heldout", d.heldout_examples)
    train, train_origin = _side(cfg, d.train_set, "data.train_set", "train", d.train_examples)
    taken = {r["prompt"] for r in heldout}
    overlap = sum(r["prompt"] in taken for r in train)
    if overlap:
        log.warning("dropped %d training prompts that are also held out", overlap)
        train = [r for r in train if r["prompt"] not in taken]
    return train, heldout, {"train": {"n": len(train), "origin": train_origin, "dropped_heldout_overlap": overlap},
                            "heldout": {"n": len(heldout), "origin": heldout_origin}}


def _side(cfg: Config, name: str, key: str, split: str, count: int) -> tuple[list[dict], str]:
    if name == "synthetic":
        rows = synthetic.task(cfg.env.name).rows(count, seed=cfg.seed, split=split, exclude=set())
        return rows, "synthetic"
    rows, origin = _load(cfg, name, key)
    random.Random(f"{cfg.seed}:{split}").shuffle(rows)
    return rows[:count], origin


def _load(cfg: Config, name: str, key: str) -> tuple[list[dict], str]:
    result = sources.load(name, fields=cfg.data.fields or None, params_key=key)
    if result.n_dropped:
        log.warning("%s: dropped %d bad rows", name, result.n_dropped)
    if not result.rows:
        raise sources.DataSourceError(f"{key} = {name}: the set has no rows")
    return list(result.rows), result.origin


def search_corpus(cfg: Config, train: list[dict], heldout: list[dict]) -> list[dict]:
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
        return sources.load_search_corpus([r for name in names for r in _load(cfg, name, "data.train_set")[0]])
    raise sources.DataSourceError("env.name = search: the data has no passages to search (only synthetic rows and "
                     "nq_open-shaped rows do); set env.search.corpus to a passages file or data set")


def _benchmark_path(cfg: Config, name: str) -> tuple[str, str]:
    """(explicit path or "", the params key that sets it) for a benchmark of `eval.benchmarks`."""
    if cfg.eval.paths.get(name):
        return cfg.eval.paths[name], f"eval.paths.{name}"
    if name == "math500" and cfg.data.math500_path:
        return cfg.data.math500_path, "data.math500_path"
    return "", "data.math500_path" if name == "math500" else f"eval.paths.{name}"


def _benchmark(name: str, explicit_path: str, params_key: str, out_dir: Path) -> dict:
    """Write benchmark `name` to `out_dir/<name>.parquet`; its manifest entry. Not found
    anywhere: `available: false` with the reason, and a warning (never a silent skip)."""
    try:
        result = sources.load(name, path=explicit_path or None, params_key=params_key)
    except sources.DataSourceError as exc:
        if explicit_path:  # the user named a file: a wrong path is an error, not a skip
            raise
        reason = str(exc)
        log.warning("benchmark %s is not available, its metrics will say so: %s", name, reason)
        return {"available": False, "reason": reason}
    sources.write_parquet(result.rows, out_dir / f"{name}.parquet")
    return {"available": True, "n": len(result.rows), "dropped": result.n_dropped, "origin": result.origin}


def load_split(data_dir: Path, name: str) -> list[dict]:
    return sources.read_parquet(data_dir / f"{name}.parquet")


def manifest(data_dir: Path) -> dict:
    return json.loads((data_dir / "manifest.json").read_text())
