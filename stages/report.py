"""DVC stage `report`: baseline against trained, per benchmark, as report/report.md with plots.

    python stages/report.py   # metrics/{baseline,eval}.json, eval/{baseline,final}/, plots/train.csv -> report/
"""
import json
from pathlib import Path

from turnrl.pipeline.stage import run_stage

BASELINE, TRAINED = Path("metrics/baseline.json"), Path("metrics/eval.json")
OUT = Path("report")


def main(cfg):
    from turnrl.tracking import artifacts, runs
    from turnrl.pipeline.report import log_headline, render
    for path, stage in [(BASELINE, "baseline_eval"), (TRAINED, "eval")]:
        if not path.exists():
            raise FileNotFoundError(f"{path} is missing; run `dvc repro {stage}` first")
    path = render(json.loads(BASELINE.read_text()), json.loads(TRAINED.read_text()), OUT,
                  baseline_gens=Path("eval/baseline"), trained_gens=Path("eval/final"),
                  curves=Path("plots/train.csv"), sources=(str(BASELINE), str(TRAINED)))
    run = runs.current_run()
    artifacts.log_artifacts(run, path.parent, "report")
    log_headline(run, json.loads(BASELINE.read_text()), json.loads(TRAINED.read_text()),
                 extra=f"The full report: artifacts `report/report.md` of the report run ({run.run_id}).")


if __name__ == "__main__":
    run_stage("report", main)
