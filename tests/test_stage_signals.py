"""A stage script stopped by SIGTERM (a scheduler's stop, `kill`, `docker stop`) after Ray started:
one line and the shell's exit code 143, its MLflow runs KILLED, as Ctrl-C (ray.init's own
handler exited mid-cleanup, SIGABRT and the reason "15")."""
import os
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]

STAGE = """
import os, signal, time
from turnrl.pipeline.stage import run_stage
from turnrl.training.cluster import start_ray

def body(cfg):
    start_ray(cfg)   # a real local Ray: its init sets a SIGTERM handler of its own
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(60)

run_stage("report", body)
"""


def test_sigterm_after_ray_started_stops_the_stage_in_one_line_with_its_runs_killed(tmp_path):
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["tracking"].update(system_metrics=False, uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    (tmp_path / "stage.py").write_text(STAGE)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "TURNRL_PIPELINE_KEY": "unit:sigterm"}
    done = subprocess.run([sys.executable, "stage.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=180)
    assert done.returncode == 143, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1] == "turnrl report: stopped by SIGTERM"
    assert "Traceback" not in done.stderr
    import mlflow
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = client.get_experiment_by_name(params["tracking"]["experiment"])
    assert {r.info.status for r in client.search_runs([experiment.experiment_id])} == {"KILLED"}
