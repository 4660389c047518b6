"""LoRA (`model.lora`): the policy with peft adapters on its linear layers (`lora_model`), its
LoRA layers by name, a wrapped parameter's base-model name, and an adapted layer's merged weight
(W + (alpha / r) B A), which is what the rollout engines get (turnrl.training.weight_export)."""
from __future__ import annotations

from typing import Any

import torch

from turnrl.config import LoraCfg

ADAPTER_DIR = "adapter"   # peft's adapter folder inside a saved (merged) LoRA model


class LoraTargetError(ValueError):
    """model.lora.target_modules does not fit the model."""


def lora_model(model: torch.nn.Module, lora: LoraCfg, seed: int) -> torch.nn.Module:
    """`model` with LoRA adapters (peft) on `lora.target_modules`; everything else frozen. B
    starts at zero, so the model computes what it did. A is drawn from `seed` alone: every
    rank starts from the same adapters (the global generator is left as it was)."""
    from peft import LoraConfig, get_peft_model
    config = LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, bias="none",
                        target_modules=lora.target_modules, task_type="CAUSAL_LM")
    linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            # adapters in the model's dtype (peft would keep bf16 models' adapters in fp32)
            peft_model = get_peft_model(model, config, autocast_adapter_dtype=False)
        except ValueError as exc:
            raise LoraTargetError(f"model.lora.target_modules = {lora.target_modules!r}: {exc} The model's linear "
                                  f"layers: {', '.join(linear)}") from None
    from peft.tuners.lora import Linear as LoraLinear
    output = peft_model.get_base_model().get_output_embeddings()
    for name, layer in lora_layers(peft_model).items():
        if type(layer) is not LoraLinear or layer.get_base_layer() is output:
            raise LoraTargetError(f"model.lora.target_modules = {lora.target_modules!r} adapts {name} "
                                  f"({type(layer.get_base_layer()).__name__}): turnrl adapts linear layers inside the "
                                  f"model only, not embeddings or the LM head; its linear layers: {', '.join(linear)}")
    return peft_model


def lora_layers(module: torch.nn.Module) -> dict[str, Any]:
    """The peft LoRA layers of `module` by name (inside the base model: no `base_model.model.`)."""
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:
        return {}
    root = module.get_base_model() if hasattr(module, "get_base_model") else module
    return {n: m for n, m in root.named_modules() if isinstance(m, LoraLayer)}


def base_name(name: str) -> str | None:
    """A parameter's name inside peft's wrapped base model -> the base model's own name
    (`...q_proj.base_layer.weight` -> `...q_proj.weight`); None for an adapter's own tensors
    (`lora_A`, `lora_B`, ...). Names without peft's parts come back unchanged."""
    parts = name.split(".")
    if any(p.startswith("lora_") for p in parts):
        return None
    return ".".join(p for p in parts if p != "base_layer")


def merged_weight(weight: torch.Tensor, layer: Any, adapter: str = "default") -> torch.Tensor:
    """W + (alpha / r) B A for a peft LoRA linear layer (in fp32, then the weight's dtype)."""
    a, b = layer.lora_A[adapter].weight, layer.lora_B[adapter].weight
    delta = (b.detach().float() @ a.detach().float()) * layer.scaling[adapter]
    if layer.fan_in_fan_out:
        delta = delta.T
    return (weight.detach().float() + delta).to(weight.dtype)
