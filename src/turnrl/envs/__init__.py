"""Multi-turn environments, built-in and plugged in through one registry.

`env.name` in params.yaml is a registered name (the built-ins below, or what `register` added)
or an import path `package.module:attribute` naming an `EnvSpec` or a factory; `env.options`
holds the factory's keyword arguments. The built-ins are registered exactly like a plugin: each
module exports an `ENV` spec.

    spec = turnrl.envs.resolve("code_tool")           # or "my_tasks.guess:make_env"
    options = turnrl.envs.check_options(spec, {"timeout_s": 2.0})
    env = turnrl.envs.make("code_tool", timeout_s=2.0)

See `turnrl.envs.base` for the protocol an environment implements.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

from turnrl.envs.base import LEVELS, Env, EnvContext, EnvSpec, StepResult, with_stop
from turnrl.plugins import PluginError, Registry, validate_options

def _as_spec(obj: Any, name: str, key: str) -> EnvSpec:
    if isinstance(obj, EnvSpec):
        from turnrl.data.synthetic import SyntheticTask
        if obj.task is not None and not isinstance(obj.task, SyntheticTask):
            raise PluginError(f"{key} = {name!r}: its EnvSpec's task is {obj.task!r:.60}, not a "
                              "turnrl.data.synthetic.SyntheticTask; give SyntheticTask(name, demonstration=fn) "
                              "(docs/plugins.md, \"The warm start\"), or leave task out")
        return obj if obj.name else dataclasses.replace(obj, name=name)
    if callable(obj):
        return EnvSpec(factory=obj, name=name)
    raise PluginError(f"{key} = {name!r}: {obj!r} is neither an EnvSpec nor a factory (a class or function "
                      "returning an environment)")


# name -> EnvSpec, a factory, or the import path of either (imported on first use)
_REGISTRY = Registry("environment", "my_tasks.guess:make_env", _as_spec, {
    "code_tool": "turnrl.envs.code_tool:ENV",
    "search": "turnrl.envs.search:ENV",
    "math_refine": "turnrl.envs.math_refine:ENV",
    "intervention": "turnrl.envs.intervention:ENV",
    "math_answer": "turnrl.envs.single_answer:ENV",
    "tools": "turnrl.envs.tools:ENV",
    "gym_text": "turnrl.envs.ecosystem.gym_text:ENV",   # TextArena / gymnasium-style text games
    "openenv": "turnrl.envs.ecosystem.openenv:ENV",   # OpenEnv (openenv-core) servers or Environment classes
    "skyrl_gym": "turnrl.envs.ecosystem.skyrl_gym:ENV",   # skyrl-gym (SkyRL) environments
    "verifiers": "turnrl.envs.ecosystem.verifiers:ENV",   # verifiers 0.4.0, in its own venv behind a bridge
    "agent": "turnrl.gateway:ENV",   # your agent program, through the OpenAI-compatible gateway
    "game": "turnrl.games:ENV",   # games of several players: self-play, fixed opponents
})


def register(name: str, spec: EnvSpec | Callable[..., Env] | str) -> None:
    """Add an environment under `name`: an EnvSpec, a factory, or an import path to either."""
    _REGISTRY.register(name, spec)


def names() -> list[str]:
    return _REGISTRY.names()


def resolve(name: str, key: str = "env.name") -> EnvSpec:
    """The EnvSpec `name` stands for (a registered name or an import path). PluginError,
    naming `key`, when it cannot be found or imported."""
    return _REGISTRY.resolve(name, key)


def check_options(spec: EnvSpec, options: dict[str, Any], key: str = "env.options",
                  set_as: str = "-S ++{full}=...") -> dict[str, Any]:
    """`options` validated by the spec's options model: keyword arguments for its factory
    (`set_as`: how the command at hand sets a missing option, see `plugins.validate_options`)."""
    return validate_options(spec.options_model(), dict(options or {}), key, set_as)


def make(name: str, context: EnvContext | None = None, **options: Any) -> Env:
    """A fresh environment `name` with `options` (validated as env.options would be)."""
    spec = resolve(name)
    return spec.bind(check_options(spec, options), context)()


__all__ = ["LEVELS", "Env", "EnvContext", "EnvSpec", "StepResult", "check_options", "make", "names", "register",
           "resolve", "with_stop"]
