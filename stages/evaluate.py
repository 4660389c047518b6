"""DVC stages `baseline_eval` and `eval`: the same evaluation, before and after training.

    python stages/evaluate.py baseline   # models/initial -> metrics/baseline.json, eval/baseline/
    python stages/evaluate.py final      # models/final   -> metrics/eval.json,     eval/final/

With levels.high_model: separate the high-level turns are played by the second model: its
start (baseline) or models/final/high_level (final).
"""
import sys
from pathlib import Path

from turnrl.stage import run_stage, write_json

WHICH = {
    "baseline": ("baseline_eval", Path("models/initial"), Path("metrics/baseline.json"), Path("eval/baseline")),
    "final": ("eval", Path("models/final"), Path("metrics/eval.json"), Path("eval/final")),
}


def main(cfg, which: str):
    from turnrl.evaluation import evaluate, load_levels, log_to_mlflow
    _, model, metrics_path, out = WHICH[which]
    # levels.high_model: separate: both models play, the trained high-level model from models/final/high_level
    engine, tokenizer = load_levels(cfg, model, model / "high_level" if which == "final" else None)
    metrics = evaluate(cfg, engine, tokenizer, Path("data/processed"), out)
    write_json(metrics_path, metrics)
    log_to_mlflow(metrics, out, metrics_path.name)


if __name__ == "__main__":
    which = sys.argv[1] if len(sys.argv) > 1 else "final"
    if which not in WHICH:
        raise SystemExit(f"usage: python stages/evaluate.py {{{'|'.join(WHICH)}}}")
    run_stage(WHICH[which][0], lambda cfg: main(cfg, which))
