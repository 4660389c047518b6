"""Checks first, and failures that keep what was done.

`turnrl config` and `turnrl evaluate` find a missing data or benchmark file, a field mapping
naming no field of the file, and a stdio MCP command that does not exist before any work (exit
2, the key named); the train stage that a reward function stops (reward.on_error: fail) leaves
its curves, metrics/train.json marked failed and its MLflow steps; baseline_eval's failure is
one line.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from turnrl.config import Config
from turnrl.config import checks

from conftest import ROOT

ROWS = [{"question": f"What is {i} + {i}?", "solution": str(2 * i)} for i in range(6)]


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _cfg(**sections) -> Config:
    return Config.model_validate(sections)


# --------------------------------------------------------------------------- the checks, in process
def test_data_files_must_exist_and_their_mapping_name_fields_of_the_first_rows(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _jsonl(tmp_path / "mine.jsonl", ROWS)
    ok = _cfg(data={"train_set": "mine.jsonl", "heldout_set": "mine.jsonl",
                    "fields": {"prompt": "question", "answer": "solution"}})
    assert checks.data_problems(ok) == []

    missing, = checks.data_problems(_cfg(data={"train_set": "nope.jsonl"}))
    assert missing.startswith("data.train_set = 'nope.jsonl': no such file") and "fix the path" in missing

    typo, = checks.data_problems(_cfg(data={"train_set": "mine.jsonl", "fields": {"prompt": "question",
                                                                                "answer": "soluton"}}))
    assert typo.startswith("data.fields.answer = 'soluton': no such field in the first 6 rows of mine.jsonl")
    assert "its fields: question, solution" in typo and "map answer to one of them" in typo

    # a row that lacks a field is a malformed row: preprocess names its line (or drops it), as before
    _jsonl(tmp_path / "holey.jsonl", ROWS[:2] + [{"question": "What is 9 + 9?"}] + ROWS[2:])
    assert checks.data_problems(_cfg(data={"train_set": "holey.jsonl",
                                           "fields": {"prompt": "question", "answer": "solution"}})) == []

    # without data.fields the loader guesses; a file it cannot guess for is named
    _jsonl(tmp_path / "odd.jsonl", [{"text": "hi", "label": "1"}])
    guess, = checks.data_problems(_cfg(data={"train_set": "odd.jsonl"}))
    assert guess.startswith("data.fields: ") and "lacks prompt" in guess


def test_an_sft_file_s_first_rows_are_read_before_any_work(tmp_path, monkeypatch):
    """A conversation file whose rows are not conversations (or not in sft.messages_field) is
    named by `turnrl config` and every stage's start, not after prepare_model's warm start."""
    monkeypatch.chdir(tmp_path)
    good = {"messages": [{"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": "4"}]}
    _jsonl(tmp_path / "chats.jsonl", [good, good])
    assert checks.sft_problems(_cfg(sft={"data": "chats.jsonl"})) == []
    wrong_field, = checks.sft_problems(_cfg(sft={"data": "chats.jsonl", "messages_field": "msgs"}))
    assert wrong_field.startswith("sft.data: chats.jsonl:1: field 'msgs' must be a non-empty list of messages")
    _jsonl(tmp_path / "bad.jsonl", [good, {"messages": "oops"}])
    bad_row, = checks.sft_problems(_cfg(sft={"data": "bad.jsonl"}))
    assert bad_row.startswith("sft.data: bad.jsonl:2: field 'messages' must be a non-empty list")


def test_a_served_model_cannot_be_the_train_stage_s_own_output(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    problem, = checks.model_problems(_cfg(reward={"teacher": {"serve": "models/final"}}))
    assert problem.startswith("reward.teacher.serve = 'models/final': that is the train stage's own output")
    assert "cp -r models/final teacher" in problem
    judged, = checks.model_problems(_cfg(reward={"judges": [{"name": "j", "template": "Rate: {completion}",
                                                                 "serve": "./models/final/"}]}))
    assert judged.startswith("reward.judges[0].serve = './models/final/'")
    assert checks.model_problems(_cfg(reward={"teacher": {"serve": "teacher"}})) == []


def test_benchmark_files_and_their_mappings_are_checked_by_key(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _jsonl(tmp_path / "bench.jsonl", ROWS)
    cfg = _cfg(eval={"benchmarks": [
        "math500",   # registered, no path: found (or reported unavailable) by the evaluation
        {"name": "mine", "path": "bench.jsonl", "fields": {"prompt": "question", "answer": "solution"}},
        {"name": "gone", "path": "gone.jsonl", "fields": {"prompt": "question", "answer": "solution"}},
        {"name": "typo", "path": "bench.jsonl", "fields": {"prompt": "question", "answer": "final"}}]})
    gone, typo = checks.benchmark_problems(cfg)
    assert gone.startswith("eval.benchmarks.2.path = 'gone.jsonl': no such file")
    assert "or remove benchmark 'gone' from eval.benchmarks" in gone
    assert typo.startswith("eval.benchmarks.3.fields.answer = 'final': no such field")


def test_a_stdio_mcp_command_must_exist(tmp_path, monkeypatch, capsys):
    """Checked with the options (turnrl.envs.tools) or by checks.tool_problems: either way
    `turnrl config` exits 2 naming env.options.mcp.N."""
    from turnrl import cli
    monkeypatch.chdir(tmp_path)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({"seed": 0, "env": {"name": "tools"}}))

    def config(command: list[str]) -> tuple[int, str]:
        # (the calculator among the tools: model.path tiny's warm start has its demonstrations)
        code = cli.main(["config", "--quiet", "-S", "env.options={functions: ['turnrl.envs.tools.calculator:calculator'], "
                         "mcp: [{command: %s}]}" % json.dumps(command)])
        return code, capsys.readouterr().err
    assert config([sys.executable, "server.py"]) == (0, "")
    code, err = config(["no-such-mcp-server", "--stdio"])
    assert code == 2 and "env.options.mcp.0" in err and "no-such-mcp-server" in err, err
    code, err = config([str(tmp_path / "bin" / "server")])
    assert code == 2 and "env.options.mcp.0" in err and str(tmp_path / "bin" / "server") in err, err
    # HTTP servers are not the params check's business (reachable or not at run time)
    assert checks.tool_problems(_cfg(env={"name": "tools", "options": {
        "functions": [], "mcp": [{"url": "http://127.0.0.1:9/mcp"}]}})) == []


def _turnrl(args: list[str], cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "MLFLOW_DISABLE_TELEMETRY": "true"}
    return subprocess.run([sys.executable, "-m", "turnrl.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_turnrl_config_with_overrides_names_every_problem_and_exits_2(tmp_path):
    """One `turnrl config -S ...` with three problems: three lines, each naming its key, exit 2."""
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({"seed": 0}))
    _jsonl(tmp_path / "bench.jsonl", ROWS)
    start = time.perf_counter()
    out = _turnrl(["config", "-S", "data.train_set=missing.jsonl",
                   "-S", "eval.benchmarks=[{name: gone, path: gone.jsonl}, "
                         "{name: mine, path: bench.jsonl, fields: {prompt: question, answer: answr}}]"],
                  tmp_path)
    seconds = time.perf_counter() - start
    assert out.returncode == 2, out.stderr[-2000:]
    lines = [line for line in out.stderr.splitlines() if line.startswith("turnrl config: ")]
    assert [line.split(" = ")[0] for line in lines] == [
        "turnrl config: data.train_set", "turnrl config: eval.benchmarks.0.path",
        "turnrl config: eval.benchmarks.1.fields.answer"], out.stderr
    assert "Traceback" not in out.stderr and out.stdout == ""
    assert seconds < 60, seconds   # seconds (an import of turnrl), never a stage's minutes

    _jsonl(tmp_path / "mine.jsonl", ROWS)
    ok = _turnrl(["config", "--quiet", "-S", "data.train_set=mine.jsonl", "-S", "data.heldout_set=mine.jsonl",
                  "-S", "data.fields={prompt: question, answer: solution}"], tmp_path)
    assert ok.returncode == 0 and ok.stdout == "", ok.stderr[-2000:]


def test_turnrl_evaluate_checks_benchmark_files_before_evaluating(tmp_path, monkeypatch, capsys):
    """A missing benchmark file: exit 2 at once, naming the key, the path and the fix; nothing
    is loaded or written (the checkpoint, not there either, is not even looked at)."""
    from turnrl import cli
    monkeypatch.chdir(tmp_path)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({"seed": 0}))
    start = time.perf_counter()
    code = cli.main(["evaluate", "no-checkpoint-here", "--out", "eval-out",
                     "-S", "eval.benchmarks=[{name: olympiad, path: data/olympiad.jsonl}]"])
    seconds = time.perf_counter() - start
    err = capsys.readouterr().err
    assert code == 2 and not (tmp_path / "eval-out").exists() and seconds < 30, seconds
    assert "eval.benchmarks.0.path = 'data/olympiad.jsonl': no such file" in err and "fix the path" in err
    assert "no-checkpoint-here" not in err   # the benchmark check came first


# --------------------------------------------------------------------------- one line per failure
def test_a_stage_failure_is_one_line(capsys):
    from turnrl.pipeline.stage import failure_exit
    from turnrl.rewards.functions import RewardFunctionError
    assert failure_exit("baseline_eval", RewardFunctionError("reward function m:f (reward.functions) raised "
                                                             "ValueError: no")) == 1
    assert capsys.readouterr().err == "turnrl baseline_eval: reward function m:f (reward.functions) raised ValueError: no\n"
    try:
        {}["missing"]
    except KeyError as exc:
        assert failure_exit("eval", exc) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("Traceback") and err[-1].startswith("turnrl eval: failed: KeyError: 'missing'")


# --------------------------------------------------------------------------- real stages
FAILING_REWARD = """
from pathlib import Path
CALLS = Path({calls!r})   # a file: the rollout actors are other processes


def score(prompt, completion, answer, **info):
    with CALLS.open("a") as f:
        f.write("x")
    if len(CALLS.read_text()) > {after}:
        raise ValueError("the grading service went away")
    return 0.0
"""


def _failing_project(root: Path, model_dir: Path, after: int, **params) -> Path:
    from test_resume import PARAMS, _project
    _project(root, model_dir)
    (root / "failing_reward.py").write_text(FAILING_REWARD.format(calls=str(root / "calls.txt"), after=after))
    merged = {**PARAMS, "reward": {"functions": ["failing_reward:score"], "on_error": "fail"},
              "rollout": {**PARAMS["rollout"], "engine": "hf"},   # spares a vLLM start (~50 s in CI)
              **params}
    (root / "params.yaml").write_text(yaml.safe_dump(merged))
    return root


@pytest.mark.slow   # a real train stage on the tiny model: ~1-3 min
def test_a_reward_failure_in_train_keeps_the_curves_and_marks_the_metrics_failed(tiny_model_dir, tmp_path):
    import mlflow
    import pandas as pd
    from test_resume import PARAMS, _run_train_stage

    per_step = PARAMS["train"]["prompts_per_step"] * PARAMS["rollout"]["n"]
    root = _failing_project(tmp_path / "p", tiny_model_dir, after=2 * per_step)   # step 3's first call raises
    code, out = _run_train_stage(root)
    assert code == 1, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    # the stage's own last line (Ray may print a deduplicated worker log line after it)
    last = [line for line in out.strip().splitlines() if line.startswith("turnrl train:")][-1]
    assert last.startswith("turnrl train: rollout") and "failing_reward:score (reward.functions) raised " \
        "ValueError: the grading service went away" in last, last
    assert list(pd.read_csv(root / "plots/train.csv")["step"]) == [1, 2]
    summary = json.loads((root / "metrics/train.json").read_text())
    assert summary["failed"] is True and summary["steps"] == 2 and "the grading service went away" in summary["reason"]
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")
    run, = client.search_runs([client.get_experiment_by_name("turnrl").experiment_id],
                              filter_string="tags.`turnrl.pipeline.stage` = 'train'")
    assert run.info.status == "FAILED" and "grading service" in run.data.tags["turnrl.failed"]
    assert {m.step for m in client.get_metric_history(run.info.run_id, "rollout/reward_mean")} == {1, 2}


@pytest.mark.slow   # a real evaluation stage on the tiny model
def test_a_reward_failure_in_baseline_eval_is_one_line(tiny_model_dir, tmp_path):
    root = _failing_project(tmp_path / "p", tiny_model_dir, after=0)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "MLFLOW_DISABLE_TELEMETRY": "true"}
    env.pop("TURNRL_PIPELINE_KEY", None)
    out = subprocess.run([sys.executable, str(ROOT / "stages" / "evaluate.py"), "baseline"], cwd=root, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 1, out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("turnrl baseline_eval: reward function failing_reward:score (reward.functions) raised "
                           "ValueError: the grading service went away"), last


def test_turnrl_evaluate_refuses_a_folder_that_is_no_model_data_of_another_environment_and_a_file_as_out(
        tmp_path, monkeypatch, capsys, tiny_model_dir):
    """Each before loading anything: a config.json without model_type, a config without weights,
    data/processed made for another env.name (it scored code_tool's rows through math_refine, exit
    0), and --out naming a file: exit 2, one line."""
    import shutil
    from turnrl import cli
    from turnrl.pipeline.preprocess import preprocess
    monkeypatch.chdir(tmp_path)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({"data": {"train_examples": 8, "heldout_examples": 4},
                                                          "eval": {"benchmarks": []}}))
    preprocess(Config.model_validate({"data": {"train_examples": 8, "heldout_examples": 4},
                                      "eval": {"benchmarks": []}}), tmp_path / "data" / "processed")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text("{}")
    shutil.copytree(tiny_model_dir, tmp_path / "no_weights", ignore=shutil.ignore_patterns("*.safetensors", "*.bin"))
    (tmp_path / "a_file").write_text("x")
    for args, said in ((["empty"], "config.json: no model_type"),
                       (["no_weights"], "no weights (*.safetensors or *.bin)"),
                       ([str(tiny_model_dir), "-S", "env.name=math_refine"],
                        "was made for env.name = code_tool, not math_refine"),
                       ([str(tiny_model_dir), "--out", "a_file"], "--out a_file: a file, not a folder")):
        out = [] if "--out" in args else ["--out", "eval-out"]
        assert cli.main(["evaluate", *args, *out]) == 2, args
        err = capsys.readouterr().err
        assert said in err and "Traceback" not in err, (args, err)
    assert json.loads((tmp_path / "empty" / "config.json").read_text()) == {}


def test_commands_say_what_they_take(tmp_path, monkeypatch, capsys):
    """`turnrl presets --help` is help (it was read as a preset name), an unknown command is named,
    a stage script's --help describes it instead of running it, and its other options are refused."""
    from turnrl import cli
    with pytest.raises(SystemExit) as done:
        cli.main(["presets", "--help"])
    assert done.value.code == 0 and "usage: turnrl presets" in capsys.readouterr().out
    assert cli.main(["foo"]) == 2 and "unknown command 'foo'" in capsys.readouterr().err
    assert cli.main(["--help"]) == 0 and "turnrl config" in capsys.readouterr().out
    monkeypatch.chdir(tmp_path)
    helped = subprocess.run([sys.executable, str(ROOT / "stages" / "preprocess.py"), "--help"], capture_output=True,
                            text=True, timeout=120)
    assert helped.returncode == 0 and "DVC stage `preprocess`" in helped.stdout and not (tmp_path / "data").exists()
    refused = subprocess.run([sys.executable, str(ROOT / "stages" / "train.py"), "--steps", "3"], capture_output=True,
                             text=True, timeout=120)
    assert refused.returncode == 2 and "turnrl train: --steps: the stage takes no options" in refused.stderr
