"""MLflow tracking: parent run per pipeline key, child run per stage, metrics in sections,
trajectories as traces, data sets as inputs, the policy as a model, and a Recorder that never
holds a stage up. Against a real sqlite store (the default backend); the Recorder's outage
rule also against a client that fails the way an unreachable server does."""
import logging
import os
import socket
import time

import mlflow
import pytest

from turnrl.tracking import artifacts, logs, model_logging, recorder, runs, traces
from turnrl.config import Config
from turnrl.errors import Terminated


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """One sqlite store for the module (making one takes seconds); each test its experiment."""
    return f"sqlite:///{tmp_path_factory.mktemp('store') / 'mlflow.db'}"


def _config(store, request, **tracking_cfg):
    experiment = request.node.name.replace("[", "-").replace("]", "")
    return Config.model_validate({"tracking": {"uri": store, "experiment": experiment, "system_metrics": False,
                                               **tracking_cfg}})


@pytest.fixture
def cfg(store, request, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("DVC_ROOT", raising=False)
    return _config(store, request)


def _client(store):
    return mlflow.MlflowClient(tracking_uri=store)


def test_stages_with_one_key_share_a_parent(cfg, tmp_path, monkeypatch):
    monkeypatch.setenv("TURNRL_PIPELINE_KEY", "unit:1")
    for stage in ["preprocess", "train"]:
        with runs.stage_run(stage, cfg):
            runs.log_metrics({"task.pass@1": 0.5, "nan": float("nan"), "text": "x", "reward_mean": 0.25,
                              "step_s": 2.0}, step=1)
    monkeypatch.setenv("TURNRL_PIPELINE_KEY", "unit:2")
    with runs.stage_run("eval", cfg):
        pass
    client = _client(cfg.tracking.uri)
    found = client.search_runs([client.get_experiment_by_name(cfg.tracking.experiment).experiment_id])
    parents = {r.info.run_id: r for r in found if "mlflow.parentRunId" not in r.data.tags}
    children = [r for r in found if "mlflow.parentRunId" in r.data.tags]
    assert len(parents) == 2 and len(children) == 3
    by_stage = {r.data.tags["turnrl.pipeline.stage"]: r for r in children}
    assert by_stage["preprocess"].data.tags["mlflow.parentRunId"] == by_stage["train"].data.tags["mlflow.parentRunId"]
    assert by_stage["eval"].data.tags["mlflow.parentRunId"] != by_stage["train"].data.tags["mlflow.parentRunId"]
    train = by_stage["train"].data
    # '@' is not allowed by MLflow; NaN and text skipped; each name in its section
    logged = {k: v for k, v in train.metrics.items() if not k.startswith("timing/mlflow_")}  # the Recorder's own cost
    assert logged == {"train/task.pass_1": 0.5, "rollout/reward_mean": 0.25, "timing/step_s": 2.0}
    assert train.metrics["timing/mlflow_items_sent"] >= 1
    by_kind = {k: v for k, v in train.metrics.items() if k.startswith("timing/mlflow_thread_cpu_s/")}
    assert "timing/mlflow_thread_cpu_s/metrics" in by_kind      # what the thread's CPU went to, by kind
    assert sum(by_kind.values()) == pytest.approx(train.metrics["timing/mlflow_thread_cpu_s"], abs=1e-6)
    assert train.params["train.steps"] == str(cfg.train.steps)
    assert (tmp_path / "mlartifacts").is_dir()
    # the parent carries what identifies the pipeline run, so found compare in the found table
    parent = parents[by_stage["train"].data.tags["mlflow.parentRunId"]].data.params
    assert parent["env.name"] == "code_tool" and parent["algorithm.name"] == "grpo" and parent["seed"] == "0"
    assert {r.info.status for r in found} == {"FINISHED"}


@pytest.mark.parametrize("raised, status", [(RuntimeError("boom"), "FAILED"), (Terminated("signal 15"), "KILLED")])
def test_a_failing_stage_marks_its_runs_failed_and_a_stopped_one_killed(cfg, monkeypatch, tmp_path, raised, status):
    """An exception: FAILED; Ctrl-C or SIGTERM (Terminated, a KeyboardInterrupt): KILLED."""
    monkeypatch.setenv("TURNRL_PIPELINE_KEY", "unit:3")
    with pytest.raises(type(raised)):
        with runs.stage_run("train", cfg):
            raise raised
    client = _client(cfg.tracking.uri)
    found = client.search_runs([client.get_experiment_by_name(cfg.tracking.experiment).experiment_id])
    assert {r.info.status for r in found} == {status}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _down_server(tmp_path, monkeypatch, **tracking_cfg):
    """A tracking.uri where nothing listens (a server that is down), in a project at tmp_path."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("DVC_ROOT", raising=False)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    uri = f"http://127.0.0.1:{_free_port()}"
    return uri, Config.model_validate({"tracking": {"uri": uri, "system_metrics": False, **tracking_cfg}})


def test_a_server_down_at_the_start_stops_the_stage_in_one_line_when_asked(tmp_path, monkeypatch):
    uri, cfg = _down_server(tmp_path, monkeypatch, on_unreachable="fail")
    with pytest.raises(runs.TrackingUnavailable) as info:
        with runs.stage_run("train", cfg):
            pytest.fail("the stage ran")
    text = str(info.value)
    assert "\n" not in text and f"tracking.uri={uri} does not answer (connection refused)" in text, text
    assert "mlflow server" in text and "tracking.on_unreachable: local" in text
    assert not (tmp_path / "mlflow.db").exists()


def test_a_server_down_at_the_start_records_to_the_local_store(tmp_path, monkeypatch, caplog):
    """tracking.on_unreachable: local (the default): each stage says so in one warning and
    records to the project's mlflow.db, its runs (and their one parent) tagged with the uri."""
    uri, cfg = _down_server(tmp_path, monkeypatch)
    monkeypatch.setenv("TURNRL_PIPELINE_KEY", "unit:fallback")
    with caplog.at_level(logging.WARNING):
        for stage in ("preprocess", "train"):
            with runs.stage_run(stage, cfg) as run:
                runs.log_metrics({"reward_mean": 0.5}, step=1)
                assert run.recorder.uri == runs.local_uri()
    ours = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith("turnrl")]
    assert len(ours) == 2 and all("\n" not in m and f"tracking.uri {uri} does not answer" in m for m in ours), ours
    assert "the train stage records to the project's local store sqlite:///" in ours[1]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and not r.name.startswith("turnrl")
                and uri in r.getMessage()]
    client = _client(f"sqlite:///{tmp_path.resolve()}/mlflow.db")
    experiment = client.get_experiment_by_name("turnrl")
    found = client.search_runs([experiment.experiment_id], f"tags.`{runs.FALLBACK_TAG}` = '{uri}'")
    by_stage = {r.data.tags.get("turnrl.pipeline.stage", "parent"): r for r in found}
    assert set(by_stage) == {"preprocess", "train", "parent"} and len(found) == 3
    train = by_stage["train"]
    assert train.info.status == "FINISHED" and train.data.metrics["rollout/reward_mean"] == 0.5
    assert train.data.tags["mlflow.parentRunId"] == by_stage["parent"].info.run_id


def test_a_store_that_is_not_usable_is_one_line_naming_tracking_uri(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = Config.model_validate({"tracking": {"uri": "nosuchscheme://x", "system_metrics": False}})
    with pytest.raises(runs.TrackingUnavailable, match="Check tracking.uri in params.yaml") as info:
        with runs.stage_run("train", cfg):
            pass
    assert "\n" not in str(info.value) and "nosuchscheme://x" in str(info.value)


@pytest.mark.parametrize("mode", ["local", "fail"])
def test_a_stage_started_with_the_server_down(tmp_path, mode):
    """The real entry point (stages/preprocess.py through run_stage), tracking.uri a port where
    nothing listens: `local` finishes (exit 0) with one line about it and the run in the local
    store; `fail` stops before the stage's work (exit 1) with one line. No traceback."""
    import subprocess
    import sys

    import yaml
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    uri = f"http://127.0.0.1:{_free_port()}"
    params = {"data": {"train_examples": 16, "heldout_examples": 4}, "eval": {"benchmarks": []},
              "tracking": {"uri": uri, "system_metrics": False, "on_unreachable": mode}}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    env = {k: v for k, v in os.environ.items() if k not in ("DVC_ROOT", "TURNRL_PIPELINE_KEY", "TURNRL_PARAMS")}
    env.update(PYTHONPATH=os.path.join(root, "src"), MLFLOW_HTTP_REQUEST_TIMEOUT="5")
    done = subprocess.run([sys.executable, os.path.join(root, "stages", "preprocess.py")], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    about = [line for line in (done.stdout + done.stderr).splitlines() if uri in line or "tracking" in line.lower()]
    assert "Traceback" not in done.stderr and len(about) == 1, done.stderr[-3000:]
    if mode == "fail":
        assert done.returncode == 1 and not (tmp_path / "data").exists()
        assert about[0].startswith(f"turnrl preprocess: the tracking server tracking.uri={uri} does not answer")
        return
    assert done.returncode == 0 and (tmp_path / "data/processed/train.parquet").exists(), done.stderr[-3000:]
    assert "WARNING" in about[0] and "records to the project's local store" in about[0]
    client = _client(f"sqlite:///{tmp_path.resolve()}/mlflow.db")
    run, = client.search_runs([client.get_experiment_by_name("turnrl").experiment_id],
                              f"tags.`turnrl.pipeline.stage` = 'preprocess' and tags.`{runs.FALLBACK_TAG}` = '{uri}'")
    assert run.info.status == "FINISHED" and run.data.metrics["data/train_n"] == 16


def test_a_resumed_stage_continues_its_run_under_a_new_pipeline(cfg, monkeypatch, tmp_path):
    client = _client(cfg.tracking.uri)
    monkeypatch.setenv("TURNRL_PIPELINE_KEY", "unit:crashed")
    with runs.stage_run("train", cfg) as run:
        runs.log_metrics({"reward_mean": 0.1}, step=1)
        first = run.info.run_id
    crashed_parent = client.get_run(first).data.tags["mlflow.parentRunId"]
    client.update_run(first, "RUNNING")            # as a kill -9 leaves them
    client.update_run(crashed_parent, "RUNNING")

    monkeypatch.setenv("TURNRL_PIPELINE_KEY", "unit:rerun")
    longer = cfg.model_copy(update={"train": cfg.train.model_copy(update={"steps": 60})})
    with runs.stage_run("train", longer, resume_run_id=first) as run:
        assert run.info.run_id == first
        runs.log_metrics({"reward_mean": 0.2}, step=2)
    resumed = client.get_run(first)
    assert resumed.info.status == "FINISHED" and resumed.data.params["train.steps"] == str(cfg.train.steps)
    assert resumed.data.tags["turnrl.params_changed_on_resume"] == '{"train.steps": "60"}'
    assert [m.step for m in client.get_metric_history(first, "rollout/reward_mean")] == [1, 2]
    assert client.get_run(crashed_parent).info.status == "KILLED"
    new_parent = client.search_runs([resumed.info.experiment_id], "tags.`turnrl.pipeline_key` = 'unit:rerun'")[0]
    assert new_parent.data.tags["turnrl.pipeline.stage.train"] == f"resumed run {first}"

    # a run id this store does not have: a new run that names it
    with runs.stage_run("train", cfg, resume_run_id="0" * 32) as run:
        assert run.info.run_id != first
    assert client.get_run(run.info.run_id).data.tags["turnrl.resumed_from_run"] == "0" * 32


def test_parent_params_name_the_knobs_changed_from_their_defaults():
    cfg = Config.model_validate({"train": {"lr": 1e-4}, "algorithm": {"kl_coef": 0.01}, "rollout": {"temperature": 0.7},
                                 "tracking": {"experiment": "x"}})
    params = runs.identifying_params(cfg)
    assert params["train.lr"] == "0.0001" and params["algorithm.kl_coef"] == "0.01"
    assert params["rollout.temperature"] == "0.7"
    assert "train.steps" in params and "env.name" in params            # identifying, changed or not
    assert "train.zero_stage" not in params and not any(k.startswith("tracking.") for k in params)


@pytest.mark.parametrize("key, name", [
    ("reward_mean", "rollout/reward_mean"), ("accuracy", "rollout/accuracy"), ("turn2_tokens_mean",
                                                                               "rollout/turn2_tokens_mean"),
    ("finish_answer_frac", "rollout/finish_answer_frac"), ("env_f1_mean", "rollout/env_f1_mean"),
    ("reward_fewer_guesses_mean", "rollout/reward_fewer_guesses_mean"),
    ("loss", "loss/loss"), ("entropy", "loss/entropy"), ("kl_ref", "loss/kl_ref"), ("grad_norm", "loss/grad_norm"),
    ("clip_fraction", "loss/clip_fraction"), ("ratio_max", "loss/ratio_max"),
    ("step_s", "timing/step_s"), ("rollout_s", "timing/rollout_s"), ("engine_idle_frac", "timing/engine_idle_frac"),
    ("gen_tokens_per_s", "timing/gen_tokens_per_s"),
    ("tool_call_rate", "tools/tool_call_rate"), ("tool_success_rate", "tools/tool_success_rate"),
    ("tool_calls_mean", "tools/tool_calls_mean"), ("env_tool_ok_mean", "tools/env_tool_ok_mean"),
    ("advantage_abs_mean", "advantage/advantage_abs_mean"), ("advantage_turn1_std", "advantage/advantage_turn1_std"),
    ("value_loss", "critic/value_loss"), ("explained_variance", "critic/explained_variance"),
    ("logp_gap_p99", "logprob_gap/logp_gap_p99"), ("health_no_signal", "health/no_signal"),
    ("high_loss", "high/loss"), ("mlmt_turn1_kl_mean", "mlmt/turn1_kl_mean"),
    ("eval/task/accuracy", "eval/task/accuracy"), ("something_new", "train/something_new"),
])
def test_metric_sections(key, name):
    assert recorder.mlflow_name(key) == name


# --------------------------------------------------------------------------- traces
def _trajectory(env, turns, times=True):

    from turnrl.rollout.chat import ChatFormat
    from turnrl.rollout.multi_turn import replay
    global _TOKENIZER
    if "_TOKENIZER" not in globals():
        from turnrl.data.synthetic import product_rows
        from turnrl.models.tiny import build_tokenizer
        rows = product_rows(50, seed=0, split="train", exclude=set())
        _TOKENIZER = build_tokenizer([r["prompt"] + "<code>print(1)</code><answer>1</answer><feedback>x</feedback>"
                                     for r in rows], 400)
    example = {"prompt": "Compute 12 * 34.", "answer": "408", "id": "p1"}
    t = replay(env, ChatFormat(_TOKENIZER), example, turns)
    if times:   # replay times only the environment; a rollout also times each generation
        t.turn_times = [(start - 0.5, start - 0.01) for start, _ in t.env_times]
    return t


def test_trace_of_a_tool_trajectory_has_a_turn_span_with_generation_and_tool_call():
    from turnrl.envs.code_tool import CodeToolEnv
    t = _trajectory(CodeToolEnv(), ["<code>print(12*)</code>", "<code>print(12*34)</code>", "<answer>408</answer>"])
    plan = traces.plan(t, name="rollout", tags={"step": 3}, advantage=0.5)
    spans = plan.spans()
    turns = [s for s in spans if s.span_type == "CHAIN"]
    assert [s.name for s in turns] == ["turn 1", "turn 2", "turn 3"]
    for turn in turns:
        assert [c.span_type for c in turn.children] == ["LLM", "TOOL"]
        llm, tool = turn.children
        assert llm.end_ns <= tool.start_ns and turn.start_ns == llm.start_ns and turn.end_ns == tool.end_ns
        assert llm.attributes["tokens"] > 0 and llm.attributes["mlflow.chat.tokenUsage"]["output_tokens"] > 0
    first, second, third = (turn.children[1] for turn in turns)
    assert (first.name, first.inputs) == ("code", {"arguments": "print(12*)"})
    assert "SyntaxError" in first.outputs["result"]
    assert second.outputs["result"] == "<output>408</output>" and second.error is None
    assert (third.name, third.inputs) == ("answer", {"arguments": "408"}) and third.outputs["result"]["outcome"] == 1.0
    assert turns[1].children[0].inputs == {"read": first.outputs["result"]}    # what the policy read
    assert abs((first.end_ns - first.start_ns) / 1e9 - (t.env_times[0][1] - t.env_times[0][0])) < 1e-6
    reward = spans[-1]
    assert reward.name == "reward" and reward.outputs["reward"] == 1.0 and reward.outputs["advantage"] == 0.5
    assert plan.tags == {"finish": "answer", "reward": "1", "turns": "3", "step": "3"}
    assert plan.root.attributes["advantage"] == 0.5 and plan.root.inputs["task"] == "Compute 12 * 34."
    assert plan.feedback[0]["name"] == "reward" and plan.feedback[0]["value"] == 1.0


def test_a_failed_last_tool_call_and_a_raising_environment_are_errors():
    from turnrl.envs.code_tool import CodeToolEnv
    t = _trajectory(CodeToolEnv(), ["<code>print(12*)</code>", "<answer>0</answer>"])
    tool = traces.plan(t, name="r", tags={}).spans()[3]
    assert tool.name == "code" and "SyntaxError" in tool.error            # info: tool_ok false, tool_error

    class Broken(CodeToolEnv):
        def step(self, text):
            if "answer" in text:
                raise RuntimeError("grader exploded")
            return super().step(text)

    from turnrl.rollout.multi_turn import _safe_step
    env = Broken()
    t = _trajectory(env, ["<code>print(1)</code>"])
    env.reset(t.example)
    result, ran = _safe_step(env, "<answer>1</answer>")     # as the rollout loop records it
    t.add_turn(1, [5], [0.0], "<answer>1</answer>")
    t.turn_times.append((ran[0] - 0.1, ran[0]))
    t.env_times.append(ran)
    t.record(result)
    plan = traces.plan(t, name="r", tags={})
    last_tool = [s for s in plan.spans() if s.span_type == "TOOL"][-1]
    assert t.finish == "env_error" and "grader exploded" in last_tool.error and "grader exploded" in plan.root.error


def test_two_level_turns_and_truncated_turns_trace_too():
    from turnrl.envs.math_refine import MathRefineEnv
    t = _trajectory(MathRefineEnv(), ["<answer>400</answer>", "<feedback>Check 2*4.</feedback>", "<answer>408</answer>"])
    names = [s.name for s in traces.plan(t, name="r", tags={}).spans() if s.span_type in ("CHAIN", "LLM")]
    assert names == ["turn 1", "generate", "turn 2 (high level)", "generate (high level)", "turn 3", "generate"]
    # a turn cut by the token budget: a generation without an environment step
    from turnrl.envs.code_tool import CodeToolEnv
    t = _trajectory(CodeToolEnv(), ["<code>print(1)</code>"])
    t.add_turn(1, [5, 6], [0.0, 0.0], "<code>pri")
    t.turn_times.append((time.time() - 0.2, time.time()))
    t.turn_rewards.append(0.0)
    t.finish = "truncated"
    turn2 = [s for s in traces.plan(t, name="r", tags={}).spans() if s.name == "turn 2"][0]
    assert [c.span_type for c in turn2.children] == ["LLM"]


def test_sampling_and_group_advantages():
    assert traces.traced_step(1, 5, 40) and traces.traced_step(10, 5, 40) and traces.traced_step(40, 5, 40)
    assert not traces.traced_step(7, 5, 40) and not traces.traced_step(1, 0, 40)
    assert traces.sample_indices(32, 4) == [0, 8, 16, 24] and traces.sample_indices(3, 8) == [0, 1, 2]
    adv = traces.group_advantages([1, 0, 0, 0, 1, 1, 1, 1], 4)
    assert adv[0] == pytest.approx(1.5, rel=1e-4) and adv[1] == pytest.approx(-0.5, rel=1e-4)
    assert adv[4:] == [0.0] * 4                        # a group with one reward: no signal


def test_traces_are_searchable_by_step_reward_and_finish(cfg, tmp_path, monkeypatch):
    from turnrl.envs.code_tool import CodeToolEnv
    good = _trajectory(CodeToolEnv(), ["<code>print(12*34)</code>", "<answer>408</answer>"])
    bad = _trajectory(CodeToolEnv(), ["<answer>400</answer>"])
    monkeypatch.setenv("TURNRL_PIPELINE_KEY", "unit:traces")
    with runs.stage_run("train", cfg) as run:
        for step in (1, 2):
            traces.log_traces(run, traces.rollout_traces([good, bad, bad, good], step, 2, 4, env="code_tool"))
        traces.log_traces(run, traces.evaluation_traces([good, bad], "task", "final", 8,
                                                        reason=lambda t: "exact"))
    mlflow.set_tracking_uri(cfg.tracking.uri)
    exp = run.experiment_id

    def search(text=None, **kw):
        return mlflow.search_traces(locations=[exp], filter_string=text, return_type="list", **kw)
    assert len(search(run_id=run.run_id)) == 10                      # linked to the stage run
    assert len(search("tags.kind = 'rollout' AND tags.step = '2'")) == 4
    assert len(search("tags.kind = 'rollout' AND tags.finish = 'answer' AND tags.reward = '1'")) == 4
    assert len(search("feedback.reward >= 1")) == 5
    assert len(search("feedback.correct = 'true'")) == 1
    trace = search("tags.kind = 'evaluation' AND tags.correct = 'false'")[0]
    spans = {s.name: s for s in trace.data.spans}
    assert {"generate", "answer", "reward"} <= set(spans) and spans["generate"].span_type == "LLM"
    assert spans["answer"].span_type == "TOOL" and trace.info.tags["benchmark"] == "task"
    correct = [a for a in trace.info.assessments if a.name == "correct"][0]
    assert correct.value is False and correct.rationale == "exact"


def test_stages_seeded_alike_make_distinct_trace_ids(cfg, monkeypatch):
    """Each stage seeds Python's random with cfg.seed; trace ids must not follow it (the
    baseline's and the final evaluation's traces once got the same ids and overwrote each other)."""
    import random

    from turnrl.envs.code_tool import CodeToolEnv
    monkeypatch.delenv("MLFLOW_TRACE_USE_ISOLATED_RANDOM_ID_GENERATOR", raising=False)
    mlflow.tracing.reset()   # the tracer provider reads the setting when it is made
    traj = _trajectory(CodeToolEnv(), ["<answer>408</answer>"])
    ids = []
    for stage, key in (("baseline_eval", "unit:ids-a"), ("eval", "unit:ids-b")):
        monkeypatch.setenv("TURNRL_PIPELINE_KEY", key)
        random.seed(cfg.seed)
        with runs.stage_run(stage, cfg) as run:
            traces.log_traces(run, traces.evaluation_traces([traj, traj], "task", stage, 8))
        mlflow.set_tracking_uri(cfg.tracking.uri)
        ids += [t.info.trace_id for t in mlflow.search_traces(locations=[run.experiment_id], run_id=run.run_id,
                                                               return_type="list")]
    assert len(ids) == 4 and len(set(ids)) == 4
    mlflow.tracing.reset()


def test_a_stage_that_traced_exits_without_a_traceback(tmp_path):
    """MLflow's isolated trace-id generator, collected at interpreter exit, printed "Exception
    ignored in ... __del__" with a traceback at the end of every stage's log."""
    import subprocess
    import sys
    script = (
        "from turnrl.tracking import runs, traces\n"
        "from turnrl.config import Config\n"
        "from turnrl.envs.code_tool import CodeToolEnv\n"
        "from tests.test_tracking import _trajectory\n"
        f"cfg = Config.model_validate({{'tracking': {{'uri': 'sqlite:///{tmp_path}/m.db', 'system_metrics': False}}}})\n"
        "t = _trajectory(CodeToolEnv(), ['<answer>408</answer>'])\n"
        "with runs.stage_run('eval', cfg) as run:\n"
        "    traces.log_traces(run, traces.evaluation_traces([t], 'task', 'eval', 8))\n"
        "print('traced', flush=True)\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root, "TURNRL_PIPELINE_KEY": "unit:exit"}
    env.pop("MLFLOW_TRACE_USE_ISOLATED_RANDOM_ID_GENERATOR", None)   # the stage's own default
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and "traced" in done.stdout, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr, done.stderr[-3000:]


# --------------------------------------------------------------------------- recorder
def test_the_recorder_gives_up_on_an_outage_once_and_never_blocks(tmp_path, caplog):
    """An outage (what an unreachable server raises) while steps keep coming: submit never
    waits, the call is retried for retry_s, then one warning, and the rest is dropped and
    counted; a refused request (4xx) drops that item only."""
    import requests
    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE

    rec = recorder.Recorder(f"sqlite:///{tmp_path / 'x.db'}", retry_s=1.0, stage="train")
    sent, attempts = [], []

    def ok(step):
        return lambda client: sent.append(step)

    def refused(client):
        raise MlflowException("bad value", error_code=INVALID_PARAMETER_VALUE)

    def unreachable(client):
        attempts.append(time.monotonic())
        raise requests.exceptions.ConnectionError("Connection refused")

    with caplog.at_level(logging.INFO, logger="turnrl.tracking"):
        rec.submit("metrics", "step 1", ok(1))
        rec.submit("params", "p", refused)
        assert rec.flush(5) and sent == [1] and rec.refused == {"params": 1}
        start = time.perf_counter()
        rec.submit("metrics", "step 2", unreachable)
        for step in range(3, 8):
            rec.submit("metrics", f"step {step}", ok(step))
            rec.submit("traces", f"trace {step}", ok(step))
        assert time.perf_counter() - start < 0.1                 # the stage never waited
        deadline = time.monotonic() + 10
        while not rec.down and time.monotonic() < deadline:
            time.sleep(0.05)
        assert rec.down and 0.9 <= attempts[-1] - attempts[0] <= 1.5 and len(attempts) >= 2
        rec.submit("metrics", "step 8", ok(8))
        assert rec.now("model", "the policy", lambda: 1 / 0) is None     # dropped without trying
        rec.close()
    assert sent == [1]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2                                  # the refused item, the outage
    assert "refused to record params" in warnings[0].getMessage()
    assert "did not answer for 1 s" in warnings[1].getMessage() and "step 2" in warnings[1].getMessage()
    assert rec.dropped_summary() == "metrics of 7 steps (2-8); 5 traces; model: the policy"
    assert "not recorded to MLflow" in caplog.records[-1].getMessage()


def test_a_short_outage_is_ridden_out(tmp_path):
    import requests
    rec = recorder.Recorder(f"sqlite:///{tmp_path / 'x.db'}", retry_s=10.0)
    calls = []

    def flaky(client):
        calls.append(1)
        if len(calls) < 3:
            raise requests.exceptions.ConnectionError("refused")

    rec.submit("metrics", "step 1", flaky)
    assert rec.flush(10) is True or rec._pending == 0
    rec.close()
    assert len(calls) == 3 and not rec.down and not rec.dropped


def test_repeated_warnings_are_shown_once():
    f = logs.OnceFilter()
    record = lambda msg, level=logging.WARNING: logging.LogRecord("vllm.x", level, "f", 1, msg, (), None)  # noqa: E731
    assert f.filter(record("RotaryEmbedding: Failed to load weights"))
    assert not f.filter(record("RotaryEmbedding: Failed to load weights"))
    assert f.filter(record("took 0.05 seconds", logging.INFO)) and f.filter(record("took 0.07 seconds", logging.INFO))
    assert f.filter(record("step 3 unhealthy")) and not f.filter(record("step 4 unhealthy"))
    ours = logging.LogRecord("turnrl.training.loop", logging.WARNING, "f", 1, "step 9: unhealthy (no_signal)", (), None)
    assert f.filter(ours) and f.filter(ours)            # turnrl's own warnings always say something new
    assert f.filter(record("engine died", logging.ERROR)) and f.filter(record("engine died", logging.ERROR))


def test_vllms_rotary_warning_after_a_weight_push_is_dropped(capsys, tmp_path):
    """The logging configuration quiet_logs gives vLLM (the file its engines and the Ray actors
    read), applied the way an engine applies it, drops the expected `RotaryEmbedding: Failed to
    load weights` of vLLM's own reload logger and lets the same warning for a layer whose weights
    were really not pushed through."""
    import json

    from vllm.config.logging import LoggingConfig
    from vllm.logger import configure_logging
    from vllm.model_executor.model_loader.reload import layerwise
    assert layerwise.logger.name == logs.RELOAD_LOGGER       # where vLLM 0.32 logs it
    vllm_logger = logging.getLogger("vllm")
    saved = vllm_logger.handlers[:], vllm_logger.level, vllm_logger.propagate, layerwise.logger.filters[:]
    layerwise.logger.filters.clear()                         # only the configured handler's filters
    try:
        path = tmp_path / "vllm-logging.json"
        path.write_text(json.dumps(logs.vllm_logging_config("WARNING")))
        configure_logging(LoggingConfig(log_level="WARNING", configure_logging=True, pylogging_config_file=str(path)))
        for layer in ("RotaryEmbedding", "Llama3RotaryEmbedding", "RotaryEmbedding", "Qwen2Attention"):
            layerwise.logger.warning("%s: Failed to load weights", layer)
    finally:
        vllm_logger.handlers[:], layerwise.logger.filters[:] = saved[0], saved[3]
        vllm_logger.setLevel(saved[1])
        vllm_logger.propagate = saved[2]
    out = capsys.readouterr().out
    assert "RotaryEmbedding" not in out and out.count("Qwen2Attention: Failed to load weights") == 1, out
    f = logs.RotaryCacheFilter()
    other = logging.LogRecord("vllm.other", logging.WARNING, "f", 1, "%s: Failed to load weights",
                              ("RotaryEmbedding",), None)
    assert f.filter(other)                                   # another logger's message is not ours to drop


def test_system_metrics_on_the_stage_run(store, request, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TURNRL_PIPELINE_KEY", "unit:system")
    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "0.5")
    metrics = {}
    for on in (True, False):
        cfg = _config(store, request, system_metrics=on)
        with runs.stage_run(f"stage-{on}", cfg) as run:
            time.sleep(1.6)
        metrics[on] = _client(store).get_run(run.run_id).data.metrics
    assert {"system/cpu_utilization_percentage", "system/system_memory_usage_megabytes"} <= set(metrics[True])
    assert not any(k.startswith("system/") for k in metrics[False])


# --------------------------------------------------------------------------- data and the model
def test_data_sets_are_run_inputs_with_their_dvc_md5(cfg, tmp_path, monkeypatch):
    import hashlib

    import pandas as pd
    (tmp_path / "data/processed").mkdir(parents=True)
    pd.DataFrame({"prompt": ["a", "b"], "answer": ["1", "2"]}).to_parquet(tmp_path / "data/processed/train.parquet")
    (tmp_path / "dvc.lock").write_text("schema: '2.0'\nstages:\n  preprocess:\n    cmd: x\n    outs:\n"
                                       "    - path: data/processed\n      md5: abc123.dir\n")
    monkeypatch.setenv("TURNRL_PIPELINE_KEY", "unit:data")
    with runs.stage_run("train", cfg) as run:
        artifacts.log_datasets(run, {"train": ("data/processed/train.parquet", "training"),
                                     "missing": ("data/processed/nothing.parquet", "evaluation")})
    client = _client(cfg.tracking.uri)
    md5 = hashlib.md5((tmp_path / "data/processed/train.parquet").read_bytes()).hexdigest()
    for run_id in (run.run_id, run.parent_id):
        inputs = client.get_run(run_id).inputs.dataset_inputs
        assert [(i.dataset.name, i.dataset.digest) for i in inputs] == [("train", md5)]
        tags = {t.key: t.value for t in inputs[0].tags}
        assert tags == {"mlflow.data.context": "training", "dvc.md5": md5, "dvc.out_md5": "abc123.dir"}


@pytest.mark.parametrize("copy", [True, False], ids=["copy", "reference"])
def test_the_policy_is_a_transformers_model_that_loads_and_registers(store, request, tmp_path, monkeypatch,
                                                                       tiny_model_dir, copy):
    import shutil
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TURNRL_PIPELINE_KEY", f"unit:model:{copy}")
    shutil.copytree(tiny_model_dir, tmp_path / "models/final")
    # MLflow asks the Hub for a license by the model's name: never by a repo-like relative path
    # (offline, five retried requests); an absolute folder is no repo id, so nothing is asked
    import huggingface_hub
    asked = []
    real_list = huggingface_hub.list_repo_files
    monkeypatch.setattr(huggingface_hub, "list_repo_files", lambda name, *a, **k: asked.append(name) or
                        real_list(name, *a, **k))
    cfg = _config(store, request, model_copy_max_mb=1000 if copy else 0, register_model=f"turnrl-unit-{copy}")
    with runs.stage_run("train", cfg) as run:
        model_id = model_logging.log_policy(run, "models/final")
    assert asked == ([str(tmp_path / "models/final")] if copy else [])
    with runs.stage_run("eval", cfg) as evaluation:
        version = model_logging.register_policy(evaluation, "models/final", {"task": {"accuracy": 0.25}},
                                                {"task": {"accuracy": 0.75}, "math500": {"accuracy": 0.1}})
    mlflow.set_tracking_uri(store)
    logged = mlflow.get_logged_model(model_id)
    assert logged.source_run_id == run.run_id and logged.tags["turnrl.storage"] == ("copy" if copy else
                                                                                  f"reference to {tmp_path}/models/final")
    parts = mlflow.transformers.load_model(f"models:/{model_id}", return_type="components")
    assert type(parts["model"]).__name__ == "Qwen2ForCausalLM" and parts["tokenizer"] is not None
    ids = parts["tokenizer"]("Compute 1 * 2.", return_tensors="pt")["input_ids"]
    assert parts["model"](input_ids=ids).logits.isfinite().all()
    requirements = mlflow.pyfunc.get_model_dependencies(f"models:/{model_id}")
    assert "torchvision" not in open(requirements).read()
    artifacts = mlflow.artifacts.download_artifacts(f"models:/{model_id}")
    weights = [p for p in os.listdir(artifacts) + os.listdir(os.path.join(artifacts, "model"))
               if p.endswith(".safetensors")] if os.path.isdir(os.path.join(artifacts, "model")) else []
    assert bool(weights) is copy                         # a reference holds no second copy of the weights
    assert version.name == f"turnrl-unit-{copy}" and version.tags["env"] == "code_tool" and \
        version.tags["algorithm"] == "grpo" and version.tags["accuracy"] == "0.7500"
    assert version.tags["accuracy_diff.task"] == "+0.5000" and version.tags["accuracy.math500"] == "0.1000"


def test_a_programs_trace_context_is_read_from_its_traceparent_header():
    tid, sid = "3a8043078fdce521be88f4f5f8358c86", "49292c844fc4f55f"
    assert traces.program_context(f"00-{tid}-{sid}-03") == (f"tr-{tid}", sid)
    assert traces.program_context(f" 00-{tid.upper()}-{sid}-01 ") == (f"tr-{tid}", sid)
    for bad in ("", "garbage", f"00-{tid}-{sid}", f"00-{'0' * 32}-{sid}-01", f"00-{tid[:-1]}-{sid}-01"):
        assert traces.program_context(bad) is None, bad


def test_program_spans_join_with_each_call_record_under_the_span_that_made_it():
    from types import SimpleNamespace as NS
    ok = NS(status_code="OK", description="")
    spans = {"tr-p": [NS(span_id="a", parent_id=None, name="agent", span_type="AGENT", start_time_ns=10, end_time_ns=90,
                         inputs={"q": 1}, outputs=1.0, attributes={"mlflow.spanInputs": "x", "mine": 2}, status=ok),
                      NS(span_id="c", parent_id="a", name="Completions", span_type="CHAT_MODEL", start_time_ns=20,
                         end_time_ns=40, inputs=None, outputs=None, attributes={},
                         status=NS(status_code="ERROR", description="boom"))]}
    turn = traces.SpanPlan("turn 1", "CHAIN", 21, 39, under="c")
    other = traces.SpanPlan("turn 2", "CHAIN", 50, 60, under="not-in-the-store")
    reward = traces.SpanPlan("reward", "EVALUATOR", 60, 60)
    root = traces.SpanPlan("rollout", "AGENT", 21, 60, attributes={"x": 1}, children=[turn, other, reward])
    joined, names = traces.join_program_spans(root, spans)
    assert names == ["tr-p"] and joined.attributes == {"x": 1, "program_traces": ["tr-p"]}
    assert (joined.start_ns, joined.end_ns) == (10, 90) and root.start_ns == 21   # pure: the input is unchanged
    assert [c.name for c in joined.children] == ["agent", "turn 2", "reward"]
    agent = joined.children[0]
    assert agent.attributes == {"program_span": True, "mine": 2} and agent.inputs == {"q": 1}
    (completions,) = agent.children
    assert completions.error == "boom" and completions.children == [turn]
