"""The evaluation used by baseline_eval, eval and `turnrl evaluate` (`python -m turnrl.pipeline.evaluate`).

Scripted engines stand in for the model where the code around the engine is under test
(metrics, protocols, grading reasons, generations); the real engines (HF in process, vLLM in
the checkpoint command) run where repeatability is.
"""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml
from transformers import AutoTokenizer

from turnrl.config import BENCHMARKS, Config, ConfigError, parse_config
from turnrl.pipeline.evaluate import evaluate, load_engine, pass_at_k
from turnrl.pipeline.preprocess import preprocess
from turnrl.rollout.multi_turn import Sample

ROOT = Path(__file__).resolve().parents[1]
SIZES = {"math500": 500, "aime24": 30, "aime25": 30, "amc23": 40, "gsm8k_test": 1319}


class Oracle:
    """Calls the tool on every problem, then copies the tool output: always right."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def turn(self, text: str) -> str:
        if "<output>" in text.rsplit("Compute", 1)[-1]:
            return "<answer>" + re.findall(r"<output>(\d+)</output>", text)[-1] + "</answer>"
        a, b = re.findall(r"Compute (\d+) \* (\d+)\.", text)[-1]
        return f"<code>print({a} * {b})</code>"

    def generate(self, prompts, *, max_tokens, stop, temperature, top_p, seeds):
        out = []
        for ids in prompts:
            tok = self.tokenizer(self.turn(self.tokenizer.decode(ids)), add_special_tokens=False)["input_ids"]
            out.append(Sample(tok, [-0.1] * len(tok), "stop"))
        return out


class BenchmarkOracle(Oracle):
    """Answers each benchmark problem with `answer(reference, index)` (default: the reference
    itself) as `\\boxed{}` in the single protocol and `<answer>` through code_tool; the task's
    products as Oracle does."""

    def __init__(self, tokenizer, data_dir: Path, answer=lambda ref, i: ref):
        super().__init__(tokenizer)
        self.answer = answer
        self.refs = {}
        for name in BENCHMARKS:
            if (data_dir / "benchmarks" / f"{name}.parquet").exists():
                for i, row in enumerate(pd.read_parquet(data_dir / "benchmarks" / f"{name}.parquet").itertuples()):
                    self.refs[row.prompt] = (row.answer, i)

    def turn(self, text: str) -> str:
        user = text.split("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]
        if user not in self.refs:
            return super().turn(text)
        said = self.answer(*self.refs[user])
        if "<code>" in text.split("<|im_start|>user", 1)[0]:   # code_tool's system prompt: tags
            return f"<answer>{said}</answer>"
        return f"So the final answer is $\\boxed{{{said}}}$." if said is not None else "I am not sure."


@pytest.fixture
def cfg():
    return Config.model_validate({"data": {"train_examples": 40, "heldout_examples": 12}})


def _cfg(**eval_keys) -> Config:
    return Config.model_validate({"data": {"train_examples": 16, "heldout_examples": 4}, "eval": eval_keys})


def test_task_metrics_and_generations(tmp_path, tiny_model_dir, cfg, monkeypatch):
    monkeypatch.delenv("TURNRL_DATA_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    preprocess(cfg, tmp_path / "data")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    metrics = evaluate(cfg, Oracle(tokenizer), tokenizer, tmp_path / "data", tmp_path / "eval")
    task = metrics["task"]
    assert task["accuracy"] == 1.0 and task["accuracy_greedy"] == 1.0 and task["n"] == 12
    assert task["mean_turns"] == 2.0 and task["tokens_per_correct"] == task["mean_response_tokens"]
    assert task["tool_call_rate"] == 1.0 and task["tool_success_rate"] == 1.0   # the oracle always calls it
    # the task always goes through the training environment, whatever eval.protocol says
    assert (task["protocol"], task["env"], task["max_turns"]) == ("multi", "code_tool", 3)
    assert task["temperature"] == 1.0 and task["samples_per_problem"] == 1 and task["seed"] == 0
    # MATH-500 could not be found: the block says so instead of disappearing
    assert metrics["math500"]["available"] is False and "TURNRL_DATA_DIR" in metrics["math500"]["reason"]
    rows = pd.read_parquet(tmp_path / "eval" / "task.parquet")
    assert len(rows) == 24 and set(rows["decoding"]) == {"greedy", "temperature=1.0,top_p=1.0"}
    assert rows["correct"].all() and (rows["extracted"] == rows["answer"]).all()
    assert set(rows["reason"]) == {"equivalent to reference"}
    assert rows["trajectory"].str.contains("<output>").all()   # observations are part of the text


def test_tool_rates_count_calls_and_successful_calls(tiny_model_dir):
    from turnrl import envs
    from turnrl.pipeline.evaluate import summarize_generations
    from turnrl.rollout.chat import ChatFormat
    from turnrl.rollout.multi_turn import replay
    fmt = ChatFormat(AutoTokenizer.from_pretrained(tiny_model_dir))
    example = {"prompt": "Compute 12 * 34.", "answer": "408"}
    scripts = [["<code>print(12 * 34)</code>", "<answer>408</answer>"],     # called, ran
               ["<code>print(12 / 0)</code>", "<answer>408</answer>"],      # called, crashed
               ["<answer>408</answer>"], ["<answer>1</answer>"]]             # never called
    out = summarize_generations([replay(envs.make("code_tool"), fmt, example, s) for s in scripts])
    assert out["tool_call_rate"] == 0.5 and out["tool_success_rate"] == 0.25 and out["accuracy"] == 0.75
    # environments without a tool have no tool rates
    assert "tool_call_rate" not in summarize_generations([replay(envs.make("intervention"), fmt, example, ["<answer>408</answer>"])])


@pytest.mark.parametrize("n, c, k, expected", [
    (5, 2, 1, 0.4),            # pass@1 = c / n
    (5, 2, 2, 0.7),            # 1 - C(3,2)/C(5,2) = 1 - 3/10
    (5, 2, 4, 1.0),            # n - c = 3 < k = 4: any 4 samples include a correct one
    (10, 0, 3, 0.0),
    (4, 1, 2, 0.5),            # 1 - C(3,2)/C(4,2) = 1 - 3/6
])
def test_pass_at_k_matches_the_closed_form(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected)


def test_k_samples_give_mean_at_k_and_pass_at_k(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.delenv("TURNRL_DATA_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    cfg = Config.model_validate({"data": {"train_examples": 40, "heldout_examples": 6},
                                 "eval": {"samples": 3, "greedy": False, "benchmarks": []}})
    preprocess(cfg, tmp_path / "data")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    metrics = evaluate(cfg, Oracle(tokenizer), tokenizer, tmp_path / "data", tmp_path / "eval")
    task = metrics["task"]
    assert list(metrics) == ["task"]
    assert task["n"] == 6 and task["samples_per_problem"] == 3
    assert task["accuracy"] == 1.0 and task["pass_at_3"] == 1.0 and "accuracy_greedy" not in task
    assert list(pd.read_parquet(tmp_path / "eval" / "task.parquet")["sample"][:6]) == [0, 1, 2, 0, 1, 2]


def test_mean_at_k_and_pass_at_k_of_mixed_samples(tmp_path, tiny_model_dir, data_dir, monkeypatch):
    """k = 4 samples of 3 AMC problems, right on samples 0 and 2 of problem 0 only: mean@4 =
    2/12, pass@4 = (1 + 0 + 0) / 3, pass@k per problem by the closed form."""
    monkeypatch.setenv("TURNRL_DATA_DIR", str(data_dir))
    cfg = _cfg(benchmarks=["amc23"], limit=3, samples=4, greedy=False)
    preprocess(cfg, tmp_path / "data")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    calls = {"n": 0}

    def answer(ref, i):   # trajectories come k per problem, in order; count the answers given
        j = calls["n"]
        calls["n"] += 1
        return ref if i == 0 and j % 2 == 0 else "-12345"
    metrics = evaluate(cfg, BenchmarkOracle(tokenizer, tmp_path / "data", answer), tokenizer,
                       tmp_path / "data", tmp_path / "eval")
    amc = metrics["amc23"]
    assert amc["n"] == 3 and amc["samples_per_problem"] == 4 and amc["correct"] == 2
    assert amc["accuracy"] == pytest.approx(2 / 12) and amc["pass_at_4"] == pytest.approx(1 / 3)
    rows = pd.read_parquet(tmp_path / "eval" / "amc23.parquet")
    assert len(rows) == 12 and list(rows["correct"][:4]) == [True, False, True, False]


def test_benchmarks_from_the_data_dir_score_their_references(tmp_path, tiny_model_dir, data_dir, monkeypatch):
    """Every benchmark preprocessed from the data directory; an engine that answers each
    reference scores 1.0 on all of them, and every row says why it was judged right."""
    monkeypatch.setenv("TURNRL_DATA_DIR", str(data_dir))
    cfg = _cfg(benchmarks=list(BENCHMARKS), greedy=False)
    manifest = preprocess(cfg, tmp_path / "data")
    assert {b: manifest["benchmarks"][b]["n"] for b in BENCHMARKS} == SIZES
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    metrics = evaluate(cfg, BenchmarkOracle(tokenizer, tmp_path / "data"), tokenizer, tmp_path / "data",
                       tmp_path / "eval")
    assert list(metrics) == ["task", *BENCHMARKS]
    for name, n in SIZES.items():
        block = metrics[name]
        assert block["available"] is True and block["n"] == n and block["accuracy"] == 1.0, name
        assert block["pass_at_1"] == 1.0 and block["tokens_per_correct"] == block["mean_response_tokens"] > 0
        assert (block["protocol"], block["env"], block["max_turns"]) == ("single", "math_answer", 1)
        assert block["temperature"] == 1.0 and block["top_p"] == 1.0
        rows = pd.read_parquet(tmp_path / "eval" / f"{name}.parquet")
        assert len(rows) == n and rows["correct"].all() and rows["id"].is_unique
        assert set(rows["reason"]) == {"equivalent to reference"}
        assert (rows["extracted"] == rows["answer"]).all() and (rows["tokens"] > 0).all()
        assert rows["trajectory"].str.contains("boxed").all() and rows["prompt"].str.len().min() > 0
    math500 = metrics["math500"]
    assert len(math500["by_subject"]) == 7 and len(math500["by_level"]) == 5
    assert sum(g["n"] for g in math500["by_subject"].values()) == 500
    assert all(g["accuracy"] == 1.0 for g in math500["by_level"].values())
    assert "by_subject" not in metrics["aime24"]   # only sets that have subjects get the breakdown


def test_multi_protocol_goes_through_the_training_environment(tmp_path, tiny_model_dir, data_dir, monkeypatch):
    monkeypatch.setenv("TURNRL_DATA_DIR", str(data_dir))
    cfg = _cfg(benchmarks=["math500", "aime24"], protocol="multi", limit=5, greedy=False)
    preprocess(cfg, tmp_path / "data")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    metrics = evaluate(cfg, BenchmarkOracle(tokenizer, tmp_path / "data"), tokenizer, tmp_path / "data",
                       tmp_path / "eval")
    for name in ("math500", "aime24"):
        block = metrics[name]
        assert (block["protocol"], block["env"], block["max_turns"]) == ("multi", "code_tool", 3)
        assert block["n"] == 5 and block["accuracy"] == 1.0
        rows = pd.read_parquet(tmp_path / "eval" / f"{name}.parquet")
        assert rows["trajectory"].str.startswith("<answer>").all()    # code_tool's answer format
        assert set(rows["reason"]) == {"equivalent to reference"}       # graded as code_tool grades


def test_wrong_and_missing_answers_say_why(tmp_path, tiny_model_dir, data_dir, monkeypatch):
    monkeypatch.setenv("TURNRL_DATA_DIR", str(data_dir))
    cfg = _cfg(benchmarks=["amc23"], limit=6, greedy=False)
    preprocess(cfg, tmp_path / "data")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    wrong = lambda ref, i: ref if i < 2 else ("-12345" if i < 4 else None)  # noqa: E731
    metrics = evaluate(cfg, BenchmarkOracle(tokenizer, tmp_path / "data", wrong), tokenizer, tmp_path / "data",
                       tmp_path / "eval")
    assert metrics["amc23"]["accuracy"] == pytest.approx(2 / 6)
    rows = pd.read_parquet(tmp_path / "eval" / "amc23.parquet")
    assert list(rows["reason"][:2]) == ["equivalent to reference"] * 2
    assert all(r.startswith("not equivalent: got -12345, expected") for r in rows["reason"][2:4])
    assert list(rows["extracted"][2:4]) == ["-12345"] * 2
    assert list(rows["reason"][4:]) == ["no answer found"] * 2 and rows["extracted"][4:].isna().all()


def test_an_unreachable_benchmark_is_explicit(tmp_path, tiny_model_dir, monkeypatch, caplog):
    monkeypatch.delenv("TURNRL_DATA_DIR", raising=False)
    cfg = _cfg(benchmarks=["aime24"], greedy=False)
    manifest = preprocess(cfg, tmp_path / "data")
    aime = manifest["benchmarks"]["aime24"]
    assert aime["available"] is False and "eval.benchmarks[0].path" in aime["reason"]
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    metrics = evaluate(cfg, Oracle(tokenizer), tokenizer, tmp_path / "data", tmp_path / "eval")
    assert metrics["aime24"]["available"] is False and "TURNRL_DATA_DIR" in metrics["aime24"]["reason"]
    assert any("aime24" in r.message and r.levelname == "WARNING" for r in caplog.records)
    assert not (tmp_path / "eval" / "aime24.parquet").exists()


def test_an_explicit_benchmark_path(tmp_path, monkeypatch):
    monkeypatch.delenv("TURNRL_DATA_DIR", raising=False)
    own = tmp_path / "mine.jsonl"
    own.write_text("".join(json.dumps({"id": f"p{i}", "problem": f"What is {i}+1?", "answer": i + 1}) + "\n"
                           for i in range(3)))
    manifest = preprocess(_cfg(benchmarks=[{"name": "aime25", "path": str(own)}]), tmp_path / "data")
    assert manifest["benchmarks"]["aime25"]["available"] is True and manifest["benchmarks"]["aime25"]["n"] == 3
    with pytest.raises(Exception, match="nope.jsonl"):   # a path the user gave must exist
        preprocess(_cfg(benchmarks=[{"name": "aime25", "path": str(tmp_path / "nope.jsonl")}]), tmp_path / "d2")


def test_missing_data_says_to_run_preprocess(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.delenv("TURNRL_DATA_DIR", raising=False)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    with pytest.raises(FileNotFoundError, match="dvc repro preprocess"):
        evaluate(_cfg(), Oracle(tokenizer), tokenizer, tmp_path / "nothing", tmp_path / "eval")
    preprocess(_cfg(benchmarks=[]), tmp_path / "data")
    with pytest.raises(FileNotFoundError, match="benchmark amc23 .* is not there; run `dvc repro preprocess`"):
        evaluate(_cfg(benchmarks=["amc23"]), Oracle(tokenizer), tokenizer, tmp_path / "data", tmp_path / "eval")


@pytest.mark.parametrize("keys, message", [
    ({"math500": False}, "eval.math500 was replaced by eval.benchmarks"),
    ({"math500_limit": 20}, "eval.math500_limit was replaced by eval.limit"),
    ({"benchmarks": ["aime"]}, "eval.benchmarks.0 = 'aime': 'aime' is not a registered benchmark (math500, aime24"),
    ({"benchmarks": [{"name": "olympiad"}]}, "eval.benchmarks.0: 'olympiad' is not a registered benchmark"),
    ({"paths": {"aime24": "a.jsonl"}}, "eval.paths was replaced by a benchmark mapping"),
    ({"temperature": 0, "samples": 4}, "greedy samples are all the same"),
    ({"protocol": "both"}, "eval.protocol = 'both': must be one of 'single' or 'multi'"),
])
def test_eval_params_errors_say_how_to_fix_them(keys, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_config({"eval": keys})


def test_same_seed_same_numbers_on_the_hf_engine(tmp_path, tiny_model_dir, monkeypatch):
    """Sampled evaluation of a real (untrained) model: a fresh engine and the same seed repeat
    every number and every generation; another seed does not."""
    monkeypatch.delenv("TURNRL_DATA_DIR", raising=False)

    def run(seed: int, out: str):
        cfg = Config.model_validate({"seed": seed, "rollout": {"engine": "hf", "max_tokens_per_turn": 12,
                                                               "max_tokens_total": 36},
                                     "data": {"train_examples": 16, "heldout_examples": 3},
                                     "eval": {"benchmarks": [], "samples": 2, "temperature": 1.0, "greedy": False}})
        preprocess(cfg, tmp_path / "data")
        engine, tokenizer = load_engine(cfg, tiny_model_dir)
        metrics = evaluate(cfg, engine, tokenizer, tmp_path / "data", tmp_path / out)
        return metrics, pd.read_parquet(tmp_path / out / "task.parquet")

    first, rows1 = run(0, "a")
    second, rows2 = run(0, "b")
    assert first == second
    pd.testing.assert_frame_equal(rows1, rows2)
    _, rows3 = run(1, "c")
    assert list(rows3["trajectory"]) != list(rows1["trajectory"])


def _checkpoint_cmd(project: Path, model: Path, out: str, *extra: str, data_dir: str | None):
    env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true"}
    env.pop("TURNRL_DATA_DIR", None)
    if data_dir:
        env["TURNRL_DATA_DIR"] = data_dir
    return subprocess.run([sys.executable, "-m", "turnrl.cli", "evaluate", str(model), "--out", out, *extra],
                          cwd=project, env=env, capture_output=True, text=True, timeout=900)


def test_checkpoint_command_needs_the_preprocessed_data(tmp_path, tiny_model_dir):
    from turnrl.pipeline.evaluate import main
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({}))
    code = main([str(tiny_model_dir), "--out", str(tmp_path / "out"), "--params", str(tmp_path / "params.yaml"),
                 "--data", str(tmp_path / "data" / "processed")])
    assert code == 2
    code = main([str(tmp_path / "no-model"), "--out", str(tmp_path / "out"), "--params", str(tmp_path / "params.yaml")])
    assert code == 2


@pytest.mark.slow
def test_checkpoint_command_end_to_end_twice_on_vllm(tmp_path, tiny_model_dir, monkeypatch):
    """`turnrl evaluate` on the tiny model with vLLM, sampled, run twice in
    fresh processes with the same seed: identical metrics and generations."""
    data_dir = os.environ.get("TURNRL_DATA_DIR") or str(ROOT.parent / "shared" / "data")
    benchmarks = ["amc23"] if Path(data_dir, "amc23").is_dir() else []
    params = {"data": {"train_examples": 16, "heldout_examples": 6},
              "rollout": {"engine": "vllm", "max_tokens_per_turn": 16, "max_tokens_total": 48},
              "eval": {"benchmarks": benchmarks, "samples": 2, "temperature": 1.0, "max_tokens": 24, "limit": 4}}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    missing = _checkpoint_cmd(tmp_path, tiny_model_dir, "out0", data_dir=data_dir)
    assert missing.returncode == 2 and "dvc repro preprocess" in missing.stderr
    monkeypatch.setenv("TURNRL_DATA_DIR", data_dir)
    preprocess(Config.model_validate(params), tmp_path / "data" / "processed")
    runs = [_checkpoint_cmd(tmp_path, tiny_model_dir, out, "-S", "eval.greedy=true", data_dir=data_dir)
            for out in ("out1", "out2")]
    for run in runs:
        assert run.returncode == 0, run.stderr[-3000:]
    first, second = (json.loads((tmp_path / o / "metrics.json").read_text()) for o in ("out1", "out2"))
    # stdout is the summary alone (vLLM's log lines go to stderr): `turnrl evaluate ... | jq` works
    assert json.loads(runs[0].stdout) == {b: {k: first[b][k] for k in ("accuracy", "n")} for b in first}
    assert first == second and list(first) == ["task", *benchmarks]
    assert first["task"]["n"] == 4 and "accuracy_greedy" in first["task"]       # eval.limit: 4 cuts the task too
    assert first["task"]["samples_per_problem"] == 2
    for block in ["task", *benchmarks]:
        a, b = (pd.read_parquet(tmp_path / o / f"{block}.parquet") for o in ("out1", "out2"))
        pd.testing.assert_frame_equal(a, b)
    if benchmarks:
        assert first["amc23"]["n"] == 4 and len(pd.read_parquet(tmp_path / "out1" / "amc23.parquet")) == 8
    run_info = json.loads((tmp_path / "out1" / "run.json").read_text())
    assert run_info["checkpoint"] == str(Path(tiny_model_dir).resolve()) and run_info["config"]["eval"]["greedy"]


def test_checkpoint_command_scores_the_benchmark_file_it_is_given(tmp_path, tiny_model_dir, monkeypatch):
    """`turnrl evaluate` reads benchmark files itself: a path given with -S is the one scored,
    whatever the preprocessed data holds (it once scored the old preprocessed copy, silently)."""
    from turnrl.pipeline.evaluate import main
    monkeypatch.delenv("TURNRL_DATA_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    old, new = tmp_path / "old.jsonl", tmp_path / "new.jsonl"
    old.write_text("".join(json.dumps({"problem": f"What is {i}+1?", "answer": i + 1}) + "\n" for i in range(5)))
    # a list answer: any element is right, and the generations keep every one (`answers`)
    new.write_text("".join(json.dumps({"problem": f"What is {i}*2?", "answer": [2 * i, f"{2 * i}.0"]}) + "\n"
                           for i in range(3)))
    params = {"data": {"train_examples": 8, "heldout_examples": 2}, "rollout": {"engine": "hf"},
              "eval": {"benchmarks": [{"name": "mine", "path": str(old)}], "greedy": False, "max_tokens": 8}}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    preprocess(Config.model_validate(params), tmp_path / "data" / "processed")
    code = main([str(tiny_model_dir), "--out", "out", "-S", f"eval.benchmarks=[{{name: mine, path: {new}}}]"])
    assert code == 0
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert metrics["mine"]["n"] == 3                                    # the new file, not the 5 preprocessed
    generations = pd.read_parquet(tmp_path / "out" / "mine.parquet")
    assert set(generations["prompt"]) == {f"What is {i}*2?" for i in range(3)}
    for _, row in generations.iterrows():
        doubled = 2 * int(row["prompt"].split()[2].split("*")[0])
        assert row["answer"] == str(doubled) and json.loads(row["answers"]) == [str(doubled), f"{doubled}.0"]


MEASURE_ENV = '''
from turnrl.envs import EnvSpec, StepResult

SEEN = []   # every example reset() was given


class Measure:
    system_prompt = "Say the word's length."
    stop = ("</n>",)
    observation_role = "user"

    def reset(self, example):
        SEEN.append(example)
        self.example = example
        return example["prompt"]

    def step(self, text):
        said = text.replace("</n>", "").strip()
        ok = said == str(self.example["length"])
        info = {"outcome": float(ok), "reason": "answer", "extracted": said}
        if self.example["meta"]["graded"]:
            info["grade"] = f"length {self.example['length']}, said {said}"
        return StepResult(None, float(ok), True, info)


ENV = EnvSpec(factory=Measure)
'''


def test_a_rows_own_fields_reach_reset_and_the_generations_and_limit_cuts_the_task(tmp_path, tiny_model_dir,
                                                                                   monkeypatch):
    """A plugin task on a file of its own: the rows' unmapped fields (an int, a nested dict)
    reach reset() equal and the generations' `extra` column; the reason is the environment's
    own (`info["grade"]`) or the generic one, never <answer>/\\boxed{} wording; eval.limit cuts
    the task block's sampled and greedy passes."""
    from conftest import ScriptedEngine
    (tmp_path / "measure_env.py").write_text(MEASURE_ENV)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("DVC_ROOT", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    words = ["cat", "horse", "ox", "zebra", "yak", "mouse", "bee", "eel"]
    rows = [{"key": f"w{i}", "question": f"How long is {w}?", "target": w, "length": len(w),
             "meta": {"letters": sorted(set(w)), "graded": i % 2 == 0, "at": {"row": i}}} for i, w in enumerate(words)]
    (tmp_path / "words.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = Config.model_validate({
        "env": {"name": "measure_env:ENV"}, "model": {"path": str(tiny_model_dir)},
        "data": {"train_set": "words.jsonl", "heldout_set": "words.jsonl", "heldout_examples": 4,
                 "fields": {"id": "key", "prompt": "question", "answer": "target"}},
        "rollout": {"max_turns": 1}, "eval": {"benchmarks": [], "limit": 3}})
    preprocess(cfg, tmp_path / "data")
    import measure_env
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    metrics = evaluate(cfg, ScriptedEngine(tokenizer, ["3</n>", "3</n>"]), tokenizer, tmp_path / "data",
                       tmp_path / "eval")
    by_id = {r["key"]: r for r in rows}
    assert len(measure_env.SEEN) == 6                                   # 3 problems, sampled and greedy
    for example in measure_env.SEEN:
        original = by_id[example["id"]]
        assert example["length"] == original["length"] and isinstance(example["length"], int)
        assert example["meta"] == original["meta"]                      # nested dict, list inside, equal
        assert "key" not in example and "question" not in example       # mapped fields are the schema's
    assert metrics["task"]["n"] == 3
    generations = pd.read_parquet(tmp_path / "eval" / "task.parquet")
    assert len(generations) == 6 and set(generations["decoding"]) == {"greedy", "temperature=1.0,top_p=1.0"}
    for _, g in generations.iterrows():
        original = by_id[g["id"]]
        assert json.loads(g["extra"]) == {"length": original["length"], "meta": original["meta"]}
        if original["meta"]["graded"]:
            assert g["reason"] == f"length {original['length']}, said 3"
        else:
            assert g["reason"] == f"scored {1 if original['length'] == 3 else 0} by measure_env:ENV: answer '3' " \
                                  "(finish answer)"
        assert "<answer>" not in g["reason"] and "boxed" not in g["reason"]


def test_an_environment_that_fails_in_evaluation_is_said_or_stops_it(tmp_path, tiny_model_dir, monkeypatch, caplog):
    """Trajectories an environment (or a grader) ended env_error score 0: a warning naming the
    first error, or, above env.max_error_fraction as in training, EnvironmentFailure, after the
    generations are written. An empty benchmark is unavailable, not 0% accuracy."""
    from turnrl.training.loop import EnvironmentFailure
    monkeypatch.delenv("TURNRL_DATA_DIR", raising=False)
    cfg = _cfg(greedy=False)
    preprocess(cfg, tmp_path / "data")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)

    from turnrl.envs import code_tool
    bad_id = str(pd.read_parquet(tmp_path / "data/heldout.parquet")["id"][1])
    original = code_tool.CodeToolEnv.reset

    def flaky(env, example):   # the sandbox cannot start for the second problem
        if str(example["id"]) == bad_id:
            raise RuntimeError("the sandbox is gone")
        return original(env, example)
    monkeypatch.setattr(code_tool.CodeToolEnv, "reset", flaky)
    cfg.env.max_error_fraction = 0.5   # 1 of 4 fails: said, not stopped
    metrics = evaluate(cfg, Oracle(tokenizer), tokenizer, tmp_path / "data", tmp_path / "eval",
                       benchmarks=lambda bench: ([], ""))
    assert metrics["task"]["env_errors"] == 1 and metrics["task"]["accuracy"] == 0.75
    warned = [r.message for r in caplog.records if r.levelname == "WARNING" and "env_error" in r.message]
    assert warned and "eval task: 1 of 4 trajectories ended env_error" in warned[0]
    assert "RuntimeError: the sandbox is gone" in warned[0]
    cfg.env.max_error_fraction = 0.1
    with pytest.raises(EnvironmentFailure, match=r"1 of 4 .* more than env.max_error_fraction = 0.1"):
        evaluate(cfg, Oracle(tokenizer), tokenizer, tmp_path / "data", tmp_path / "eval2")
    assert len(pd.read_parquet(tmp_path / "eval2" / "task.parquet")) == 4   # written first


def test_a_benchmark_with_no_problems_left_is_unavailable_not_zero(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.delenv("TURNRL_DATA_DIR", raising=False)
    cfg = _cfg(greedy=False, benchmarks=["aime24"])
    preprocess(cfg, tmp_path / "data")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    metrics = evaluate(cfg, Oracle(tokenizer), tokenizer, tmp_path / "data", tmp_path / "eval",
                       benchmarks=lambda bench: ([], ""))
    assert metrics["aime24"]["available"] is False and metrics["aime24"]["accuracy"] is None
    assert "no problems to evaluate" in metrics["aime24"]["reason"]
