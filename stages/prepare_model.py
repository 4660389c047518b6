"""DVC stage `prepare_model`: build and warm-start the tiny model, or resolve a checkpoint."""
from pathlib import Path

from turnrl.stage import run_stage, write_json

OUT = Path("models/initial")


def main(cfg):
    import shutil

    import mlflow

    from turnrl import tracking
    from turnrl.prepare import build_tiny, resolve_checkpoint
    shutil.rmtree(OUT, ignore_errors=True)
    if cfg.model.path == "tiny":
        summary = build_tiny(cfg, OUT,
                             log_metrics=lambda step, m: step % 10 == 0 and tracking.log_metrics(m, step))
        mlflow.log_artifacts(str(OUT), "model")
    else:
        summary = resolve_checkpoint(cfg.model.path, OUT)
    mlflow.log_dict(summary, "model_summary.json")
    write_json("metrics/prepare_model.json", summary)


if __name__ == "__main__":
    run_stage("prepare_model", main)
