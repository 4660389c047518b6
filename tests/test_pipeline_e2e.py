"""The whole pipeline on the real stack, from a copy of the project as a clean clone has it:
`dvc repro` with short params (vLLM, DeepSpeed ZeRO-2 in a Ray actor, a local Ray cluster)
recording to a real `mlflow server` (sqlite backend, loopback port) through tracking.uri, then
the DVC contract: nothing reruns, `dvc exp run -S` reruns what depends on the key, a bad value
fails at once naming it; and what MLflow got, read back through its client: the parent run's
params and headline metrics, rollouts and evaluation generations as traces with per-turn LLM and
TOOL spans, data sets as run inputs, the policy as a model that loads, a registered version."""
from __future__ import annotations

import csv
import json
import subprocess
import time

import pytest
import yaml

from conftest import copy_project, run_dvc
from mlflow_server import MlflowServer

SHORT = {
    "data": {"train_examples": 256, "heldout_examples": 32},
    "model": {"warmstart": {"demonstrations": 100, "skill_steps": 20, "prior_steps": 5}},
    "train": {"steps": 3, "prompts_per_step": 4},
    "rollout": {"n": 4},
}
STAGES = ["preprocess", "prepare_model", "sft", "baseline_eval", "train", "eval", "report"]


def _merge(base: dict, extra: dict) -> None:
    for key, value in extra.items():
        if isinstance(value, dict):
            _merge(base.setdefault(key, {}), value)
        else:
            base[key] = value


REGISTERED = "turnrl-e2e"


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    with MlflowServer(tmp_path_factory.mktemp("mlflow-server")) as server:
        yield server


@pytest.fixture(scope="module")
def project(tmp_path_factory, data_dir, mlflow_server):
    root = tmp_path_factory.mktemp("pipeline")
    copy_project(root)
    params = yaml.safe_load((root / "params.yaml").read_text())
    _merge(params, SHORT)
    _merge(params, {"tracking": {"uri": mlflow_server.uri, "register_model": REGISTERED}})
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    return root




@pytest.fixture(scope="module")
def first_run(project):
    start = time.perf_counter()
    proc = run_dvc(project, "repro")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc, time.perf_counter() - start


@pytest.mark.slow
def test_repro_writes_every_out_and_the_metrics_contract(project, first_run):
    proc, seconds = first_run
    for stage in STAGES:
        assert f"Running stage '{stage}'" in proc.stdout
    for path in ["data/processed/train.parquet", "data/processed/heldout.parquet", "models/initial/config.json",
                 "models/final/model.safetensors", "models/final/tokenizer.json", "eval/baseline/task.parquet",
                 "eval/final/math500.parquet", "plots/train.csv", "plots/train_curves.png", "dvc.lock"]:
        assert (project / path).exists(), path

    baseline = json.loads((project / "metrics/baseline.json").read_text())
    final = json.loads((project / "metrics/eval.json").read_text())
    assert baseline.keys() == final.keys() == {"task", "math500"}
    for block in [baseline["task"], final["task"], baseline["math500"], final["math500"]]:
        assert {"accuracy", "n", "mean_response_tokens"} <= block.keys()
        assert 0.0 <= block["accuracy"] <= 1.0
    assert final["task"]["n"] == 32 and "accuracy_greedy" in final["task"]
    math500 = final["math500"]
    assert math500["available"] is True and math500["n"] == 500
    assert len(math500["by_subject"]) == 7 and len(math500["by_level"]) == 5
    import pandas as pd
    assert len(pd.read_parquet(project / "eval/final/math500.parquet")) == 500

    train = json.loads((project / "metrics/train.json").read_text())
    assert train["steps"] == 3
    # the engine sampled with exactly the trainer's weights: fp32 noise, not a real gap
    assert train["logp_gap_max"] < 1e-3
    assert train["sync_s_mean"] > 0 and train["gen_tokens_per_s_mean"] > 0
    curve = pd.read_csv(project / "plots/train.csv")
    assert list(curve["step"]) == [1, 2, 3]
    for column in ["reward_mean", "accuracy", "kl_ref", "response_tokens_mean", "step_s", "rollout_s",
                   "train_s", "sync_s", "gen_tokens_per_s", "logp_gap_max"]:
        assert column in curve.columns, column
    print(f"short pipeline: {seconds:.0f}s")


@pytest.mark.slow
def test_repro_leaves_no_new_file_for_git(project, first_run):
    """What the stages generate is ignored (.gitignore) or tracked: after `dvc repro` a clean clone
    shows changed tracked files only (dvc.lock, the metrics and curves, the params this test set)."""
    status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=project,
                            capture_output=True, text=True, check=True).stdout.splitlines()
    assert not [line for line in status if line.startswith("??")], status
    changed = [line[3:] for line in status]
    assert all(path in ("dvc.lock", "params.yaml") or path.startswith(("metrics/", "plots/")) for path in changed), status


@pytest.mark.slow
def test_final_model_is_a_hugging_face_folder(project, first_run):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(project / "models/final")
    tokenizer = AutoTokenizer.from_pretrained(project / "models/final")
    initial = AutoModelForCausalLM.from_pretrained(project / "models/initial")
    drop = lambda c: {k: v for k, v in c.to_dict().items() if k != "_name_or_path"}  # noqa: E731
    assert drop(model.config) == drop(initial.config)
    assert model.state_dict().keys() == initial.state_dict().keys()
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Compute 123 * 456."}],
                                        add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    assert model(input_ids=ids).logits.isfinite().all()


@pytest.mark.slow
def test_mlflow_has_one_parent_with_a_child_per_stage(project, first_run, mlflow_server):
    import mlflow
    client = mlflow.MlflowClient(tracking_uri=mlflow_server.uri)
    experiment = client.get_experiment_by_name("turnrl")
    runs = client.search_runs([experiment.experiment_id])
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    assert len(parents) == 1
    assert sorted(r.data.tags["turnrl.pipeline.stage"] for r in children) == sorted(STAGES)
    assert {r.data.tags["mlflow.parentRunId"] for r in children} == {parents[0].info.run_id}
    assert {r.info.status for r in runs} == {"FINISHED"}
    train = next(r for r in children if r.data.tags["turnrl.pipeline.stage"] == "train")
    assert train.data.params["train.steps"] == "3"
    assert train.data.tags["mlflow.source.git.commit"] != "unknown"
    assert len(client.get_metric_history(train.info.run_id, "rollout/reward_mean")) == 3
    assert all("/" in name for name in train.data.metrics)                 # every metric in a section
    assert {"loss/loss", "timing/step_s", "rollout/reward_mean", "health/no_signal"} <= set(train.data.metrics)
    # tool_call_rate exists once a tool was called (the 20-step warm start here may never call it)
    called = any(float(r["tool_calls_mean"]) > 0 for r in csv.DictReader(open(project / "plots/train.csv")))
    assert ("tools/tool_call_rate" in train.data.metrics) == called
    assert any(name.startswith("system/") for name in train.data.metrics)  # system metrics
    artifacts = {a.path for a in client.list_artifacts(train.info.run_id)}
    assert {"samples", "config.json", "plots"} <= artifacts
    samples = client.list_artifacts(train.info.run_id, "samples")
    assert samples, "no table of sample trajectories"


@pytest.mark.slow
def test_the_parent_run_compares_pipeline_runs(project, first_run, mlflow_server):
    """Params that identify the run, headline metrics per benchmark, training time, and the
    report's table as the description, all on the parent."""
    import mlflow
    client = mlflow.MlflowClient(tracking_uri=mlflow_server.uri)
    parent, = client.search_runs([client.get_experiment_by_name("turnrl").experiment_id],
                                 "tags.`turnrl.pipeline_key` LIKE 'dvc:%'")
    params, metrics = parent.data.params, parent.data.metrics
    assert params["env.name"] == "code_tool" and params["algorithm.name"] == "grpo"
    assert params["train.steps"] == "3" and params["seed"] == "0" and params["rollout.n"] == "4"
    baseline = json.loads((project / "metrics/baseline.json").read_text())
    final = json.loads((project / "metrics/eval.json").read_text())
    for block in ("task", "math500"):
        assert metrics[f"eval/{block}/accuracy_baseline"] == pytest.approx(baseline[block]["accuracy"])
        assert metrics[f"eval/{block}/accuracy_final"] == pytest.approx(final[block]["accuracy"])
        assert metrics[f"eval/{block}/accuracy_diff"] == pytest.approx(final[block]["accuracy"]
                                                                       - baseline[block]["accuracy"])
    train = json.loads((project / "metrics/train.json").read_text())
    assert metrics["train/step_s_mean"] == pytest.approx(train["step_s_mean"]) and metrics["train/wall_s"] > 0
    description = parent.data.tags["mlflow.note.content"]
    assert "| `task` |" in description and "| `math500` |" in description and "grpo" in description
    evaluation = client.search_runs([parent.info.experiment_id], "tags.`turnrl.pipeline.stage` = 'eval'")[0]
    assert evaluation.data.params["eval/task/temperature"] == "1.0"            # settings are params ...
    assert not any(k.endswith(("temperature", "top_p", "seed")) for k in evaluation.data.metrics)  # not metrics
    assert evaluation.data.metrics["eval/task/accuracy"] == pytest.approx(final["task"]["accuracy"])


@pytest.mark.slow
def test_rollouts_and_generations_are_traces(project, first_run, mlflow_server):
    import mlflow
    mlflow.set_tracking_uri(mlflow_server.uri)
    client = mlflow.MlflowClient()
    experiment = client.get_experiment_by_name("turnrl").experiment_id
    by_stage = {r.data.tags["turnrl.pipeline.stage"]: r for r in client.search_runs([experiment], "tags.`turnrl.pipeline.stage` != ''")}
    train_id = by_stage["train"].info.run_id
    rollouts = mlflow.search_traces(locations=[experiment], run_id=train_id, return_type="list")
    # tracking.traces: every 10 steps and the first and last: steps 1 and 3, 4 trajectories each
    assert sorted(int(t.info.tags["step"]) for t in rollouts) == [1] * 4 + [3] * 4
    for trace in rollouts:
        spans = trace.data.spans
        turns = [s for s in spans if s.name.startswith("turn ")]
        assert turns and len(turns) == int(trace.info.tags["turns"])
        llm = [s for s in spans if s.span_type == "LLM"]
        tools = [s for s in spans if s.span_type == "TOOL"]
        assert len(llm) == len(turns) and all(s.attributes["tokens"] > 0 for s in llm)
        # every environment step is a TOOL span; only a turn cut by its token limit has none
        assert len(tools) == len(turns) - (trace.info.tags["finish"] == "truncated")
        assert all(s.parent_id in {t.span_id for t in turns} for s in llm + tools)
        assert all(s.end_time_ns >= s.start_time_ns for s in spans)
        root = next(s for s in spans if s.parent_id is None)
        assert {"step", "group", "reward", "advantage", "finish"} <= set(root.attributes)
        assert trace.info.tags["finish"] == root.attributes["finish"]
    found = mlflow.search_traces(locations=[experiment], filter_string="tags.step = '3' AND tags.kind = 'rollout'",
                                 return_type="list")
    assert len(found) == 4
    finish = rollouts[0].info.tags["finish"]
    assert len(mlflow.search_traces(locations=[experiment], filter_string=f"tags.finish = '{finish}'",
                                    return_type="list")) >= 1
    rewarded = mlflow.search_traces(locations=[experiment], filter_string="feedback.reward >= 0", return_type="list")
    assert len(rewarded) >= 8
    # evaluation generations, baseline and final, a sample per benchmark, correctness as feedback
    for stage, run in (("baseline", by_stage["baseline_eval"]), ("final", by_stage["eval"])):
        generations = mlflow.search_traces(locations=[experiment], run_id=run.info.run_id, return_type="list")
        assert {t.info.tags["benchmark"] for t in generations} == {"task", "math500"}
        assert {t.info.tags["stage"] for t in generations} == {stage} and len(generations) == 16
        for trace in generations:
            correct = [a for a in trace.info.assessments if a.name == "correct"]
            assert len(correct) == 1 and correct[0].value == (trace.info.tags["correct"] == "true")
            assert correct[0].rationale


@pytest.mark.slow
def test_data_sets_and_the_model_are_in_their_registries(project, first_run, mlflow_server):
    import hashlib

    import mlflow
    mlflow.set_tracking_uri(mlflow_server.uri)
    client = mlflow.MlflowClient()
    experiment = client.get_experiment_by_name("turnrl").experiment_id
    runs = client.search_runs([experiment])
    by_stage = {r.data.tags.get("turnrl.pipeline.stage"): r for r in runs}
    parent = by_stage[None]

    def digests(run):
        return {i.dataset.name: (i.dataset.digest, {t.key: t.value for t in i.tags}["mlflow.data.context"])
                for i in run.inputs.dataset_inputs}
    md5 = {name: hashlib.md5((project / "data/processed" / path).read_bytes()).hexdigest()
           for name, path in (("train", "train.parquet"), ("heldout", "heldout.parquet"),
                              ("math500", "benchmarks/math500.parquet"))}
    assert digests(by_stage["train"]) == {"train": (md5["train"], "training")}
    assert digests(by_stage["eval"]) == {"heldout": (md5["heldout"], "evaluation"),
                                         "math500": (md5["math500"], "evaluation")}
    assert {name for name, _ in digests(parent).items()} == {"train", "heldout", "math500"}

    model, = mlflow.search_logged_models(experiment_ids=[experiment], output_format="list",
                                         filter_string=f"source_run_id = '{by_stage['train'].info.run_id}'")
    parts = mlflow.transformers.load_model(f"models:/{model.model_id}", return_type="components")
    ids = parts["tokenizer"]("Compute 12 * 34.", return_tensors="pt")["input_ids"]
    assert parts["model"](input_ids=ids).logits.isfinite().all()
    version, = client.search_model_versions(f"name = '{REGISTERED}'")
    final = json.loads((project / "metrics/eval.json").read_text())
    assert version.tags["env"] == "code_tool" and version.tags["algorithm"] == "grpo"
    assert float(version.tags["accuracy"]) == pytest.approx(final["task"]["accuracy"], abs=1e-4)
    assert version.run_id == by_stage["train"].info.run_id or version.source.endswith(model.model_id)


@pytest.mark.slow
def test_second_repro_runs_nothing_and_exp_run_reruns_what_depends(project, first_run):
    again = run_dvc(project, "repro")
    assert again.returncode == 0 and "Running stage" not in again.stdout, again.stdout

    exp = run_dvc(project, "exp", "run", "-S", "train.steps=4")
    assert exp.returncode == 0, exp.stdout[-3000:] + exp.stderr[-3000:]
    ran = [s for s in STAGES if f"Running stage '{s}'" in exp.stdout]
    assert ran[0] == "train" and set(ran) <= {"train", "eval", "report"}, exp.stdout
    # eval depends on the trained weights: DVC reruns it unless they came out byte-identical
    # (a 2-step run of a barely warm-started model can have all-equal rewards, so no update)
    assert "Running stage 'eval'" in exp.stdout or "Stage 'eval' didn't change" in exp.stdout
    assert json.loads((project / "metrics/train.json").read_text())["steps"] == 4


@pytest.mark.slow
def test_a_bad_value_fails_fast_naming_the_key(project, first_run):
    start = time.perf_counter()
    params = (project / "params.yaml").read_text()
    bad = run_dvc(project, "exp", "run", "-S", "train.steps=-3")
    (project / "params.yaml").write_text(params)   # `exp run -S` leaves the bad value in the workspace
    assert bad.returncode != 0
    assert "train.steps = -3" in bad.stdout + bad.stderr
    assert time.perf_counter() - start < 60


@pytest.mark.slow
def test_sft_then_async_distillation_from_the_start_model_through_the_pipeline(project, first_run, mlflow_server):
    """Post-training end to end: `sft.data` names a file of conversations (OpenAI messages: code_tool
    episodes, the tool's result a tool message), the sft stage trains on it (its loss falls) and logs
    to its MLflow child run; then the train stage distills (`algorithm.name: opd`, `train.mode:
    async`) from a teacher turnrl serves with vLLM (models/initial: the same tokenizer), its engines
    loading models/sft. The default (`sft.data: none`) had passed models/initial through."""
    from transformers import AutoTokenizer

    from turnrl import envs
    from turnrl.data.synthetic import product_demonstration, product_rows
    from turnrl.rollout.chat import ChatFormat
    from turnrl.rollout.multi_turn import replay
    import random
    assert json.loads((project / "metrics/sft.json").read_text()) == {"skipped": True, "reason": "sft.data: none"}
    assert (project / "models/sft/model.safetensors").read_bytes() == \
        (project / "models/initial/model.safetensors").read_bytes()
    fmt = ChatFormat(AutoTokenizer.from_pretrained(project / "models/initial"))
    make_env = envs.resolve("code_tool").factory
    with open(project / "chat.jsonl", "w") as out:
        for row in product_rows(40, seed=7, split="train", exclude=set()):
            t = replay(make_env(), fmt, row, product_demonstration(row, random.Random(0), True).turns)
            out.write(json.dumps({"messages": t.messages, "tools": t.tools}) + "\n")
    params = (project / "params.yaml").read_text()
    sets = ["sft.data=chat.jsonl", "sft.steps=6", "sft.batch_size=8", "sft.lr=0.002", "sft.eval_every=3",
            "sft.heldout_fraction=0.1", "algorithm.name=opd", "reward.teacher.serve=models/initial",
            "reward.teacher.max_model_len=1024", "train.mode=async", "algorithm.policy_loss=decoupled",
            "train.steps=2"]
    try:
        proc = run_dvc(project, "exp", "run", "train", *[a for kv in sets for a in ("-S", kv)])
    finally:
        (project / "params.yaml").write_text(params)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Running stage 'sft'" in proc.stdout and "Running stage 'train'" in proc.stdout
    summary = json.loads((project / "metrics/sft.json").read_text())
    assert summary["conversations"] == 40 and summary["heldout_conversations"] == 4 and summary["steps"] == 6
    assert summary["loss_last"] < summary["loss_first"] and summary["heldout_loss_last"] < summary["heldout_loss_start"]
    assert (project / "models/sft/model.safetensors").read_bytes() != \
        (project / "models/initial/model.safetensors").read_bytes()
    import pandas as pd
    curve = pd.read_csv(project / "plots/train.csv")
    assert list(curve["step"]) == [1, 2] and curve["advantage_abs_mean"].gt(0).all()   # the teacher's signal
    import mlflow
    client = mlflow.MlflowClient(tracking_uri=mlflow_server.uri)
    sft = client.search_runs([client.get_experiment_by_name("turnrl").experiment_id],
                             "tags.`turnrl.pipeline.stage` = 'sft'", order_by=["attributes.start_time DESC"])[0]
    assert sft.data.params["sft.data"] == "chat.jsonl"
    assert len(client.get_metric_history(sft.info.run_id, "sft/loss")) == 6
    assert len(client.get_metric_history(sft.info.run_id, "sft/heldout_loss")) == 3   # steps 0, 3, 6
    assert {"sft/tokens_per_s", "sft/grad_norm"} <= set(sft.data.metrics)


REAL_DATA = {
    # MT-GRPO's setting: GSM8K through the code tool
    "gsm8k_code_tool": ["env.name=code_tool", "data.train_set=gsm8k_train", "data.heldout_set=gsm8k_test"],
    # RoSTE / MTGRPO's setting: NQ-open questions, their gold passages as the search corpus
    "nq_open_search": ["env.name=search", "data.train_set=nq_open", "data.heldout_set=nq_open"],
}


@pytest.mark.slow
# nq_open_search is long (~180 s): the search environment on NQ-open has its own tests (test_env_search)
@pytest.mark.parametrize("setting", [pytest.param(s, marks=[pytest.mark.long] if s == "nq_open_search" else [])
                                     for s in sorted(REAL_DATA)])
def test_real_data_runs_through_the_pipeline(project, first_run, setting):
    """The tiny model on real sets: accuracy near zero is expected; the path must work.
    Only `eval` and what it depends on run (baseline_eval is the same code as eval, and
    report is covered by the first repro): two fewer engine starts per setting."""
    sets = [arg for kv in REAL_DATA[setting] for arg in ("-S", kv)]
    proc = run_dvc(project, "exp", "run", "eval", *sets, "-S", "data.heldout_examples=16", "-S", "eval.benchmarks=[]",
               "-S", "eval.greedy=false", "-S", "train.steps=2")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for stage in ["preprocess", "prepare_model", "train", "eval"]:
        assert f"Running stage '{stage}'" in proc.stdout, stage
    manifest = json.loads((project / "data/processed/manifest.json").read_text())
    assert manifest["heldout"]["n"] == 16
    assert ("gsm8k" if setting.startswith("gsm8k") else "nq") in manifest["train"]["origin"]
    final = json.loads((project / "metrics/eval.json").read_text())
    assert final["task"]["n"] == 16 and 0.0 <= final["task"]["accuracy"] <= 1.0
    assert json.loads((project / "metrics/train.json").read_text())["steps"] == 2
    import pandas as pd
    rows = pd.read_parquet(project / "eval/final/task.parquet")
    heldout = pd.read_parquet(project / "data/processed/heldout.parquet")
    assert set(rows["prompt"]) == set(heldout["prompt"])
    if setting == "nq_open_search":
        assert manifest["corpus"]["n"] > 2500
        assert rows["trajectory"].str.contains("<result>|No results", regex=True).any() or \
            not rows["trajectory"].str.contains("<search>").any()


@pytest.mark.slow
def test_self_play_nim_with_a_turn_level_algorithm_through_the_pipeline(project, first_run):
    """Issue 52: self-play Nim (`env.name: game`) through the real pipeline with a turn-level
    algorithm, mt_grpo (rae has its own real-stack test in test_games.py): each seat is a trajectory
    of its own, so the turn-level estimator sees one role's turns (Nim gives no per-move rewards:
    the turn term is 0 and the outcome term is within each (seed, role) group). Only `eval` and
    what it depends on run; the evaluation plays both roles against both default opponents."""
    import math

    import pandas as pd
    params = (project / "params.yaml").read_text()
    sets = ["env.name=game", "++env.options.game=nim", "algorithm.name=mt_grpo",
            # the real-data tests may have left other sets in the workspace's params.yaml
            "data.train_set=synthetic", "data.heldout_set=synthetic",
            "rollout.max_turns=8", "rollout.max_tokens_per_turn=8", "rollout.max_tokens_total=200",
            # 40 steps: the rules (a legal move most of the time), so games go on past a first move
            "model.warmstart.skill_steps=40", "model.warmstart.prior_steps=0",
            # 2 seeds x 2 roles x 2 evaluation opponents
            "data.heldout_examples=8", "eval.benchmarks=[]", "eval.greedy=false", "train.steps=2"]
    start = time.perf_counter()
    try:
        proc = run_dvc(project, "exp", "run", "eval", *[a for kv in sets for a in ("-S", kv)])
    finally:
        (project / "params.yaml").write_text(params)
    seconds = time.perf_counter() - start
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for stage in ["preprocess", "prepare_model", "train", "eval"]:
        assert f"Running stage '{stage}'" in proc.stdout, stage

    task = json.loads((project / "metrics/eval.json").read_text())["task"]
    assert task["n"] == 8
    assert task["win"] + task["draw"] + task["loss"] == pytest.approx(1.0, abs=1e-3)
    assert 0.0 <= task["illegal_move_rate"] <= 1.0
    subjects = {f"{role} vs {opponent}" for role in ("first", "second")
                for opponent in ("random", "checkpoint:models/initial")}
    assert set(task["by_subject"]) == subjects
    for entry in task["by_subject"].values():
        assert entry["n"] == 2 and entry["win"] + entry["draw"] + entry["loss"] == pytest.approx(1.0, abs=1e-3)

    assert json.loads((project / "metrics/train.json").read_text())["steps"] == 2
    curve = pd.read_csv(project / "plots/train.csv")
    assert list(curve["step"]) == [1, 2]
    assert {"env_win_mean", "env_draw_mean", "env_loss_mean", "env_illegal_move_rate_mean"} <= set(curve.columns)
    assert all(math.isfinite(x) for x in curve["loss"])
    assert (curve["env_win_mean"] + curve["env_draw_mean"] + curve["env_loss_mean"]).sub(1.0).abs().max() < 1e-3

    # each row is one seat's conversation: the heap it was shown before each of its moves, so
    # from one to the next the heap fell by its own move and the other player's (1 to 3)
    from turnrl.games.base import last_number
    rows = pd.read_parquet(project / "eval/final/task.parquet")
    assert len(rows) == 8 and set(rows["subject"]) == subjects
    replied = 0
    for _, row in rows.iterrows():
        role = json.loads(row["extra"])["role"]
        assert role == row["subject"].split(" vs ")[0]
        messages = [m for m in json.loads(row["messages"]) if m["role"] != "system"]
        if row["turns"] == 0:    # the opponent opened with an illegal move: the seat never moved, shown the board
            assert role == "second" and [m["role"] for m in messages] == ["user"], row.to_dict()
            assert messages[0]["content"].startswith("Heap ") and row["finish"] in ("opponent_no_move",
                                                                                    "opponent_illegal_move"), row.to_dict()
            continue
        assert [m["role"] for m in messages] == ["user", "assistant"] * row["turns"], messages
        heaps = [int(m["content"].split()[1].rstrip(".")) for m in messages[::2]]
        assert all(m["content"].startswith("Heap ") for m in messages[::2]) and 1 <= heaps[0] <= 15, messages
        for k in range(1, len(heaps)):
            own = int(last_number(messages[2 * k - 1]["content"]))
            assert 1 <= heaps[k - 1] - own - heaps[k] <= 3, messages
            replied += 1
    assert replied, "no game went past a seat's first move: nothing shows the other player's moves"
    print(f"self-play nim, mt_grpo: {seconds:.0f}s; task block {task}")
