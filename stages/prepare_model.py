"""DVC stage `prepare_model`: build and warm-start the tiny model, or resolve a checkpoint."""
from pathlib import Path

from turnrl.pipeline.stage import run_stage, write_json

OUT = Path("models/initial")


def main(cfg):
    import shutil

    from turnrl.tracking import artifacts, runs
    from turnrl.pipeline.prepare_model import build_tiny, resolve_checkpoint
    run = runs.current_run()
    shutil.rmtree(OUT, ignore_errors=True)
    if cfg.model.path == "tiny":
        summary = build_tiny(cfg, OUT, log_metrics=lambda step, m: step % 10 == 0 and runs.log_metrics(
            {f"warmstart/{k.removeprefix('warmstart_')}": v for k, v in m.items()}, step))
        write_json("metrics/prepare_model.json", summary)
        artifacts.log_artifacts(run, OUT, "model")
    else:
        summary = resolve_checkpoint(cfg.model.path, OUT)
        write_json("metrics/prepare_model.json", summary)
    artifacts.log_dict(run, summary, "model_summary.json")


if __name__ == "__main__":
    run_stage("prepare_model", main)
