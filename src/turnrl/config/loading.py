"""Reading params.yaml: the loader DVC uses (ruamel's safe loader), `-S key=value` overrides,
pydantic's errors turned into messages naming the key path, the bad value and what is allowed,
the plugin checks, and `turnrl config`."""
from __future__ import annotations

import difflib
import json
import os
import re
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError
from ruamel.yaml import YAML
from ruamel.yaml.error import MarkedYAMLError


from turnrl.config.sections import Config, ConfigError


# --------------------------------------------------------------------------- loading
def _section_at(annotation: Any, part: Any) -> Any:
    """The type one step below `annotation` along `part` of an error location: a section's
    field, a list's item (part is the index) or a mapping's value (part is the key)."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Annotated:
        return _section_at(args[0], part)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        field = annotation.model_fields.get(str(part))
        return field.annotation if field is not None else None
    if origin in (list, tuple, set, frozenset) and args and isinstance(part, int):
        return args[0]
    if origin is dict and len(args) == 2:
        return args[1]
    if origin not in (Union, UnionType):
        return None
    if isinstance(part, str) and _UNION_TAG.fullmatch(part):   # pydantic's name of a member: no key
        return annotation
    return next(filter(None, (_section_at(a, part) for a in args)), None)


def _model_of(annotation: Any) -> type[BaseModel] | None:
    """The section a (possibly Annotated or optional) type stands for, if any."""
    if get_origin(annotation) is Annotated:
        return _model_of(get_args(annotation)[0])
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if get_origin(annotation) in (Union, UnionType):
        return next(filter(None, map(_model_of, get_args(annotation))), None)
    return None


def _allowed_keys(loc: tuple) -> list[str]:
    """The keys allowed beside the unknown one at `loc`: through sections, list items
    (eval.benchmarks.0) and mapping values alike."""
    annotation: Any = Config
    for part in loc[:-1]:
        annotation = _section_at(annotation, part)
        if annotation is None:
            return []
    model = _model_of(annotation)
    return list(model.model_fields) if model is not None else []


_PLAIN_KEY = re.compile(r"[A-Za-z0-9_-]+")


def _key_text(part: Any) -> str:
    """A key as written in params.yaml; quoted when it is not a plain name (empty, spaces,
    control characters, a number or null used as a key) so the message stays one clear line."""
    return part if isinstance(part, str) and _PLAIN_KEY.fullmatch(part) else repr(part)


def _value_text(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + " ..."


def _describe(err: dict, source: str) -> str:
    loc = tuple(err["loc"])
    key = ".".join(_key_text(p) for p in loc) or "params"
    if err["type"] == "extra_forbidden":
        allowed = _allowed_keys(loc)
        guess = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
        hint = f" (did you mean '{guess[0]}'?)" if guess else ""
        parent = ".".join(_key_text(p) for p in loc[:-1]) or "the top level"
        if not allowed:   # a place that takes no keys at all
            return f"{source}: {key}: unknown key; {parent} takes no keys here"
        return f"{source}: {key}: unknown key{hint}; keys under {parent}: {', '.join(allowed)}"
    msg = err["msg"].removeprefix("Value error, ").replace("Input should be", "must be")
    if err["type"] == "literal_error":
        msg = "must be one of " + err["ctx"]["expected"]
    msg = " ".join(msg.split())  # one line
    if isinstance(err.get("input"), dict) and err["type"] == "value_error":  # a section-wide check
        return f"{source}: {key}: {msg}"
    return f"{source}: {key} = {_value_text(err.get('input'))}: {msg}"


# pydantic names the member of a union a value failed as a part of its location
# (model.lora.target_modules.'list[str]'): not a key a user wrote
_UNION_TAG = re.compile(r"(str|int|float|bool|none|(list|dict|tuple|set|literal|function-\w+)\[.*\]|[A-Z]\w*)")


def _merge_union_errors(errors: list[dict]) -> list[dict]:
    """One error per key: a value that fails every member of a union (`list[str] | str`) gives
    one line that says what each member needs, at the key as written in params.yaml."""
    merged: dict[tuple, dict] = {}
    for err in errors:
        loc = tuple(err["loc"])
        if err["type"] != "extra_forbidden":
            loc = tuple(p for p in loc if not (isinstance(p, str) and _UNION_TAG.fullmatch(p)))
        if loc in merged and merged[loc]["type"] != "extra_forbidden":
            first = merged[loc]
            msg = err["msg"].removeprefix("Value error, ")
            if msg not in first["msg"]:
                first["msg"] = f"{first['msg']}; or {msg}"
                first["type"] = "union"   # literal_error's own wording no longer fits two messages
            continue
        merged[loc] = {**err, "loc": loc}
    return list(merged.values())


def parse_config(data: Any, source: str = "params.yaml", plugins: bool = True) -> Config:
    """Validate params; with `plugins`, also import and check what they name (`check_plugins`)."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of sections (model, env, train, ...), got {type(data).__name__}")
    try:
        cfg = Config.model_validate(data)
    except ValidationError as exc:
        lines = [_describe(e, source) for e in _merge_union_errors(exc.errors())]
        raise ConfigError("\n".join(dict.fromkeys(lines))) from None
    if plugins:
        problems = check_plugins(cfg)
        if problems:
            raise ConfigError("\n".join(f"{source}: {p}" for p in problems))
    return cfg


def check_plugins(cfg: Config) -> list[str]:
    """What params name by import path or registry, imported and checked: the environment and
    its options, its synthetic task and demonstrations where params need them, the algorithm,
    the reward functions and the benchmarks' graders. One fix-it line per problem."""
    from turnrl import envs
    from turnrl.data.synthetic import demonstration_problem
    from turnrl.plugins import PluginError, check_call
    from turnrl.rewards.functions import from_config as reward_functions
    from turnrl.rewards.graders import grader

    problems: list[str] = []

    def attempt(fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except PluginError as exc:
            problems.extend(str(exc).splitlines())
            return None

    spec = attempt(envs.resolve, cfg.env.name)
    if spec is not None:
        options = attempt(cfg.env.checked_options)   # (unknown keys another environment takes: a hint)
        if options is not None and (problem := spec.call_problem(options)):
            problems.append(problem)
        try:
            task = attempt(spec.task_for, options) if options is not None else spec.task
        except Exception as exc:   # noqa: BLE001 - a plugin's own code (a game's factory) that raises
            from turnrl.errors import one_line
            problems.append(f"env.name = {cfg.env.name!r}: its task could not be made with env.options: "
                            f"{one_line(exc)}")
            return problems
        if "synthetic" in (cfg.data.train_set, cfg.data.heldout_set) and (task is None or task.rows is None):
            problems.append(f"data.train_set / data.heldout_set = synthetic: the environment {cfg.env.name!r} has no "
                            "synthetic task (EnvSpec.task with rows); set them to your data files (jsonl/parquet)")
        if cfg.model.path == "tiny" and (problem := demonstration_problem(task, cfg.env.name)):
            problems.append(f"model.path = tiny: {problem}")
        if getattr(task, "demonstration", None) is not None:   # called (row, rng, good) by the warm start and sft
            hooked = (options or {}).get("demonstration")
            attempt(check_call, task.demonstration,
                    f"env.options.demonstration = {hooked!r}" if hooked else f"env.name = {cfg.env.name!r}: its task's "
                    "demonstration", "demonstration(row, rng, good) -> the assistant turns", positional=3)
    attempt(cfg.algorithm.fill_options)        # the algorithm and its options, defaults filled in
    from turnrl.algos.registry import resolve as resolve_algorithm
    try:
        algorithm = resolve_algorithm(cfg.algorithm.name)
    except Exception:   # noqa: BLE001 - fill_options has said what is wrong with the name
        algorithm = None
    if algorithm is not None and algorithm.check_params is not None and (problem := algorithm.check_params(cfg)):
        problems.append(problem)
    if algorithm is not None and algorithm.teacher and not cfg.reward.teacher.enabled:
        problems.append(f"algorithm.name = {cfg.algorithm.name} learns from a teacher's logprobs: set "
                        "reward.teacher.serve (a checkpoint turnrl serves, same tokenizer as the policy) or "
                        "reward.teacher.base_url (a vLLM server)")
    if cfg.algorithm.dynamic_sampling.enabled:
        if algorithm is not None and algorithm.teacher:
            problems.append(f"algorithm.dynamic_sampling.enabled with algorithm.name = {cfg.algorithm.name}: its "
                            "signal is the teacher's per-token logprobs, which a group of equal rewards still has; "
                            "turn dynamic sampling off")
        elif algorithm is not None and (algorithm.critic or algorithm.prepare is not None):
            problems.append(f"algorithm.dynamic_sampling.enabled with algorithm.name = {cfg.algorithm.name}: its "
                            "advantages do not come from a group baseline (a critic, or MLMT's levels), so a group "
                            "whose rewards are equal still has signal there; turn dynamic sampling off, or use a "
                            "group-based algorithm (grpo, dr_grpo, rloo, mt_grpo, ms_grpo, ms_po)")
    attempt(cfg.algorithm.fill_loss_options)   # the policy loss and its options
    scorer = attempt(reward_functions, cfg.reward, cfg.rollout)
    signal = cfg.algorithm.dynamic_sampling.signal
    if scorer is not None and cfg.algorithm.dynamic_sampling.enabled and signal not in ("reward", "outcome", *scorer.names):
        problems.append(f"algorithm.dynamic_sampling.signal = {signal!r}: not reward, outcome or a reward function's "
                        f"name ({', '.join(scorer.names) or 'none configured'})")
    for i, bench in enumerate(cfg.eval.benchmarks):
        attempt(grader, bench.grader, f"eval.benchmarks[{i}].grader")
    return problems


def _set_dotted(data: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    node = data
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {key}: {_key_text(part)} is a value, not a section")
        node = child
    node[parts[-1]] = value


def _delete_dotted(data: Any, key: str) -> None:
    """`key` removed from `data` (a key that is not there: nothing to remove)."""
    *parents, last = key.split(".")
    node = data
    for part in parents:
        node = node.get(part) if isinstance(node, dict) else None
    if isinstance(node, dict):
        node.pop(last, None)


def _yaml_fix(text: str, exc: Any) -> str | None:
    """The fix for the two mistakes DVC's loader stops on that PyYAML lets through: `[a.b:c]` or
    `{k: a.b:c}` (in a flow collection a plain value may not contain ':'; names the value to
    quote), and a key written twice."""
    if "duplicate key" in str(exc.problem):
        return "keep one of the two (DVC rejects a key written twice in a mapping)"
    mark = exc.context_mark
    lines = text.splitlines()
    if "unexpected ':'" not in str(exc.problem) or mark is None or mark.line >= len(lines):
        return None
    value = re.split(r"[,\]}]| #", lines[mark.line][mark.column:], maxsplit=1)[0].strip()
    quoted = f"'{value}'" if "'" not in value else json.dumps(value)
    return f"quote the value: {quoted} (inside [...] or {{...}} a value with ':' must be quoted)"


def _yaml(text: str, what: str, fix: str, override: bool = False) -> Any:
    """Parse YAML the way DVC reads params.yaml (ruamel.yaml's safe loader, YAML 1.2), so what
    DVC rejects is rejected here, before a stage starts; every failure a ConfigError naming the
    line and the fix. The loader raises more than YAMLError on some input (ValueError for a date
    like 2020-13-45, KeyError for `!!bool maybe`, RecursionError for deep nesting, ...)."""
    try:
        return YAML(typ="safe").load(text)
    except MarkedYAMLError as exc:
        if override and "unexpected ':'" in str(exc.problem):
            # `-S 'reward.functions=[a.b:c]'` is command-line syntax: `dvc exp run -S` (Hydra's
            # grammar) takes it unquoted and writes it to params.yaml quoted; so does PyYAML
            try:
                return yaml.safe_load(text)
            except Exception:   # noqa: BLE001 -- report the loader's own error below
                pass
        mark = exc.problem_mark or exc.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = " ".join(filter(None, [exc.context, exc.problem])) or "syntax error"
        raise ConfigError(f"{what}: {' '.join(problem.split())}{where}; "
                          f"{_yaml_fix(text, exc) or fix}") from None
    except Exception as exc:   # noqa: BLE001 -- any loader failure is a bad file, and DVC stops on it too
        problem = " ".join(str(exc).replace('in "<unicode string>", ', "").split())[:200]
        raise ConfigError(f"{what}: {type(exc).__name__}: {problem}; {fix}") from None


def load_config(path: str | Path = "params.yaml", overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read and validate params.yaml, read as DVC reads it (a file DVC rejects is rejected here
    with the line and the fix); `overrides` are `key.path=value` strings (YAML values, as `-S`)."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"{path}: not found; run from the project root or pass the params file path")
    if not path.is_file():
        raise ConfigError(f"{path}: not a file; pass the params file path (e.g. params.yaml)")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start}); save it as UTF-8 YAML") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    data = _yaml(text, f"{path}: not valid YAML", "fix the line it names")
    data = data if data is not None else {}
    for item in overrides:
        if str(item).strip().startswith("~"):   # DVC's (Hydra's) ~key: delete the key, e.g. ~env.options
            key = str(item).strip()[1:].partition("=")[0].strip()
            if not key or not all(key.split(".")):
                raise ConfigError(f"override {item!r}: expected ~key.path, e.g. ~env.options")
            _delete_dotted(data, key)
            continue
        key, eq, raw = str(item).partition("=")
        key = key.strip().lstrip("+")   # DVC's ++key (add or override) and +key (add) set the key too
        if not eq or not key or not all(key.split(".")):
            raise ConfigError(f"override {item!r}: expected key.path=value, e.g. train.steps=60")
        # key= is the empty string, as DVC (Hydra) writes it: how a user clears reward.teacher.serve
        value = "" if not raw.strip() else _yaml(raw, f"override {key}: the value {raw!r} is not valid YAML",
                                                 f"quote it if it is a string, e.g. {key}='\"...\"'", override=True)
        if isinstance(data, dict):
            _set_dotted(data, key, value)
    return parse_config(data, source=str(path.name))


PARAMS_ENV = "TURNRL_PARAMS"   # the params file the stages and every command read, when set


def default_params_file() -> str:
    """params.yaml, or the file $TURNRL_PARAMS names (as the stages read it)."""
    return os.environ.get(PARAMS_ENV) or "params.yaml"


def add_params_argument(parser, positional: bool = False) -> None:
    """The params file option every command takes (`--params FILE`; default $TURNRL_PARAMS or
    params.yaml); `positional`: also as the first argument (`turnrl config FILE`)."""
    if positional:
        parser.add_argument("params_file", nargs="?", metavar="params", help="the params file (or --params)")
    parser.add_argument("--params", default=None, metavar="FILE",
                        help=f"the params file (default: ${PARAMS_ENV} if set, else params.yaml)")


def params_file(args, parser) -> str:
    """The params file of arguments made by `add_params_argument` (two different files: an error)."""
    given = getattr(args, "params_file", None)
    if given and args.params and given != args.params:
        parser.error(f"two params files given ({given} and --params {args.params}); give one")
    return given or args.params or default_params_file()


def main(argv: list[str] | None = None) -> int:
    """`python -m turnrl.config [params.yaml] [-S key=value ...]`: validate params, check what
    the stages would check before heavy work (turnrl.config.checks: data and benchmark files,
    their field mappings, stdio MCP commands), print the resolved config. Exit 2 on a problem."""
    import argparse
    import sys
    parser = argparse.ArgumentParser(prog="turnrl config",
                                     description="Validate a params file, check the files and commands it names, "
                                                 "and print the resolved config (every key, defaults filled in).")
    add_params_argument(parser, positional=True)
    parser.add_argument("-S", "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a param, e.g. -S train.steps=3 (repeatable; as `dvc exp run -S`)")
    parser.add_argument("-q", "--quiet", action="store_true", help="print nothing when everything checks out")
    args = parser.parse_args(argv)
    from turnrl.config.checks import InputProblems, all_problems, require
    try:
        cfg = load_config(params_file(args, parser), args.overrides)
        require(all_problems(cfg))
    except (ConfigError, InputProblems) as exc:
        lines = str(exc).splitlines()   # a line a problem
        print("\n".join(f"turnrl config: {line}" for line in lines), file=sys.stderr)
        return 2
    if args.quiet:
        return 0
    from turnrl import envs
    resolved = cfg.model_dump()
    resolved["env"]["options"] = envs.check_options(envs.resolve(cfg.env.name), cfg.env.options)   # defaults shown
    print(yaml.safe_dump(resolved, sort_keys=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
