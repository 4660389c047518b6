"""The environment params.yaml configures (`env.name`, `env.options`), for the stages and actors.

    make_env = env_factory(cfg, data_dir)   # a fresh environment per trajectory
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from turnrl import envs
from turnrl.config import Config


def env_context(cfg: Config, data_dir: str | Path | None = None) -> envs.EnvContext:
    return envs.EnvContext(data_dir=Path(data_dir) if data_dir else None, max_turns=cfg.rollout.max_turns,
                           seed=cfg.seed)


def env_options(cfg: Config) -> dict:
    """`env.options` checked by the environment's options model, defaults filled in."""
    return envs.check_options(envs.resolve(cfg.env.name), cfg.env.options)


def env_factory(cfg: Config, data_dir: str | Path | None = None) -> Callable[[], envs.Env]:
    """A no-argument factory of fresh `env.name` environments with `env.options`; `data_dir`
    (data/processed) is where the environment's data files are (a search corpus)."""
    return envs.resolve(cfg.env.name).bind(env_options(cfg), env_context(cfg, data_dir))
