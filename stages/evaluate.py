"""DVC stages `baseline_eval` and `eval`: the same evaluation, before and after training.

    python stages/evaluate.py baseline   # models/sft -> metrics/baseline.json, eval/baseline/
    python stages/evaluate.py final      # models/final   -> metrics/eval.json,     eval/final/

With levels.high_model: separate the high-level turns are played by the second model: its
start (baseline) or models/final/high_level (final).

MLflow: the stage run gets the metrics (`eval/<benchmark>/...`), the settings as params, the
generations as tables and a sample of them as traces with their correctness; the pipeline's
parent run gets the headline accuracies (baseline, final, diff per benchmark) and the report's
table as its description; `eval` registers the final policy when `tracking.register_model`
names a registry model.
"""
import json
import sys
from pathlib import Path

from turnrl.pipeline.stage import run_stage, write_json

DATA = Path("data/processed")
WHICH = {
    "baseline": ("baseline_eval", Path("models/sft"), Path("metrics/baseline.json"), Path("eval/baseline")),
    "final": ("eval", Path("models/final"), Path("metrics/eval.json"), Path("eval/final")),
}


def main(cfg, which: str):
    from turnrl.tracking import artifacts, model_logging, runs
    from turnrl.pipeline.evaluate import evaluate, load_levels, log_to_mlflow
    from turnrl.pipeline.report import log_headline
    from turnrl.pipeline.preprocess import BENCHMARK_DIR
    _, model, metrics_path, out = WHICH[which]
    # levels.high_model: separate: both models play, the trained high-level model from models/final/high_level
    engine, tokenizer = load_levels(cfg, model, model / "high_level" if which == "final" else None)
    trajectories = {}
    metrics = evaluate(cfg, engine, tokenizer, DATA, out, keep=trajectories)
    write_json(metrics_path, metrics)

    run = runs.current_run()
    artifacts.log_datasets(run, {"heldout": (DATA / "heldout.parquet", "evaluation"),
                                 **{b.name: (DATA / BENCHMARK_DIR / f"{b.name}.parquet", "evaluation")
                                    for b in cfg.eval.benchmarks}})
    log_to_mlflow(metrics, out, metrics_path.name, trajectories=trajectories, stage=which)
    other = WHICH["final" if which == "baseline" else "baseline"][2]
    earlier = json.loads(other.read_text()) if other.exists() else None
    # baseline_eval: a metrics/eval.json already there is an older model's, not this pipeline's result
    baseline, final = (metrics, None) if which == "baseline" else (earlier, metrics)
    log_headline(run, baseline, final)
    if which == "final":
        model_logging.register_policy(run, model, baseline or {}, metrics)


if __name__ == "__main__":
    which = sys.argv[1] if len(sys.argv) > 1 and not sys.argv[1].startswith("-") else "final"
    if which not in WHICH:
        print(f"usage: python stages/evaluate.py {{{'|'.join(WHICH)}}}", file=sys.stderr)
        raise SystemExit(2)
    run_stage(WHICH[which][0], lambda cfg: main(cfg, which))
