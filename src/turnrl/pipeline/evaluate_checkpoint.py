"""Evaluate any Hugging Face checkpoint folder exactly as `baseline_eval` and `eval` do.

    python -m turnrl.pipeline.evaluate_checkpoint PATH --out DIR [--params params.yaml] [--data data/processed]
                                         [-S key=value ...] [--mlflow]

PATH is a Hugging Face model folder (config.json, weights, tokenizer), e.g. a published model
fetched with `huggingface-cli download Qwen/Qwen2.5-Math-1.5B --local-dir ckpt/qwen-math`, or
a pipeline model out (models/final; with `levels.high_model: separate` its high_level/ folder
plays the high-level turns). The evaluation is `turnrl.pipeline.evaluate.evaluate` with the params of
`--params` and the overrides of `-S` (same syntax as `dvc exp run -S`): the held-out task from
the pipeline's preprocessed data (run `dvc repro preprocess` first), and every benchmark read
from its source now (its `path`, $TURNRL_DATA_DIR or the hub), so a benchmark given with `-S` is
the one scored, whatever was preprocessed. It writes
`DIR/metrics.json` (the shape of metrics/eval.json), `DIR/<block>.parquet` (the per-problem
generations) and `DIR/run.json` (the checkpoint and the resolved params); `--mlflow` also
records the run, under the params' `tracking` settings.

    python -m turnrl.pipeline.evaluate_checkpoint ckpt/qwen-math --out eval/qwen-math \\
        -S model.dtype=bfloat16 -S eval.temperature=0 -S eval.max_tokens=3000 \\
        -S "eval.benchmarks=[math500,aime24,amc23]"
    python -m turnrl.pipeline.evaluate_checkpoint models/final --out eval/olympiad \\
        -S "eval.benchmarks=[{name: olympiad, path: olympiad.jsonl, fields: {prompt: question, answer: final_answer}}]"

Compare two evaluations with `python -m turnrl.pipeline.report A/metrics.json B/metrics.json --out DIR`.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from turnrl.config import Config, ConfigError, load_config
from turnrl.data.sources import DataSourceError

BAD_INPUT_EXIT = 2


def check_inputs(cfg: Config, model: Path, data_dir: Path) -> None:
    """Fail early, saying what to do, when the checkpoint or the preprocessed data is missing."""
    if not model.is_dir():
        raise FileNotFoundError(f"{model}: not a folder. Pass a Hugging Face checkpoint folder (config.json, "
                                "weights, tokenizer); for a hub id download it first: "
                                f"huggingface-cli download <id> --local-dir {model}")
    if not (model / "config.json").exists() and not (model / "turnrl_model.json").exists():
        raise FileNotFoundError(f"{model}: no config.json, so not a Hugging Face checkpoint folder")
    from turnrl.pipeline.evaluate import check_data
    check_data(cfg, data_dir)


def evaluate_checkpoint(cfg: Config, model: str | Path, out: str | Path,
                        data_dir: str | Path = "data/processed") -> dict:
    """Evaluate checkpoint folder `model`; write `out/metrics.json`, `out/run.json` and the
    generations; return the metrics."""
    from turnrl.pipeline.evaluate import evaluate, load_levels, source_benchmarks
    from turnrl.pipeline.stage import write_json
    model, out, data_dir = Path(model), Path(out), Path(data_dir)
    check_inputs(cfg, model, data_dir)
    high = model / "high_level"   # levels.high_model: separate: the trained high-level model saved beside the policy
    engine, tokenizer = load_levels(cfg, model, high if high.is_dir() else None)
    metrics = evaluate(cfg, engine, tokenizer, data_dir, out, benchmarks=source_benchmarks(cfg))
    write_json(out / "metrics.json", metrics)
    write_json(out / "run.json", {"checkpoint": str(model.resolve()), "data": str(data_dir.resolve()),
                                  "config": cfg.model_dump()})
    return metrics


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m turnrl.pipeline.evaluate_checkpoint",
                                description="Evaluate a Hugging Face checkpoint folder on the pipeline's benchmarks.")
    p.add_argument("model", type=Path, help="a Hugging Face checkpoint folder")
    p.add_argument("--out", type=Path, required=True, help="folder for metrics.json and the generations")
    p.add_argument("--params", default="params.yaml", help="params file (default: params.yaml)")
    p.add_argument("--data", type=Path, default=Path("data/processed"),
                   help="the preprocess stage's output (default: data/processed)")
    p.add_argument("-S", "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a param, e.g. -S eval.temperature=0 (repeatable)")
    p.add_argument("--mlflow", action="store_true", help="record the evaluation as an MLflow run")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = load_config(args.params, args.overrides)
        check_inputs(cfg, args.model, args.data)
    except (ConfigError, FileNotFoundError, DataSourceError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return BAD_INPUT_EXIT
    if args.mlflow:
        from turnrl import tracking
        from turnrl.pipeline.evaluate import log_to_mlflow
        with tracking.stage_run("evaluate_checkpoint", cfg):
            import mlflow
            mlflow.set_tag("turnrl.checkpoint", str(args.model.resolve()))
            metrics = evaluate_checkpoint(cfg, args.model, args.out, args.data)
            log_to_mlflow(metrics, args.out, "metrics.json")
    else:
        metrics = evaluate_checkpoint(cfg, args.model, args.out, args.data)
    summary = {b: {k: v[k] for k in ("accuracy", "n") if k in v} for b, v in metrics.items()}
    print(json.dumps(summary, indent=2))
    print(f"wrote {args.out / 'metrics.json'} and the generations in {args.out}/")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
