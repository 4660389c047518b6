"""The two roles of a training run, each a plain class that runs as a Ray actor:

- `PolicyWorker`: the policy as a DeepSpeed engine (ZeRO stage from params). Computes token
  logprobs, runs the policy-gradient update, hands out its weights as named tensors.
- `RolloutWorker`: a rollout engine (vLLM, or transformers) plus the environments. Runs the
  multi-turn loop for a batch of prompts and takes new weights without restarting.

They are joined only by "push named weights": the driver asks the policy for its weights
and gives them to the rollout worker (through Ray's object store on one machine).
"""
from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import torch

from turnrl.algos import (entropy_from_logits, explained_variance, kl_estimate, kl_loss, logprobs_from_logits,
                          masked_mean, policy_loss, value_loss)
from turnrl.config import Config


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """logits [B, L, V], input_ids [B, L] -> [B, L]: entry t is log p(token t | tokens < t);
    entry 0 (no context) is 0. Token-aligned, like every per-token tensor of a batch."""
    return torch.nn.functional.pad(logprobs_from_logits(logits[:, :-1], input_ids[:, 1:]), (1, 0))


def entropy(logits: torch.Tensor) -> torch.Tensor:
    """logits [B, L, V] -> [B, L]: entropy of the distribution token t was drawn from."""
    return torch.nn.functional.pad(entropy_from_logits(logits[:, :-1]), (1, 0))


def _deepspeed_engine(model: torch.nn.Module, cfg: Config, lr: float, rank: int, world_size: int,
                      master_addr: str, master_port: int):
    """`model` wrapped in a DeepSpeed engine (ZeRO stage from params) in this process's group."""
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": "0", "WORLD_SIZE": str(world_size),
                       "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port)})
    os.environ.setdefault("DS_ACCELERATOR", "cpu" if not torch.cuda.is_available() else "cuda")
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo" if not torch.cuda.is_available() else "nccl")
    train = cfg.train
    # A torch optimizer avoids DeepSpeed's JIT-built Adam kernels (minutes of gcc on CPU).
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=train.weight_decay, betas=(0.9, 0.99))
    # Linear warmup over optimizer steps (a factor of 1 throughout with warmup_steps 0); its
    # state is part of every checkpoint.
    warmup = train.warmup_steps
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: min(1.0, (k + 1) / (warmup + 1)))
    ds_config = {
        "train_micro_batch_size_per_gpu": 1,   # we pass whole mini-batches; see train()
        "gradient_accumulation_steps": 1,
        "gradient_clipping": train.grad_clip,
        "zero_optimization": {"stage": train.zero_stage},
        "bf16": {"enabled": cfg.model.dtype == "bfloat16"},
        "steps_per_print": 10 ** 9,
        "wall_clock_breakdown": False,
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config)
    return engine


class _Checkpointed:
    """Checkpoint save and load for a worker holding a DeepSpeed `engine` as trainer `rank`.
    Every rank calls these with the same folder (DeepSpeed writes each rank's ZeRO shard)."""
    engine: Any
    rank: int
    TAG = "engine"

    def save_checkpoint(self, folder: str) -> None:
        self.engine.save_checkpoint(folder, tag=self.TAG, save_latest=False)
        torch.save(rng_state(), Path(folder).parent / f"rng_{Path(folder).name}_rank{self.rank}.pt")

    def load_checkpoint(self, folder: str) -> None:
        path, _ = self.engine.load_checkpoint(folder, tag=self.TAG)
        if path is None:
            raise FileNotFoundError(f"{folder}: no DeepSpeed checkpoint '{self.TAG}' for rank {self.rank}")
        set_rng_state(torch.load(Path(folder).parent / f"rng_{Path(folder).name}_rank{self.rank}.pt",
                                 weights_only=False))


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


class PolicyWorker(_Checkpointed):
    def __init__(self, model_dir: str, cfg: dict[str, Any], rank: int = 0, world_size: int = 1,
                 master_addr: str = "127.0.0.1", master_port: int = 29500):
        from transformers import AutoModelForCausalLM

        self.cfg = Config.model_validate(cfg)
        self.rank = rank
        torch.manual_seed(self.cfg.seed + rank)
        torch.set_flush_denormal(True)   # subnormal floats slow CPU training down several-fold
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, self.cfg.model.dtype))
        train = self.cfg.train
        self.engine = _deepspeed_engine(model, self.cfg, train.lr, rank, world_size, master_addr, master_port)
        self.zero_stage = train.zero_stage
        # The frozen starting policy: KL to it is reported every step and, with
        # algorithm.kl_coef > 0, added to the loss. Loaded once; it only computes logprobs.
        self.reference = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=getattr(torch, self.cfg.model.dtype)).eval().requires_grad_(False)

    def _forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.engine(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits

    @torch.no_grad()
    def logprobs(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        self.engine.eval()
        return token_logprobs(self._forward(batch), batch["input_ids"])

    def train(self, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        """One policy-gradient update on a rollout batch.

        batch: input_ids, attention_mask, loss_mask, advantages, engine_logprobs, all [B, L],
        token-aligned (entry t describes token t)."""
        alg = self.cfg.algorithm
        mask = batch["loss_mask"]
        old_logp = self.logprobs(batch)
        # Correctness signal: the engine sampled with the same weights the trainer holds.
        gap = ((old_logp - batch["engine_logprobs"]).abs() * mask).max().item()
        with torch.no_grad():
            ref_logits = self.reference(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            ref_logp = token_logprobs(ref_logits, batch["input_ids"])
        kl_ref = masked_mean(kl_estimate(old_logp, ref_logp, kind=alg.kl_estimator), mask).item()

        stats: dict[str, list[float]] = {}
        self.engine.train()
        size = batch["input_ids"].shape[0]
        for _ in range(alg.epochs):
            order = torch.randperm(size)
            for chunk in order.chunk(alg.mini_batches):
                mb = {k: v[chunk] for k, v in batch.items()}
                logits = self._forward(mb)
                logp = token_logprobs(logits, mb["input_ids"])
                loss, info = policy_loss(logp, old_logp[chunk], mb["advantages"], mb["loss_mask"],
                                         clip_low=alg.clip_low, clip_high=alg.clip_high,
                                         dual_clip=alg.dual_clip, agg=alg.loss_agg)
                ent_mean = masked_mean(entropy(logits if alg.entropy_coef else logits.detach()), mb["loss_mask"])
                if alg.entropy_coef:
                    loss = loss - alg.entropy_coef * ent_mean
                if alg.kl_coef:
                    loss = loss + alg.kl_coef * kl_loss(logp, ref_logp[chunk], mb["loss_mask"], kind=alg.kl_estimator,
                                                        agg=alg.loss_agg)
                self.engine.backward(loss)
                self.engine.step()
                row = {"loss": loss.item(), "entropy": ent_mean.item(),
                       "grad_norm": float(self.engine.get_global_grad_norm() or 0.0)}
                row.update({k: float(v) for k, v in info.items()})
                for k, v in row.items():
                    stats.setdefault(k, []).append(v)
        out = {k: sum(v) / len(v) for k, v in stats.items()}
        out["logp_gap_max"] = gap
        out["kl_ref"] = kl_ref
        return out

    def named_weights(self) -> dict[str, torch.Tensor]:
        """Full weights as CPU tensors (gathered from all ranks under ZeRO-3)."""
        module = self.engine.module
        if self.zero_stage == 3:
            import deepspeed
            with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
                return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}
        return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}

    def save(self, out_dir: str, tokenizer_dir: str) -> str:
        """Save an HF folder (weights + tokenizer) that transformers and vLLM load."""
        from transformers import AutoTokenizer
        weights = self.named_weights()
        self.engine.module.save_pretrained(out_dir, state_dict=weights, safe_serialization=True)
        AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(out_dir)
        return out_dir


class CriticWorker(_Checkpointed):
    """PPO's critic: the policy's network with a scalar value head instead of the LM head
    (transformers' `...ForTokenClassification` with one label, the head freshly initialized),
    in its own DeepSpeed engine. Values are token-aligned like logprobs: entry t is V of the
    state before token t."""

    def __init__(self, model_dir: str, cfg: dict[str, Any], rank: int = 0, world_size: int = 1,
                 master_addr: str = "127.0.0.1", master_port: int = 29501):
        from transformers import AutoModelForTokenClassification

        self.cfg = Config.model_validate(cfg)
        self.rank = rank
        torch.manual_seed(self.cfg.seed + 1000 + rank)
        torch.set_flush_denormal(True)
        model = AutoModelForTokenClassification.from_pretrained(
            model_dir, num_labels=1, dtype=getattr(torch, self.cfg.model.dtype))
        self.engine = _deepspeed_engine(model, self.cfg, self.cfg.algorithm.critic_lr, rank, world_size,
                                        master_addr, master_port)

    def _values(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        out = self.engine(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[..., 0]
        return torch.nn.functional.pad(out[:, :-1], (1, 0))   # [B, L], shifted like token_logprobs

    @torch.no_grad()
    def values(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        self.engine.eval()
        return self._values(batch).float()

    def train(self, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        """Clipped value regression on `returns` from the values at rollout time (`values`)."""
        alg = self.cfg.algorithm
        stats: dict[str, list[float]] = {}
        self.engine.train()
        size = batch["input_ids"].shape[0]
        for _ in range(alg.epochs):
            for chunk in torch.randperm(size).chunk(alg.mini_batches):
                mb = {k: v[chunk] for k, v in batch.items()}
                loss, info = value_loss(self._values(mb), mb["values"], mb["returns"], mb["loss_mask"],
                                        clip=alg.value_clip, agg=alg.loss_agg)
                self.engine.backward(loss)
                self.engine.step()
                for k, v in {"value_loss": loss.item(), **{k: float(v) for k, v in info.items()}}.items():
                    stats.setdefault(k, []).append(v)
        out = {k: sum(v) / len(v) for k, v in stats.items()}
        out["explained_variance"] = float(explained_variance(batch["values"], batch["returns"], batch["loss_mask"]))
        return out


class RolloutWorker:
    def __init__(self, model_dir: str, cfg: dict[str, Any], data_dir: str):
        from transformers import AutoTokenizer

        from turnrl.rollout.chat import ChatFormat
        from turnrl.rollout.engines import context_length, make_engine
        self.cfg = Config.model_validate(cfg)
        r = self.cfg.rollout
        self.engine = make_engine(r.engine, model_dir, dtype=self.cfg.model.dtype, seed=self.cfg.seed,
                                  kv_cache_gib=r.kv_cache_gib, max_model_len=context_length(model_dir))
        self.fmt = ChatFormat(AutoTokenizer.from_pretrained(model_dir), self.cfg.model.template_type)
        from turnrl.envs.configured import env_factory
        self.make_env = env_factory(self.cfg, data_dir)   # built once: a search index is loaded here

    def rollout(self, examples: list[dict], n: int, seed: int | None = None,
                temperature: float | None = None, generator_seed: int | None = None) -> list:
        """`n` trajectories per example. `generator_seed` seeds this process's generators
        first: vLLM's CPU sampler (and transformers' sampling) draw from torch's global
        generator, and the engine runs in this process, so the batch samples the same tokens
        for the same seed, weights and prompts however many batches came before."""
        from turnrl.rollout.loop import Budgets, run_rollouts
        if generator_seed is not None:
            torch.manual_seed(generator_seed)
            random.seed(generator_seed)
        r = self.cfg.rollout
        return run_rollouts(self.engine, examples, self.make_env, self.fmt,
                            Budgets(r.max_turns, r.max_tokens_per_turn, r.max_tokens_total),
                            n=n, temperature=r.temperature if temperature is None else temperature,
                            top_p=r.top_p, seed=seed, env_workers=self.cfg.env.workers)

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        self.engine.load_weights(weights.items())
