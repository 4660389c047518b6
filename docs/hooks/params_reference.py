"""MkDocs hook: the params reference page (`reference/params.md`), generated at build time from
turnrl's typed config (`turnrl.config.sections.Config` and the section models under it), so it
cannot drift from the code: every key as it is written in params.yaml and in
`dvc exp run -S key=value`, its type, bounds, default and the description it carries.

`sections(Config)` is the walk over the models (a pure function); `render` turns its result into
Markdown; `on_files` adds the page to the build as a virtual file (nothing is written to docs/).
"""
from __future__ import annotations

import inspect
import re
import types
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import annotated_types as at
import yaml
from pydantic import BaseModel
from pydantic_core import PydanticUndefined, to_jsonable_python

PAGE = "reference/params.md"


@dataclass(frozen=True)
class Key:
    path: str           # as written in params.yaml, dotted: train.health.window, reward.judges[*].name
    type: str           # int, float | null, list[str], "fail" | "zero", section, ...
    default: str        # YAML (flow style); "required" when the key has none
    bounds: str         # "> 0", "≥ 0, < 1", "min length 1", ...
    description: str
    section: str = ""   # the path of the section the key opens, if it is one


@dataclass(frozen=True)
class Section:
    path: str           # "" for the top level
    doc: str
    keys: list[Key] = field(default_factory=list)


# --------------------------------------------------------------------------- the walk
def _strip(annotation: Any) -> Any:
    return _strip(get_args(annotation)[0]) if get_origin(annotation) is Annotated else annotation


def _model(annotation: Any) -> tuple[type[BaseModel], str] | None:
    """The section model a field holds, with the path step to its keys: "" (the field is a
    section), "[*]" (a list of them), ".<name>" (a mapping of them)."""
    annotation = _strip(annotation)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, ""
    args = [_strip(a) for a in get_args(annotation)]
    if get_origin(annotation) in (list, tuple, set) and args and isinstance(args[0], type) \
            and issubclass(args[0], BaseModel):
        return args[0], "[*]"
    if get_origin(annotation) is dict and len(args) == 2 and isinstance(args[1], type) \
            and issubclass(args[1], BaseModel):
        return args[1], ".<name>"
    return None


def type_text(annotation: Any) -> str:
    """A field's type as a params.yaml writer reads it."""
    annotation = _strip(annotation)
    origin, args = get_origin(annotation), get_args(annotation)
    if annotation is type(None):
        return "null"
    if annotation is Any:
        return "any"
    if origin is Literal:
        return " | ".join(f'"{a}"' if isinstance(a, str) else str(a) for a in args)
    if origin in (Union, types.UnionType):
        return " | ".join(type_text(a) for a in args)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "section"
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[{', '.join(type_text(a) for a in args)}]" if args else name
    return getattr(annotation, "__name__", str(annotation))


_BOUNDS = ((at.Gt, "gt", "> {}"), (at.Ge, "ge", "≥ {}"), (at.Lt, "lt", "< {}"), (at.Le, "le", "≤ {}"),
           (at.MultipleOf, "multiple_of", "multiple of {}"), (at.MinLen, "min_length", "min length {}"),
           (at.MaxLen, "max_length", "max length {}"))


def bounds_text(metadata: list[Any]) -> str:
    out = []
    for item in metadata:
        out += [fmt.format(getattr(item, attr)) for kind, attr, fmt in _BOUNDS if isinstance(item, kind)]
        if getattr(item, "pattern", None):
            out.append(f"matches `{item.pattern}`")
    return ", ".join(out)


def default_text(value: Any) -> str:
    """A default in YAML flow style, as it would be written in params.yaml."""
    if value is PydanticUndefined:
        return "required"
    text = yaml.safe_dump(to_jsonable_python(value), default_flow_style=True, sort_keys=False, width=10**6)
    return text.removesuffix("\n").removesuffix("\n...").strip()


def _doc(model: type[BaseModel]) -> str:
    own = model.__dict__.get("__doc__")     # not BaseModel's docstring when the model has none
    return inspect.cleandoc(own) if own else ""


def sections(model: type[BaseModel], path: str = "") -> list[Section]:
    """Every section under `model` (itself first, then each sub-section depth first), each with
    its keys: the whole params reference as data."""
    here = Section(path, _doc(model))
    below: list[Section] = []
    for name, info in model.model_fields.items():
        key = f"{path}.{name}" if path else name
        nested = _model(info.annotation)
        default = info.get_default(call_default_factory=True)
        if nested is not None:
            sub, step = nested
            here.keys.append(Key(key, type_text(info.annotation) if step else "section",
                                 "" if not step else default_text(default), "", info.description or "",
                                 section=key + step))
            below += sections(sub, key + step)
        else:
            here.keys.append(Key(key, type_text(info.annotation), default_text(default),
                                 bounds_text(info.metadata), info.description or ""))
    return [here, *below]


# --------------------------------------------------------------------------- the page
_CODE = re.compile(r"(`+)(.+?)\1", re.S)
_PROSE = str.maketrans({"<": "&lt;", ">": "&gt;", "*": r"\*", "_": r"\_", "[": r"\[", "]": r"\]"})
_CELL = str.maketrans({"<": "&lt;", ">": "&gt;", "*": r"\*", "_": r"\_", "[": r"\[", "]": r"\]",
                       "|": r"\|", "\n": " "})


def md_text(text: str, *, cell: bool = True) -> str:
    """`text` shown as written: Markdown specials escaped outside its `code` spans; in a table
    `cell`, on one line and with its pipes escaped."""
    table = _CELL if cell else _PROSE
    out, pos = [], 0
    for m in _CODE.finditer(text):
        span = m.group(0).replace("\n", " ") if cell else m.group(0)   # a table keeps a code span's pipes
        out += [text[pos:m.start()].translate(table), span]
        pos = m.end()
    return "".join(out + [text[pos:].translate(table)])


def anchor(path: str) -> str:
    return "params-" + (re.sub(r"[^A-Za-z0-9]+", "-", path).strip("-") or "top")


def _code(text: str) -> str:
    ticks = "``" if "`" in text else "`"
    return f"{ticks}{text}{ticks}" if text else ""


def render(all_sections: list[Section]) -> str:
    lines = [
        "# Params reference", "",
        "Every key of `params.yaml`, generated from the typed config (`src/turnrl/config/sections.py`) each "
        "time the site is built. A key is written in `params.yaml` as nested YAML, or set for one run with its "
        "dotted path: `dvc exp run -S train.steps=80` (a new key under a mapping such as `env.options` takes "
        "DVC's `++`: `-S ++env.options.max_guesses=6`). `turnrl config` checks a file against these types "
        "and prints the values resolved.", "",
        "Sections: " + ", ".join(f"[`{s.path}`](#{anchor(s.path)})" for s in all_sections if s.path and
                                 "." not in s.path), "",
    ]
    for s in all_sections:
        title = f"`{s.path}`" if s.path else "Top level"
        lines += [f"## {title} {{ #{anchor(s.path)} }}", ""]
        if s.doc:
            lines += [md_text(s.doc, cell=False), ""]
        lines += ["| key | type | default | description |", "|---|---|---|---|"]
        for k in s.keys:
            kind = (_code(k.type) if k.type != "section" else "section") + \
                (f" ({md_text(k.bounds)})" if k.bounds else "")
            if k.section:
                kind += f", [keys below](#{anchor(k.section)})"
            lines.append(f"| `{k.path}` | {kind} | {_code(k.default)} | {md_text(k.description)} |")
        lines.append("")
    return "\n".join(lines)


def params_page() -> str:
    from turnrl.config.sections import Config
    return render(sections(Config))


# --------------------------------------------------------------------------- the hook
def on_files(files, config):
    from mkdocs.structure.files import File
    files.append(File.generated(config, PAGE, content=params_page()))
    return files
