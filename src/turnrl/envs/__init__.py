"""Multi-turn environments: `make(name, **overrides)` returns a fresh environment.

Users add their own with `register(name, factory)`; a factory takes keyword overrides and
returns an object with `system_prompt`, `stop`, `observation_role`, `reset` and `step`
(see `turnrl.envs.base`).
"""
from __future__ import annotations

import importlib
from typing import Any, Callable

from turnrl.envs.base import Env, StepResult

# Built-in environments, imported on first use so that importing turnrl.envs stays cheap.
_REGISTRY: dict[str, Callable[..., Env] | str] = {
    "code_tool": "turnrl.envs.code_tool:CodeToolEnv",
    "math_answer": "turnrl.envs.single_answer:SingleAnswerEnv",
    "search": "turnrl.envs.search:SearchEnv",
    "intervention": "turnrl.envs.intervention:InterventionEnv",
    "math_refine": "turnrl.envs.math_refine:MathRefineEnv",
}


def register(name: str, factory: Callable[..., Env]) -> None:
    _REGISTRY[name] = factory


def make(name: str, **overrides: Any) -> Env:
    if name not in _REGISTRY:
        raise KeyError(f"unknown environment {name!r}; known: {', '.join(sorted(_REGISTRY))}")
    factory = _REGISTRY[name]
    if isinstance(factory, str):
        module, attr = factory.split(":")
        factory = _REGISTRY[name] = getattr(importlib.import_module(module), attr)
    return factory(**overrides)


def names() -> list[str]:
    return sorted(_REGISTRY)

__all__ = ["Env", "StepResult", "make", "register", "names"]
