"""The checks that need the trainer (a PolicyWorker of world size 1, in this process, as
tests/test_update.py runs it): the logprobs on load, one DeepSpeed update per ZeRO stage pushed
into vLLM, the saved folder reloaded by transformers, peft and vLLM, and multi-turn rollouts on
vLLM scored by the trainer. Each adds its `Result` to the `CheckRun` it is given."""
from __future__ import annotations

import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

from turnrl.models.check_report import (GAP_BOUND, MEAN_BOUND, PROMPTS, CheckRun, Result, Timer, indent,
                                        short_error)
from turnrl.models.engine_process import EngineError, EngineProcess
from turnrl.models.template_checks import TwoTurnEnv


def _pad(sequences: list[list[int]], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for row, s in enumerate(sequences):
        ids[row, :len(s)] = torch.tensor(s)
        attn[row, :len(s)] = 1
    return ids, attn


def _gaps(a: list[list[float]], b: torch.Tensor, lengths: list[int], start: int = 1) -> torch.Tensor:
    """|a - b| over the real tokens (from position `start`) of every row, as one flat tensor."""
    parts = [(torch.tensor(a[row][start:n], dtype=torch.float64) - b[row, start:n].double()).abs()
             for row, n in enumerate(lengths)]
    parts = [p for p in parts if len(p)]
    return torch.cat(parts) if parts else torch.zeros(1, dtype=torch.float64)


def _gap(a: list[list[float]], b: torch.Tensor, lengths: list[int], start: int = 1,
         record: tuple[dict, str] | None = None) -> float:
    """max |a - b| over the real tokens of each row; with `record` = (metrics, key), the mean and
    99th percentile go to metrics[key + "_mean"] and [key + "_p99"] (bf16's max is set by a few
    unlikely tokens; its mean and p99 say how the rest fare)."""
    gaps = _gaps(a, b, lengths, start)
    if record is not None:
        metrics, key = record
        metrics[f"{key}_mean"] = float(gaps.mean())
        metrics[f"{key}_p99"] = float(torch.quantile(gaps, 0.99))
    return float(gaps.max())


@dataclass
class Batch:
    """The engine's samples as the trainer takes them: prompt + sampled tokens, padded, with the
    sampled tokens in the loss mask and a random +-1 advantage per sequence."""
    sequences: list[list[int]]
    lengths: list[int]
    ids: torch.Tensor
    attn: torch.Tensor
    loss_mask: torch.Tensor
    engine_logp: torch.Tensor
    tensors: dict           # what PolicyWorker.logprobs and .train take


def build_batch(prompts: list[list[int]], samples: list, seed: int) -> Batch:
    sequences = [p + s.token_ids for p, s in zip(prompts, samples)]
    lengths = [len(s) for s in sequences]
    ids, attn = _pad(sequences)
    loss_mask = torch.zeros(ids.shape)
    engine_logp = torch.zeros(ids.shape)
    for row, (p, s) in enumerate(zip(prompts, samples)):
        loss_mask[row, len(p):len(p) + len(s.token_ids)] = 1
        engine_logp[row, len(p):len(p) + len(s.token_ids)] = torch.tensor(s.logprobs)
    g = torch.Generator().manual_seed(seed)
    advantages = torch.where(torch.rand(len(sequences), 1, generator=g) < 0.5, -1.0, 1.0).expand_as(loss_mask) * loss_mask
    tensors = {"input_ids": ids, "attention_mask": attn, "loss_mask": loss_mask, "advantages": advantages,
               "engine_logprobs": engine_logp, "turn_ids": torch.zeros_like(ids)}
    return Batch(sequences, lengths, ids, attn, loss_mask, engine_logp, tensors)


# --------------------------------------------------------------------------- one update per ZeRO stage
def zero_stage_checks(run: CheckRun, zero_stages) -> None:
    """The trainer, one update per ZeRO stage, pushed into vLLM (the first stage's trainer also
    gives the logprobs check). run.worker is the last stage's trainer, None if a stage failed."""
    from turnrl.config import Config
    from turnrl.training.cluster import rendezvous_port
    from turnrl.training.workers import PolicyWorker, TrainerParams
    run.vllm_now = run.engine.prompt_logprobs(run.batch.sequences) if run.engine else None
    run.worker = None
    push_gaps: list[float] = []
    for stage in zero_stages:
        timer = Timer()
        name = f"zero{stage}"
        run.say(f"{name}: one update")
        try:
            # a whole Config only to build the worker (its constructor takes the params tree)
            cfg = Config.model_validate({"seed": run.seed,
                                         "model": {"dtype": run.dtype, **({"lora": run.lora} if run.lora else {})},
                                         "train": {"zero_stage": stage, "lr": run.lr, "grad_clip": 1.0}})
            run.worker = PolicyWorker(run.model_dir, TrainerParams.of(cfg), master_port=rendezvous_port())
            _one_update(run, name, stage == zero_stages[0], push_gaps, timer)
        except Exception as exc:
            traceback.print_exc()
            run.add(Result(name, "FAIL", f"{short_error(exc)}",
                           "DeepSpeed cannot train this model at this ZeRO stage", timer()))
            run.worker = None
            break
    if push_gaps:
        run.m["logp_gap_max"] = max(push_gaps)


def _one_update(run: CheckRun, name: str, first: bool, push_gaps: list[float], timer: Timer) -> None:
    b, worker = run.batch, run.worker
    before = worker.logprobs(b.tensors)
    if first and run.engine:
        _load_check(run, before)
    if run.engine and not first:
        # vLLM holds the last stage's update: push this worker's starting weights first
        run.engine.load_packed(list(worker.packed_buckets(run.bucket_mb)))
        run.vllm_now = run.engine.prompt_logprobs(b.sequences)
        push_gaps.append(_gap(run.vllm_now, before, b.lengths))
    stats = worker.train(dict(b.tensors), step=1)
    after = worker.logprobs(b.tensors)
    moved = float(((after - before).abs() * b.loss_mask).max())
    if run.engine:
        run.add(_push_check(run, name, after, moved, push_gaps, timer))
    else:
        run.add(Result(name, "OK" if moved > 0 else "FAIL",
                       f"update moved the logprobs by up to {moved:.2e} (no vLLM to push to)", seconds=timer()))
    run.m[f"{name}_loss"] = float(stats["sum"]["loss"][0])


def _load_check(run: CheckRun, before: torch.Tensor) -> None:
    """Before any update, vLLM's prompt and sampling logprobs against the trainer's."""
    b, m = run.batch, run.m
    load_gap = _gap(run.vllm_now, before, b.lengths, record=(m, "load_gap"))
    sample_gap = float(((before - b.engine_logp).abs() * b.loss_mask).max()) if run.vllm_samples else 0.0
    m["load_gap"], m["sample_gap"] = load_gap, sample_gap
    bound, mean_bound = run.bound, run.mean_bound
    ok = max(load_gap, sample_gap) <= bound and m["load_gap_mean"] <= mean_bound
    run.add(Result(
        "logprobs", "OK" if ok else "FAIL",
        f"before any update, vLLM against the trainer: prompt logprobs max gap {load_gap:.2e}, "
        f"sampling logprobs {sample_gap:.2e}; mean {m['load_gap_mean']:.1e} (bounds {bound:g}, mean "
        f"{mean_bound:g})",
        "" if ok else "vLLM computes a different model than transformers from the same folder: check "
        "the config (rope scaling, soft-capping, sliding window, norms) against vLLM's implementation"))


def _push_check(run: CheckRun, name: str, after: torch.Tensor, moved: float, push_gaps: list[float],
                timer: Timer) -> Result:
    """The update pushed into vLLM in packed buckets: vLLM's prompt logprobs equal the trainer's."""
    b, m, lora = run.batch, run.m, run.lora
    packed = list(run.worker.packed_buckets(run.bucket_mb))
    push_s = run.engine.load_packed(packed)
    vllm_new = run.engine.prompt_logprobs(b.sequences)
    gap = _gap(vllm_new, after, b.lengths, record=(m, f"{name}_gap"))
    stale = _gap(run.vllm_now, after, b.lengths)
    run.vllm_now = vllm_new
    push_gaps.append(gap)
    m[f"{name}_gap"], m[f"{name}_moved"] = gap, moved
    allowed = run.allowed()
    ok = gap <= allowed and m[f"{name}_gap_mean"] <= run.mean_allowed() and moved > allowed and stale > allowed
    what = f"a LoRA update (r={lora['r']}; merged weights pushed)" if lora else "update"
    detail = (f"{what} moved the trainer's logprobs by up to {moved:.2e}; after the push ({len(packed)} "
              f"buckets, {push_s:.2f} s) vLLM's prompt logprobs are within {gap:.2e} of the trainer's "
              f"(vLLM before the push: {stale:.2e} away)")
    if allowed > run.bound:
        detail += f"; judged against vLLM's gap on load ({m['load_gap']:.2e})"
    fix = ("" if ok else "the pushed weights do not reach vLLM's parameters (names or layouts vLLM "
           "renames, fuses or drops): see turnrl.rollout.engines.VLLMEngine.load_weights"
           if gap > allowed else "the update did not move the weights: raise lr")
    return Result(name, "OK" if ok else "FAIL", detail, fix, timer())


# --------------------------------------------------------------------------- save and reload
def save_check(run: CheckRun, fresh_engine: bool) -> None:
    """PolicyWorker.save, reloaded in transformers (and peft's adapters with LoRA) and in vLLM: a
    fresh engine on the folder (`fresh_engine`; it becomes run.fresh and run.engine is closed), or
    the running one's checkpoint loader."""
    timer = Timer()
    run.say("save: reload in transformers and vLLM")
    saved = run.work / "saved"
    try:
        run.add(_save_and_reload(run, saved, fresh_engine, timer))
    except EngineError as exc:
        run.add(Result("save", "FAIL", f"vLLM cannot load the saved folder: {exc.message}\n"
                       f"{indent(exc.log_tail)}", "see PolicyWorker.save", timer()))
    except Exception as exc:
        traceback.print_exc()
        run.add(Result("save", "FAIL", short_error(exc), "see PolicyWorker.save", timer()))


def _save_and_reload(run: CheckRun, saved: Path, fresh_engine: bool, timer: Timer) -> Result:
    run.worker.save(str(saved), run.model_dir)
    trained = run.worker.logprobs(run.batch.tensors)
    problems: list[str] = []
    logit_gap, hf_gap = _hf_reload(run, saved, trained, problems)
    adapter_gap = None
    if run.lora:
        b = run.batch
        adapter_gap = _adapter_gap(run.model_dir, saved, run.dtype, b.ids, b.attn, trained, b.lengths)
        run.m["saved_adapter_gap"] = adapter_gap
        if adapter_gap > run.bound:
            problems.append(f"peft's reload of the adapters over the starting model is off by "
                            f"{adapter_gap:.2e} in logprobs")
    saved_gap = _vllm_reload(run, saved, trained, fresh_engine, problems)
    how = "a fresh vLLM" if fresh_engine else "vLLM's checkpoint loader"
    detail = (f"saved; transformers reloads it (logits within {logit_gap:.2e}, logprobs {hf_gap:.2e})"
              + (f", {how} too (logprobs within {saved_gap:.2e})" if saved_gap is not None else "")
              + (f"; peft loads its adapter/ over the starting model (logprobs within {adapter_gap:.2e})"
                 if adapter_gap is not None else ""))
    return Result("save", "FAIL" if problems else "OK", "; ".join(problems) if problems else detail,
                  "the saved folder does not hold the trained weights under the names the "
                  "loaders expect: see PolicyWorker.save" if problems else "", timer())


def _hf_reload(run: CheckRun, saved: Path, trained: torch.Tensor, problems: list[str]) -> tuple[float, float]:
    """transformers' reload of the saved folder against the trainer: (logit gap, logprob gap)."""
    from transformers import AutoModelForCausalLM

    from turnrl.training.batching import token_logprobs
    b, worker = run.batch, run.worker
    with torch.no_grad():
        worker.engine.eval()
        trainer_logits = worker.engine(input_ids=b.ids, attention_mask=b.attn).logits.float()
        reloaded = AutoModelForCausalLM.from_pretrained(saved, dtype=getattr(torch, run.dtype)).eval()
        logits = reloaded(input_ids=b.ids, attention_mask=b.attn).logits.float()
    valid = b.attn.bool()
    logit_gap = float((logits - trainer_logits).abs()[valid].max())
    hf_gap = _gap([[0.0] + r.tolist()[1:] for r in token_logprobs(logits, b.ids)], trained, b.lengths)
    del reloaded
    run.m["saved_hf_logit_diff"], run.m["saved_hf_gap"] = logit_gap, hf_gap
    if hf_gap > run.bound:
        problems.append(f"transformers' reload is off by {hf_gap:.2e} in logprobs")
    if logit_gap > 1e3 * run.bound:
        problems.append(f"transformers' reload is off by {logit_gap:.2e} in logits")
    return logit_gap, hf_gap


def _vllm_reload(run: CheckRun, saved: Path, trained: torch.Tensor, fresh_engine: bool,
                 problems: list[str]) -> float | None:
    """vLLM on the saved folder against the trainer (None without vLLM)."""
    b, m = run.batch, run.m
    saved_gap = None
    if run.engine and fresh_engine:
        run.engine.close()
        run.engine = None
        run.fresh = EngineProcess("vllm", str(saved), run.work / "vllm_saved.log", **run.options)
        saved_gap = _gap(run.fresh.prompt_logprobs(b.sequences), trained, b.lengths, record=(m, "saved_vllm_gap"))
    elif run.engine:
        # over the pushed weights: a name or shape vLLM's loader cannot place fails, a wrong
        # value shows in the gap (a weight missing from the files shows in transformers' reload)
        run.engine.call("reload_from", str(saved))
        saved_gap = _gap(run.engine.prompt_logprobs(b.sequences), trained, b.lengths, record=(m, "saved_vllm_gap"))
    if saved_gap is not None:
        m["saved_vllm_gap"] = saved_gap
        m["logp_gap_max"] = max(m.get("logp_gap_max", 0.0), saved_gap)
        if saved_gap > run.allowed() or m["saved_vllm_gap_mean"] > run.mean_allowed():
            problems.append(f"vLLM on the saved folder is off by {saved_gap:.2e} (mean "
                            f"{m['saved_vllm_gap_mean']:.1e})")
    return saved_gap


def _adapter_gap(model_dir: str, saved: Path, dtype: str, ids: torch.Tensor, attn: torch.Tensor,
                 trained: torch.Tensor, lengths: list[int]) -> float:
    """max |logp| gap between the trainer and peft's model: the starting folder with the saved
    adapter/ folder loaded over it (as a user would load the adapters)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from turnrl.training.batching import token_logprobs
    from turnrl.training.lora import ADAPTER_DIR
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    model = PeftModel.from_pretrained(base, str(saved / ADAPTER_DIR)).eval()
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attn).logits.float()
    return _gap([[0.0] + r.tolist()[1:] for r in token_logprobs(logits, ids)], trained, lengths)


class _ProxyEngine:
    """An EngineProcess as the rollout loop's `Engine` (whole-batch generate)."""

    def __init__(self, process: EngineProcess):
        self.process = process

    def generate(self, prompts, **kwargs):
        return self.process.generate([list(p) for p in prompts], **kwargs)


def rollout_check(engine: EngineProcess, fmt, worker, bound: float, max_tokens: int, seed: int, m: dict) -> Result:
    from turnrl.rollout.multi_turn import Budgets, run_rollouts
    problems, gaps, trainer_gaps, turns = [], [], [], []
    for role in ("tool", "user"):
        torch.manual_seed(seed)
        trajs = run_rollouts(_ProxyEngine(engine), [{"prompt": p} for p in PROMPTS[:3]], lambda: TwoTurnEnv(role), fmt,
                             Budgets(2, max_tokens, 4 * max_tokens), n=2, seed=seed)
        turns += [t.num_turns for t in trajs]
        for t in trajs:
            policy = [i for i, k in enumerate(t.loss_mask) if k]
            texts = []
            for turn in range(t.num_turns):
                ids = [t.response_ids[i] for i in policy if t.turn_ids[i] == turn]
                texts.append(fmt.tokenizer.decode(ids, skip_special_tokens=False))
            if texts != t.turn_texts:
                problems.append(f"{role}: sampled tokens decode to other text than the turns")
        full = [t.prompt_ids + t.response_ids for t in trajs]
        scored = engine.prompt_logprobs(full)
        for t, lp in zip(trajs, scored):
            offset = len(t.prompt_ids)
            for i, (mask, sampled) in enumerate(zip(t.loss_mask, t.engine_logprobs)):
                if mask:
                    gaps.append(abs(sampled - lp[offset + i]))
        if worker is not None:
            ids, attn = _pad(full)
            trained = worker.logprobs({"input_ids": ids, "attention_mask": attn})
            trainer_gaps.append(_gaps(scored, trained, [len(f) for f in full]))
    sample_gap = max(gaps) if gaps else 0.0
    m["rollout_sample_gap"] = sample_gap
    if trainer_gaps:
        every = torch.cat(trainer_gaps)
        trainer_gaps = [float(every.max())]
        m["rollout_trainer_gap"] = trainer_gaps[0]
        m["rollout_trainer_gap_mean"] = float(every.mean())
        m["rollout_trainer_gap_p99"] = float(torch.quantile(every, 0.99))
        m["rollout_tokens"] = int(every.numel())
    m["rollout_turns"] = f"{sum(1 for n in turns if n == 2)}/{len(turns)} trajectories reached turn 2"
    # against the trainer only where vLLM computes the model as transformers does (the logprobs
    # check): otherwise the kernels' difference grows with the context and says nothing new here
    dtype = m.get("dtype", "float32")
    judge_trainer = m.get("load_gap", 0.0) <= GAP_BOUND[dtype]
    bad = sample_gap > bound or (judge_trainer and trainer_gaps and (
        max(trainer_gaps) > bound or m["rollout_trainer_gap_mean"] > MEAN_BOUND[dtype]))
    if bad:
        problems.append(f"logprobs over multi-turn trajectories: sampling vs prompt {sample_gap:.2e}, "
                        f"vLLM vs trainer {max(trainer_gaps or [0.0]):.2e}")
    if problems:
        return Result("rollout", "FAIL", "; ".join(problems), "see turnrl.rollout.multi_turn.run_rollouts")
    return Result("rollout", "OK", f"{len(turns)} two-turn rollouts on vLLM ({m['rollout_turns']}); sampling "
                                   f"logprobs within {sample_gap:.2e} of vLLM's prompt logprobs, the trainer's within "
                                   f"{max(trainer_gaps or [0.0]):.2e}")

