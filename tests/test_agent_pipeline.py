"""An agent program trained unmodified through the whole pipeline: `dvc exp run` with the
`agent` preset (examples/agents/calculator_agent.py, the openai SDK only) from a clean copy of the
project. The tiny model is warm-started on the conversations the real program builds when the
gateway answers it with the demonstration hook's replies, trained two steps through the gateway
(sync, then `train.mode: async` as a second experiment that reuses the cached stages, with a
judge on loopback in `reward.judges`), and evaluated through the program (after the sync run)."""
import json
import math

import pandas as pd
import pytest
import yaml

from conftest import copy_project, run_dvc
from judge_server import ReferenceJudge

PRESET = ["env.name=agent", "++env.options.program=examples.agents.calculator_agent:run",
          "++env.options.demonstration=examples.agents.calculator_agent:demonstrate",
          "++env.options.rows=turnrl.data.synthetic:product_rows", "++env.options.timeout_s=60"]


def _sets(*pairs: str) -> list[str]:
    return [a for kv in pairs for a in ("-S", kv)]


@pytest.mark.slow
def test_an_openai_sdk_agent_through_the_pipeline_sync_and_async(tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    copy_project(project)
    params = yaml.safe_load((project / "params.yaml").read_text())
    # mostly tool-calling: episodes of several calls (1.2-1.7 calls an episode after 80-150 skill steps;
    # the skill steps are most of prepare_model's time)
    params["model"]["warmstart"].update(demonstrations=100, skill_steps=100, prior_steps=10, good_fraction=0.9)
    params["data"].update(train_examples=32, heldout_examples=8)
    params["train"].update(steps=2, prompts_per_step=4)
    params["rollout"].update(n=4, max_turns=3, max_tokens_per_turn=48, max_tokens_total=160)
    params["eval"].update(greedy=False, limit=8, benchmarks=[])
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))

    # the agent traced by MLflow as deployed agents often are (its own span, OpenAI autologging):
    # examples/agents/traced_agent.py, the calculator agent inside; both runs use it, so the second
    # reuses the first's warm start (a program of its own would be a warm start of its own)
    traced = "++env.options.program=examples.agents.traced_agent:run"
    # `eval` and what it depends on: baseline_eval is eval's code on another model, report is covered by test_pipeline_e2e
    proc = run_dvc(project, "exp", "run", "eval", *_sets(*PRESET, traced), timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    warm = json.loads((project / "metrics/prepare_model.json").read_text())
    assert warm["env"] == "agent" and warm["demonstrations"] > 0
    curve = pd.read_csv(project / "plots/train.csv")
    assert len(curve) == 2 and math.isfinite(curve["loss"].iloc[-1])
    assert curve["finish_env_error_frac"].max() == 0.0
    # the warm-started model calls the calculator: its episodes are several calls, merged into one sample
    assert curve["calls_per_episode"].max() > 1.0, curve[["calls_per_episode", "samples_per_episode"]]
    assert (curve["samples_per_episode"] == 1.0).all() and curve["merged_frac"].max() > 0
    final = json.loads((project / "metrics/eval.json").read_text())
    assert final["task"]["n"] == 8 and final["task"]["env"] == "agent"
    rows = pd.read_parquet(project / "eval/final/task.parquet")
    assert len(rows) == 8 and rows["finish"].ne("env_error").all()

    # async, with a judge on loopback rewarding the episodes beside the program's outcome (reward.judges in params.yaml)
    judge = ReferenceJudge()
    params = yaml.safe_load((project / "params.yaml").read_text())
    params["reward"]["judges"] = [{"name": "reference", "base_url": judge.url, "range": [0, 10], "weight": 0.5,
                                   "template": "Reference: {reference}\nAnswer: {response}"}]
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    try:
        # only `train` (what is asserted below) and what it depends on, cached from the first run
        proc = run_dvc(project, "exp", "run", "train", *_sets(*PRESET, traced, "train.mode=async",
                                                              "algorithm.policy_loss=decoupled"), timeout=1500)
    finally:
        judge.close()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    curve = pd.read_csv(project / "plots/train.csv")
    assert len(curve) == 2 and "staleness_mean" in curve and curve["finish_env_error_frac"].max() == 0.0
    assert curve["calls_per_episode"].max() > 1.0 and math.isfinite(curve["loss"].iloc[-1])
    assert judge.calls >= 2 and curve["judge_reference_calls"].min() > 0     # every step's batch was judged
    assert (curve["judge_reference_failures"] == 0).all() and (curve["judge_reference_latency_p50_s"] > 0).all()
    assert curve["reward_reference_mean"].between(0, 1).all()
    _assert_the_agents_spans_joined_its_rollout_traces(project)


def _assert_the_agents_spans_joined_its_rollout_traces(project) -> None:
    """The program host logged the agent's own traces to the run's store; turnrl's rollout traces
    took their spans in, each call's turn under the autologged call that made it."""
    import mlflow
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{project / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("turnrl").experiment_id
    joined = [t for t in client.search_traces(locations=[experiment], max_results=200)
              if t.info.tags.get("kind") == "rollout" and any(s.name == "calculator agent" for s in t.data.spans)]
    assert joined, "no rollout trace holds the agent's own spans"
    for trace in joined:
        by_id = {s.span_id: s for s in trace.data.spans}
        turns = [s for s in trace.data.spans if s.name.startswith("turn ")]
        assert turns and all(by_id[s.parent_id].name == "Completions" for s in turns)
    judged = [t for t in client.search_traces(locations=[experiment], max_results=200)
              if t.info.tags.get("kind") == "rollout" and any(s.name == "judge reference" for s in t.data.spans)]
    assert judged, "no rollout trace holds the judge's call"
    span = next(s for s in judged[0].data.spans if s.name == "judge reference")
    assert span.inputs["prompt"].startswith("Reference: ") and 0 <= span.outputs["score"] <= 1
