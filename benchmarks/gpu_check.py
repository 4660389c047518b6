"""The policy trainer's math on a GPU, checked against a CPU float32 reference.

What runs is the trainer's own code: `token_logprobs` and `entropy` from
turnrl.training.workers (what PolicyWorker computes for its logprobs and its update) and two
registered policy losses, called as the worker calls them (`compute_policy_loss`): `clipped`
(PPO's clipped surrogate + kl_coef * KL, `policy_loss_with_kl`) and `decoupled` (the asynchronous
mode's correction: clipped against the recomputed pi_prox, weighted by min(pi_prox / mu, 2)).
Around them, one update step as PolicyWorker.train takes it on one rank: a train-mode forward,
the loss, backward, the global grad norm clipped to `grad_clip`, AdamW with the worker's betas.
DeepSpeed itself is not run (the GPU image has none); in bf16 the step keeps fp32 master weights
and fp32 optimizer state, as DeepSpeed's bf16 mode does.

Two models: the embedded tiny model (built by the prepare_model stage's own `build_tiny` from
params.yaml, loaded from its folder as PolicyWorker loads a model) and a ~190M-parameter Qwen2
built from a transformers config with seeded random weights (no download), so that bf16 speed
means something. Each gets a fixed, seeded batch of multi-turn-like rows: a prompt, then
assistant turns (loss mask 1, one advantage per turn) between observations (mask 0), then padding.

    PYTHONPATH=src python benchmarks/gpu_check.py --build-tiny   # the tiny model's folder (minutes)
    PYTHONPATH=src python benchmarks/gpu_check.py --device cpu --dtype float32
        # the reference: benchmarks/results/gpu-check-reference-cpu.json and .pt (batch, logprobs)
    PYTHONPATH=src python benchmarks/gpu_check.py --device cuda --dtype bfloat16,float32
        # recompute on the GPU, compare with the reference, time the step

The GPU run writes benchmarks/results/gpu-check-<card>-<date>.json (or under --out). Every run
prints one JSON object as its last line.
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import re
import statistics
import sys
import time
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import turnrl  # noqa: E402,F401  first: it sets OMP_WAIT_POLICY before torch loads libgomp (10x on busy cores)
import torch  # noqa: E402
from turnrl.algos import masked_mean   # noqa: E402
from turnrl.algos.registry import compute_policy_loss, resolve_loss   # noqa: E402
from turnrl.config.sections import AlgorithmCfg   # noqa: E402
from turnrl.training.workers import entropy, token_logprobs  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
REFERENCE_JSON = RESULTS / "gpu-check-reference-cpu.json"
REFERENCE_PT = RESULTS / "gpu-check-reference-cpu.pt"
TINY_DIR = ROOT / ".cache" / "gpu-check" / "tiny"

# The update's settings: params.yaml's clip range, loss aggregation, betas, grad clip and
# weight decay; a small lr (a 190M model) and kl_coef > 0 so the KL term is exercised too.
SETTINGS = {"lr": 1e-5, "betas": (0.9, 0.99), "weight_decay": 0.0, "grad_clip": 1.0,
            "clip_low": 0.2, "clip_high": 0.28, "kl_coef": 0.05, "kl_kind": "k3", "agg": "token-mean"}

# The policy losses checked, by their registered names (`algorithm.policy_loss`), as the worker
# calls them (`compute_policy_loss`): `clipped`, PPO's (old_logp: the rollout's logprobs); and
# `decoupled`, the asynchronous mode's correction (old_logp: pi_prox, the trainer's own scores
# recomputed before the update; engine_logprobs: mu, the sampler's; weight min(pi_prox / mu, 2)).
LOSSES = ("clipped", "decoupled")


def algorithm(loss: str) -> AlgorithmCfg:
    return AlgorithmCfg(policy_loss=loss, clip_low=SETTINGS["clip_low"], clip_high=SETTINGS["clip_high"],
                        kl_coef=SETTINGS["kl_coef"], kl_estimator=SETTINGS["kl_kind"], loss_agg=SETTINGS["agg"])


def run_key(model: str, loss: str) -> str:
    """Where a run lives in the reference files: the model's name for `clipped` (as before
    `decoupled` was checked), `model/loss` otherwise."""
    return model if loss == "clipped" else f"{model}/{loss}"

QWEN2_190M = {"hidden_size": 1024, "num_hidden_layers": 8, "num_attention_heads": 16,
              "num_key_value_heads": 4, "intermediate_size": 4096, "vocab_size": 32768,
              "max_position_embeddings": 4096, "tie_word_embeddings": False, "rope_theta": 10000.0}

MODELS = {
    "tiny": {"rows": 8, "length": 256, "seed": 11},
    # 4 x 512 keeps the CPU reference within minutes on 2 cores; the GPU also times 16 x 1024.
    "qwen2-190m": {"rows": 4, "length": 512, "seed": 12, "config": QWEN2_190M, "throughput": (16, 1024)},
}


# --------------------------------------------------------------------------- models
def seeded_init(model: torch.nn.Module, seed: int) -> None:
    """Weights from a CPU generator seeded per parameter name: the same on any machine and
    torch version, unlike transformers' own init (which moves between versions)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
                continue
            gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            p.copy_(torch.randn(p.shape, generator=gen) * 0.02)


def build_model(name: str) -> torch.nn.Module:
    """The named model, float32 on the CPU."""
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

    if name == "tiny":
        if not (TINY_DIR / "config.json").exists():
            raise SystemExit(f"{TINY_DIR}: no tiny model folder; build it with "
                             "`python benchmarks/gpu_check.py --build-tiny`")
        return AutoModelForCausalLM.from_pretrained(TINY_DIR).float()
    model = Qwen2ForCausalLM(Qwen2Config(**MODELS[name]["config"]))
    seeded_init(model, MODELS[name]["seed"])
    return model.float()


def fingerprint(model: torch.nn.Module) -> dict:
    """Sum and sum of squares of every weight (float64): equal weights on both sides."""
    with torch.no_grad():
        total = sum(p.detach().double().sum().item() for p in model.parameters())
        squares = sum(p.detach().double().pow(2).sum().item() for p in model.parameters())
    return {"parameters": sum(p.numel() for p in model.parameters()), "sum": total, "sum_sq": squares}


# A shorter warm start than params.yaml's 1200 + 40 steps, so that the build fits a busy 2-core box.
TINY_OVERRIDES = ["model.warmstart.skill_steps=200", "model.warmstart.prior_steps=20"]


def build_tiny(overrides: list[str]) -> dict:
    """The embedded model as the prepare_model stage builds it from params.yaml (+ overrides)."""
    from turnrl.config import load_config
    from turnrl.pipeline.prepare_model import build_tiny as stage_build

    return stage_build(load_config(ROOT / "params.yaml", overrides), TINY_DIR)


# --------------------------------------------------------------------------- batch
def make_batch(vocab: int, rows: int, length: int, seed: int) -> dict[str, torch.Tensor]:
    """Right-padded rows shaped like multi-turn rollouts: prompt (mask 0), then assistant
    turns (mask 1, one advantage per turn) alternating with observations (mask 0)."""
    gen = torch.Generator().manual_seed(seed)

    def draw(low: int, high: int) -> int:
        return int(torch.randint(low, high + 1, (1,), generator=gen))

    ids = torch.zeros(rows, length, dtype=torch.long)
    attn = torch.zeros(rows, length, dtype=torch.long)
    mask = torch.zeros(rows, length)
    adv = torch.zeros(rows, length)
    for r in range(rows):
        end = draw(int(0.6 * length), length)
        ids[r, :end] = torch.randint(3, vocab, (end,), generator=gen)
        attn[r, :end] = 1
        pos, assistant = draw(length // 8, length // 4), True
        while pos < end:
            span = draw(16, 64) if assistant else draw(8, 48)
            if assistant:
                mask[r, pos:pos + span] = 1.0
                adv[r, pos:pos + span] = float(torch.randn((), generator=gen))
            pos, assistant = pos + span, not assistant
        mask[r, end:] = 0.0
        adv[r, end:] = 0.0
    return {"input_ids": ids, "attention_mask": attn, "loss_mask": mask, "advantages": adv}


def rollout_logprobs(logp: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(old, ref): the reference run's logprobs moved by seeded noise, so that the ratio is
    not 1 (some tokens clip) and the KL to the reference is not 0."""
    gen = torch.Generator().manual_seed(seed + 7)
    old = logp + 0.2 * torch.randn(logp.shape, generator=gen)
    ref = logp + 0.3 * torch.randn(logp.shape, generator=gen)
    return old, ref


# --------------------------------------------------------------------------- the update
class Update:
    """One optimizer step as the worker's engine takes it: global grad norm, clip, AdamW.
    Low-precision weights get fp32 master copies that the optimizer updates."""

    def __init__(self, model: torch.nn.Module):
        self.params = [p for p in model.parameters() if p.requires_grad]
        low = self.params[0].dtype != torch.float32
        self.master = [p.detach().float().clone() for p in self.params] if low else None
        self.opt = torch.optim.AdamW(self.master or self.params, lr=SETTINGS["lr"],
                                     betas=SETTINGS["betas"], weight_decay=SETTINGS["weight_decay"])

    def step(self) -> float:
        if self.master is not None:
            for m, p in zip(self.master, self.params):
                m.grad, p.grad = p.grad.float(), None
        norm = torch.nn.utils.clip_grad_norm_(self.master or self.params, SETTINGS["grad_clip"])
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if self.master is not None:
            with torch.no_grad():
                for m, p in zip(self.master, self.params):
                    p.copy_(m)
        return float(norm)


@torch.no_grad()
def score(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    """PolicyWorker._logprobs: eval mode, no grad, token-aligned logprobs [B, L] (fp32)."""
    model.eval()
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return token_logprobs(logits, batch["input_ids"])


def train_step(model: torch.nn.Module, update: Update, batch: dict, old: torch.Tensor,
               ref: torch.Tensor, loss_name: str = "clipped", prox: torch.Tensor | None = None) -> dict:
    """PolicyWorker.train's step on one rank, one mini-batch: forward, logprobs, the registered
    loss `loss_name`, backward, step. `old` is the sampler's logprobs; with `prox` (the trainer's
    recomputed scores, asynchronous training) `old` is mu and `prox` is old_logp."""
    model.train()
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    logp = token_logprobs(logits, batch["input_ids"])
    mb = {**batch, "logp": logp, "old_logp": old if prox is None else prox, "ref_logp": ref,
          "mask": batch["loss_mask"], "engine_logprobs": old}
    loss, info = compute_policy_loss(resolve_loss(loss_name), mb, algorithm(loss_name))
    ent = masked_mean(entropy(logits.detach()), batch["loss_mask"])
    loss.backward()
    grad_norm = update.step()
    return {"loss": loss.item(), "grad_norm": grad_norm, "entropy": ent.item(),
            **{k: float(v) for k, v in info.items()}}


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn, device: str, repeats: int) -> list[float]:
    """Milliseconds of each of `repeats` calls, the device synchronized around each."""
    out = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        out.append(1000 * (time.perf_counter() - start))
    return out


# --------------------------------------------------------------------------- one model
def run_model(name: str, device: str, dtype: str, ref: dict | None, repeats: int,
              loss: str = "clipped") -> tuple[dict, dict]:
    """Score, one update with the policy loss `loss`, score again (each timed), then `repeats`
    more timed updates and scorings. Returns (numbers, tensors)."""
    spec = MODELS[name]
    model = build_model(name)
    prints = fingerprint(model)
    model = model.to(device=device, dtype=getattr(torch, dtype))
    batch = ref["batch"] if ref else make_batch(model.config.vocab_size, spec["rows"], spec["length"], spec["seed"])
    batch = {k: v.to(device) for k, v in batch.items()}
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    held: dict = {}
    score_ms = timed(lambda: held.update(logp=score(model, batch)), device, 1)
    logp = held["logp"]
    old, refl = (ref["old"], ref["ref"]) if ref else rollout_logprobs(logp.cpu(), spec["seed"])
    old, refl = old.to(device), refl.to(device)
    # decoupled: pi_prox is this run's own score before the update (as the trainer recomputes it)
    prox = logp if loss == "decoupled" else None
    update = Update(model)
    step_ms = timed(lambda: held.update(first=train_step(model, update, batch, old, refl, loss, prox)), device, 1)
    after = score(model, batch)
    step_ms += timed(lambda: train_step(model, update, batch, old, refl, loss, prox), device, repeats)
    score_ms += timed(lambda: score(model, batch), device, repeats)
    tokens = int(batch["attention_mask"].sum())
    # The first call of each pays one-off costs (allocator, kernel choice): with repeats, leave it out.
    step_ms, score_ms = (step_ms[1:], score_ms[1:]) if repeats else (step_ms, score_ms)
    numbers = {
        "model": name, "loss": loss, "device": device, "dtype": dtype, "weights": prints,
        "attn_implementation": getattr(model.config, "_attn_implementation", None),
        "batch": {"rows": spec["rows"], "length": spec["length"], "tokens": tokens,
                  "policy_tokens": int(batch["loss_mask"].sum())},
        "logp_masked_mean": masked_mean(logp, batch["loss_mask"]).item(),
        "first_step": held["first"],
        "step_ms": summary(step_ms), "score_ms": summary(score_ms),
        "step_tokens_per_s": tokens / (statistics.median(step_ms) / 1000),
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None,
    }
    if device == "cuda" and "throughput" in spec and loss == "clipped":
        numbers["throughput"] = throughput(model, update, spec, repeats)
    tensors = {"batch": {k: v.cpu() for k, v in batch.items()}, "old": old.cpu(), "ref": refl.cpu(),
               "logp": logp.cpu(), "logp_after_step": after.cpu()}
    del model, update
    if device == "cuda":
        torch.cuda.empty_cache()
    return numbers, tensors


def throughput(model: torch.nn.Module, update: Update, spec: dict, repeats: int) -> dict:
    """Timing only (nothing to compare): the update step on a bigger batch of the same shape."""
    rows, length = spec["throughput"]
    batch = {k: v.cuda() for k, v in make_batch(model.config.vocab_size, rows, length, spec["seed"] + 1).items()}
    old = ref = score(model, batch)
    torch.cuda.reset_peak_memory_stats()
    ms = timed(lambda: train_step(model, update, batch, old, ref), "cuda", repeats + 1)[1:]
    tokens = int(batch["attention_mask"].sum())
    return {"rows": rows, "length": length, "tokens": tokens, "step_ms": summary(ms),
            "step_tokens_per_s": tokens / (statistics.median(ms) / 1000),
            "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30}


def summary(ms: list[float]) -> dict:
    return {"median": statistics.median(ms), "min": min(ms), "max": max(ms), "n": len(ms)}


def compare(numbers: dict, tensors: dict, ref_numbers: dict, ref_tensors: dict) -> dict:
    """This run against the CPU float32 reference, over the policy (loss-mask) tokens."""
    mask = ref_tensors["batch"]["loss_mask"].bool()

    def gap(key: str) -> dict:
        diff = (tensors[key] - ref_tensors[key]).abs()[mask]
        return {"max": diff.max().item(), "mean": diff.mean().item(),
                "p99": diff.kthvalue(max(1, int(0.99 * diff.numel()))).values.item()}

    def rel(key: str) -> float:
        a, b = numbers["first_step"][key], ref_numbers["first_step"][key]
        return abs(a - b) / max(abs(b), 1e-12)

    w, rw = numbers["weights"], ref_numbers["weights"]
    same = w["parameters"] == rw["parameters"] and all(
        abs(w[k] - rw[k]) <= 1e-9 * max(1.0, abs(rw[k])) for k in ("sum", "sum_sq"))
    extra = {f"{k}_rel_diff": rel(k) for k in ("is_weight_mean", "clip_fraction") if k in ref_numbers["first_step"]}
    return {"weights_match_reference": same, "logp_abs_diff": gap("logp"), **extra,
            "logp_after_step_abs_diff": gap("logp_after_step"),
            "loss_rel_diff": rel("loss"), "grad_norm_rel_diff": rel("grad_norm"),
            "entropy_rel_diff": rel("entropy"),
            "cpu_step_ms": ref_numbers["step_ms"]["median"],
            "speedup_vs_cpu_step": ref_numbers["step_ms"]["median"] / numbers["step_ms"]["median"]}


# --------------------------------------------------------------------------- main
def environment(device: str) -> dict:
    import transformers
    env = {"torch": torch.__version__, "transformers": transformers.__version__,
           "python": platform.python_version(), "cpu_threads": torch.get_num_threads()}
    if device == "cuda":
        env.update({"gpu": torch.cuda.get_device_name(0), "cuda": torch.version.cuda,
                    "float32_matmul_precision": torch.get_float32_matmul_precision()})
    return env


def card_slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def reference_run(models: list[str], losses: list[str], repeats: int) -> dict:
    """CPU float32 runs of `models` x `losses`, merged into the reference files (other entries stay)."""
    old = json.loads(REFERENCE_JSON.read_text())["runs"] if REFERENCE_JSON.exists() else []
    tensors = torch.load(REFERENCE_PT, weights_only=False) if REFERENCE_PT.exists() else {}
    runs = {run_key(r["model"], r.get("loss", "clipped")): r for r in old}
    for name in models:
        for loss in losses:
            key = run_key(name, loss)
            # a later loss reuses the first's batch and noisy logprobs: both see identical inputs
            base = tensors.get(name) if loss != "clipped" else None
            runs[key], tensors[key] = run_model(name, "cpu", "float32", base, repeats, loss)
            print(json.dumps({"done": key, "step_ms": runs[key]["step_ms"]["median"]}), file=sys.stderr)
    RESULTS.mkdir(parents=True, exist_ok=True)
    torch.save(tensors, REFERENCE_PT)
    order = [run_key(m, loss) for m in MODELS for loss in LOSSES]
    result = {"what": "cpu float32 reference", "settings": SETTINGS, "environment": environment("cpu"),
              "date": datetime.date.today().isoformat(), "runs": [runs[k] for k in order if k in runs]}
    REFERENCE_JSON.write_text(json.dumps(result, indent=2) + "\n")
    return result


def device_run(models: list[str], dtypes: list[str], losses: list[str], repeats: int, out: Path | None) -> dict:
    if not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device; run on a GPU machine or use --device cpu")
    if not (REFERENCE_JSON.exists() and REFERENCE_PT.exists()):
        raise SystemExit(f"{REFERENCE_JSON}: no CPU reference; run `--device cpu --dtype float32` first")
    ref_json = {run_key(r["model"], r.get("loss", "clipped")): r for r in json.loads(REFERENCE_JSON.read_text())["runs"]}
    ref_pt = torch.load(REFERENCE_PT, weights_only=False)
    runs = []
    for name in models:
        for loss in losses:
            key = run_key(name, loss)
            if key not in ref_json:
                raise SystemExit(f"{REFERENCE_JSON}: no reference for {key!r}; rerun the CPU reference with it")
            for dtype in dtypes:
                numbers, tensors = run_model(name, "cuda", dtype, ref_pt[key], repeats, loss)
                numbers["vs_cpu_float32"] = compare(numbers, tensors, ref_json[key], ref_pt[key])
                runs.append(numbers)
                print(json.dumps({"done": f"{key}/{dtype}", **numbers["vs_cpu_float32"]}), file=sys.stderr)
    env = environment("cuda")
    date = datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    result = {"what": "gpu vs cpu float32 reference", "settings": SETTINGS, "environment": env,
              "date": date, "runs": runs}
    path = (out or RESULTS) / f"gpu-check-{card_slug(env['gpu'])}-{date}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    return result


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build-tiny", nargs="*", default=None, metavar="KEY=VALUE",
                    help=f"build the tiny model into {TINY_DIR} and exit; params overrides "
                         f"(default {' '.join(TINY_OVERRIDES)})")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--dtype", default="float32", help="comma-separated: float32, bfloat16 (cpu: float32 only)")
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {list(MODELS)}")
    ap.add_argument("--losses", default=",".join(LOSSES), help=f"comma-separated policy losses, of {list(LOSSES)}")
    ap.add_argument("--repeats", type=int, default=None, help="timed steps after the first (cpu 0, cuda 10)")
    ap.add_argument("--out", type=Path, default=None, help="folder for the GPU run's JSON (default benchmarks/results)")
    args = ap.parse_args(argv)
    if args.build_tiny is not None:
        print(json.dumps(build_tiny(args.build_tiny or TINY_OVERRIDES)))
        return
    models, dtypes, losses = args.models.split(","), args.dtype.split(","), args.losses.split(",")
    for loss in losses:
        if loss not in LOSSES:
            raise SystemExit(f"--losses: unknown loss {loss!r}; choose from {list(LOSSES)}")
    for m in models:
        if m not in MODELS:
            raise SystemExit(f"--models: unknown model {m!r}; choose from {list(MODELS)}")
    for d in dtypes:
        if d not in ("float32", "bfloat16"):
            raise SystemExit(f"--dtype: unknown dtype {d!r}; choose float32 or bfloat16")
    if args.device == "cpu":
        if dtypes != ["float32"]:
            raise SystemExit("--device cpu: the reference is float32 only; pass --dtype float32")
        result = reference_run(models, losses, args.repeats or 0)
    else:
        result = device_run(models, dtypes, losses, args.repeats or 10, args.out)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
