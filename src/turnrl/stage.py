"""What every DVC stage script shares: validated params first, then an MLflow stage run.

Exit codes: 2 for bad input (params, data, model path: retrying will not help, and the
Prefect flow does not retry it), 1 for anything else.
"""
from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Any, Callable

from turnrl.config import Config, ConfigError, load_config

BAD_INPUT_EXIT = 2


def run_stage(name: str, body: Callable[[Config], Any],
              resume_run: Callable[[Config], str | None] | None = None) -> None:
    """Validate params, then run `body` inside the stage's MLflow run. `resume_run(cfg)` may
    name an earlier run of this stage to continue (train after a crash)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    params = os.environ.get("TURNRL_PARAMS", "params.yaml")
    try:
        cfg = load_config(params)
    except ConfigError as exc:
        print(f"turnrl {name}: invalid params\n{exc}", file=sys.stderr)
        raise SystemExit(BAD_INPUT_EXIT) from None

    from turnrl import tracking
    from turnrl.data.sources import DataSourceError
    try:
        with tracking.stage_run(name, cfg, resume_run(cfg) if resume_run else None):
            body(cfg)
    except (DataSourceError, FileNotFoundError) as exc:
        print(f"turnrl {name}: {exc}", file=sys.stderr)
        raise SystemExit(BAD_INPUT_EXIT) from None


def write_json(path: str | Path, data: Any) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
    tmp.replace(path)   # readers never see a half-written file
