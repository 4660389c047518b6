"""Environments as params.yaml configures them (`env.*`), for the stages and the workers.

    make_env = env_factory(cfg, data_dir)   # a fresh environment per trajectory
    mask = trained_turns(cfg, turn_ids)     # which policy turns the update may train
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from turnrl import envs
from turnrl.config import Config
from turnrl.training.mlmt import level_mask


def env_options(cfg: Config, data_dir: str | Path | None = None,
                corpus: Sequence[dict] | None = None) -> dict[str, Any]:
    """Keyword arguments of `envs.make(cfg.env.name, ...)`. The search corpus is `corpus` if
    given, else `data_dir/corpus.parquet` written by the preprocess stage."""
    e = cfg.env
    if e.name == "code_tool":
        return e.code_tool.model_dump()
    if e.name == "search":
        from turnrl.envs.search import build_index
        if corpus is None:
            if data_dir is None:
                raise ValueError("env.name = search needs the corpus: pass data_dir (data/processed) or corpus")
            corpus_file = Path(data_dir) / "corpus.parquet"
            if not corpus_file.exists():
                raise FileNotFoundError(f"{corpus_file} is missing; run `dvc repro preprocess` with env.name = search")
            corpus = str(corpus_file)
        s = e.search
        return {"index": build_index(corpus), "top_k": s.top_k, "max_passage_chars": s.max_passage_chars,
                "max_searches": s.max_searches}
    if e.name == "math_refine":
        m = e.math_refine
        if m.feedback in ("self", "model"):   # model: the same conversation, its feedback turn on a second engine
            return {"feedback": "self"}
        return {"feedback": "endpoint", "endpoint_url": m.endpoint_url, "endpoint_model": m.endpoint_model,
                "api_key_env": m.api_key_env, "feedback_max_tokens": m.feedback_max_tokens}
    if e.name == "intervention":
        return {"max_turns": cfg.rollout.max_turns}
    return {}


def env_factory(cfg: Config, data_dir: str | Path | None = None,
                corpus: Sequence[dict] | None = None) -> Callable[[], envs.Env]:
    options = env_options(cfg, data_dir, corpus)
    return lambda: envs.make(cfg.env.name, **options)


def trained_level(cfg: Config, step: int) -> str:
    """Which `math_refine` level training step `step` (from 1) updates: "both", "high" or "low"
    (`env.math_refine.train_levels`, and `alternate: [h, l]`: h steps high, then l steps low)."""
    m = cfg.env.math_refine
    if m.train_levels != "both" or not m.alternate:
        return m.train_levels
    high_steps, low_steps = m.alternate
    return "high" if (step - 1) % (high_steps + low_steps) < high_steps else "low"


def trained_turns(cfg: Config, turn_ids: torch.Tensor, step: int = 1) -> torch.Tensor:
    """1.0 where a token's policy turn is trained at `step`, else 0.0 (shape of `turn_ids`).

    Only `math_refine` with a feedback turn (feedback self or model) has turns the update may
    skip: turn 1 is the high-level feedback, turns 0 and 2 the solver's (see `trained_level`).
    With `feedback: model` each model then trains on its own level's part of this mask."""
    level = trained_level(cfg, step)
    if cfg.env.name != "math_refine" or cfg.env.math_refine.feedback == "endpoint" or level == "both":
        return torch.ones_like(turn_ids, dtype=torch.float)
    return level_mask(turn_ids, level)
