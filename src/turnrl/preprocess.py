"""`preprocess`: the environment's synthetic train and held-out splits, and the benchmarks,
as parquet in the common schema (see `turnrl.data.sources`).

An optional benchmark nobody can provide offline is not an error: the manifest records
`available: false` with the reason, a warning says so, and the evaluations report it.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

from turnrl.config import Config
from turnrl.data import sources
from turnrl.data.synthetic import product_splits

log = logging.getLogger(__name__)


def preprocess(cfg: Config, out_dir: Path) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    tool = cfg.env.code_tool
    train, heldout = product_splits(cfg.data.train_examples, cfg.data.heldout_examples,
                                    min_digits=tool.min_digits, max_digits=tool.max_digits, seed=cfg.seed)
    sources.write_parquet(train, out_dir / "train.parquet")
    sources.write_parquet(heldout, out_dir / "heldout.parquet")
    manifest: dict = {"train": {"n": len(train)}, "heldout": {"n": len(heldout)}}

    if cfg.eval.math500:
        manifest["math500"] = _benchmark("math500", cfg.data.math500_path, out_dir)
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return manifest


def _benchmark(name: str, explicit_path: str, out_dir: Path) -> dict:
    try:
        result = sources.load(name, path=explicit_path or None, params_key=f"data.{name}_path")
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
