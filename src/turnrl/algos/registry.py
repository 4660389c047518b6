"""Algorithms and policy losses: one signature each, one registry each.

An algorithm is an advantage function over a rollout batch,

    advantages(inputs: AdvantageInputs, cfg) -> advantages [B, T]
                                               (or (advantages, returns) [B, T] with a critic)

and a policy loss turns a mini-batch's tensors into the update's loss,

    loss(batch: Mapping[str, Tensor], cfg) -> (loss 0-dim, metrics {name: 0-dim tensor})

`cfg` is the `algorithm` params section (gamma, clip_low, kl_coef, ...), with `cfg.options` the
algorithm's own options and `cfg.policy_loss_options` the loss's own, each checked by the
options model it registered. The training loop builds the inputs, calls the advantage function,
and the policy worker calls the loss named by `algorithm.policy_loss` on the result for every
algorithm. Optional, declared on an `Algorithm`:

- `critic=True`: the loop fits a value model (PPO's) and puts its values in `inputs.values`;
  the function returns (advantages, returns), the returns being the critic's targets.
- `prepare(trajs, batch, scorer, cfg) -> (extras, metrics)`: inputs that need the models
  (MLMT's per-turn KL and context-utilization reward), computed before the advantages through
  a `Scorer`; `extras` arrive as `inputs.extras`, `metrics` are logged.
- `teacher=True`: it reads `inputs.teacher_logprobs` (reward.teacher's logprob of every sampled
  token, on-policy distillation); params without a teacher are refused when checked.
- `loss_term(batch, cfg) -> (loss, metrics)`: a term the policy worker adds to
  `algorithm.policy_loss`'s loss on every micro-batch, whichever loss that is. Its `batch` is
  the loss's (below) plus `logits` [B, T, V] (entry t: the distribution token t+1 is drawn
  from), for what needs more than the sampled tokens' logprobs: opd's top-k distillation from
  `teacher_top_ids` / `teacher_top_logprobs` [B, T, k].
- `options`: a pydantic model of the algorithm's keys under `algorithm.options` (unknown keys
  and bad values are params errors before any work); none: any keys, passed as given.
- `check_params(params) -> str | None`: what this algorithm finds wrong with the whole params
  (the checked turnrl Config) that its options alone cannot show, one line naming the keys, or
  None; `turnrl config` and every stage's start report it before any work (a group baseline
  over groups of one; opd with no signal left).

Built-ins and plugins register the same way, where they are defined (`turnrl.algos.builtin`):

    @register("my_algo", options=MyOptions)          # or register("my_algo", fn_or_Algorithm)
    def my_algo(inputs, cfg): ...

    @register_loss("my_loss")
    def my_loss(batch, cfg): ...

or are named by import path in params: `algorithm.name: my_algos.module:advantages` (an
Algorithm or a bare function), `algorithm.policy_loss: my_algos.module:loss` (a PolicyLoss or a
bare function). Both go through the same checks.
"""
from __future__ import annotations

import copy
import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping

from pydantic import BaseModel, ConfigDict

from turnrl.plugins import PluginError, Registry, check_call, validate_options

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
    logprobs       [B, T]  the sampling engine's logprob of each sampled token (0 off the mask)
    teacher_logprobs [B, T] reward.teacher's logprob of each sampled token (opd), else None
    roles          [B]     what each trajectory played: "<game>/<role>" for a seat of a game of several
                           players (`env.name: game`), "" elsewhere (role-conditioned baselines key on it)
    state          dict    kept by the training loop for the run, empty at its start: an advantage
                           function's memory across steps (rae's role baselines); not checkpointed
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
    logprobs: "torch.Tensor | None" = None
    teacher_logprobs: "torch.Tensor | None" = None
    roles: tuple[str, ...] = ()
    state: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Scorer:
    """Model calls an algorithm's `prepare` may make, each batch -> token logprobs [B, L]
    (entry t: log p(token t | tokens < t)), the batch holding input_ids and attention_mask."""
    logprobs: Callable[[dict], "torch.Tensor"]             # the policy's current weights
    reference_logprobs: Callable[[dict], "torch.Tensor"]   # the frozen starting weights
    high: tuple[Callable, Callable] | None = None           # a second model playing the high level: its pair
    eos_id: int | None = None                               # the chat template's end-of-turn token


class NoOptions(BaseModel):
    """The options model of a method that has none: any key under its options is an error."""
    model_config = ConfigDict(extra="forbid")


@dataclass(frozen=True)
class Algorithm:
    advantages: Callable[..., Any]
    critic: bool = False
    prepare: Callable[..., tuple[dict, dict]] | None = None
    name: str = ""
    options: type[BaseModel] | None = None
    teacher: bool = False   # reads inputs.teacher_logprobs: params must name reward.teacher
    loss_term: Callable[..., Any] | None = None   # added to the policy loss (module doc)
    check_params: Callable[[Any], str | None] | None = None   # params -> a problem before any work (module doc)


@dataclass(frozen=True)
class PolicyLoss:
    """A policy loss and the model of its `algorithm.policy_loss_options` (none: any keys).

    loss(batch, cfg) -> (loss, metrics). `batch` maps names to the mini-batch's tensors, every
    per-token one [B, T] (B rows of this rank's mini-batch, T tokens of prompt and response;
    entry t is about token t):
        logp         the policy's logprob of each token, carrying the gradient
        old_logp     the logprob the ratio is taken to (detached): the policy before this update,
                     or the sampling engine's under train.overlap_rollout
        ref_logp     the frozen reference model's logprob (detached)
        advantages   the algorithm's advantages
        mask         1 on the tokens the update trains on (the batch's loss_mask)
        engine_logprobs  the behaviour policy's logprob: what the rollout engine sampled with
    and whatever else the trainer's batch holds (input_ids, attention_mask, ... and the
    per-token tensors later modes add). `cfg` is the algorithm section. `loss` is a 0-dim
    tensor; `metrics` 0-dim tensors, logged as the mean over the update's tokens, except
    names ending in `_max`, logged as the largest."""
    fn: Callable[..., Any]
    name: str = ""
    options: type[BaseModel] | None = None

    def __call__(self, batch: Mapping[str, "torch.Tensor"], cfg: Any) -> tuple["torch.Tensor", dict]:
        return self.fn(batch, cfg)


def _with_options(fn: Callable, model: type[BaseModel] | None, attribute: str, key: str) -> Callable:
    """`fn` called with `cfg.<attribute>` checked by `model`, defaults filled in (as a dict)."""
    if model is None or fn is None:
        return fn

    def checked(cfg: Any) -> Any:
        values = validate_options(model, dict(getattr(cfg, attribute, None) or {}), key)
        if hasattr(cfg, "model_copy"):   # a pydantic section: a copy, the params object stays as written
            return cfg.model_copy(update={attribute: values})
        cfg = copy.copy(cfg)
        setattr(cfg, attribute, values)
        return cfg

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:   # cfg is the last argument, positional or by name
        if "cfg" in kwargs:
            return fn(*args, **{**kwargs, "cfg": checked(kwargs["cfg"])})
        return fn(*args[:-1], checked(args[-1]), **kwargs)
    return call


def _as_algorithm(obj: Any, name: str, key: str) -> Algorithm:
    obj = getattr(obj, _DECLARED, obj)   # a function registered by the decorator: what it declared
    if not isinstance(obj, Algorithm):
        obj = Algorithm(advantages=obj)
    where = f"{key} = {name!r}"
    check_call(obj.advantages, where, "advantages(inputs, cfg) -> advantages [B, T]", positional=2)
    if obj.prepare is not None:
        check_call(obj.prepare, where, "prepare(trajs, batch, scorer, cfg) -> (extras, metrics)", positional=4)
    _check_model(obj.options, where)
    if obj.loss_term is not None:
        check_call(obj.loss_term, where, "loss_term(batch, cfg) -> (loss, metrics)", positional=2)
    if obj.check_params is not None:
        check_call(obj.check_params, where, "check_params(params) -> problem or None", positional=1)
    return Algorithm(_with_options(obj.advantages, obj.options, "options", "algorithm.options"), obj.critic,
                     _with_options(obj.prepare, obj.options, "options", "algorithm.options"),
                     obj.name or name, obj.options, obj.teacher,
                     _with_options(obj.loss_term, obj.options, "options", "algorithm.options"), obj.check_params)


def _as_loss(obj: Any, name: str, key: str) -> PolicyLoss:
    obj = getattr(obj, _DECLARED, obj)
    if not isinstance(obj, PolicyLoss):
        obj = PolicyLoss(fn=obj)
    where = f"{key} = {name!r}"
    check_call(obj.fn, where, "loss(batch, cfg) -> (loss, metrics)", positional=2)
    _check_model(obj.options, where)
    return PolicyLoss(_with_options(obj.fn, obj.options, "policy_loss_options", "algorithm.policy_loss_options"),
                      obj.name or name, obj.options)


def _check_model(model: Any, where: str) -> None:
    if model is not None and not (isinstance(model, type) and issubclass(model, BaseModel)):
        raise PluginError(f"{where}: options = {model!r} must be a pydantic model class (or None: any keys)")


#: The attribute the decorators leave on a function: its Algorithm or PolicyLoss, so the function
#: named by import path (`module:function`) brings its critic, prepare and options along.
_DECLARED = "__turnrl_declared__"

# name -> Algorithm / PolicyLoss (the built-ins: registered by turnrl.algos.builtin on first use)
_ALGORITHMS = Registry("algorithm", "my_algos.module:advantages", _as_algorithm, builtins="turnrl.algos.builtin")
_LOSSES = Registry("policy loss", "my_algos.module:loss", _as_loss, builtins="turnrl.algos.builtin")


def register(name: str, algorithm: Algorithm | Callable | str | None = None, *, critic: bool = False,
             prepare: Callable | None = None, options: type[BaseModel] | None = None, teacher: bool = False,
             loss_term: Callable | None = None, check_params: Callable | None = None) -> Any:
    """Add an algorithm under `name`: an Algorithm, a bare advantage function or an import path;
    without one, a decorator for the advantage function (`critic`, `prepare`, `options`,
    `teacher`, `loss_term`, `check_params` as on Algorithm), which returns it unchanged."""
    if algorithm is not None:
        return _ALGORITHMS.register(name, algorithm)

    def decorate(fn: Callable) -> Callable:
        declared = Algorithm(fn, critic=critic, prepare=prepare, name=name, options=options, teacher=teacher,
                             loss_term=loss_term, check_params=check_params)
        _ALGORITHMS.register(name, declared)
        setattr(fn, _DECLARED, declared)
        return fn
    return decorate


def register_loss(name: str, loss: PolicyLoss | Callable | str | None = None, *,
                  options: type[BaseModel] | None = None) -> Any:
    """Add a policy loss under `name` (a PolicyLoss, a bare function or an import path); without
    one, a decorator for the loss function, which returns it unchanged."""
    if loss is not None:
        return _LOSSES.register(name, loss)

    def decorate(fn: Callable) -> Callable:
        declared = PolicyLoss(fn, name=name, options=options)
        _LOSSES.register(name, declared)
        setattr(fn, _DECLARED, declared)
        return fn
    return decorate


def names() -> list[str]:
    return _ALGORITHMS.names()


def loss_names() -> list[str]:
    return _LOSSES.names()


def resolve(name: str, key: str = "algorithm.name") -> Algorithm:
    """The Algorithm `name` stands for; PluginError naming `key` if it is unknown or unusable."""
    return _ALGORITHMS.resolve(name, key)


def resolve_loss(name: str, key: str = "algorithm.policy_loss") -> PolicyLoss:
    """The PolicyLoss `name` stands for; PluginError naming `key` if it is unknown or unusable."""
    return _LOSSES.resolve(name, key)


def check_options(algorithm: Algorithm | PolicyLoss, options: dict[str, Any], key: str) -> dict[str, Any]:
    """`options` checked by the method's options model, defaults filled in (no model: as given)."""
    if algorithm.options is None:
        return dict(options or {})
    return validate_options(algorithm.options, dict(options or {}), key)


def compute_policy_loss(loss: PolicyLoss, batch: Mapping[str, "torch.Tensor"], cfg: Any,
                        algorithm: Algorithm | None = None, logits: "torch.Tensor | None" = None
                        ) -> tuple["torch.Tensor", dict[str, "torch.Tensor"]]:
    """What the policy worker calls on each mini-batch: `loss(batch, cfg)`, plus the algorithm's
    `loss_term` (given the `logits` too) when it has one, each result checked (a plugin's mistake
    is named here, not as a failure deep in DeepSpeed)."""
    out = _checked(loss(batch, cfg), f"algorithm.policy_loss = {loss.name!r}")
    if algorithm is None or algorithm.loss_term is None:
        return out
    term, info = _checked(algorithm.loss_term({**batch, "logits": logits}, cfg),
                          f"algorithm.name = {algorithm.name!r}: its loss_term")
    return out[0] + term, {**out[1], **info}


def _checked(out: Any, what: str) -> tuple["torch.Tensor", dict[str, "torch.Tensor"]]:
    if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], dict)
            and getattr(out[0], "dim", lambda: -1)() == 0):
        raise PluginError(f"{what} returned {type(out).__name__}; it must return "
                          "(loss: a 0-dim tensor, metrics: a dict of 0-dim tensors)")
    return out


__all__ = ["AdvantageInputs", "Algorithm", "NoOptions", "PolicyLoss", "Scorer", "check_options",
           "compute_policy_loss", "loss_names", "names", "register", "register_loss", "resolve", "resolve_loss"]
