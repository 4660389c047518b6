"""The compatibility matrix of real model families (issue 21).

For each family (turnrl.models.miniatures.FAMILIES: qwen2 with tied embeddings, qwen3, llama 3, mistral,
gemma2, gemma3, phi3, qwen3_moe, mixtral) build its miniature (the family's transformers config
and model classes, a tokenizer with its special tokens, a chat template in its documented
format, a short warm start) and run turnrl.models.check on the folder, as `model.path` of a
user's checkpoint: template and end-of-turn checks, a token-exact two-turn trajectory, generation
on vLLM and transformers, vLLM's logprobs against the trainer's before and after a DeepSpeed
ZeRO-2 and a ZeRO-3 update pushed in training's packed buckets, save and reload in transformers
and a fresh vLLM, two-turn rollouts on vLLM. Each family runs in a fresh process.

    python benchmarks/compat.py                        # every family, fp32 (~1 min each on 2 cores)
    python benchmarks/compat.py --dtype bfloat16       # the same in bf16 (model.dtype: bfloat16)
    python benchmarks/compat.py --families qwen2,gemma2 --work-dir /tmp/compat

Prints a table and, as its last line, one JSON object:
{"dtype": ..., "gap_bound": ..., "families": {"qwen2": {"ok": true, "tied_embeddings": true,
"moe": false, "logp_gap_max": ..., ...}, ...}}; the same goes to
benchmarks/results/compat-<dtype>-<date>.json.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_family(family: str, dtype: str, work: Path) -> dict:
    """Build the family's miniature and check it (in this process)."""
    from turnrl.models import miniatures
    from turnrl.models import check as modelcheck
    start = time.perf_counter()
    folder = miniatures.build(family, work / family / "model")
    built = time.perf_counter() - start
    report = modelcheck.check_model_folder(folder, dtype=dtype, work_dir=work / family / f"check-{dtype}")
    m = report.metrics
    fam = miniatures.FAMILIES[family]
    return {
        "ok": report.ok,
        "tied_embeddings": fam.tied,
        "moe": fam.moe,
        "logp_gap_max": m.get("logp_gap_max"),
        "load_gap": m.get("load_gap"),
        "sample_gap": m.get("sample_gap"),
        "zero2_gap": m.get("zero2_gap"),
        "zero3_gap": m.get("zero3_gap"),
        "saved_vllm_gap": m.get("saved_vllm_gap"),
        "saved_hf_gap": m.get("saved_hf_gap"),
        "rollout_trainer_gap": m.get("rollout_trainer_gap"),
        "gap_stats": {k: v for k, v in m.items() if ("_gap" in k or k.endswith("_diff")) and v is not None},
        "rollout_tokens": m.get("rollout_tokens"),
        "end_of_turn": m.get("end_of_turn"),
        "turns_ended_by_model": m.get("turns_ended_by_model"),
        "checks": {c.name: c.status for c in report.checks},
        "failed": {c.name: c.detail for c in report.checks if c.status == "FAIL"},
        "warnings": {c.name: c.detail for c in report.checks if c.status == "WARN"},
        "notes": fam.notes,
        "seconds": round(time.perf_counter() - start, 1),
        "build_seconds": round(built, 1),
    }


def _fmt(value) -> str:
    return "-" if value is None else f"{value:.1e}"


def main(argv: list[str] | None = None) -> int:
    from turnrl.models.miniatures import FAMILIES
    from turnrl.models.check import GAP_BOUND
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", default="float32", choices=sorted(GAP_BOUND))
    parser.add_argument("--families", default=",".join(FAMILIES), help="comma-separated (default: all)")
    parser.add_argument("--work-dir", default="", help="where the miniatures and logs go (default: a temp dir)")
    parser.add_argument("--one", default="", help=argparse.SUPPRESS)          # internal: one family, in this process
    parser.add_argument("--result", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="turnrl-compat-"))
    work.mkdir(parents=True, exist_ok=True)
    if args.one:
        Path(args.result).write_text(json.dumps(run_family(args.one, args.dtype, work)))
        return 0

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    families = [f for f in args.families.split(",") if f]
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        parser.error(f"unknown families {unknown}; known: {', '.join(FAMILIES)}")
    results: dict[str, dict] = {}
    for family in families:
        out = work / f"{family}-{args.dtype}.json"
        log = work / f"{family}-{args.dtype}.log"
        start = time.perf_counter()
        with open(log, "w") as handle:
            proc = subprocess.run([sys.executable, __file__, "--one", family, "--dtype", args.dtype,
                                   "--work-dir", str(work), "--result", str(out)],
                                  stdout=handle, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        if proc.returncode == 0 and out.exists():
            results[family] = json.loads(out.read_text())
        else:
            tail = log.read_text(errors="replace").splitlines()[-15:]
            results[family] = {"ok": False, "tied_embeddings": FAMILIES[family].tied, "moe": FAMILIES[family].moe,
                               "logp_gap_max": None, "crashed": proc.returncode, "log_tail": tail}
        r = results[family]
        print(f"{family:<10} ok={r['ok']!s:<5} gap={_fmt(r.get('logp_gap_max'))} "
              f"({time.perf_counter() - start:.0f} s) {'; '.join(f'{k}: {v[:160]}' for k, v in r.get('failed', {}).items())}",
              flush=True)

    bound = GAP_BOUND[args.dtype]
    print(f"\n| family | tied | moe | {args.dtype} logprob gap (max) | load | zero2 push | zero3 push | saved, fresh vLLM "
          f"| ok |\n|---|---|---|---|---|---|---|---|---|")
    for family, r in results.items():
        print(f"| {family} | {'yes' if r['tied_embeddings'] else ''} | {'yes' if r['moe'] else ''} | "
              f"{_fmt(r.get('logp_gap_max'))} | {_fmt(r.get('load_gap'))} | {_fmt(r.get('zero2_gap'))} | "
              f"{_fmt(r.get('zero3_gap'))} | {_fmt(r.get('saved_vllm_gap'))} | {'yes' if r['ok'] else 'no'} |")
    summary = {"dtype": args.dtype, "gap_bound": bound, "date": datetime.date.today().isoformat(),
               "machine": f"{os.cpu_count()} cores", "families": results}
    results_dir = ROOT / "benchmarks" / "results"
    results_dir.mkdir(parents=True, exist_ok=True)
    (results_dir / f"compat-{args.dtype}-{summary['date']}.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
