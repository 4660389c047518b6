"""What every DVC stage script shares: validated params and the checks of the files and
commands they name (turnrl.config.checks) first, then an MLflow stage run.

A failure is one line, `turnrl <stage>: <why>`: the message alone for the errors written for
the user (a plugin, a reward function, an actor, the environment, an unhealthy run), the
traceback first for an unexpected one (a bug: where it happened matters).

Exit codes: 2 for bad input (params, data, model path: retrying will not help, and the
Prefect flow does not retry it), 130 for Ctrl-C and 143 for SIGTERM (the shell's codes; the
MLflow run closed as killed), 1 for anything else. A full disk is reported as such (what
was being written, where to free space), with exit code 1: it is not bad input, and a retry
after space was freed succeeds. So is a tracking store that cannot be opened (one line naming
tracking.uri; a server that does not answer only with `tracking.on_unreachable: fail`, else
the stage records to the project's mlflow.db): a retry once the server is up succeeds.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any, Callable

from turnrl.config import Config, ConfigError, default_params_file, load_config
from turnrl.errors import Terminated, one_line, raise_on_sigterm

BAD_INPUT_EXIT = 2
DISK_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT}
RESUMES = "; a rerun resumes from the last checkpoint (train.checkpoint_every)"


def run_stage(name: str, body: Callable[[Config], Any],
              resume_run: Callable[[Config], str | None] | None = None) -> None:
    """Validate params, then run `body` inside the stage's MLflow run. `resume_run(cfg)` may
    name an earlier run of this stage to continue (train after a crash)."""
    _stage_arguments(name, sys.argv[1:])
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    params = default_params_file()
    try:
        cfg = load_config(params)
    except ConfigError as exc:
        print("\n".join(f"turnrl {name}: invalid params: {line}" for line in str(exc).splitlines()), file=sys.stderr)
        raise SystemExit(BAD_INPUT_EXIT) from None
    from turnrl.config.checks import stage_problems
    problems = stage_problems(cfg, name)   # files and commands params name: before the MLflow run and any work
    if problems:
        print("\n".join(f"turnrl {name}: {problem}" for problem in problems), file=sys.stderr)
        raise SystemExit(BAD_INPUT_EXIT)

    from turnrl.data.sources import DataSourceError
    from turnrl.tracking import runs
    raise_on_sigterm()   # SIGTERM (a scheduler, kill, docker stop) stops the stage as Ctrl-C does
    try:
        with runs.stage_run(name, cfg, resume_run(cfg) if resume_run else None):
            body(cfg)
    except (DataSourceError, FileNotFoundError, ConfigError) as exc:   # e.g. params that cannot work together
        print(f"turnrl {name}: {exc}", file=sys.stderr)
        raise SystemExit(BAD_INPUT_EXIT) from None
    except Terminated:   # the MLflow run was closed as killed; a rerun resumes (train)
        print(f"turnrl {name}: stopped by SIGTERM{RESUMES if name == 'train' else ''}", file=sys.stderr)
        raise SystemExit(143) from None
    except KeyboardInterrupt:   # Ctrl-C: as SIGTERM
        print(f"turnrl {name}: interrupted{RESUMES if name == 'train' else ''}", file=sys.stderr)
        raise SystemExit(130) from None
    except runs.TrackingUnavailable as exc:   # a server that is down: starting it and rerunning will do
        print(f"turnrl {name}: {exc}", file=sys.stderr)
        raise SystemExit(1) from None
    except OSError as exc:
        if exc.errno not in DISK_FULL_ERRNOS:
            raise SystemExit(failure_exit(name, exc)) from None
        print(disk_full_message(name, exc), file=sys.stderr)
        raise SystemExit(1) from None
    except Exception as exc:   # noqa: BLE001 - every failure is its one-line message, never a bare traceback
        raise SystemExit(failure_exit(name, exc)) from None


def _stage_arguments(name: str, argv: list[str]) -> None:
    """A stage script takes no options (params.yaml is its input): --help prints what it does and
    exits, another option is refused, before any work (`python stages/train.py --help` trained)."""
    if any(arg in ("-h", "--help") for arg in argv):
        doc = (getattr(sys.modules.get("__main__"), "__doc__", None) or f"The {name} stage.").strip()
        print(f"{doc}\n\nRun by `dvc repro` (params from params.yaml, or the file $TURNRL_PARAMS names); change a "
              "value with `dvc exp run -S key=value`.")
        raise SystemExit(0)
    flags = [arg for arg in argv if arg.startswith("-")]
    if flags:
        print(f"turnrl {name}: {flags[0]}: the stage takes no options; it reads params.yaml (dvc exp run -S "
              "key=value changes a value)", file=sys.stderr)
        raise SystemExit(BAD_INPUT_EXIT)


# Exceptions whose message is written for the user (it names the key or the plugin, and the fix):
# that line alone. Looked up in sys.modules: a module never imported raised none of them.
USER_FACING = (("turnrl.plugins", "PluginError", BAD_INPUT_EXIT),
               ("turnrl.rewards.functions", "RewardFunctionError", 1),
               ("turnrl.training.cluster", "ActorFailure", 1),
               ("turnrl.training.checkpoint", "DamagedCheckpoint", BAD_INPUT_EXIT),   # a retry would fail alike
               ("turnrl.training.loop", "EnvironmentFailure", 1),
               ("turnrl.training.health", "UnhealthyTraining", 1))


def failure_exit(stage: str, exc: BaseException) -> int:
    """Print why `stage` failed as one line (`turnrl <stage>: ...`) and return its exit code. An
    exception no user-facing message was written for (a bug) gets its traceback first."""
    for module, name, code in USER_FACING:
        cls = getattr(sys.modules.get(module), name, None)
        if cls is not None and isinstance(exc, cls):
            print(f"turnrl {stage}: {' '.join(str(exc).split())}", file=sys.stderr)
            return code
    import traceback
    traceback.print_exception(exc, file=sys.stderr)
    print(f"turnrl {stage}: failed: {one_line(exc, 1000)} (an unexpected error: "
          "the traceback above says where; please report it)", file=sys.stderr)
    return 1


def disk_full_message(stage: str, exc: OSError) -> str:
    """What to do when a stage's write failed with ENOSPC / EDQUOT."""
    target = Path(exc.filename) if exc.filename else Path.cwd()
    where = f"while writing {exc.filename}" if exc.filename else "while writing its outputs"
    folder = target if target.is_dir() else target.parent
    return (f"turnrl {stage}: the disk is full ({os.strerror(exc.errno)}) {where}. Free space on the "
            f"file system holding {folder} (see `df -h {folder}`), or move the project to a bigger "
            f"disk, then rerun the stage (`dvc repro {stage}`). This run's outputs are incomplete and "
            "DVC has not recorded them.")


def write_json(path: str | Path, data: Any) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    try:
        tmp.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
        tmp.replace(path)   # readers never see a half-written file
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        exc.filename = exc.filename or str(path)
        raise
