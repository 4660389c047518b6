"""Named presets: each method's setup as a few params keys (`configs/NAME.yaml`).

    python -m turnrl.presets                       # list them
    dvc exp run $(python -m turnrl.presets mutis)  # an experiment with the preset's keys (-S k=v ...)
    python -m turnrl.presets mutis --apply         # or write them into params.yaml (comments kept)

A preset is checked against params.yaml before anything runs: a key it sets that params do
not have is an error naming it.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import yaml

from turnrl.config import ConfigError, load_config

# the project's configs/ (run from the project root, as dvc does), else the one beside src/
PRESETS = Path("configs") if Path("configs").is_dir() else Path(__file__).resolve().parents[2] / "configs"


def names(folder: Path = PRESETS) -> list[str]:
    return sorted(p.stem for p in folder.glob("*.yaml"))


def flatten(data: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        dotted = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, dict):
            out.update(flatten(value, dotted))
        else:
            out[dotted] = value
    return out


def load(name: str, params: str | Path = "params.yaml", folder: Path = PRESETS) -> dict[str, Any]:
    """The preset's dotted keys, validated over `params`."""
    path = folder / f"{name}.yaml"
    if not path.exists():
        raise ConfigError(f"unknown preset {name!r}; presets: {', '.join(names(folder))}")
    keys = flatten(yaml.safe_load(path.read_text()) or {})
    load_config(params, [f"{k}={_yaml_value(v)}" for k, v in keys.items()])
    return keys


def _yaml_value(value: Any) -> str:
    """A value as one line of YAML, the form `-S key=value` takes."""
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()


def set_args(keys: dict[str, Any], params: str | Path = "params.yaml") -> list[str]:
    """`-S key=value` arguments for `dvc exp run`; a key params.yaml does not have yet (e.g. an
    entry of env.options) gets DVC's `++` (add or override)."""
    have = flatten(yaml.safe_load(Path(params).read_text()) or {}) if Path(params).exists() else {}
    args = []
    for key, value in keys.items():
        args += ["-S", f"{'' if key in have else '++'}{key}={_yaml_value(value)}"]
    return args


def apply(keys: dict[str, Any], params: str | Path = "params.yaml") -> None:
    """Write the keys into params.yaml, keeping its comments and order."""
    from ruamel.yaml import YAML
    rt = YAML()
    rt.preserve_quotes = True   # "" stays "", not ''
    rt.width = 4096             # long lines stay as they are, not folded
    rt.representer.add_representer(type(None), lambda r, _: r.represent_scalar("tag:yaml.org,2002:null", "null"))
    path = Path(params)
    data = rt.load(path.read_text())
    for key, value in keys.items():
        node = data
        *parents, last = key.split(".")
        for part in parents:
            node = node[part]
        if last not in node or node[last] != value:   # a value already there keeps how it is written
            node[last] = value
    with path.open("w") as fh:
        rt.dump(data, fh)


def main(argv: list[str] | None = None) -> int:
    import argparse
    parser = argparse.ArgumentParser(prog="turnrl presets", description=(
        "List the presets (the papers' settings as params keys); with NAME print them as dvc exp run -S "
        "arguments, or with --apply write them into ./params.yaml."))
    parser.add_argument("name", nargs="?", help="a preset (none: list them)")
    parser.add_argument("--apply", action="store_true", help="write the preset's keys into ./params.yaml")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.name is None:
        if args.apply:
            parser.error("--apply needs a preset NAME")
        width = max(len(name) for name in names())
        for name in names():
            first = (PRESETS / f"{name}.yaml").read_text().splitlines()[0].lstrip("# ")
            print(f"{name:{width}s}  {first}")
        return 0
    try:
        keys = load(args.name)
    except ConfigError as exc:
        print(f"turnrl presets: {exc}", file=sys.stderr)
        return 2
    if args.apply:
        apply(keys)
        print(f"params.yaml: set {', '.join(f'{k}={v}' for k, v in keys.items())}", file=sys.stderr)
    else:
        print(" ".join(set_args(keys)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
