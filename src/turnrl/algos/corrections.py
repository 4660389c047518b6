"""Off-policy corrections: what to do when the tokens were sampled by another policy than the
one the update starts from (asynchronous rollouts, a stale engine, bf16 sampling against an
fp32 trainer). Pure functions over [B, T] tensors; `mask` is the loss mask (1 on policy tokens).

Three policies (the decoupled-PPO view that AReaL and verl's rollout correction share):
    mu       the behaviour policy that sampled a token (its logprob kept per token, `engine_logprobs`)
    pi_prox  the proximal policy the update is clipped against (recomputed at the start of the
             update, "old logprobs"; or interpolated, see `interpolated_proximal_logprobs`)
    pi_theta the policy being trained
    rho_t = pi_prox(a_t) / mu(a_t)     corrects the off-policy gap (importance weight)
    r_t   = pi_theta(a_t) / pi_prox(a_t)  is clipped to [1 - eps_low, 1 + eps_high] as in PPO

- truncated IS (TIS): w_t = min(rho_t, C) per token, or w = min(prod_t rho_t, C) per sequence
  (computed in log space), a detached weight on the clipped surrogate;
- masked IS (MIS, rejection): tokens, or whole sequences (by the product of their ratios or
  by its geometric mean), whose ratio lies outside [1/C, C] leave the loss mask;
- decoupled PPO: the clipped surrogate against pi_prox, weighted by rho_t (TIS with C = inf
  unless capped).

Each is a registered policy loss (`algorithm.policy_loss: tis | mis | decoupled`, its settings
in `algorithm.policy_loss_options`), so every algorithm can use it. They read the mini-batch's
`old_logp` as pi_prox (the trainer recomputes it when the batch is off-policy: asynchronous
training) and `engine_logprobs` as mu.
"""
from __future__ import annotations

from typing import Literal, Mapping

import torch
from pydantic import BaseModel, ConfigDict, Field

from turnrl.algos.kl import policy_loss_with_kl
from turnrl.algos.registry import register_loss

from .losses import _LOG_RATIO_CLAMP, _where_mask, masked_mean

LEVELS = ("token", "sequence")
REJECTION_LEVELS = ("token", "sequence", "geometric")


def log_ratio(logp_prox: torch.Tensor, logp_behaviour: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """log rho_t = log pi_prox - log mu, clamped to +-20 and 0 outside the mask. [B, T] -> [B, T]."""
    return _where_mask(torch.clamp(logp_prox - logp_behaviour, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP), mask)


def _sequence_log_ratio(log_rho: torch.Tensor, mask: torch.Tensor, geometric: bool = False) -> torch.Tensor:
    """Per sequence, sum_t log rho_t over its masked tokens (or their mean: the log of the
    geometric mean), broadcast back to [B, T]."""
    total = _where_mask(log_rho, mask).sum(dim=-1, keepdim=True)
    if geometric:
        total = total / mask.to(log_rho.dtype).sum(dim=-1, keepdim=True).clamp(min=1.0)
    return total.expand_as(log_rho)


def importance_weights(log_rho: torch.Tensor, mask: torch.Tensor, level: str = "token",
                       cap: float | None = None) -> torch.Tensor:
    """Importance weights [B, T], detached, 0 outside the mask: rho_t per token, or prod_t rho_t
    for every token of a sequence (level "sequence"); with `cap`, truncated at it (TIS:
    min(rho, cap)). Without a cap (decoupled PPO) only the +-20 log clamp bounds them."""
    if level not in LEVELS:
        raise ValueError(f"unknown importance-weight level {level!r}; choose one of {LEVELS}")
    if cap is not None and cap <= 0:
        raise ValueError(f"the truncation cap must be > 0, got {cap}")
    log_w = log_rho if level == "token" else _sequence_log_ratio(log_rho, mask)
    ceiling = _LOG_RATIO_CLAMP if cap is None else min(float(torch.tensor(cap).log()), _LOG_RATIO_CLAMP)
    return _where_mask(torch.exp(torch.clamp(log_w, max=ceiling)), mask).detach()


def rejection_mask(log_rho: torch.Tensor, mask: torch.Tensor, upper: float, lower: float | None = None,
                   level: str = "token") -> torch.Tensor:
    """MIS: the loss mask [B, T] (float) without the tokens (level "token") or whole sequences
    ("sequence": by prod_t rho_t; "geometric": by its geometric mean) whose ratio lies outside
    [lower, upper]; lower defaults to 1 / upper."""
    if level not in REJECTION_LEVELS:
        raise ValueError(f"unknown rejection level {level!r}; choose one of {REJECTION_LEVELS}")
    lower = 1.0 / upper if lower is None else lower
    if not 0 < lower <= 1 <= upper:
        raise ValueError(f"rejection bounds must satisfy 0 < lower <= 1 <= upper, got [{lower}, {upper}]")
    ratio_log = log_rho if level == "token" else _sequence_log_ratio(log_rho, mask, geometric=level == "geometric")
    low, high = torch.tensor(lower).log(), torch.tensor(upper).log()
    keep = (ratio_log >= low) & (ratio_log <= high)
    return (mask.bool() & keep).to(mask.dtype if mask.is_floating_point() else torch.float)


def interpolated_proximal_logprobs(logp_behaviour: torch.Tensor, logp_current: torch.Tensor,
                                   behaviour_version: torch.Tensor, current_version: int,
                                   proximal_version: int | None = None) -> torch.Tensor:
    """log pi_prox without a forward pass of the proximal weights: log mu + alpha (log pi_theta
    - log mu) per token, alpha = (v_prox - v_mu) / (v_theta - v_mu) clamped to [0, 1], v_prox
    the version just before the current one by default. A token sampled by the current
    version (v_mu = v_theta) keeps log mu. All [B, T]; `behaviour_version` is the policy version
    that sampled each token (int tensor), `logp_current` is detached here."""
    proximal_version = current_version - 1 if proximal_version is None else proximal_version
    span = (current_version - behaviour_version).to(logp_behaviour.dtype)
    alpha = ((proximal_version - behaviour_version).to(logp_behaviour.dtype) / span.clamp(min=1.0)).clamp(0.0, 1.0)
    alpha = torch.where(span > 0, alpha, torch.zeros_like(alpha))
    return logp_behaviour + alpha * (logp_current.detach() - logp_behaviour)


def effective_sample_size(weights: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(sum w)^2 / (n sum w^2) over the masked tokens, in (0, 1]: 1 when every weight is equal,
    1/n when one token carries all the weight. 0-dim; 1 for an empty mask."""
    w = _where_mask(weights, mask)
    n = mask.to(weights.dtype).sum()
    denominator = n * (w ** 2).sum()
    ess = w.sum() ** 2 / denominator.clamp(min=1e-30)   # <= 1 (Cauchy-Schwarz) but for float rounding
    return torch.where(denominator > 0, ess.clamp(max=1.0), torch.ones(()))


def importance_stats(raw: torch.Tensor, weights: torch.Tensor, mask: torch.Tensor,
                     kept: torch.Tensor) -> dict[str, torch.Tensor]:
    """What a correction did to a batch, as detached 0-dim tensors. `raw`: the untruncated
    weights (`importance_weights` without a cap), `weights` the ones applied, `mask` the loss
    mask before rejection and `kept` after it. is_weight_mean / _max over the kept tokens,
    is_truncated_frac (tokens whose weight was capped) and is_masked_frac (tokens rejected) over
    the mask, is_ess the effective sample size of the applied weights."""
    with torch.no_grad():
        return {"is_weight_mean": masked_mean(weights, kept), "is_weight_max": _where_mask(weights, kept).max(),
                "is_raw_weight_max": _where_mask(raw, mask).max(),
                "is_truncated_frac": masked_mean((weights < raw * (1 - 1e-6)).float(), mask),
                "is_masked_frac": masked_mean(1.0 - kept.float(), mask),
                "is_ess": effective_sample_size(weights, kept)}


# --------------------------------------------------------------------------- the registered losses
class _Options(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TisOptions(_Options):
    level: Literal["token", "sequence"] = Field("token", description="one weight per token, or per sequence")
    cap: float = Field(2.0, gt=0, description="C: weights above it are truncated to it")


class MisOptions(_Options):
    level: Literal["token", "sequence", "geometric"] = Field("token", description=(
        "reject tokens by their ratio, or whole sequences by the product of their ratios or its geometric mean"))
    upper: float = Field(2.0, ge=1.0, description="C: ratios above it are rejected")
    lower: float | None = Field(None, gt=0, le=1.0, description="ratios below it are rejected; null: 1 / upper")


class DecoupledOptions(_Options):
    cap: float | None = Field(2.0, gt=0, description=(
        "truncate the behaviour weight pi_prox / mu at C; null: not (AReaL's form; on the tiny default at "
        "staleness 2 it diverged: kl_ref 100 by step 14)"))
    level: Literal["token", "sequence"] = "token"
    proximal: Literal["recompute", "interpolate"] = Field("recompute", description=(
        "pi_prox: the trainer's logprobs at the start of the update (recompute), or interpolated between mu and "
        "the current policy by policy version (interpolate: from the batch's `versions` and `trainer_version`)"))


def _surrogate(batch: Mapping[str, torch.Tensor], cfg, logp_prox: torch.Tensor, weights: torch.Tensor,
               mask: torch.Tensor, raw: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The clipped surrogate against pi_prox with importance `weights` on `mask`, + KL as in
    `clipped`; its metrics with the correction's stats."""
    loss, metrics = policy_loss_with_kl(batch["logp"], logp_prox, batch["ref_logp"], batch["advantages"], mask,
                                        kl_coef=cfg.kl_coef, kl_kind=cfg.kl_estimator, clip_low=cfg.clip_low,
                                        clip_high=cfg.clip_high, dual_clip=cfg.dual_clip, agg=cfg.loss_agg,
                                        weights=weights)
    return loss, {**metrics, **importance_stats(raw, weights, batch["mask"], mask)}


@register_loss("tis", options=TisOptions)
def tis(batch: Mapping[str, torch.Tensor], cfg) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Truncated importance sampling: the clipped surrogate against pi_prox (old_logp), each
    token weighted by min(pi_prox / mu, cap) (per token or per sequence)."""
    o = cfg.policy_loss_options   # checked by the options model below, defaults filled in
    mask = batch["mask"]
    log_rho = log_ratio(batch["old_logp"], batch["engine_logprobs"], mask)
    raw = importance_weights(log_rho, mask, o["level"])
    weights = importance_weights(log_rho, mask, o["level"], cap=o["cap"])
    return _surrogate(batch, cfg, batch["old_logp"], weights, mask, raw)


@register_loss("mis", options=MisOptions)
def mis(batch: Mapping[str, torch.Tensor], cfg) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Masked importance sampling (rejection): tokens or sequences whose pi_prox / mu lies
    outside [lower, upper] leave the loss; the rest train unweighted against pi_prox."""
    o = cfg.policy_loss_options   # checked by the options model below, defaults filled in
    mask = batch["mask"]
    log_rho = log_ratio(batch["old_logp"], batch["engine_logprobs"], mask)
    kept = rejection_mask(log_rho, mask, o["upper"], o["lower"], o["level"])
    raw = importance_weights(log_rho, mask, "token")
    return _surrogate(batch, cfg, batch["old_logp"], kept, kept, raw)


@register_loss("decoupled", options=DecoupledOptions)
def decoupled(batch: Mapping[str, torch.Tensor], cfg) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Decoupled PPO (AReaL): clip pi_theta / pi_prox, weight by pi_prox / mu. pi_prox is the
    recomputed old_logp, or interpolated by version between mu and the current policy (this
    forward's logp, detached: no forward pass of older weights)."""
    o = cfg.policy_loss_options   # checked by the options model below, defaults filled in
    mask = batch["mask"]
    prox = batch["old_logp"]
    if o["proximal"] == "interpolate":
        current = int(batch["trainer_version"].reshape(-1)[0])
        prox = interpolated_proximal_logprobs(batch["engine_logprobs"], batch["logp"],
                                              batch["versions"], current_version=current)
    log_rho = log_ratio(prox, batch["engine_logprobs"], mask)
    raw = importance_weights(log_rho, mask, o["level"])
    weights = importance_weights(log_rho, mask, o["level"], cap=o["cap"])
    return _surrogate(batch, cfg, prox, weights, mask, raw)
