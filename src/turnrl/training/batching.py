"""How a training batch is shared and cut: token-aligned logprobs and entropies from logits,
each trainer rank's rows, micro-batches of like-length rows, the weights that make the ranks'
losses add up to the whole mini-batch's, and the ranks' statistics combined.

Every trainer rank gets the whole rollout batch and trains on its share of each mini-batch
(`rank_rows`), its loss weighted by the share's part of the mini-batch's normalizer
(`share_weight`) and multiplied by the world size, so that DeepSpeed's average of the ranks'
gradients is the gradient one rank computes on the whole mini-batch. A rank's share goes through
the model in micro-batches of like-length rows (`train.micro_batch_rows`, `micro_batches`), the
update's gradients accumulating into one optimizer step per mini-batch (turnrl.training.workers).
"""
from __future__ import annotations

import math

import torch

from turnrl.algos import entropy_from_logits, logprobs_from_logits


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """logits [B, L, V], input_ids [B, L] -> [B, L]: entry t is log p(token t | tokens < t);
    entry 0 (no context) is 0. Token-aligned, like every per-token tensor of a batch."""
    return torch.nn.functional.pad(logprobs_from_logits(logits[:, :-1], input_ids[:, 1:]), (1, 0))


def entropy(logits: torch.Tensor) -> torch.Tensor:
    """logits [B, L, V] -> [B, L]: entropy of the distribution token t was drawn from."""
    return torch.nn.functional.pad(entropy_from_logits(logits[:, :-1]), (1, 0))


# --------------------------------------------------------------------------- data parallel
def rank_rows(rows: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """This rank's contiguous share of the row indices `rows` (shares differ by at most one)."""
    return rows.tensor_split(world_size)[rank]


def normalizer(mask: torch.Tensor, agg: str) -> float:
    """What `algos.aggregate(..., agg)` divides by for a [B, T] mask: its tokens (token-mean)
    or its sequences with at least one token (seq-mean-*)."""
    if agg == "token-mean":
        return float(mask.sum())
    return float((mask.sum(dim=-1) > 0).sum())


def share_weight(part_mask: torch.Tensor, whole_mask: torch.Tensor, agg: str) -> float:
    """w such that aggregate(whole) = sum over disjoint parts of w(part) * aggregate(part)."""
    whole = normalizer(whole_mask, agg)
    return normalizer(part_mask, agg) / whole if whole else 0.0


def micro_batches(attention_mask: torch.Tensor, parts: int) -> list[tuple[torch.Tensor, int]]:
    """(row indices [b], width) of each of `parts` micro-batches of a right-padded batch
    (attention_mask [B, L]): rows of like length together (sorted by length, stable), sizes
    differing by at most one, each micro-batch's width its longest row's, so padding costs no
    compute. parts 0: one micro-batch of every row, at full width."""
    B, L = attention_mask.shape
    if parts == 0:
        return [(torch.arange(B, device=attention_mask.device), L)]
    positions = torch.arange(1, L + 1, device=attention_mask.device)
    lengths = (attention_mask.bool() * positions).amax(dim=-1)   # one past the last attended token
    return [(idx, max(1, int(lengths[idx].max())))
            for idx in torch.argsort(lengths, stable=True).tensor_split(parts) if len(idx)]


def micro_batch_count(rows: int, world_size: int, micro_batch_rows: int) -> int:
    """How many micro-batches every rank splits its share of `rows` into: the same on every rank
    (under ZeRO-3 each pass gathers the weights, a collective), enough that the largest share's
    have at most `micro_batch_rows` rows, and none empty (at most the smallest share). 0: whole."""
    if micro_batch_rows == 0:
        return 0
    largest, smallest = math.ceil(rows / world_size), rows // world_size   # `rank_rows`' shares
    return max(1, min(math.ceil(largest / micro_batch_rows), smallest))


def take_rows(batch: dict[str, torch.Tensor], idx: torch.Tensor, width: int) -> dict[str, torch.Tensor]:
    """Rows `idx` of a batch, its token-aligned [B, L] tensors cut to their first `width` columns."""
    L = batch["attention_mask"].shape[1]
    return {k: v[idx, :width] if v.dim() >= 2 and v.shape[1] == L else v[idx] for k, v in batch.items()}


def combine_rank_stats(per_rank: list[dict[str, dict]]) -> dict[str, float]:
    """The ranks' train() results -> one dict: `sum` entries (per mini-batch, already weighted
    by each rank's share) add up across ranks, `max` entries take the largest; both are then
    averaged over mini-batches. `same` entries (computed on the whole batch) come from rank 0."""
    out: dict[str, float] = {}
    for kind, reduce in (("sum", sum), ("max", max)):
        for key, first in per_rank[0][kind].items():
            per_minibatch = [reduce(r[kind][key][i] for r in per_rank) for i in range(len(first))]
            out[key] = sum(per_minibatch) / len(per_minibatch)
    out.update(per_rank[0]["same"])
    return out
