"""The roles of a training run, each a plain class that runs as a Ray actor:

- `PolicyWorker`: one rank of the policy's DeepSpeed group (ZeRO stage from params). Computes
  token logprobs, runs the policy-gradient update, hands out its weights as named tensors. With
  `model.lora` it trains LoRA adapters (peft) and hands out the merged weights (see `lora_model`).
- `CriticWorker`: one rank of PPO's critic, a DeepSpeed group of its own.
- `RolloutWorker` (turnrl.training.rollout_worker): a rollout engine plus the environments.

Every trainer rank gets the whole rollout batch and trains on its share of each mini-batch, the
ranks' losses weighted so that DeepSpeed's average of their gradients is the gradient one rank
computes on the whole mini-batch, in micro-batches of like-length rows.

The roles are joined only by "push named weights" (see turnrl.training.cluster). The parts they
are built from live beside this module, and their names stay importable from here:

- turnrl.training.batching: logprobs and entropies from logits, each rank's rows, micro-batches,
  share weights, the ranks' statistics combined;
- turnrl.training.weight_export: what the engines load under which names, packed for Ray's object
  store or streamed over NCCL;
- turnrl.training.lora: the peft adapters and their merged weights.
"""
from __future__ import annotations

import contextlib
import functools
import math
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from turnrl.algos import explained_variance, kl_estimate, masked_mean, nll_loss, off_policy_kl_mean, value_loss
from turnrl.algos.registry import compute_policy_loss, resolve, resolve_loss
from turnrl.config import AlgorithmCfg, Config, EnvCfg, ModelCfg, RewardCfg, RolloutCfg, TrainCfg
from turnrl.training.batching import (combine_rank_stats, entropy, micro_batch_count, micro_batches, normalizer,
                                      rank_rows, share_weight, take_rows, token_logprobs)
from turnrl.training.checkpoint import step_seed
from turnrl.training.lora import (ADAPTER_DIR, LoraTargetError, base_name, lora_layers, lora_model,
                                  merged_weight)
from turnrl.training.weight_export import (ALIGN, Export, export_plan, gathering_source, pack_tensors,
                                           unpack_tensors)

__all__ = [
    # the roles
    "CriticWorker", "PolicyWorker", "RolloutParams", "TrainerParams", "actor_location", "rng_state",
    "set_rng_state",
    # turnrl.training.batching
    "combine_rank_stats", "entropy", "micro_batch_count", "micro_batches", "normalizer", "rank_rows",
    "share_weight", "take_rows", "token_logprobs",
    # turnrl.training.lora
    "ADAPTER_DIR", "LoraTargetError", "base_name", "lora_layers", "lora_model", "merged_weight",
    # turnrl.training.weight_export
    "ALIGN", "Export", "export_plan", "pack_tensors", "unpack_tensors",
]


# --------------------------------------------------------------------------- what each role reads
@dataclass(frozen=True)
class TrainerParams:
    """The params a trainer rank (policy, critic, high level) reads, validated once by the
    driver and shipped to the actor as they are."""
    seed: int
    model: ModelCfg
    algorithm: AlgorithmCfg
    train: TrainCfg

    @classmethod
    def of(cls, cfg: Config) -> "TrainerParams":
        return cls(seed=cfg.seed, model=cfg.model, algorithm=cfg.algorithm, train=cfg.train)

    @property
    def optimizer_steps(self) -> int:
        """The run's optimizer steps: each training step's epochs x mini-batches."""
        return self.train.steps * self.algorithm.epochs * self.algorithm.mini_batches


@dataclass(frozen=True)
class RolloutParams:
    """The params a rollout actor reads (its engine, environments and reward functions)."""
    seed: int
    model: ModelCfg
    rollout: RolloutCfg
    env: EnvCfg
    reward: RewardCfg

    @classmethod
    def of(cls, cfg: Config) -> "RolloutParams":
        return cls(seed=cfg.seed, model=cfg.model, rollout=cfg.rollout, env=cfg.env, reward=cfg.reward)


# --------------------------------------------------------------------------- DeepSpeed ranks
def lr_factor(k: int, warmup: int, total: int, schedule: str, min_ratio: float) -> float:
    """The learning rate's multiple at optimizer step `k` (0-based) of `total`: a linear warmup
    over the first `warmup` steps, then `schedule` (constant; linear or cosine from 1 down
    towards `min_ratio`, which the step after the last would reach)."""
    ramp = min(1.0, (k + 1) / (warmup + 1))
    if schedule == "constant":
        return ramp
    progress = min(1.0, max(0.0, (k - warmup) / max(1, total - warmup)))
    decay = 1.0 - progress if schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return ramp * (min_ratio + (1.0 - min_ratio) * decay)


def _deepspeed_engine(model: torch.nn.Module, train: TrainCfg, dtype: str, lr: float, rank: int, world_size: int,
                      master_addr: str, master_port: int, optimizer_steps: int):
    """`model` wrapped in a DeepSpeed engine (ZeRO stage from params) in this process's group:
    gloo on CPU, NCCL on GPUs (each rank's actor sees its own GPU as device 0)."""
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": "0", "WORLD_SIZE": str(world_size),
                       "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port)})
    os.environ.setdefault("DS_ACCELERATOR", "cpu" if not torch.cuda.is_available() else "cuda")
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo" if not torch.cuda.is_available() else "nccl")
    # A torch optimizer avoids DeepSpeed's JIT-built Adam kernels (minutes of gcc on CPU). Only
    # what trains (with LoRA: the adapters; the base weights are frozen and get no optimizer state).
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr,
                                  weight_decay=train.weight_decay, betas=(0.9, 0.99))
    # Warmup, then train.lr_schedule over the run's `optimizer_steps`; the scheduler's state is
    # part of every checkpoint.
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(
        lr_factor, warmup=train.warmup_steps, total=optimizer_steps, schedule=train.lr_schedule,
        min_ratio=train.min_lr_ratio))
    ds_config = {
        "train_micro_batch_size_per_gpu": 1,   # we pass whole mini-batches; see train()
        "gradient_accumulation_steps": 1,
        "gradient_clipping": train.grad_clip,
        "zero_optimization": {"stage": train.zero_stage},
        "bf16": {"enabled": dtype == "bfloat16"},
        "steps_per_print": 10 ** 9,
        "wall_clock_breakdown": False,
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config)
    return engine


def rng_state() -> dict[str, Any]:
    """This process's generator states: python, numpy, torch (and CUDA when present)."""
    import numpy as np
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    import numpy as np
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def actor_location() -> dict[str, Any]:
    """Which node, process, GPUs and turnrl code this actor has (for the run's log)."""
    import ray

    import turnrl
    return {"node": ray.util.get_node_ip_address(), "node_id": ray.get_runtime_context().get_node_id(),
            "pid": os.getpid(), "gpus": [str(g) for g in ray.get_gpu_ids()] if ray.is_initialized() else [],
            "turnrl": str(Path(turnrl.__file__).parent)}


class _TrainerRank:
    """What a policy or critic rank shares: its DeepSpeed engine, its rows of a batch, ZeRO-3
    gathers, checkpoints. Every rank of a group is called with the same arguments."""
    engine: Any
    params: TrainerParams
    rank: int
    world_size: int
    TAG = "engine"   # DeepSpeed's checkpoint tag inside a checkpoint folder
    frozen_base = False   # LoRA: checkpoints hold the adapters and their optimizer state, not the frozen base

    def where(self) -> dict[str, Any]:
        return {**actor_location(), "rank": self.rank}

    def timed_train(self, batch: dict[str, torch.Tensor], step: int = 0,
                    update: bool = True) -> tuple[dict[str, dict], float]:
        """`train`, and the seconds this rank spent on it (timed here, so the Ray call and the
        batch's transfer are not in it)."""
        start = time.perf_counter()
        return self.train(batch, step, update), time.perf_counter() - start

    def _to_device(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: v.to(self.engine.device) for k, v in batch.items()}

    def _all_rows(self, fn: Callable[[dict], torch.Tensor], batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """fn over the whole batch ([B, ...] out): each rank computes its contiguous rows, an
        all-reduce of the disjoint parts gives every rank all of them."""
        size = batch["input_ids"].shape[0]
        mine = rank_rows(torch.arange(size), self.rank, self.world_size)
        if len(mine) == 0:
            raise ValueError(f"a batch of {size} rows cannot be shared by {self.world_size} trainer ranks")
        part = self._micro_batched(fn, {k: v[mine] for k, v in batch.items()}, self._micro_count(size))
        if self.world_size == 1:
            return part
        full = torch.zeros((size, *part.shape[1:]), dtype=part.dtype, device=part.device)
        full[mine] = part
        torch.distributed.all_reduce(full)
        return full

    def _micro_count(self, rows: int) -> int:
        return micro_batch_count(rows, self.world_size, self.params.train.micro_batch_rows)

    def _micro_batched(self, fn: Callable[[dict], torch.Tensor], rows: dict[str, torch.Tensor],
                       parts: int) -> torch.Tensor:
        """fn ([b, width] tensors -> [b, width]) over `rows` in `parts` micro-batches, put back in
        place: [B, L] (0 past each micro-batch's width: padding)."""
        pieces = micro_batches(rows["attention_mask"], parts)
        if len(pieces) == 1 and pieces[0][1] == rows["attention_mask"].shape[1]:
            return fn(rows)
        out = None
        for idx, width in pieces:
            piece = fn(take_rows(rows, idx, width))
            if out is None:
                out = piece.new_zeros(rows["attention_mask"].shape + piece.shape[2:])
            out[idx, :width] = piece
        return out

    def _micro_steps(self, mb: dict[str, torch.Tensor], whole_mask: torch.Tensor,
                     agg: str) -> Iterator[tuple[dict[str, torch.Tensor], float, float, bool]]:
        """Each micro-batch of this rank's share `mb` of a mini-batch (whose loss mask, all ranks'
        rows, is `whole_mask`): its tensors, its weight in the mini-batch's loss (`agg`) and in its
        token means, and whether it is the last (the optimizer steps after it)."""
        parts = micro_batches(mb["attention_mask"], self._micro_count(whole_mask.shape[0]))
        for j, (idx, width) in enumerate(parts):
            micro = take_rows(mb, idx, width)
            yield (micro, share_weight(micro["loss_mask"], whole_mask, agg),
                   share_weight(micro["loss_mask"], whole_mask, "token-mean"), j == len(parts) - 1)

    def _accumulate(self, loss: torch.Tensor, last: bool) -> None:
        """Backward of one micro-batch's loss; the optimizer steps after the mini-batch's last."""
        self.engine.set_gradient_accumulation_boundary(last)
        self.engine.backward(loss * self.world_size)   # DeepSpeed averages gradients over ranks
        if last:
            self.engine.step()

    def _minibatches(self, size: int, step: int, stream: str) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """(mini-batch rows, this rank's share of them) for every epoch and mini-batch, in an
        order that is a function of (seed, step): the same on every rank, and on a resume."""
        alg = self.params.algorithm
        generator = torch.Generator().manual_seed(step_seed(self.params.seed, step, stream))
        for _ in range(alg.epochs):
            for chunk in torch.randperm(size, generator=generator).chunk(alg.mini_batches):
                mine = rank_rows(chunk, self.rank, self.world_size)
                if len(mine) == 0:
                    raise ValueError(f"a mini-batch of {len(chunk)} rows cannot be shared by {self.world_size} "
                                     "trainer ranks: raise train.prompts_per_step or lower algorithm.mini_batches")
                yield chunk, mine

    @contextlib.contextmanager
    def _gathered(self, params: list[torch.nn.Parameter]) -> Iterator[None]:
        """Under ZeRO-3, the full `params` on every rank inside the block (a collective)."""
        if self.params.train.zero_stage == 3:
            import deepspeed
            with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
                yield
        else:
            yield

    def save_checkpoint(self, folder: str) -> None:
        """Every rank: DeepSpeed writes this rank's shard (weights, optimizer, scheduler) and
        we add its generator states."""
        self.engine.save_checkpoint(folder, tag=self.TAG, save_latest=False,
                                    exclude_frozen_parameters=self.frozen_base)
        torch.save(rng_state(), Path(folder).parent / f"rng_{Path(folder).name}_rank{self.rank}.pt")

    def load_checkpoint(self, folder: str) -> None:
        # LoRA: the frozen base weights are not in the checkpoint; they are the starting model's,
        # which this rank loaded (the checkpoint's fingerprint covers that folder's content)
        path, _ = self.engine.load_checkpoint(folder, tag=self.TAG, load_module_strict=not self.frozen_base)
        if path is None:
            raise FileNotFoundError(f"{folder}: no DeepSpeed checkpoint '{self.TAG}' for rank {self.rank}")
        set_rng_state(torch.load(Path(folder).parent / f"rng_{Path(folder).name}_rank{self.rank}.pt",
                                 weights_only=False))


class PolicyWorker(_TrainerRank):
    def __init__(self, model_dir: str, params: TrainerParams, rank: int = 0, world_size: int = 1,
                 master_addr: str = "127.0.0.1", master_port: int = 29500, reference: bool = True):
        """`reference`: keep the frozen starting policy for KL (RL); SFT has none to keep."""
        from transformers import AutoModelForCausalLM

        self.params = params
        self.rank, self.world_size = rank, world_size
        torch.manual_seed(self.params.seed + rank)
        torch.set_flush_denormal(True)   # subnormal floats slow CPU training down several-fold
        dtype = getattr(torch, self.params.model.dtype)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
        self.lora = self.params.model.lora if self.params.model.lora.enabled else None
        if self.lora is not None:
            model = lora_model(model, self.lora, self.params.seed)
            self.frozen_base = True
        self.engine = _deepspeed_engine(model, params.train, params.model.dtype, params.train.lr, rank, world_size,
                                        master_addr, master_port, params.optimizer_steps)
        self.zero_stage = self.params.train.zero_stage
        # The frozen starting policy: KL to it is reported every step and, with
        # algorithm.kl_coef > 0, added to the loss. Loaded once; it only computes logprobs.
        # With LoRA it is the base model itself with the adapters switched off (exactly the
        # starting weights, which the base keeps frozen): no second copy of the model.
        self.reference = None if self.lora is not None or not reference else AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=dtype).to(self.engine.device).eval().requires_grad_(False)
        self._exports: dict[bool, list[Export]] = {}
        self.transfer = None   # vLLM's NCCL weight transfer (GPUs), see init_weight_transfer

    def where(self) -> dict[str, Any]:
        out = super().where()
        if self.lora is not None:
            trained = sum(getattr(p, "ds_numel", p.numel()) for p in self.engine.module.parameters() if p.requires_grad)
            total = sum(getattr(p, "ds_numel", p.numel()) for p in self.engine.module.parameters())
            out["lora"] = {"r": self.lora.r, "alpha": self.lora.alpha, "trained_parameters": trained,
                           "parameters": total, "modules": sorted(lora_layers(self.engine.module))}
        return out

    def _forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.engine(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits

    @torch.no_grad()
    def _logprobs(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        self.engine.eval()
        return token_logprobs(self._forward(batch), batch["input_ids"])

    @torch.no_grad()
    def _reference_logprobs(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        if self.reference is None:   # LoRA: the base model, adapters off
            self.engine.eval()
            with self.engine.module.disable_adapter():
                logits = self._forward(batch)
        else:
            logits = self.reference(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        return token_logprobs(logits, batch["input_ids"])

    def logprobs(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Token logprobs [B, L] of the whole batch under the current weights (all ranks call)."""
        return self._all_rows(self._logprobs, self._to_device(batch)).cpu()

    def reference_logprobs(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Token logprobs [B, L] of the whole batch under the frozen reference (all ranks call)."""
        return self._all_rows(self._reference_logprobs, self._to_device(batch)).cpu()

    def train(self, batch: dict[str, torch.Tensor], step: int = 0, update: bool = True) -> dict[str, dict]:
        """One policy-gradient update on a rollout batch; this rank trains on its share of
        each mini-batch. Returns stats for `combine_rank_stats`. With `update=False` (PPO's
        critic warm-up) the stats are computed as usual and the weights and the optimizer
        are left alone.

        batch: input_ids, attention_mask, loss_mask, advantages, engine_logprobs, all [B, L],
        token-aligned (entry t describes token t); optionally old_logprobs and ref_logprobs
        [B, L], the whole batch already scored under the current and the reference weights
        (MLMT's reward terms need them first), which are then not computed again.

        With one epoch of one mini-batch (the default) the update is on-policy: the old
        logprobs are the update's own, detached (the ratio is 1 and its gradient the policy
        gradient), so no separate forward pass computes them. With `train.overlap_rollout` the
        batch was sampled by the weights before the last update: the ratio is taken to the
        engine's logprobs, and logp_gap_max measures that step of staleness."""
        alg = self.params.algorithm
        algorithm = resolve(alg.name)   # its loss_term, if any, joins the policy loss
        batch = self._to_device(batch)
        mask = batch["loss_mask"]
        stale = self.params.train.overlap_rollout
        scored = batch.pop("old_logprobs", None)
        ref_logp = batch.pop("ref_logprobs", None)
        if ref_logp is None:
            ref_logp = self._all_rows(self._reference_logprobs, batch)
        off_policy = self.params.train.mode == "async"   # the proximal policy: these weights, recomputed
        if stale:
            old_logp = batch["engine_logprobs"]
        elif scored is not None or off_policy or alg.epochs > 1 or alg.mini_batches > 1:
            old_logp = scored if scored is not None else self._all_rows(self._logprobs, batch)
        else:
            old_logp = None   # on-policy: the update's own logprobs, detached
        sums: dict[str, list[float]] = {}
        maxes: dict[str, list[float]] = {}
        same: dict[str, float] = {}
        if old_logp is not None and not stale:
            # asynchronous: the engine-trainer gap over the tokens these very weights sampled (the
            # older ones differ by their staleness, which the correction's stats measure)
            fresh = mask * (batch["versions"] == batch["trainer_version"]) if off_policy else mask
            same = self._sampling_stats(old_logp, ref_logp, batch["engine_logprobs"], mask, fresh,
                                        off_policy=off_policy)

        self.engine.train()
        scored = {"ref_logp": ref_logp, **({} if old_logp is None else {"old_logp": old_logp})}
        for chunk, mine in self._minibatches(mask.shape[0], step, "policy"):
            mb = {k: v[mine] for k, v in {**batch, **scored}.items()}
            # this mini-batch's stats: its micro-batches' (weighted by their share) add up, maxima are taken
            mb_sums: dict[str, float] = {}
            mb_maxes: dict[str, float] = {"lr": self.engine.get_lr()[0]}   # this optimizer step's rate
            for micro, weight, token_weight, last in self._micro_steps(mb, mask[chunk], alg.loss_agg):
                logits = self._forward(micro)
                logp = token_logprobs(logits, micro["input_ids"])
                row: dict[str, float] = {}
                top: dict[str, float] = {}
                if not same:   # the stats from this forward, on this rank's share
                    # a share without policy tokens adds nothing: weight 0, and 0 never wins a max of |gaps|
                    share = self._sampling_stats(logp.detach(), micro["ref_logp"], micro["engine_logprobs"],
                                                 micro["loss_mask"], no_tokens=0.0, off_policy=stale)
                    row.update({key: token_weight * share[key] for key in ("kl_ref", "logp_gap_mean")})
                    # p99: of the micro-batch whose share has the largest
                    top.update({key: share[key] for key in ("logp_gap_max", "logp_gap_p99")})
                # algorithm.policy_loss (turnrl.algos.registry): every tensor of the micro-batch, by name
                loss, info = compute_policy_loss(resolve_loss(alg.policy_loss), {
                    **micro, "logp": logp, "old_logp": micro.get("old_logp", logp.detach()),
                    "mask": micro["loss_mask"]}, alg, algorithm, logits)
                loss = weight * loss
                ent_mean = masked_mean(entropy(logits if alg.entropy_coef else logits.detach()), micro["loss_mask"])
                if alg.entropy_coef:
                    loss = loss - alg.entropy_coef * token_weight * ent_mean
                if update:
                    self._accumulate(loss, last)
                row.update({"loss": loss.item(), "entropy": token_weight * ent_mean.item()})
                row.update({k: token_weight * float(v) for k, v in info.items() if not k.endswith("_max")})
                top.update({k: float(v) for k, v in info.items() if k.endswith("_max")})
                if last:
                    top["grad_norm"] = float(self.engine.get_global_grad_norm() or 0.0) if update else 0.0
                for k, v in row.items():
                    mb_sums[k] = mb_sums.get(k, 0.0) + v
                for k, v in top.items():
                    mb_maxes[k] = max(mb_maxes.get(k, v), v)
            for k, v in mb_sums.items():
                sums.setdefault(k, []).append(v)
            for k, v in mb_maxes.items():
                maxes.setdefault(k, []).append(v)
        return {"sum": sums, "max": maxes, "same": same}

    def supervised(self, batch: dict[str, torch.Tensor], update: bool = True) -> dict[str, float]:
        """One optimizer step of supervised fine-tuning on `batch` (input_ids, attention_mask,
        loss_mask [B, L], token-aligned), this rank on its rows; with `update=False` only the
        loss (held-out). Returns this rank's share of the batch's token-mean NLL ("loss": the
        ranks' shares add up to it), its loss tokens, and the gradient norm."""
        batch = self._to_device(batch)
        mask = batch["loss_mask"]
        mine = rank_rows(torch.arange(mask.shape[0]), self.rank, self.world_size)
        if len(mine) == 0:
            raise ValueError(f"a batch of {mask.shape[0]} rows cannot be shared by {self.world_size} trainer ranks: "
                             "raise sft.batch_size")
        rows = {k: v[mine] for k, v in batch.items()}
        self.engine.train(update)
        lr = self.engine.get_lr()[0]   # the rate this step updates at
        total = 0.0
        with torch.set_grad_enabled(update):
            for micro, weight, _, last in self._micro_steps(rows, mask, "token-mean"):
                loss = weight * nll_loss(token_logprobs(self._forward(micro), micro["input_ids"]), micro["loss_mask"])
                if update:
                    self._accumulate(loss, last)
                total += loss.item()
        grad_norm = float(self.engine.get_global_grad_norm() or 0.0) if update else 0.0
        return {"loss": total, "tokens": float(rows["loss_mask"].sum()), "grad_norm": grad_norm, "lr": lr}

    def _sampling_stats(self, logp: torch.Tensor, ref_logp: torch.Tensor, engine_logp: torch.Tensor,
                        mask: torch.Tensor, gap_mask: torch.Tensor | None = None,
                        no_tokens: float = math.nan, off_policy: bool = False) -> dict[str, float]:
        """logp_gap_max, _mean, _p99: the largest, mean and 99th percentile |trainer - engine|
        logprob over policy tokens (`gap_mask`, default `mask`: the tokens the engines sampled
        with the weights the trainer holds; with none, as when an asynchronous batch is all older
        samples, `no_tokens`: NaN, not measured); kl_ref: the policy's mean KL to its start, on
        `off_policy` samples (older weights sampled them) importance-weighted by policy / engine."""
        kind = self.params.algorithm.kl_estimator
        kl_ref = (off_policy_kl_mean(logp, ref_logp, engine_logp, mask, kind=kind) if off_policy
                  else masked_mean(kl_estimate(logp, ref_logp, kind=kind), mask)).item()
        gaps = (logp - engine_logp).abs()[(mask if gap_mask is None else gap_mask).bool()].float()
        if gaps.numel() == 0:
            return {"logp_gap_max": no_tokens, "logp_gap_mean": no_tokens, "logp_gap_p99": no_tokens, "kl_ref": kl_ref}
        return {"logp_gap_max": gaps.max().item(), "logp_gap_mean": gaps.mean().item(),
                "logp_gap_p99": gaps.kthvalue(max(1, math.ceil(0.99 * gaps.numel()))).values.item(),
                "kl_ref": kl_ref}

    # ----------------------------------------------------------------------- weights out
    def exports(self, remove_duplicate: bool = False) -> list["Export"]:
        """The weights the engines get, in order (see `export_plan`)."""
        if remove_duplicate not in self._exports:
            self._exports[remove_duplicate] = export_plan(self.engine.module, remove_duplicate)
        return self._exports[remove_duplicate]

    def _param_buckets(self, bucket_bytes: int) -> list[list["Export"]]:
        """The weights in order, grouped into buckets of at most bucket_bytes (or one tensor).
        Tied weights come under each of their names (lm_head.weight too: the engine may hold it
        apart from the embedding). With LoRA: the base model's weights under its own names, an
        adapted layer's weight merged (W + (alpha / r) B A); the adapters themselves are not sent."""
        buckets: list[list] = [[]]
        size = 0
        for export in self.exports():
            param = export.param
            nbytes = getattr(param, "ds_numel", param.numel()) * param.element_size()
            if buckets[-1] and size + nbytes > bucket_bytes:
                buckets.append([])
                size = 0
            buckets[-1].append(export)
            size += nbytes
        return buckets

    def weight_buckets(self, bucket_mb: int) -> list | None:
        """Every rank calls this (a collective under ZeRO-3). Rank 0 returns its weights as
        object-store refs, one per bucket (`pack_tensors`); the others return None."""
        import ray
        refs = [ray.put(packed) for packed in self.packed_buckets(bucket_mb)]
        return refs if self.rank == 0 else None

    def packed_buckets(self, bucket_mb: int) -> Iterator[tuple[Any, list]]:
        """The weights as `pack_tensors` buffers, one per bucket (yielded on rank 0 only; every
        rank must run the generator to the end under ZeRO-3, whose gathers are collectives)."""
        for bucket in self._param_buckets(bucket_mb << 20):
            with self._gathered(list({id(p): p for e in bucket for p in e.sources()}.values())):
                if self.rank == 0:
                    yield pack_tensors([(e.name, e.value()) for e in bucket])

    def named_weights(self) -> dict[str, torch.Tensor]:
        """Full weights as CPU tensors (gathered from all ranks under ZeRO-3: all ranks call),
        under the base model's names; with LoRA merged, without the adapters."""
        module = self.engine.module
        root = module.get_base_model() if self.lora is not None else module
        merged = {e.name: e for e in self.exports() if e.lora is not None}
        # Tied weights stay one tensor under both names: save_pretrained then writes one (the
        # embedding), as the checkpoint had it. Separate copies made it write lm_head.weight too,
        # which vLLM's Gemma 2 (no lm_head) refuses to load.
        copies: dict[int, torch.Tensor] = {}
        out = {}
        with self._gathered(list(module.parameters())):
            for name, value in root.state_dict(keep_vars=True).items():
                name = base_name(name)
                if name is None:   # an adapter's own tensor
                    continue
                if name in merged:
                    out[name] = merged[name].value().cpu().clone()
                    continue
                if id(value) not in copies:
                    copies[id(value)] = value.detach().cpu().clone()
                out[name] = copies[id(value)]
        return out

    def adapter_weights(self) -> dict[str, torch.Tensor]:
        """The LoRA adapters' tensors under peft's names (gathered under ZeRO-3: all ranks call)."""
        module = self.engine.module
        params = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        with self._gathered([p for _, p in params]):
            return {n: p.detach().cpu().clone() for n, p in params}

    def save(self, out_dir: str, tokenizer_dir: str) -> str:
        """Save an HF folder (weights + tokenizer) that transformers and vLLM load; all ranks
        call, rank 0 writes. With LoRA the folder is the merged model, and `ADAPTER_DIR` in it
        peft's adapter folder (`PeftModel.from_pretrained(base, out_dir + "/adapter")`)."""
        from transformers import AutoTokenizer
        weights = self.named_weights()
        adapters = self.adapter_weights() if self.lora is not None else None
        if self.rank == 0:
            module = self.engine.module
            root = module.get_base_model() if self.lora is not None else module
            root.save_pretrained(out_dir, state_dict=weights, safe_serialization=True)
            AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(out_dir)
            if adapters is not None:
                module.save_pretrained(str(Path(out_dir) / ADAPTER_DIR), state_dict=adapters,
                                       save_embedding_layers=False)
        return out_dir

    def init_weight_transfer(self, master_address: str, master_port: int, world_size: int, engines: list) -> None:
        """GPUs: join vLLM's NCCL weight transfer (rank 0 broadcasts to every engine; the other
        ranks join the ZeRO-3 gathers). `engines` are the RolloutWorker actors."""
        from vllm.distributed.weight_transfer.clients import RayVLLMWeightSyncClient
        from vllm.distributed.weight_transfer.nccl_engine import (NCCLTrainerInitInfo,
                                                                   NCCLTrainerWeightTransferEngine)
        self.transfer = NCCLTrainerWeightTransferEngine.trainer_init(
            NCCLTrainerInitInfo(master_address=master_address, master_port=master_port,
                                world_size=world_size, rank=self.rank),
            client=RayVLLMWeightSyncClient(engines), source=gathering_source(self))

    def send_weights(self) -> None:
        self.transfer.send_weights()


class CriticWorker(_TrainerRank):
    """PPO's critic: the policy's network with a scalar value head instead of the LM head
    (transformers' `...ForTokenClassification` with one label, the head freshly initialized),
    in its own DeepSpeed group. Values are token-aligned like logprobs: entry t is V of the
    state before token t."""

    def __init__(self, model_dir: str, params: TrainerParams, rank: int = 0, world_size: int = 1,
                 master_addr: str = "127.0.0.1", master_port: int = 29501):
        from transformers import AutoModelForTokenClassification

        self.params = params
        self.rank, self.world_size = rank, world_size
        torch.manual_seed(self.params.seed + 1000)   # the same fresh value head on every rank
        torch.set_flush_denormal(True)
        model = AutoModelForTokenClassification.from_pretrained(
            model_dir, num_labels=1, dtype=getattr(torch, self.params.model.dtype))
        self.engine = _deepspeed_engine(model, params.train, params.model.dtype, params.algorithm.critic_lr, rank,
                                        world_size, master_addr, master_port, params.optimizer_steps)

    def _values(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        out = self.engine(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[..., 0]
        return torch.nn.functional.pad(out[:, :-1], (1, 0))   # [B, L], shifted like token_logprobs

    @torch.no_grad()
    def _values_no_grad(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        self.engine.eval()
        return self._values(batch).float()

    def values(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """V [B, L] of the whole batch (all ranks call)."""
        return self._all_rows(self._values_no_grad, self._to_device(batch)).cpu()

    def train(self, batch: dict[str, torch.Tensor], step: int = 0, update: bool = True) -> dict[str, dict]:
        """Clipped value regression on `returns` from the values at rollout time (`values`);
        this rank fits its share of each mini-batch. Returns stats for `combine_rank_stats`."""
        alg = self.params.algorithm
        batch = self._to_device(batch)
        mask = batch["loss_mask"]
        sums: dict[str, list[float]] = {}
        self.engine.train()
        for chunk, mine in self._minibatches(mask.shape[0], step, "critic"):
            mb = {k: v[mine] for k, v in batch.items()}
            mb_sums: dict[str, float] = {}
            for micro, weight, token_weight, last in self._micro_steps(mb, mask[chunk], alg.loss_agg):
                loss, info = value_loss(self._values(micro), micro["values"], micro["returns"], micro["loss_mask"],
                                        clip=alg.value_clip, agg=alg.loss_agg)
                loss = weight * loss
                if update:
                    self._accumulate(loss, last)
                row = {"value_loss": loss.item(), **{k: token_weight * float(v) for k, v in info.items()}}
                for k, v in row.items():
                    mb_sums[k] = mb_sums.get(k, 0.0) + v
            for k, v in mb_sums.items():
                sums.setdefault(k, []).append(v)
        same = {"explained_variance": float(explained_variance(batch["values"], batch["returns"], mask))}
        return {"sum": sums, "max": {}, "same": same}
