"""Losses and masked statistics for policy-gradient training.

Shapes: B trajectories, T response tokens (padded), V vocabulary size.
`mask` is [B, T], 1 (or True) where the policy sampled the token and we train on it,
0 at prompt padding, environment/observation tokens and padding. Every function here reads
values only where mask is set, so garbage (even NaN/inf) at masked positions is harmless.
"""

from __future__ import annotations

import torch

AGGREGATION_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")

# Bounds the log-ratio so exp() cannot overflow when the policy drifts far from the
# rollout policy (e.g. a token that became near-impossible).
_LOG_RATIO_CLAMP = 20.0


def _where_mask(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    # torch.where instead of x * mask: 0 * NaN would still be NaN.
    return torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    """Sum of x over positions where mask is set. x, mask: same shape."""
    x = _where_mask(x, mask)
    return x.sum() if dim is None else x.sum(dim=dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    """Mean of x over positions where mask is set; 0 (not NaN) when the mask is empty.

    x, mask: same shape, e.g. [B, T]. dim=None reduces everything to a 0-dim tensor.
    """
    count = mask.to(x.dtype)
    count = count.sum() if dim is None else count.sum(dim=dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1.0)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of x over all masked positions (0-dim). Bessel-corrected by default.

    A single masked value has variance 0.
    """
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    if unbiased:
        n = mask.to(x.dtype).sum()
        var = var * n / (n - 1).clamp(min=1.0)
    return var


def masked_whiten(
    x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8
) -> torch.Tensor:
    """Normalize x to zero mean and unit variance over the masked positions.

    x, mask: [B, T] -> [B, T], exactly 0 where mask is 0. With shift_mean=False the mean is
    kept (only the scale changes). Statistics are over the whole batch, not per row.
    """
    mean = masked_mean(x, mask)
    whitened = (x - mean) * torch.rsqrt(masked_var(x, mask) + eps)
    if not shift_mean:
        whitened = whitened + mean
    return _where_mask(whitened, mask)


def explained_variance(
    pred: torch.Tensor, target: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """1 - Var[target - pred] / Var[target] over masked positions (0-dim).

    1 means the critic predicts the returns perfectly, 0 no better than a constant, negative
    worse. NaN when the targets have no variance (the ratio is undefined).
    """
    var_target = masked_var(target, mask)
    var_resid = masked_var(target - pred, mask)
    # torch.where rather than an `if`, so no device sync for a metric.
    nan = torch.full_like(var_target, float("nan"))
    return torch.where(var_target > 0, 1.0 - var_resid / var_target, nan)


def aggregate(
    loss_tokens: torch.Tensor, mask: torch.Tensor, mode: str = "token-mean"
) -> torch.Tensor:
    """Reduce per-token losses [B, T] to a scalar.

    - token-mean: sum over all masked tokens / number of masked tokens (long answers weigh more).
    - seq-mean-token-sum: per-sequence sum, then mean over sequences.
    - seq-mean-token-mean: per-sequence mean, then mean over sequences (each sequence weighs
      the same, as in the original GRPO).
    Sequences with no masked token are left out of the sequence mean. An empty mask gives 0.
    """
    if mode == "token-mean":
        return masked_mean(loss_tokens, mask)
    if mode not in AGGREGATION_MODES:
        raise ValueError(f"unknown loss aggregation {mode!r}; choose one of {AGGREGATION_MODES}")
    per_seq = masked_sum(loss_tokens, mask, dim=-1)  # [B]
    n_tokens = mask.to(loss_tokens.dtype).sum(dim=-1)  # [B]
    if mode == "seq-mean-token-mean":
        per_seq = per_seq / n_tokens.clamp(min=1.0)
    return masked_mean(per_seq, n_tokens > 0)


def logprobs_from_logits(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Log-probability of each sampled token: logits [B, T, V], tokens [B, T] -> [B, T] fp32.

    Computed as logit[token] - logsumexp(logits) in fp32, so bf16 logits lose no precision and
    no full [B, T, V] log_softmax tensor is kept.
    """
    logits = logits.float()
    picked = logits.gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def top_k_distillation(logits: torch.Tensor, top_ids: torch.Tensor, top_logprobs: torch.Tensor) -> torch.Tensor:
    """KL from a teacher's top-k distribution to the policy's, per token: logits [B, T, V] (entry t
    the distribution token t+1 is drawn from), top_ids / top_logprobs [B, T, k] (entry t: the
    teacher's k most likely tokens at token t's position and their logprobs) -> [B, T] fp32,
    entry 0 (no context) 0.

        KL_t = sum_j q_j (log q_j - log pi(top_ids[t, j]))   q = softmax(top_logprobs[t]) (renormalised)

    It is 0 where the policy gives the k tokens the teacher's probabilities, renormalised, and
    nothing else; its gradient reaches tokens the policy did not sample (forward KL, as a
    teacher's full distribution gives in GKD with beta 0). Like logprobs_from_logits, in fp32
    without a full [B, T, V] log_softmax."""
    logits = logits[:, :-1].float()
    ids = top_ids[:, 1:].long()
    student = logits.gather(-1, ids) - torch.logsumexp(logits, dim=-1, keepdim=True)   # [B, T-1, k]
    teacher = torch.log_softmax(top_logprobs[:, 1:].float(), dim=-1)
    kl = (teacher.exp() * (teacher - student)).sum(dim=-1)
    return torch.nn.functional.pad(kl, (1, 0))


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the categorical distribution at each position: [B, T, V] -> [B, T] fp32.

    H = logsumexp(z) - sum_v softmax(z)_v * z_v, which stays finite for very negative logits.
    """
    logits = logits.float()
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


def nll_loss(logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Supervised fine-tuning's loss: the mean negative log-likelihood of the masked tokens.
    logp, mask: [B, T] -> 0-dim (0 when the mask is empty)."""
    return masked_sum(-logp, mask) / mask.sum().clamp(min=1.0)


def policy_loss(
    logp: torch.Tensor,
    logp_old: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    agg: str = "token-mean",
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate loss.

    logp, logp_old, advantages, mask: [B, T]. logp carries the gradient; logp_old is the
    rollout policy's (detached) log-probability of the same tokens.
        ratio = exp(clamp(logp - logp_old, -20, 20))
        loss_t = max(-A * ratio, -A * clip(ratio, 1 - clip_low, 1 + clip_high))
        dual clip (c > 1), for A < 0 only: loss_t = min(loss_t, -A * c)
    The dual clip caps how much a single negative-advantage token with a huge ratio can push.
    `weights` [B, T] (detached; e.g. an off-policy correction's importance weights, see
    turnrl.algos.corrections) multiply loss_t before aggregation; None: all 1.

    Returns (loss 0-dim, metrics) where metrics holds detached 0-dim tensors:
    clip_fraction (tokens where the clipped term is active), dual_clip_fraction,
    approx_kl (k3 estimate of KL(old || new): mean of (ratio - 1) - log ratio),
    ratio_mean, ratio_max.
    """
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (e.g. 3.0), got {dual_clip}")
    log_ratio = torch.clamp(logp - logp_old, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss_tokens = torch.maximum(loss_unclipped, loss_clipped)

    dual_active = torch.zeros_like(loss_tokens, dtype=torch.bool)
    if dual_clip is not None:
        cap = -advantages * dual_clip
        dual_active = (advantages < 0) & (loss_tokens > cap)
        loss_tokens = torch.where(dual_active, cap, loss_tokens)
    if weights is not None:
        loss_tokens = loss_tokens * weights.detach()

    loss = aggregate(loss_tokens, mask, agg)
    with torch.no_grad():
        metrics = {
            "clip_fraction": masked_mean((loss_clipped > loss_unclipped).float(), mask),
            "dual_clip_fraction": masked_mean(dual_active.float(), mask),
            "approx_kl": masked_mean((ratio - 1.0) - log_ratio, mask),
            "ratio_mean": masked_mean(ratio, mask),
            "ratio_max": _where_mask(ratio, mask).max(),  # ratio > 0, so masked zeros never win
        }
    return loss, {k: v.detach() for k, v in metrics.items()}


def value_loss(
    values: torch.Tensor,
    values_old: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip: float | None = 0.2,
    agg: str = "token-mean",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped critic loss, PPO style.

    values (with gradient), values_old (from the rollout), returns, mask: [B, T].
        v_clip = values_old + clamp(values - values_old, -clip, clip)
        loss_t = 0.5 * max((values - returns)^2, (v_clip - returns)^2)
    clip=None gives the plain 0.5 * squared error. Returns (loss 0-dim, metrics) with
    vf_clip_fraction (tokens where the clipped error is larger) and value_mean.
    """
    err = (values - returns) ** 2
    if clip is None:
        loss_tokens = err
        clipped = torch.zeros_like(err, dtype=torch.bool)
    else:
        v_clip = values_old + torch.clamp(values - values_old, -clip, clip)
        err_clip = (v_clip - returns) ** 2
        loss_tokens = torch.maximum(err, err_clip)
        clipped = err_clip > err
    loss = 0.5 * aggregate(loss_tokens, mask, agg)
    with torch.no_grad():
        metrics = {
            "vf_clip_fraction": masked_mean(clipped.float(), mask),
            "value_mean": masked_mean(values.detach(), mask),
        }
    return loss, metrics
