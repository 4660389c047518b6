"""Import paths to user code: environments, reward functions, algorithms, policy losses and graders.

A params value such as `env.name: my_pkg.guess:make_env` names an object `make_env` in the
module `my_pkg.guess`, found in the project folder (where dvc.yaml is) or in an installed
package. `load_object` imports it and turns every way that can fail into a `PluginError`
naming the params key and what to fix; `check_call` checks that a callable takes the
arguments turnrl will pass; `options_model` and `validate_options` check a plugin's options
(its own pydantic model, or one made from its signature) with the same fix-it messages as
params.yaml. `import_library` imports an optional library (an ecosystem adapter's, reasoning-gym's)
on first use, or says in one line which extra installs it.

Modules of the project folder ship with a Ray job to every node (`local_packages` lists them
for Ray's `py_modules`), so actors on other machines import the same code.

Nothing here imports torch, Ray or vLLM: params are checked within a second.
"""
from __future__ import annotations

import importlib
import inspect
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

from pydantic import BaseModel, ConfigDict, ValidationError, create_model

from turnrl.errors import one_line

#: A value is an import path when it has this separator: `package.module:attribute`.
SEPARATOR = ":"
#: What installs the optional libraries of the ecosystem adapters and reasoning-gym (pyproject's extra).
INSTALL_HINT = "install the ecosystem extra: pip install -e '.[ecosystem]'"


class PluginError(ValueError):
    """A plugin that cannot be used; the message names the params key and what to fix."""


def is_import_path(value: str) -> bool:
    return SEPARATOR in value


def project_root() -> Path:
    """Where plugin modules of the project are found: the DVC root of a running stage, else
    the working directory."""
    return Path(os.environ.get("DVC_ROOT") or os.getcwd()).resolve()


def _ensure_project_on_path() -> None:
    root = str(project_root())
    if root not in sys.path:
        sys.path.insert(0, root)


def load_object(path: str, key: str) -> Any:
    """The object `path` (`package.module:attribute`, attributes may be dotted) names.
    Raises PluginError naming `key` (the params key, e.g. env.name) for a malformed path, a
    module that does not import (and why), or a missing attribute."""
    module_name, sep, attribute = path.partition(SEPARATOR)
    if not sep or not module_name or not attribute or SEPARATOR in attribute:
        raise PluginError(f"{key} = {path!r}: an import path is 'package.module:name', e.g. my_tasks.guess:make_env")
    _ensure_project_on_path()
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and module_name.startswith(exc.name):   # the module itself (or its package) is missing
            raise PluginError(
                f"{key} = {path!r}: no module named {exc.name!r}. Put it in the project folder ({project_root()}), "
                f"where {module_name.replace('.', '/')}.py (or a package folder) resolves, or install its package "
                "(pip install -e ...)") from None
        raise PluginError(f"{key} = {path!r}: importing {module_name} failed: it needs the module {exc.name!r}, "
                          "which is not installed (pip install it)") from None
    except Exception as exc:   # noqa: BLE001 - any error in the user's module
        raise PluginError(f"{key} = {path!r}: importing {module_name} raised {one_line(exc)}") from None
    obj: Any = module
    for part in attribute.split("."):
        if not hasattr(obj, part):
            raise PluginError(f"{key} = {path!r}: module {module_name} has no attribute {attribute!r}; "
                              f"it defines: {', '.join(_defined(module)) or 'nothing public'}")
        obj = getattr(obj, part)
    return obj


def _defined(module: Any) -> list[str]:
    """The public names a module defines itself (not the ones it imports), at most 20."""
    def defined_here(v: Any) -> bool:
        if inspect.ismodule(v):
            return False
        if inspect.isclass(v) or inspect.isfunction(v):
            return v.__module__ == module.__name__
        return True   # an instance (an EnvSpec, a constant)
    own = [n for n, v in vars(module).items() if not n.startswith("_") and n != "annotations" and defined_here(v)]
    return sorted(own)[:20]


def import_library(module: str, *, where: str, what: str | None = None, pin: str | None = None,
                   error: type[Exception] = PluginError) -> ModuleType:
    """The optional library `module` (`what`: its distribution's name, for the message), imported on
    first use; otherwise `error` (PluginError unless the caller's floor has its own) in one line:
    `<where>: the <what> library is not importable (<why>); install the ecosystem extra: ...`,
    with ` (or pip install <pin>)` when `pin` names the library alone."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        hint = INSTALL_HINT + (f" (or pip install {pin})" if pin else "")
        raise error(f"{where}: the {what or module} library is not importable ({exc}); {hint}") from None


class Registry:
    """Names for plugins of one kind (environments, algorithms, policy losses, graders): each a
    registered object, or the import path of one loaded on first use; a name that is not
    registered but is an import path is loaded too. A built-in and a plugin go the same way:
    `convert(obj, name, key)` turns what was found into the kind's object, checking it. The
    result is kept per registered name; an unregistered import path is looked up each time
    (cheap: its module stays imported), so a module reloaded in between is seen.

    Built-ins are registered where they are defined, either as import paths in `entries` (one
    table) or with `register` as a decorator in the module `builtins`, imported on first use
    (so this registry costs nothing until a name is looked up):

        @REGISTRY.register("grpo")
        def grpo(inputs, cfg): ...
    """

    def __init__(self, kind: str, example: str, convert: Callable[[Any, str, str], Any],
                 entries: dict[str, Any] | None = None, builtins: str | None = None):
        self.kind, self.example, self.convert = kind, example, convert
        self.entries: dict[str, Any] = dict(entries or {})
        self.resolved: dict[str, Any] = {}
        self._builtins = builtins

    def _load_builtins(self) -> None:
        if self._builtins:
            module, self._builtins = self._builtins, None   # first: its decorators call register
            try:
                importlib.import_module(module)
            except BaseException:
                self._builtins = module
                raise

    def register(self, name: str, obj: Any = None) -> Any:
        """Add `obj` (the kind's object, or an import path to one) under `name`; the last
        registration of a name wins. Without `obj`, a decorator that registers what it decorates
        and returns it unchanged."""
        if obj is None:
            def decorate(target: Any) -> Any:
                self.register(name, target)
                return target
            return decorate
        self._load_builtins()   # a user's entry must not be overwritten by a built-in loaded later
        self.entries[name] = obj
        self.resolved.pop(name, None)
        return obj

    def names(self) -> list[str]:
        self._load_builtins()
        return sorted(self.entries)

    def resolve(self, name: str, key: str) -> Any:
        if name in self.resolved:
            return self.resolved[name]
        self._load_builtins()
        if name in self.entries:
            entry = self.entries[name]
            obj = load_object(entry, key) if isinstance(entry, str) else entry
        elif is_import_path(name):
            obj = load_object(name, key)
        else:
            raise PluginError(f"{key} = {name!r}: not a registered {self.kind} ({', '.join(self.names()) or 'none yet'}) nor an "
                              f"import path 'package.module:name' (the object after the colon), e.g. {self.example}")
        converted = self.convert(obj, name, key)
        if name in self.entries:
            self.resolved[name] = converted
        return converted


def check_call(fn: Any, key: str, what: str, positional: int = 0, keywords: tuple[str, ...] = (),
               extra_keywords: bool = False) -> None:
    """PluginError unless `fn` is callable with `positional` positional arguments and the
    `keywords` (and, with `extra_keywords`, any others). `what` describes the expected call
    for the message, e.g. 'score(prompt, completion, answer, **info) -> float'."""
    if not callable(fn):
        raise PluginError(f"{key}: {fn!r} is not callable; it must be {what}")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):   # builtins without a signature: trust them
        return
    args = [None] * positional
    kwargs = dict.fromkeys(keywords)
    if extra_keywords:
        kwargs["__turnrl_extra__"] = None
    try:
        signature.bind(*args, **kwargs)
    except TypeError as exc:
        why = ("it takes no other keyword arguments: add **kwargs (or **info) to its parameters"
               if "__turnrl_extra__" in str(exc) else str(exc))
        raise PluginError(f"{key}: {_name(fn)}{signature} cannot be called as {what} ({why})") from None


def _name(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)


# --------------------------------------------------------------------------- options
class _Options(BaseModel):
    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True, protected_namespaces=())


def options_model(factory: Callable, reserved: tuple[str, ...] = ()) -> type[BaseModel]:
    """A pydantic model of `factory`'s keyword options, from its signature: each parameter
    with its annotation (Annotated[int, Field(gt=0)] keeps its constraints) and default;
    `reserved` parameters (what turnrl passes itself, e.g. context) are left out. A factory
    taking **kwargs accepts any other key."""
    try:   # string annotations (from __future__ import annotations) resolved in the factory's module
        signature = inspect.signature(factory, eval_str=True)
    except Exception:   # noqa: BLE001 - an annotation that does not resolve: check names and defaults only
        try:
            signature = inspect.signature(factory)
        except (TypeError, ValueError):
            return _Options
        signature = signature.replace(parameters=[p.replace(annotation=p.empty) for p in signature.parameters.values()])
    fields: dict[str, Any] = {}
    extra = False
    for name, p in signature.parameters.items():
        if name in reserved:
            continue
        if p.kind is p.VAR_KEYWORD:
            extra = True
            continue
        if p.kind in (p.VAR_POSITIONAL, p.POSITIONAL_ONLY):
            continue
        annotation = Any if p.annotation is p.empty else p.annotation
        fields[name] = (annotation, ... if p.default is p.empty else p.default)
    config = ConfigDict(extra="allow" if extra else "forbid", arbitrary_types_allowed=True,
                        protected_namespaces=())
    try:
        model = create_model(f"{_name(factory)}Options", __config__=config, **fields)
        model.model_json_schema()   # fails now, not at validation, if a type is not fully defined
        return model
    except Exception:   # noqa: BLE001 - types pydantic cannot check (a Callable, a custom class): names only
        loose = {name: (Any, default) for name, (_, default) in fields.items()}
        return create_model(f"{_name(factory)}Options", __config__=config, **loose)


def validate_options(model: type[BaseModel], options: dict[str, Any], key: str,
                     set_as: str = "-S ++{full}=...") -> dict[str, Any]:
    """`options` checked by `model`; the values as keyword arguments. PluginError with one line
    per problem: `key.name = value: what is wrong` (unknown keys name the known ones). `set_as`:
    how the command at hand sets a missing one ({full}: key.name, {name}: the name in options;
    `dvc exp run -S ++env.options.id=...` by default, `turnrl env` says `-S id=...`)."""
    lines = []
    if model.model_config.get("extra") not in ("allow", "forbid"):   # pydantic's default drops unknown keys silently
        known = ", ".join(model.model_fields) or "none"
        lines += [f"{key}.{name}: unknown option; options of this plugin: {known}"
                  for name in options if name not in model.model_fields]
    try:
        validated = model.model_validate(options)
    except ValidationError as exc:
        for err in exc.errors():
            where = ".".join(str(p) for p in err["loc"])
            full = f"{key}.{where}" if where else key
            if err["type"] == "extra_forbidden":
                known = ", ".join(model.model_fields) or "none"
                lines.append(f"{full}: unknown option; options of this plugin: {known}")
                continue
            msg = " ".join(err["msg"].removeprefix("Value error, ").replace("Input should be", "must be").split())
            if err["type"] == "missing":
                lines.append(f"{full}: required, set it (e.g. {set_as.format(full=full, name=where)})")
            elif msg.startswith(f"{full} = "):   # a validator's own message that names the key already
                lines.append(msg)
            else:
                lines.append(f"{full} = {err.get('input')!r}: {msg}")
    if lines:
        raise PluginError("\n".join(lines)) from None
    values = {name: getattr(validated, name) for name in model.model_fields}
    values.update(validated.model_extra or {})
    return values


def local_packages(paths: list[str]) -> list[str]:
    """The folders of the project's own top-level packages that `paths` (import paths) live
    in, for Ray's `py_modules`: installed packages are on every node already."""
    root = project_root()
    out = []
    for path in paths:
        top = path.partition(SEPARATOR)[0].split(".")[0]
        if top == "turnrl":
            continue
        for candidate in (root / top, root / f"{top}.py"):
            if candidate.exists() and str(candidate) not in out:
                out.append(str(candidate))
    return out
