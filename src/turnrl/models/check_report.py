"""What the model checks report (`Result`, `Report`), the bounds they judge logprob gaps against,
and the state one `check_model_folder` run shares between its steps (`CheckRun`)."""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

#: Largest |logp(vLLM) - logp(trainer)| over the tokens of the checked sequences that passes, and
#: (bf16) the largest mean over them. Reasons in GAP_BOUND_REASON; the bf16 figures come from
#: benchmarks/compat.py --dtype bfloat16 (nine families, README).
GAP_BOUND = {"float32": 1e-4, "bfloat16": 0.5, "float16": 0.1}
MEAN_BOUND = {"float32": 1e-4, "bfloat16": 0.02, "float16": 0.005}
GAP_BOUND_REASON = {
    "float32": "the same fp32 arithmetic in a different order (fused projections, other kernels) leaves ~1e-6 to "
               "1e-5; the issue's bound",
    "bfloat16": "bf16 keeps 8 bits of mantissa: a logit between 8 and 16 is stored to 0.0625, between 16 and 32 to "
                "0.125, so two stacks that round at different places (vLLM fuses qkv and gate/up, accumulates in "
                "its own order) routinely differ by ~0.1 on a token. Measured on the miniatures: mean 0.004-0.013, "
                "p99 0.035-0.10, max 0.05-0.32 nats over 1-2k tokens; bound: max 0.5, mean 0.02 (1.5x the "
                "largest seen), while the push bugs the matrix found left vLLM 2.6-7.7 nats away",
    "float16": "fp16 keeps 11 bits: about 8x tighter than bf16 (not measured here)",
}

#: What the engines generate from (six prompts, repeated up to `samples`), and the system prompt.
PROMPTS = ["Ada has 12 apples and buys 30 more. How many now?", "What is 6 times 7?",
           "Bo has 5 pears and buys 9 more. How many now?", "Name a colour.",
           "Cy has 41 plums and buys 2 more. How many now?", "Count to three."]
SYSTEM = "You are a careful assistant. Use the tool when it helps."


@dataclass
class Result:
    name: str
    status: str               # OK | WARN | FAIL | SKIP
    detail: str
    fix: str = ""
    seconds: float = 0.0


@dataclass
class Report:
    model_dir: str
    dtype: str
    checks: list[Result] = field(default_factory=list)
    metrics: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return all(c.status in ("OK", "WARN", "SKIP") for c in self.checks)

    def status(self, name: str) -> str | None:
        return next((c.status for c in self.checks if c.name == name), None)

    def failed(self) -> list[Result]:
        return [c for c in self.checks if c.status == "FAIL"]

    def to_dict(self) -> dict:
        return {"model_dir": self.model_dir, "dtype": self.dtype, "ok": self.ok, "metrics": self.metrics,
                "checks": [asdict(c) for c in self.checks]}


@dataclass
class CheckRun:
    """One `check_model_folder` run, as its steps share it: the settings, the report they add to, and what
    earlier steps left for later ones (the engines, the trainer, the sampled batch)."""
    model_dir: str
    dtype: str
    work: Path
    report: Report
    seed: int
    max_tokens: int
    bucket_mb: int
    lr: float
    lora: dict | None
    say: Callable[[str], None]
    options: dict = field(default_factory=dict)   # the vLLM engine's make_engine options
    engine: Any = None          # EngineProcess: vLLM on model_dir
    fresh: Any = None           # EngineProcess: a fresh vLLM on the saved folder
    worker: Any = None          # PolicyWorker: the trainer after the last update
    batch: Any = None           # trainer_checks.Batch: the sampled sequences everything is scored on
    vllm_samples: list | None = None
    vllm_now: list | None = None   # vLLM's current prompt logprobs of the batch

    @property
    def m(self) -> dict[str, Any]:
        return self.report.metrics

    @property
    def bound(self) -> float:
        return GAP_BOUND[self.dtype]

    @property
    def mean_bound(self) -> float:
        return MEAN_BOUND[self.dtype]

    def add(self, result: Result) -> None:
        self.report.checks.append(result)

    def allowed(self) -> float:
        """What a push, a reload or a rollout may be off by: the bound, or, when vLLM already
        computes the model differently on load (reported once, by the logprobs check), twice
        that gap: these checks then judge the weights' way into vLLM, not vLLM's kernels."""
        return max(self.bound, 2 * self.m.get("load_gap", 0.0))

    def mean_allowed(self) -> float:
        return max(self.mean_bound, 2 * self.m.get("load_gap_mean", 0.0))


class Timer:
    def __init__(self):
        self.start = time.perf_counter()

    def __call__(self) -> float:
        return round(time.perf_counter() - self.start, 1)


def short_error(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) < 600 else text[:600] + " ..."


def indent(text: str) -> str:
    return "\n".join("      | " + line for line in text.splitlines()[-12:])
