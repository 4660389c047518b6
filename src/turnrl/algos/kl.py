"""KL divergence to a reference model, per token, as a reward penalty or as a loss term.

Shapes: logp, logp_ref, mask, token rewards are [B, T]. logp is the current (or rollout)
policy's log-probability of each sampled token, logp_ref the reference model's.
With Δ = logp - logp_ref and tokens sampled from the policy (Schulman's estimators of
KL(policy || ref)):
    k1 = Δ                    unbiased, can be negative per token
    k2 = ½ Δ²                 biased, low variance, ≥ 0
    k3 = exp(-Δ) + Δ - 1      unbiased, ≥ 0
On tokens another policy mu sampled (asynchronous or overlapped training), their plain mean
is not an estimate of KL(policy || ref): a token mu liked and the policy has since made
near-impossible gets exp(-Δ) ~ e^20. `off_policy_kl_mean` reweights them by policy / mu.
"""

from __future__ import annotations

import torch

from .losses import aggregate, policy_loss

KL_KINDS = ("k1", "k2", "k3")


def kl_estimate(
    logp: torch.Tensor, logp_ref: torch.Tensor, kind: str = "k3", clamp: float | None = 20.0
) -> torch.Tensor:
    """Per-token KL estimate [B, T] (any shape works).

    Δ is clamped to [-clamp, clamp] first (None disables) so exp(-Δ) in k3 cannot overflow
    on tokens the reference model finds near-impossible.
    """
    delta = logp - logp_ref
    if clamp is not None:
        delta = torch.clamp(delta, -clamp, clamp)
    if kind == "k1":
        return delta
    if kind == "k2":
        return 0.5 * delta**2
    if kind == "k3":
        return torch.exp(-delta) + delta - 1.0
    raise ValueError(f"unknown KL estimator {kind!r}; choose one of {KL_KINDS}")


def off_policy_kl_mean(
    logp: torch.Tensor, logp_ref: torch.Tensor, logp_behaviour: torch.Tensor, mask: torch.Tensor,
    kind: str = "k3", clamp: float | None = 20.0,
) -> torch.Tensor:
    """KL(policy || ref) from tokens that the behaviour policy mu sampled: the self-normalized
    importance-weighted mean sum(w kl) / sum(w) over masked tokens, w = exp(logp - logp_behaviour)
    (log-weights clamped like Δ). All inputs [B, T], detached; returns a 0-dim tensor (0 for an
    empty mask). Equals the plain masked mean when the policy is the behaviour policy."""
    log_w = logp - logp_behaviour
    if clamp is not None:
        log_w = torch.clamp(log_w, -clamp, clamp)
    if not mask.bool().any():
        return torch.zeros(())
    # self-normalized weights w / sum(w) over the masked tokens: a softmax of the log-weights
    weights = torch.softmax(log_w.masked_fill(~mask.bool(), -torch.inf).flatten(), 0).view_as(log_w)
    kl = torch.where(mask.bool(), kl_estimate(logp, logp_ref, kind, clamp), torch.zeros_like(logp))
    return (weights * kl).sum()


def kl_penalized_rewards(
    token_rewards: torch.Tensor,
    logp: torch.Tensor,
    logp_ref: torch.Tensor,
    mask: torch.Tensor,
    beta: float,
    kind: str = "k1",
    clamp: float | None = 20.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """KL as a reward penalty (PPO style): r_t <- r_t - beta * kl_t on policy tokens.

    All inputs [B, T]; logp/logp_ref should be detached (rewards carry no gradient).
    Returns (penalized rewards [B, T], kl [B, T] zeroed where mask is 0, for logging).
    Positions with mask 0 keep their reward unchanged.
    """
    kl = kl_estimate(logp, logp_ref, kind, clamp)
    kl = torch.where(mask.bool(), kl, torch.zeros_like(kl))
    return token_rewards - beta * kl, kl


def kl_loss(
    logp: torch.Tensor,
    logp_ref: torch.Tensor,
    mask: torch.Tensor,
    kind: str = "k3",
    agg: str = "token-mean",
    clamp: float | None = 20.0,
) -> torch.Tensor:
    """KL as a loss term (GRPO style): aggregate(kl_estimate) as a 0-dim tensor.

    logp carries the gradient. The caller adds beta * kl_loss(...) to the policy loss, so the
    same number can also be logged unscaled.
    """
    return aggregate(kl_estimate(logp, logp_ref, kind, clamp), mask, agg)


def policy_loss_with_kl(
    logp: torch.Tensor,
    logp_old: torch.Tensor,
    logp_ref: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    kl_coef: float = 0.0,
    kl_kind: str = "k3",
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    agg: str = "token-mean",
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The policy update's loss: PPO's clipped surrogate + kl_coef * KL to the reference.

    All tensors [B, T]; logp carries the gradient, logp_old and logp_ref are detached. Without
    the KL term (kl_coef 0) a group whose trajectories all scored alike has zero advantage and
    gives no gradient at all, however far the policy has drifted; with it, it pulls back.
    `weights` [B, T]: detached per-token weights on the surrogate (off-policy corrections).
    Returns (loss 0-dim, policy_loss's metrics).
    """
    loss, metrics = policy_loss(logp, logp_old, advantages, mask, clip_low=clip_low, clip_high=clip_high,
                                dual_clip=dual_clip, agg=agg, weights=weights)
    if kl_coef:
        loss = loss + kl_coef * kl_loss(logp, logp_ref, mask, kind=kl_kind, agg=agg)
    return loss, metrics
