"""The trainer's forward passes in micro-batches (train.micro_batch_rows) against whole batches.

    python benchmarks/micro_batch.py                     # 1 and 2 threads, micro_batch_rows 0 (whole), 16, 32
    python benchmarks/micro_batch.py --rows 0 8 16 32 64 --threads 1

One trainer rank (`PolicyWorker`: real DeepSpeed, ZeRO 2, on CPU) of the embedded default's
architecture (params.yaml's model.tiny, random weights: the speed does not depend on them) scores
and trains on one batch shaped like the async benchmark's (128 trajectories, right-padded, lengths
drawn uniformly from 60-220 tokens): the reference logprobs of the whole batch (the no-grad pass
every step makes; async mode makes a second, the proximal policy's) and one update (one mini-batch,
as params.yaml; four, as the async benchmark's mb4 modes). Per setting, the best of `--repeats`
timings. The last line printed is one JSON object {"rows": {...}} with the seconds per pass.
"""
from __future__ import annotations

import argparse
import json
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tiny_model(folder: Path, vocab_size: int = 371) -> Path:
    """The embedded default's tiny architecture (its vocabulary's size) with random weights, saved
    as a Hugging Face folder."""
    from transformers import Qwen2ForCausalLM

    from turnrl.config import TinyModel
    from turnrl.models.tiny import tiny_config
    torch.manual_seed(0)
    Qwen2ForCausalLM(tiny_config(TinyModel(), vocab_size, pad_token_id=0)).save_pretrained(folder)
    return folder


def batch(rows: int, shortest: int, longest: int, vocab_size: int = 371) -> dict[str, torch.Tensor]:
    """A right-padded batch [rows, longest]: response tokens (the second half of each row) in the loss."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(shortest, longest + 1, (rows,), generator=g)
    positions = torch.arange(longest)
    attention = (positions < lengths[:, None]).long()
    loss_mask = ((positions >= lengths[:, None] // 2) & attention.bool()).float()
    return {"input_ids": torch.randint(3, vocab_size, (rows, longest), generator=g) * attention,
            "attention_mask": attention, "loss_mask": loss_mask,
            "advantages": torch.randn(rows, 1, generator=g).expand(rows, longest) * loss_mask,
            "turn_ids": torch.zeros(rows, longest, dtype=torch.long),
            "engine_logprobs": torch.full((rows, longest), -5.0) * loss_mask}


def measure(model: Path, data: dict[str, torch.Tensor], micro_rows: int, threads: int, mini_batches: int,
            repeats: int) -> dict[str, float]:
    from turnrl.config import Config
    from turnrl.training.workers import PolicyWorker, TrainerParams
    torch.set_num_threads(threads)
    cfg = Config.model_validate({"train": {"micro_batch_rows": micro_rows},
                                 "algorithm": {"mini_batches": mini_batches}})
    worker = PolicyWorker(str(model), TrainerParams.of(cfg), master_port=_port())
    out = {}
    calls = {f"update_mb{mini_batches}_s": lambda: worker.train({**data}, 1)}
    if mini_batches == 1:   # the same scoring pass either way
        calls = {"reference_logprobs_s": lambda: worker.reference_logprobs(data), **calls}
    for name, call in calls.items():
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            call()
            best = min(best, time.perf_counter() - start)
        out[name] = round(best, 3)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[0, 16, 32], help="train.micro_batch_rows values (0: whole)")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--batch-rows", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args(argv)
    data = batch(args.batch_rows, 60, 220)
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = tiny_model(Path(tmp) / "tiny")
        for threads in args.threads:
            for rows in args.rows:
                timing = {}
                for mini_batches in (1, 4):
                    timing.update(measure(model, data, rows, threads, mini_batches, args.repeats))
                results[f"threads{threads}_rows{rows}"] = timing
                print(f"threads {threads}, micro_batch_rows {rows}: {timing}", flush=True)
    print(json.dumps({"rows": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
