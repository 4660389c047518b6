"""MLMT's reward terms that need the models (`algorithm.name: mlmt`), computed by the loop
before the advantages:

- per-turn KL to the frozen reference, KL_k = Σ(logp − logp_ref) over turn k's policy tokens,
  weighted in the turn rewards by `algorithm.mlmt_betas` = [β₁ (β₂ in stage I), β_H, β_L];
- the context-utilization reward on the refinement turn, λ·min(log p(y | x, c) − log p(y | x), τ)
  (`mlmt_context_coef` λ, `mlmt_context_cap` τ): how much the feedback c raised the solver's
  log-likelihood of its refinement y. "Without c" is `without_feedback`.

Both use the solver's current weights (no grad), called through the trainer ranks; with a
second model for the feedback (`env.math_refine.feedback: model`) the feedback turn's KL is
that model's own, to its own reference.

`feedback: model` also needs `high_level_folder` (where the second model starts) and
`level_mask` (which tokens each model trains).
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Sequence

import torch

from turnrl.algos import context_utilization_bonus, per_turn_sum
from turnrl.config import Config

MLMT_TURNS = 3   # 0 attempt, 1 feedback, 2 refinement
Logprobs = Callable[[dict[str, torch.Tensor]], torch.Tensor]   # batch -> token logprobs [B, L]


def mlmt_turn_ids(cfg: Config, turn_ids: torch.Tensor) -> torch.Tensor:
    """Policy turn ids [B, L] -> MLMT roles (0 attempt, 1 feedback, 2 refinement). With an
    endpoint's feedback the policy plays only the attempt (0) and the refinement (1 -> 2)."""
    if cfg.env.name == "math_refine" and cfg.env.math_refine.feedback == "endpoint":
        return torch.where(turn_ids == 1, 2, turn_ids)
    return turn_ids


def high_level_folder(cfg: Config, solver_dir: str | Path) -> str:
    """The feedback model's starting folder with `feedback: model`: `high_level_model`, or the
    solver's own starting folder when empty. Raises ValueError if its tokenizer is not the
    solver's (the two models continue each other's token ids in one conversation)."""
    from transformers import AutoTokenizer

    from turnrl.prepare import model_dir
    chosen = cfg.env.math_refine.high_level_model
    folder = model_dir(chosen) if chosen else str(solver_dir)
    if chosen:
        solver, high = AutoTokenizer.from_pretrained(str(solver_dir)), AutoTokenizer.from_pretrained(folder)
        if solver.get_vocab() != high.get_vocab() or solver.chat_template != high.chat_template:
            raise ValueError(
                f"env.math_refine.high_level_model = {chosen!r}: its tokenizer (vocabulary or chat template) is not "
                f"the solver's ({solver_dir}); both models write into one token sequence, so they need the same "
                "tokenizer. Use a model of the same family, or leave high_level_model empty (the solver's start)")
    return folder


def level_mask(turn_ids: torch.Tensor, level: str) -> torch.Tensor:
    """1.0 on the tokens of `level`'s policy turns in a math_refine conversation (feedback self
    or model: turn 1 is the feedback, "high"; turns 0 and 2 the solver's, "low"), else 0.0;
    the shape of `turn_ids` [B, L] (-1 outside the response counts as low: the loss mask is 0 there)."""
    high = (turn_ids == 1).float()
    return high if level == "high" else 1.0 - high


def without_feedback(response_ids: Sequence[int], loss_mask: Sequence[int], turn_ids: Sequence[int],
                     eos_id: int | None) -> tuple[list[int], list[int]]:
    """The solver's conversation with the feedback c removed: (response ids, y mask), the y
    mask 1 on the refinement's tokens. The prompt (the problem, x) is unchanged.

    A math_refine response is attempt | feedback request | feedback | refine request |
    refinement (policy turns 0, 1, 2; the requests are the observations after turns 0 and 1).
    Removed: the feedback request and the feedback turn, the whole exchange with the high level.
    Kept: the attempt, the refine request (same tokens) and the refinement y, so the two
    sequences differ only by c. The attempt's message is closed as the removed request closed
    it: an observation starts with the end-of-turn token unless the turn before it wrote it, so
    the request's leading eos (if any) is kept and the refine request's leading eos dropped.

    Raises ValueError if the response does not have that layout (e.g. it ended before the
    refinement).
    """
    segments: list[tuple[tuple[int, int], list[int]]] = []
    for token, mask, turn in zip(response_ids, loss_mask, turn_ids):
        key = (turn, mask)
        if not segments or segments[-1][0] != key:
            segments.append((key, []))
        segments[-1][1].append(token)
    layout = [key for key, _ in segments]
    if layout != [(0, 1), (0, 0), (1, 1), (1, 0), (2, 1)]:
        raise ValueError(f"not an attempt / request / feedback / request / refinement response: (turn, mask) "
                         f"segments {layout}")
    attempt, request, _feedback, refine_request, refinement = (ids for _, ids in segments)
    closing = request[:1] if eos_id is not None and request[:1] == [eos_id] else []
    opening = refine_request[1:] if eos_id is not None and refine_request[:1] == [eos_id] else refine_request
    ids = attempt + closing + opening + refinement
    return ids, [0] * (len(ids) - len(refinement)) + [1] * len(refinement)


def refinement_logprobs(trajs: Sequence, batch: dict[str, torch.Tensor], logp: torch.Tensor, logprobs: Logprobs,
                        eos_id: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log p(y | x, c) [B], log p(y | x) [B], has_refinement [B] bool): the summed logprobs of
    each trajectory's refinement y with the feedback (`logp` [B, L] of `batch`) and without it
    (`without_feedback`, scored by `logprobs`). Rows without a refinement get 0 and 0."""
    seqs, y_masks, has = [], [], []
    for t in trajs:
        try:
            response, y = without_feedback(t.response_ids, t.loss_mask, t.turn_ids, eos_id)
            has.append(True)
        except ValueError:   # no refinement (ended early): scored too, as every trainer rank needs rows, counted nowhere
            response, y = t.response_ids, [0] * len(t.response_ids)
            has.append(False)
        seqs.append(t.prompt_ids + response)
        y_masks.append([0] * len(t.prompt_ids) + y)
    has = torch.tensor(has)
    y_with = (batch["turn_ids"] == 2) & (batch["loss_mask"] > 0) & has[:, None]
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


def mlmt_extras(cfg: Config, trajs: Sequence, batch: dict[str, torch.Tensor], logprobs: Logprobs,
                reference_logprobs: Logprobs, eos_id: int | None,
                high: tuple[Logprobs, Logprobs] | None = None) -> tuple[dict, dict[str, float]]:
    """(extra inputs of `algos.mlmt`: turn_kl, betas, refine_bonus; per-step metrics).

    `batch` is the collated rollout batch with every policy token in loss_mask (before a
    frozen level is masked out); `logprobs` / `reference_logprobs` score a batch under the
    solver's current weights / the frozen reference; `high`, with a second feedback model, is
    the same pair for that model, which then gives the feedback turn's KL. Nothing is computed
    when the betas and λ are all 0."""
    alg = cfg.algorithm
    if not (any(alg.mlmt_betas) or alg.mlmt_context_coef):
        return {}, {}
    inputs: dict = {}
    metrics: dict[str, float] = {}
    logp = logprobs(batch)
    if any(alg.mlmt_betas):
        log_ratio = logp - reference_logprobs(batch)
        if high is not None:   # the feedback turn's tokens: the feedback model against its own start
            high_logprobs, high_reference = high
            log_ratio = torch.where(batch["turn_ids"] == 1, high_logprobs(batch) - high_reference(batch), log_ratio)
        turn_kl = per_turn_sum(log_ratio, batch["loss_mask"],
                               mlmt_turn_ids(cfg, batch["turn_ids"]), MLMT_TURNS)
        inputs.update(turn_kl=turn_kl, betas=tuple(alg.mlmt_betas))
        metrics.update({f"mlmt_turn{k + 1}_kl_mean": float(turn_kl[:, k].mean()) for k in range(MLMT_TURNS)})
    if alg.mlmt_context_coef:
        with_c, without_c, has = refinement_logprobs(trajs, batch, logp, logprobs, eos_id)
        bonus = torch.where(has, context_utilization_bonus(with_c, without_c, alg.mlmt_context_coef,
                                                           alg.mlmt_context_cap), 0.0)
        inputs["refine_bonus"] = bonus
        count = max(1, int(has.sum()))   # means over the trajectories that reached the refinement
        metrics["mlmt_context_gain_mean"] = float(((with_c - without_c) * has).sum() / count)
        metrics["mlmt_context_bonus_mean"] = float(bonus.sum() / count)
        metrics["mlmt_context_rows_frac"] = float(has.float().mean())
    return inputs, metrics
