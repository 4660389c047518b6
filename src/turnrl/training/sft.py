"""Supervised fine-tuning on the train stage's machinery: the policy's trainer ranks on Ray
(DeepSpeed ZeRO at train.zero_stage, LoRA with model.lora, micro-batches of
train.micro_batch_rows), no rollout engines, the loss the mean NLL of the samples' loss-mask
tokens (`turnrl.algos.nll_loss`). The samples are `Trajectory`s, as RL trains on: a
conversation's (turnrl.gateway.conversations) or a replayed demonstration's.
"""
from __future__ import annotations

import random
import time
from typing import Callable, Sequence

from tqdm import tqdm

from turnrl.config import Config
from turnrl.rollout.multi_turn import Trajectory
from turnrl.training.loop import collate

_KEYS = ("input_ids", "attention_mask", "loss_mask")


def sft_batch(samples: Sequence[Trajectory], pad_id: int) -> dict:
    """input_ids, attention_mask, loss_mask [B, L] (right-padded, token-aligned) of `samples`."""
    full = collate(samples, pad_id)
    return {k: full[k] for k in _KEYS}


def fine_tune(cfg: Config, model_dir: str, train: list[Trajectory], heldout: list[Trajectory], out_dir: str,
              pad_id: int, on_step: Callable[[int, dict], None] | None = None) -> list[dict]:
    """`cfg.sft.steps` optimizer steps of `cfg.sft.batch_size` samples drawn (seeded, with
    replacement) from `train`, the held-out loss on all of `heldout` every sft.eval_every steps
    and at the last; the model saved to `out_dir` (an HF folder; with LoRA the merged model and
    its adapter/ folder). Returns every step's metrics: loss, tokens_per_s, grad_norm, lr, and
    heldout_loss where it was measured (and at step 0, before the first update)."""
    from turnrl.training.cluster import start_ray, start_trainer_ranks
    from turnrl.training.workers import TrainerParams
    spec = cfg.sft
    # One optimizer step per sft step, at sft's own rate and schedule.
    params = TrainerParams(
        seed=cfg.seed, model=cfg.model, algorithm=cfg.algorithm.model_copy(update={"epochs": 1, "mini_batches": 1}),
        train=cfg.train.model_copy(update={"steps": spec.steps, "lr": spec.lr, "warmup_steps": spec.warmup_steps,
                                           "lr_schedule": spec.lr_schedule, "min_lr_ratio": spec.min_lr_ratio}))
    start_ray(cfg)
    group, placement = start_trainer_ranks(cfg, model_dir, params, reference=False)
    rng = random.Random(f"{cfg.seed}:sft")
    history: list[dict] = []
    try:
        ranks = cfg.cluster.trainer_ranks
        start_loss = heldout_loss(group, heldout, spec.batch_size, pad_id, ranks) if heldout else None
        if start_loss is not None:   # step 0: the model as it came
            history.append({"step": 0, "heldout_loss": start_loss})
            if on_step is not None:
                on_step(0, history[-1])
        bar = tqdm(range(1, spec.steps + 1), desc="sft", unit="step")
        for step in bar:
            batch = sft_batch([rng.choice(train) for _ in range(spec.batch_size)], pad_id)
            start = time.perf_counter()
            shares = group.results("supervised", batch, True)
            seconds = time.perf_counter() - start
            metrics = {"step": step, "loss": sum(s["loss"] for s in shares),
                       "tokens_per_s": sum(s["tokens"] for s in shares) / seconds,
                       "grad_norm": max(s["grad_norm"] for s in shares), "lr": shares[0]["lr"], "step_s": seconds}
            if heldout and (step == spec.steps or (spec.eval_every and step % spec.eval_every == 0)):
                metrics["heldout_loss"] = heldout_loss(group, heldout, spec.batch_size, pad_id, ranks)
            history.append(metrics)
            bar.set_postfix(loss=f"{metrics['loss']:.3f}", refresh=False)
            if on_step is not None:
                on_step(step, metrics)
        group.results("save", out_dir, model_dir)
    finally:
        import ray
        ray.util.remove_placement_group(placement)
    return history


def heldout_loss(group, samples: list[Trajectory], batch_size: int, pad_id: int, ranks: int = 1) -> float:
    """The token-mean NLL over all of `samples`, in batches of `batch_size`, no update (a last
    batch of fewer rows than the `ranks` that share it joins the one before)."""
    loss_sum = tokens = 0.0
    starts = list(range(0, len(samples), max(batch_size, ranks)))
    if len(starts) > 1 and len(samples) - starts[-1] < ranks:
        starts.pop()
    for k, start in enumerate(starts):
        chunk = samples[start:starts[k + 1] if k + 1 < len(starts) else len(samples)]
        shares = group.results("supervised", sft_batch(chunk, pad_id), False)
        count = sum(s["tokens"] for s in shares)
        loss_sum += sum(s["loss"] for s in shares) * count
        tokens += count
    return loss_sum / max(tokens, 1.0)


def split_heldout(items: list, fraction: float, seed: int, keep: int = 1) -> tuple[list, list]:
    """(train, held out): a seeded share `fraction` held out, none with fewer than 20 items; at
    least `keep` items (the trainer ranks, which each take a share of a batch) on either side, so
    a fraction near 1 leaves something to train on."""
    if fraction <= 0 or len(items) < max(20, 2 * keep):
        return list(items), []
    order = list(range(len(items)))
    random.Random(f"{seed}:sft-heldout").shuffle(order)
    count = min(max(keep, round(fraction * len(items))), len(items) - keep)
    held = set(order[:count])
    return [x for i, x in enumerate(items) if i not in held], [x for i, x in enumerate(items) if i in held]
