"""GSM8K with a user's function as the tool, through the whole pipeline: `dvc exp run -S
env.name=tools -S data.train_set=gsm8k_train ...` from a clean copy of the project, the tiny
model warm-started on the tools environment's calculator demonstrations, trained two steps."""
import json
import math

import pytest
import yaml

from conftest import copy_project, run_dvc

SETS = ["env.name=tools", "data.train_set=gsm8k_train", "data.heldout_set=gsm8k_test",
        "++env.options.functions=[examples.tools.calc:calculator]"]




@pytest.mark.slow
@pytest.mark.long   # ~250 s; CI covers its parts: function tools by path (test_tools), GSM8K through the pipeline (test_pipeline_e2e)
def test_gsm8k_with_a_users_function_as_the_tool_through_the_pipeline(tmp_path, data_dir):
    project = tmp_path / "project"
    project.mkdir()
    copy_project(project)
    params = yaml.safe_load((project / "params.yaml").read_text())
    params["model"]["warmstart"].update(demonstrations=120, skill_steps=40, prior_steps=4)
    params["data"].update(train_examples=32, heldout_examples=8)
    params["train"].update(steps=2, prompts_per_step=4)
    params["rollout"].update(n=4, engine="hf", max_turns=3, max_tokens_per_turn=48, max_tokens_total=200,
                             rejoin="ready")
    params["eval"].update(greedy=False, limit=8, benchmarks=[])
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    proc = run_dvc(project, "exp", "run", *[a for kv in SETS for a in ("-S", kv)], timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    demos = json.loads((project / "metrics/prepare_model.json").read_text())
    assert demos["env"] == "tools" and demos["demonstrations"] > 0
    final = json.loads((project / "metrics/eval.json").read_text())
    assert final["task"]["n"] == 8 and final["task"]["env"] == "tools"
    import pandas as pd
    curve = pd.read_csv(project / "plots/train.csv")
    assert len(curve) == 2 and math.isfinite(curve["loss"].iloc[-1])
    assert curve["finish_env_error_frac"].max() == 0.0            # botched calls are observations, never errors
    # tool calls (the tiny model's, mostly botched after 40 warm-start steps) are counted every step
    assert {"env_tool_calls_mean", "env_tool_errors_mean", "env_tool_malformed_mean"} <= set(curve)
    rows = pd.read_parquet(project / "eval/final/task.parquet")      # GSM8K's test problems, through the env
    assert len(rows) == 8 and rows["id"].str.startswith("gsm8k_test").all() and rows["finish"].ne("env_error").all()
