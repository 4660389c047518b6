"""DVC stage `sft`: supervised fine-tuning before RL (params' `sft`), or, with sft.data: none,
prepare_model's model passed through. models/initial -> models/sft, metrics/sft.json."""
from pathlib import Path

from turnrl.pipeline.stage import run_stage, write_json

INITIAL, OUT = Path("models/initial"), Path("models/sft")


def main(cfg):
    from turnrl.training.folders import model_dir
    from turnrl.pipeline.sft import pass_through, run_sft
    from turnrl.tracking import artifacts, runs
    run = runs.current_run()
    if not cfg.sft.enabled:
        write_json("metrics/sft.json", pass_through(INITIAL, OUT))
        return
    summary = run_sft(cfg, model_dir(INITIAL), OUT, on_step=lambda step, m: runs.log_metrics(
        {f"sft/{k}": v for k, v in m.items() if k != "step"}, step))
    write_json("metrics/sft.json", summary)
    runs.log_parent(run, metrics={"sft/loss_last": summary["loss_last"],     # None (no held-out) is not logged
                                  "sft/heldout_loss_last": summary["heldout_loss_last"]})
    artifacts.log_dict(run, summary, "sft_summary.json")


if __name__ == "__main__":
    run_stage("sft", main)
