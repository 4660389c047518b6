"""`turnrl env [NAME] [-S key=value ...] [--row N] [--step TEXT ...]`: look at an environment by hand.

Prints the environment's resolved options (defaults filled in, checked as `env.options` is),
its system prompt, stop strings (params' env.stop, or --stop, replaces its own) and observation
role, its tool schemas (the `tools` environment, or any with a `tools` attribute: what the chat
template renders), the row and the
first observation `reset` gives for it, then steps it with each `--step` text in turn, printing
every StepResult, until one is done.

    turnrl env                                        # params.yaml's env.name and env.options
    turnrl env examples.guess.env:ENV -S max_guesses=3 --step '<guess>8</guess>' --step '<guess>12</guess>'
    turnrl env tools -S 'functions=["examples.tools.calc:calculator"]'

NAME: a registered name or an import path; empty: params.yaml's `env.name`, with its
`env.options` (then `-S` changes single options). `-S key=value`: an option, the value read as
YAML (as `dvc exp run -S`). The row (`--row N`, default 0) is the Nth of data/processed/
heldout.parquet when the preprocess stage wrote it for this environment and options (its
manifest.json, or dvc.lock, records which), else of the environment's synthetic held-out rows
(`--data PATH` names another processed parquet or data file).
"""
from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import sys
import traceback
from pathlib import Path
from typing import Any

import yaml

from turnrl import envs
from turnrl.config import add_params_argument, params_file
from turnrl.config.sections import locked_env
from turnrl.envs.base import step_result_problem
from turnrl.errors import first_line, one_line
from turnrl.plugins import PluginError
from turnrl.rollout.multi_turn import MalformedStep, malformed_step, opened, own_stops

PROCESSED = Path("data/processed/heldout.parquet")


class EnvCliError(ValueError):
    """Bad input to `turnrl env`; the message says what to fix."""


def env_options(pairs: list[str]) -> dict[str, Any]:
    """Environment options of `-S key=value` pairs (`env.options.` and dvc's `++` dropped, values read as
    YAML); a pair that is not key=value, names another env key or holds bad YAML is an EnvCliError."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise EnvCliError(f"-S {pair!r}: write an option as key=value (e.g. -S max_guesses=3)")
        try:
            key = key.strip().lstrip("+")   # dvc exp run's ++key / +key
            if key.startswith("env.") and not key.startswith("env.options."):
                raise EnvCliError(f"-S {pair!r}: here -S sets an environment option (e.g. -S max_guesses=3 or "
                                  "-S env.options.max_guesses=3); the environment is NAME, the first argument")
            out[key.removeprefix("env.options.")] = yaml.safe_load(value) if value else ""
        except yaml.YAMLError as exc:
            raise EnvCliError(f"-S {pair!r}: the value is not YAML ({first_line(exc)}); quote it") from None
    return out


def _from_params(params: str) -> tuple[str, dict[str, Any], int, list[str] | None]:
    """(env.name, env.options, rollout.max_turns, env.stop) of a params file."""
    from turnrl.config import load_config
    cfg = load_config(params)
    return cfg.env.name, dict(cfg.env.options), cfg.rollout.max_turns, cfg.env.stop


def _made_by(processed: Path = PROCESSED) -> tuple[str, dict] | None:
    """(env.name, env.options) the preprocess stage wrote `processed` for: its manifest says so,
    else (data from before the manifest recorded it) dvc.lock's preprocess params; None: unknown."""
    try:
        recorded = json.loads((processed.parent / "manifest.json").read_text()).get("env")
        if isinstance(recorded, dict) and isinstance(recorded.get("name"), str):
            return recorded["name"], dict(recorded.get("options") or {})
    except (OSError, ValueError, AttributeError):
        pass
    return locked_env(stages_first=("preprocess",))


def _belongs(spec: envs.EnvSpec, name: str, options: dict[str, Any], made_by: tuple[str, dict] | None) -> bool:
    """Whether the processed data was made for this environment (unknown: assumed so)."""
    if made_by is None:
        return True
    if made_by[0] != name:
        return False
    try:
        return envs.check_options(spec, made_by[1]) == options
    except PluginError:
        return False


def _row(spec: envs.EnvSpec, index: int, data: str | None, name: str = "",
         options: dict[str, Any] | None = None) -> tuple[dict, str]:
    """The `index`th row and where it came from: --data, else the processed held-out rows when
    the preprocess stage made them for this environment (`name` with these resolved `options`),
    else the environment's synthetic held-out rows."""
    from turnrl.data import sources
    name = name or spec.name
    other = ""
    if not data and PROCESSED.is_file():
        made_by = _made_by()
        if not _belongs(spec, name, options or {}, made_by):
            other = (f"{PROCESSED} holds the rows preprocess made for env.name {made_by[0]!r}"
                     f"{' with other options' if made_by[0] == name else ''}")
    if data or (PROCESSED.is_file() and not other):
        path = Path(data) if data else PROCESSED
        rows = sources.read_parquet(path) if path.suffix == ".parquet" else sources.load_rows(path)
        where = str(path)
    elif (task := spec.task_for(options or {})) is not None and task.rows is not None:
        rows, where = task.rows(index + 1, seed=0, split="heldout", exclude=set()), "synthetic held-out rows"
        if other:
            where += f"; {other}, not shown"
    elif other:
        raise EnvCliError(f"no rows of {name} to reset it with: {other}, and {name} has no synthetic rows; give "
                          f"--data FILE (a data file of its rows), or run the preprocess stage for it "
                          f"(dvc exp run -S env.name={name} preprocess, or set env.name in params.yaml and "
                          "dvc repro preprocess)")
    else:
        raise EnvCliError(f"no rows to reset {spec.name or 'the environment'} with: it has no synthetic rows and "
                          f"{PROCESSED} does not exist; run `dvc repro preprocess` or give --data FILE")
    if not 0 <= index < len(rows):
        raise EnvCliError(f"--row {index}: {where} has {len(rows)} rows (0 to {len(rows) - 1})")
    return rows[index], where


def _show(label: str, value: Any) -> None:
    """`label: value` on one line when short, else the value indented below (JSON for data)."""
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
    if "\n" in text or len(text) > 100:
        if not isinstance(value, str):
            text = json.dumps(value, indent=2, ensure_ascii=False, default=str)
        indent = " " * (len(label) - len(label.lstrip()) + 2)
        text = "\n" + "\n".join(indent + line for line in text.splitlines())
    else:
        text = " " + text
    print(f"{label}:{text}")


def explore(name: str, options: dict[str, Any], row: int = 0, steps: list[str] | tuple[str, ...] = (),
            data: str | None = None, max_turns: int = 3, stop: list[str] | None = None) -> None:
    """Print the environment `name` with `options` (and env.stop `stop`), a row's first
    observation and each step."""
    spec = envs.resolve(name, "NAME")
    resolved = envs.check_options(spec, options, "env.options", set_as="-S {name}=...")   # this command's -S
    data_dir = PROCESSED.parent if PROCESSED.parent.is_dir() else None
    env = envs.with_stop(spec.bind(resolved, envs.EnvContext(data_dir=data_dir, max_turns=max_turns, seed=0)), stop)()
    print(f"environment: {name}")
    _show("options", resolved)
    _show("system prompt", getattr(env, "system_prompt", None))
    strings = list(own_stops(env))
    where = " (env.stop)" if stop is not None and strings else ""
    if not strings:
        where = " (none: a turn ends at the model's chat-template end-of-turn token; env.stop or --stop sets strings)"
    print(f"stop: {strings}{where}    observation role: {getattr(env, 'observation_role', 'user')}")
    if getattr(env, "tools", None):
        _show("tool schemas", env.tools)
    example, where = _row(spec, row, data, name, resolved)
    _show(f"row {row} ({where})", example)
    first = env.reset(example)
    opened(env, first)   # what a rollout would end env_error for: MalformedStep, as there
    _show("first observation", first)
    for turn, text in enumerate(steps, start=1):
        result = env.step(text)
        if inspect.isawaitable(result):
            result = asyncio.run(result)
        print(f"step {turn}: {text!r}")
        if (problem := step_result_problem(result)) is not None:
            raise malformed_step(env, problem)
        _show("  observation", result.observation)
        print(f"  reward: {result.reward}    done: {result.done}")
        _show("  info", result.info)
        if result.done and turn < len(steps):
            print(f"done after step {turn}: the remaining {len(steps) - turn} step(s) are not run")
            break


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="turnrl env", description=__doc__.split("\n")[0].split(": ", 1)[1])
    parser.add_argument("name", nargs="?", default="", help="registered name or import path; empty: params.yaml's env")
    parser.add_argument("-S", "--set", dest="options", action="append", default=[], metavar="KEY=VALUE",
                        help="an environment option (its value read as YAML)")
    parser.add_argument("--row", type=int, default=0, help="which row to reset with (default 0)")
    parser.add_argument("--step", dest="steps", action="append", default=[], metavar="TEXT",
                        help="a policy turn to step with (repeat for more turns)")
    parser.add_argument("--stop", dest="stop", action="append", default=None, metavar="TEXT",
                        help="a string that ends a policy turn, as env.stop (repeat for more; replaces the "
                             "environment's own)")
    parser.add_argument("--data", default=None, help="rows from this file instead of data/processed/heldout.parquet")
    add_params_argument(parser)
    args = parser.parse_args(argv)
    if args.row < 0:
        parser.error(f"--row {args.row}: a row number, 0 or more")
    from turnrl.config import ConfigError
    from turnrl.data.sources import DataSourceError
    try:
        name, options, max_turns, stop = args.name, {}, 3, None
        if not name:
            name, options, max_turns, stop = _from_params(params_file(args, parser))
        explore(name, {**options, **env_options(args.options)}, args.row, args.steps, args.data, max_turns,
                args.stop if args.stop is not None else stop)
    except (EnvCliError, PluginError, ConfigError, DataSourceError, FileNotFoundError) as exc:
        print(f"turnrl env: {exc}", file=sys.stderr)   # (a data file missing: what to run says the message)
        return 2
    except MalformedStep as exc:   # reset or step returned what a rollout refuses: the plugin's to fix
        print(f"turnrl env: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:   # the environment itself raised: its traceback is what one debugs
        traceback.print_exc()
        print(f"turnrl env: the environment raised {one_line(exc)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
