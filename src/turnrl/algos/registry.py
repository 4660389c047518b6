"""Algorithms: one signature, one registry.

An algorithm is an advantage function over a rollout batch,

    advantages(inputs: AdvantageInputs, cfg) -> advantages [B, T]
                                               (or (advantages, returns) [B, T] with a critic)

`cfg` is the `algorithm` params section (gamma, lam, turn_coef, ... and `options`, a plugin's
own keys). The training loop builds the inputs, calls the function and runs the same clipped
policy-gradient update on the result for every algorithm. Optional, declared on an `Algorithm`:

- `critic=True`: the loop fits a value model (PPO's) and puts its values in `inputs.values`;
  the function returns (advantages, returns), the returns being the critic's targets.
- `prepare(trajs, batch, scorer, cfg) -> (extras, metrics)`: inputs that need the models
  (MLMT's per-turn KL and context-utilization reward), computed before the advantages through
  a `Scorer`; `extras` arrive as `inputs.extras`, `metrics` are logged.

A new algorithm is one function and one `register("name", Algorithm(fn))`, or an import path in
params: `algorithm.name: my_algos.module:advantages` (an Algorithm, or a bare function).

This module imports no torch until an algorithm is resolved, so params are checked fast.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from turnrl.plugins import Registry, check_call

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class AdvantageInputs:
    """What an advantage function may read (B trajectories, T tokens, K policy turns).

    rewards        [B]     each trajectory's reward: the environment's outcome plus the reward functions
    turn_rewards   [B, K]  each policy turn's reward from the environment (`StepResult.reward`), 0 for
                           turns a trajectory did not reach
    mask           [B, T]  1 on the policy's sampled tokens the update trains on, 0 elsewhere
    turn_ids       [B, T]  policy turn index of each response token, -1 outside the response
    high           [B, T]  True on tokens of high-level turns (hierarchical environments' `role`)
    group_ids      [B]     trajectories sampled from the same prompt share an id
    first_obs_pos  [B]     index of the first observation token in the response (T if none)
    values         [B, T]  the critic's values (algorithms with critic=True), else None
    extras         dict    the algorithm's `prepare` results
    """
    rewards: "torch.Tensor"
    turn_rewards: "torch.Tensor"
    mask: "torch.Tensor"
    turn_ids: "torch.Tensor"
    high: "torch.Tensor"
    group_ids: "torch.Tensor"
    first_obs_pos: "torch.Tensor"
    values: "torch.Tensor | None" = None
    extras: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Scorer:
    """Model calls an algorithm's `prepare` may make, each batch -> token logprobs [B, L]
    (entry t: log p(token t | tokens < t)), the batch holding input_ids and attention_mask."""
    logprobs: Callable[[dict], "torch.Tensor"]             # the policy's current weights
    reference_logprobs: Callable[[dict], "torch.Tensor"]   # the frozen starting weights
    high: tuple[Callable, Callable] | None = None           # a second model playing the high level: its pair
    eos_id: int | None = None                               # the chat template's end-of-turn token


@dataclass(frozen=True)
class Algorithm:
    advantages: Callable[..., Any]
    critic: bool = False
    prepare: Callable[..., tuple[dict, dict]] | None = None
    name: str = ""


def _as_algorithm(obj: Any, name: str, key: str) -> Algorithm:
    if not isinstance(obj, Algorithm):
        obj = Algorithm(advantages=obj)
    where = f"{key} = {name!r}"
    check_call(obj.advantages, where, "advantages(inputs, cfg) -> advantages [B, T]", positional=2)
    if obj.prepare is not None:
        check_call(obj.prepare, where, "prepare(trajs, batch, scorer, cfg) -> (extras, metrics)", positional=4)
    return Algorithm(obj.advantages, obj.critic, obj.prepare, obj.name or name)


# name -> Algorithm, or the import path of one (the built-ins: turnrl.algos.builtin)
_REGISTRY = Registry("algorithm", "my_algos.module:advantages", _as_algorithm, {
    name: f"turnrl.algos.builtin:{name.upper()}"
    for name in ("grpo", "dr_grpo", "rloo", "mt_grpo", "ms_grpo", "ms_po", "mlmt", "ppo")
})


def register(name: str, algorithm: Algorithm | Callable | str) -> None:
    """Add an algorithm under `name`: an Algorithm, a bare advantage function, or an import path."""
    _REGISTRY.register(name, algorithm)


def names() -> list[str]:
    return _REGISTRY.names()


def resolve(name: str, key: str = "algorithm.name") -> Algorithm:
    """The Algorithm `name` stands for; PluginError naming `key` if it is unknown or unusable."""
    return _REGISTRY.resolve(name, key)
