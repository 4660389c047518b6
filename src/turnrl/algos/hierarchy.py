"""MLMT-RL's hierarchy on a batch: which turn is the attempt, the feedback and the refinement, and
the reward terms that need the models (`prepare`, run by the loop before the advantages).

Slots come from the environment's turn roles (`Env.role`), not from its name: the high-level
turns are the feedback (slot 1); the first low-level turn is the attempt (slot 0), later
low-level turns the refinement (slot 2). math_refine with the policy writing the feedback has
turns low, high, low -> 0, 1, 2; with an endpoint's feedback (an observation) low, low -> 0, 2.

`prepare` computes, through a `Scorer`:
- per-slot KL to the frozen reference, KL_k = sum(logp - logp_ref) over slot k's policy tokens,
  weighted in the turn rewards by `algorithm.options.betas` = [beta_1 (beta_2 in stage I), beta_H,
  beta_L]; with a second model for the high level, the feedback's KL is that model's own;
- the context-utilization reward on the refinement, lambda * min(log p(y | x, c) - log p(y | x),
  tau) (`options.context_coef` lambda, `options.context_cap` tau): how much the feedback c raised the
  solver's log-likelihood of its refinement y ("without c" is `without_feedback`).
"""
from __future__ import annotations

from typing import Any, Literal, Sequence

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

from turnrl.algos.advantages import context_utilization_bonus, per_turn_sum

SLOTS = 3   # 0 attempt, 1 feedback, 2 refinement


class MlmtOptions(BaseModel):
    """`algorithm.options` of `algorithm.name: mlmt`."""
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    stage: Literal[1, 2] = Field(2, description="stage I or II turn rewards")
    alpha: float = Field(1.0, ge=0.0, description="stage II: weight of the improvement R - R1")
    betas: list[float] = Field(default_factory=lambda: [0.0, 0.0, 0.0], description=(
        "[beta_1 (stage II; beta_2 in stage I), beta_H, beta_L], the weights of each turn's KL to the "
        "reference, sum(logp - logp_ref) over the turn's tokens, in the turn rewards; all 0: no KL terms"))
    context_coef: float = Field(0.0, ge=0.0, description=(
        "lambda of the context-utilization reward lambda * min(log p(y | x, c) - log p(y | x), tau) added to "
        "the refinement turn (y the refinement, c the feedback); 0: off"))
    context_cap: float = Field(1.0, gt=0.0, description="tau, the cap of the log-likelihood gain")

    @field_validator("betas")
    @classmethod
    def _three(cls, betas: list[float]) -> list[float]:
        if len(betas) != 3 or min(betas) < 0:
            raise ValueError("must be three non-negative numbers [beta_1 (beta_2 in stage I), beta_H, beta_L], "
                             "e.g. [0.01, 0.01, 0.01]")
        return betas


def mlmt_options(cfg: Any) -> MlmtOptions:
    """The mlmt options of the algorithm section `cfg`, defaults filled in."""
    return MlmtOptions.model_validate(dict(getattr(cfg, "options", None) or {}))


def mlmt_slots(turn_ids: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    """turn_ids [B, T] (-1 outside the response), high [B, T] bool -> slots [B, T] long: 1 on
    high-level tokens, 0 on the first low-level turn's, 2 on later low-level turns', -1 outside."""
    inside = turn_ids >= 0
    low = inside & ~high.bool()
    big = torch.iinfo(turn_ids.dtype).max
    first_low = torch.where(low, turn_ids, big).min(dim=1, keepdim=True).values   # [B, 1]
    slots = torch.where(turn_ids == first_low, 0, 2)
    slots = torch.where(high.bool(), 1, slots)
    return torch.where(inside, slots, -1)


def without_feedback(response_ids: Sequence[int], loss_mask: Sequence[int], slots: Sequence[int],
                     eos_id: int | None) -> tuple[list[int], list[int]]:
    """The solver's conversation with the feedback c removed: (response ids, y mask), the y
    mask 1 on the refinement's tokens. The prompt (the problem, x) is unchanged.

    A response with a feedback turn is attempt | feedback request | feedback | refine request |
    refinement (slots 0, 1, 2; the requests are the observations after slots 0 and 1).
    Removed: the feedback request and the feedback turn, the whole exchange with the high level.
    Kept: the attempt, the refine request (same tokens) and the refinement y, so the two
    sequences differ only by c. The attempt's message is closed as the removed request closed
    it: an observation starts with the end-of-turn token unless the turn before it wrote it, so
    the request's leading eos (if any) is kept and the refine request's leading eos dropped.

    Raises ValueError if the response does not have that layout (e.g. it ended before the
    refinement).
    """
    segments: list[tuple[tuple[int, int], list[int]]] = []
    for token, mask, slot in zip(response_ids, loss_mask, slots):
        key = (slot, mask)
        if not segments or segments[-1][0] != key:
            segments.append((key, []))
        segments[-1][1].append(token)
    layout = [key for key, _ in segments]
    if layout != [(0, 1), (0, 0), (1, 1), (1, 0), (2, 1)]:
        raise ValueError(f"not an attempt / request / feedback / request / refinement response: (slot, mask) "
                         f"segments {layout}")
    attempt, request, _feedback, refine_request, refinement = (ids for _, ids in segments)
    closing = request[:1] if eos_id is not None and request[:1] == [eos_id] else []
    opening = refine_request[1:] if eos_id is not None and refine_request[:1] == [eos_id] else refine_request
    ids = attempt + closing + opening + refinement
    return ids, [0] * (len(ids) - len(refinement)) + [1] * len(refinement)


def refinement_logprobs(trajs: Sequence, batch: dict[str, torch.Tensor], slots: torch.Tensor, logp: torch.Tensor,
                        logprobs, eos_id: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log p(y | x, c) [B], log p(y | x) [B], has_refinement [B] bool): the summed logprobs of
    each trajectory's refinement y with the feedback (`logp` [B, L] of `batch`) and without it
    (`without_feedback`, scored by `logprobs`). Rows without a refinement get 0 and 0.
    `slots` [B, L] as `mlmt_slots` gives for the batch."""
    seqs, y_masks, has = [], [], []
    for row, t in enumerate(trajs):
        start = len(t.prompt_ids)
        row_slots = slots[row, start:start + len(t.response_ids)].tolist()
        try:
            response, y = without_feedback(t.response_ids, t.loss_mask, row_slots, eos_id)
            has.append(True)
        except ValueError:   # no refinement (ended early): scored too, as every trainer rank needs rows, counted nowhere
            response, y = t.response_ids, [0] * len(t.response_ids)
            has.append(False)
        seqs.append(t.prompt_ids + response)
        y_masks.append([0] * len(t.prompt_ids) + y)
    has = torch.tensor(has)
    y_with = (slots == 2) & (batch["loss_mask"] > 0) & has[:, None]
    with_c = (logp * y_with).sum(dim=1)
    width = max(map(len, seqs))
    ids = torch.zeros((len(seqs), width), dtype=torch.long)
    attention = torch.zeros_like(ids)
    y_without = torch.zeros((len(seqs), width), dtype=torch.bool)
    for row, (seq, y) in enumerate(zip(seqs, y_masks)):
        ids[row, :len(seq)] = torch.tensor(seq)
        attention[row, :len(seq)] = 1
        y_without[row, :len(seq)] = torch.tensor(y, dtype=torch.bool)
    without_c = (logprobs({"input_ids": ids, "attention_mask": attention}) * y_without).sum(dim=1)
    return with_c, without_c, has


def prepare(trajs: Sequence, batch: dict[str, torch.Tensor], scorer: Any, cfg: Any) -> tuple[dict, dict[str, float]]:
    """(extras of the mlmt advantages: turn_kl [B, 3], betas, refine_bonus [B]; per-step metrics).

    `batch` is the collated rollout batch with every policy token in loss_mask (before a frozen
    level is masked out) and `high` [B, L]; `scorer` a `turnrl.algos.registry.Scorer`. Nothing is
    computed when the betas and lambda are all 0."""
    opts = mlmt_options(cfg)
    if not (any(opts.betas) or opts.context_coef):
        return {}, {}
    extras: dict[str, Any] = {}
    metrics: dict[str, float] = {}
    slots = mlmt_slots(batch["turn_ids"], batch["high"])
    logp = scorer.logprobs(batch)
    if any(opts.betas):
        log_ratio = logp - scorer.reference_logprobs(batch)
        if scorer.high is not None:   # the feedback tokens: the high-level model against its own start
            high_logprobs, high_reference = scorer.high
            log_ratio = torch.where(batch["high"].bool(), high_logprobs(batch) - high_reference(batch), log_ratio)
        turn_kl = per_turn_sum(log_ratio, batch["loss_mask"], slots, SLOTS)
        extras.update(turn_kl=turn_kl, betas=tuple(opts.betas))
        metrics.update({f"mlmt_turn{k + 1}_kl_mean": float(turn_kl[:, k].mean()) for k in range(SLOTS)})
    if opts.context_coef:
        with_c, without_c, has = refinement_logprobs(trajs, batch, slots, logp, scorer.logprobs, scorer.eos_id)
        bonus = torch.where(has, context_utilization_bonus(with_c, without_c, opts.context_coef,
                                                           opts.context_cap), 0.0)
        extras["refine_bonus"] = bonus
        count = max(1, int(has.sum()))   # means over the trajectories that reached the refinement
        metrics["mlmt_context_gain_mean"] = float(((with_c - without_c) * has).sum() / count)
        metrics["mlmt_context_bonus_mean"] = float(bonus.sum() / count)
        metrics["mlmt_context_rows_frac"] = float(has.float().mean())
    return extras, metrics
