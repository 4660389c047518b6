"""The policy's weights on their way to the rollout engines: which tensors an engine loads under
which names (`export_plan`, `Export`: a plain model's parameters, or a LoRA model's base weights
with each adapted layer merged), packed into one shared-memory buffer per bucket for Ray's object
store (`pack_tensors`, `unpack_tensors`), or streamed to vLLM's NCCL weight transfer while
ZeRO-3 gathers them (`gathering_source`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

import torch

from turnrl.training.lora import base_name, lora_layers, merged_weight

@dataclass
class Export:
    """One tensor the rollout engines get: `param` under `name` (the base model's name), or with
    `lora` that layer's merged weight."""
    name: str
    param: torch.nn.Parameter
    lora: Any = None

    def sources(self) -> list[torch.nn.Parameter]:
        """What must be gathered (ZeRO-3) to compute `value`."""
        if self.lora is None:
            return [self.param]
        return [self.param, self.lora.lora_A["default"].weight, self.lora.lora_B["default"].weight]

    def value(self) -> torch.Tensor:
        return self.param.detach() if self.lora is None else merged_weight(self.param, self.lora)


def export_plan(module: torch.nn.Module, remove_duplicate: bool = False) -> list[Export]:
    """The weights an engine loads, for a plain model (its parameters) or a peft LoRA model (the
    base model's parameters under their own names, adapted weights merged, adapters left out)."""
    layers = lora_layers(module)
    if not layers:
        return [Export(n, p) for n, p in module.named_parameters(remove_duplicate=remove_duplicate)]
    out = []
    for name, param in module.get_base_model().named_parameters(remove_duplicate=remove_duplicate):
        target = base_name(name)
        if target is None:
            continue
        owner, _, leaf = name.rpartition(".")
        layer = layers.get(owner.removesuffix(".base_layer")) if owner.endswith(".base_layer") else None
        out.append(Export(target, param, layer if leaf == "weight" else None))
    return out


# --------------------------------------------------------------------------- weights in transit
ALIGN = 64   # bytes: every tensor of a packed bucket starts at a multiple of this


def pack_tensors(named: list[tuple[str, torch.Tensor]]) -> tuple[Any, list[tuple[str, str, tuple, int, int]]]:
    """Named tensors -> (one uint8 numpy buffer, [(name, dtype, shape, byte offset, bytes)]).
    Ray's object store keeps a numpy buffer as one block of shared memory and hands it to a
    reader on the same node without copying, where a dict of torch tensors is pickled tensor
    by tensor (measured: ~0.4 s each way for a 4 MB model). Any dtype (bf16 too) goes as bytes."""
    index, offset = [], 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        index.append((name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), offset, nbytes))
        offset += -(-nbytes // ALIGN) * ALIGN
    buffer = torch.empty(offset, dtype=torch.uint8)
    for (_, _, _, start, nbytes), (_, tensor) in zip(index, named):
        buffer[start:start + nbytes] = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    return buffer.numpy(), index


def unpack_tensors(packed: tuple[Any, list]) -> Iterator[tuple[str, torch.Tensor]]:
    """`pack_tensors` reversed: (name, tensor) views into the buffer (read-only when it comes
    from the object store: the engine copies them into its own weights)."""
    import warnings
    array, index = packed
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)   # "the given NumPy array is not writable"
        buffer = torch.from_numpy(array)
    for name, dtype, shape, start, nbytes in index:
        yield name, buffer[start:start + nbytes].view(getattr(torch, dtype)).view(shape)


def gathering_source(rank: Any):
    """vLLM's WeightSource over a policy rank's DeepSpeed module (`rank`: a
    turnrl.training.workers.PolicyWorker): full shapes up front, each parameter gathered (ZeRO-3)
    while it is sent (with LoRA: merged, as in `PolicyWorker._param_buckets`)."""
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    class GatheringSource(WeightSource):
        def metadata(self) -> list:
            return [ParamMeta(e.name, e.param.dtype, tuple(getattr(e.param, "ds_shape", e.param.shape)))
                    for e in rank.exports(remove_duplicate=True)]

        def __iter__(self):
            for e in rank.exports(remove_duplicate=True):
                with rank._gathered(e.sources()):
                    yield e.name, e.value()

    return GatheringSource()
