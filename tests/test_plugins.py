"""Bring your own task: environments, reward functions, algorithms and benchmarks by import path,
checked before any work with fix-it errors, and (slow) the example task package of examples/guess
through the real pipeline: `dvc exp run -S env.name=examples.guess.env:ENV ...`."""
from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Annotated

import pytest
import yaml
from pydantic import Field

from turnrl import envs
from turnrl.config import ConfigError, load_config, parse_config
from turnrl.plugins import PluginError, options_model, validate_options
from turnrl.rewards.functions import RewardFunctionError, RewardFunctions
from turnrl.rollout.multi_turn import Trajectory

from conftest import ROOT, ScriptedEngine, copy_project, run_dvc

EXAMPLE = ["env.name=examples.guess.env:ENV", "data.train_set=examples/guess/train.jsonl",
           "data.heldout_set=examples/guess/heldout.jsonl", "reward.functions=[examples.guess.rewards:fewer_guesses]"]


@pytest.fixture
def plugin_dir(tmp_path, monkeypatch):
    """A project folder with a module of the user's own, found as DVC_ROOT (what a stage sees)."""
    monkeypatch.setenv("DVC_ROOT", str(tmp_path))
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "params.yaml").write_text((ROOT / "params.yaml").read_text())
    for name in [m for m in sys.modules if m.startswith("mytask")]:
        monkeypatch.delitem(sys.modules, name)
    return tmp_path


def _write(folder: Path, name: str, source: str) -> None:
    (folder / name).write_text(textwrap.dedent(source))


# ----------------------------------------------------------------------------- bad input, each before any work
@pytest.mark.parametrize("overrides, message", [
    (["env.name=nosuch_pkg.env:make"], "env.name = 'nosuch_pkg.env:make': no module named 'nosuch_pkg'"),
    (["env.name=examples.guess.env:MISSING"], "has no attribute 'MISSING'; it defines: ENV, GuessEnv"),
    (["env.name=examples.guess.env"], "nor an import path 'package.module:name' (the object after the colon)"),
    (["env.name=examples.guess.env:ENV", "env.options={max_guesses: -1}"],
     "env.options.max_guesses = -1: must be greater than 0"),
    (["env.name=examples.guess.env:ENV", "env.options={guesses: 3}"],
     "env.options.guesses: unknown option; options of this plugin: max_guesses"),
    (["env.name=examples.guess.env:ENV"], "data.train_set / data.heldout_set = synthetic: the environment"),
    (["reward.functions=[examples.guess.rewards:nope]"], "reward.functions[0] = 'examples.guess.rewards:nope'"),
    (["reward.functions=[json:dumps]"], "cannot be called as fn(prompt, completion, answer, **info)"),
    (["reward.functions=[examples.guess.rewards:fewer_guesses]", "reward.weights=[1, 2]"],
     "weights has 2 entries for 1 functions"),
    (["algorithm.name=json:loads"], "algorithm.name = 'json:loads': loads"),
    (["algorithm.name=gpro"], "algorithm.name = 'gpro': not a registered algorithm (dr_grpo, grpo"),
    (["eval.benchmarks=[{name: mine, path: m.jsonl, grader: exactly}]"], "eval.benchmarks[0].grader = 'exactly'"),
])
def test_bad_plugins_fail_at_load_naming_the_key(overrides, message, monkeypatch):
    monkeypatch.chdir(ROOT)
    with pytest.raises(ConfigError) as err:
        load_config("params.yaml", overrides)
    assert message in str(err.value) and str(err.value).startswith("params.yaml: ")


def test_a_module_that_raises_on_import_is_named_with_its_error(plugin_dir):
    _write(plugin_dir, "mytask_broken.py", "raise RuntimeError('half-written')\n")
    with pytest.raises(ConfigError, match="importing mytask_broken raised RuntimeError: half-written"):
        load_config(plugin_dir / "params.yaml", ["env.name=mytask_broken:make"])


def test_a_factory_of_the_wrong_shape(plugin_dir):
    _write(plugin_dir, "mytask_shape.py", """
        def make(size):   # a required option the params do not give
            raise AssertionError("not called at load")
        NOT_CALLABLE = 3
    """)
    with pytest.raises(ConfigError, match=r"env.options.size: required, set it \(e.g. -S \+\+env.options.size=...\)"):
        load_config(plugin_dir / "params.yaml", ["env.name=mytask_shape:make"])
    with pytest.raises(ConfigError, match="3 is neither an EnvSpec nor a factory"):
        load_config(plugin_dir / "params.yaml", ["env.name=mytask_shape:NOT_CALLABLE"])


def test_options_from_a_signature_keep_their_bounds():
    def make(max_guesses: Annotated[int, Field(gt=0)] = 4, name: str = "x", *, context=None):
        return None
    model = options_model(make, reserved=("context",))
    assert validate_options(model, {}, "env.options") == {"max_guesses": 4, "name": "x"}
    assert validate_options(model, {"max_guesses": "7"}, "env.options")["max_guesses"] == 7
    with pytest.raises(PluginError, match="env.options.max_guesses = 0: must be greater than 0"):
        validate_options(model, {"max_guesses": 0}, "env.options")
    with pytest.raises(PluginError, match="env.options.context: unknown option"):   # turnrl passes it, not params
        validate_options(model, {"context": 1}, "env.options")


def test_a_plain_factory_is_a_plugin_and_register_adds_a_name(plugin_dir):
    _write(plugin_dir, "mytask_echo.py", """
        from turnrl.envs import StepResult

        class Echo:
            system_prompt, stop, observation_role = "Say it.", ("</s>",), "user"
            def __init__(self, word: str = "hi"):
                self.word = word
            def reset(self, example):
                return example["prompt"]
            def step(self, text):
                ok = float(self.word in text)
                return StepResult(None, ok, True, {"outcome": ok, "reason": "answer"})
    """)
    env = envs.make("mytask_echo:Echo", word="yo")
    assert env.reset({"prompt": "p"}) == "p" and env.step("yo").info["outcome"] == 1.0
    envs.register("echo", "mytask_echo:Echo")
    assert envs.resolve("echo").factory is envs.resolve("mytask_echo:Echo").factory
    cfg = parse_config({"env": {"name": "echo", "options": {"word": "yo"}}, "model": {"path": "some/ckpt"},
                        "data": {"train_set": "t.jsonl", "heldout_set": "h.jsonl"}})
    assert cfg.env.name == "echo"


# ----------------------------------------------------------------------------- reward functions
def _traj(outcome: float, **info) -> Trajectory:
    t = Trajectory(example={"id": "q1", "prompt": "P", "answer": "7"}, prompt_ids=[1], response_ids=[5, 6],
                   loss_mask=[1, 1], turn_ids=[0, 0], turn_texts=["<guess>7</guess>"], outcome=outcome)
    t.info.update(info)
    return t


def test_reward_functions_add_to_the_outcome_by_weight(plugin_dir):
    _write(plugin_dir, "mytask_rewards.py", """
        def length(prompt, completion, answer, **info):
            return len(completion) / 10
        def solved_early(prompt, completion, answer, *, guesses=0, outcome=0.0, **info):
            return float(outcome > 0 and guesses == 1)
    """)
    fns = RewardFunctions(["mytask_rewards:length", "mytask_rewards:solved_early"], [1.0, 0.5])
    trajs = [_traj(1.0, guesses=1), _traj(0.0, guesses=3)]
    fns.score(trajs, decode=lambda ids: "x" * len(ids))   # completion "xx"
    assert trajs[0].rewards == {"length": 0.2, "solved_early": 1.0} and trajs[0].reward == pytest.approx(1.7)
    assert trajs[1].rewards == {"length": 0.2, "solved_early": 0.0} and trajs[1].reward == pytest.approx(0.2)


@pytest.mark.parametrize("body, problem", [
    ("raise ValueError('bad row')", "raised ValueError: bad row"),
    ("return float('nan')", "returned nan"),
    ("return None", "returned None"),
    ("return 'high'", "returned str 'high', not a number"),
])
def test_a_failing_reward_function_stops_the_step_naming_it_or_scores_zero(plugin_dir, body, problem, caplog):
    _write(plugin_dir, "mytask_bad.py", f"def score(prompt, completion, answer, **info):\n    {body}\n")
    with pytest.raises(RewardFunctionError) as err:
        RewardFunctions(["mytask_bad:score"]).score([_traj(1.0)], decode=str)
    assert f"reward function mytask_bad:score (reward.functions) {problem}" in str(err.value)
    assert "'q1'" in str(err.value) and "reward.on_error: zero" in str(err.value)
    zero = RewardFunctions(["mytask_bad:score"], on_error="zero")
    trajs = [_traj(1.0), _traj(0.0)]
    zero.score(trajs, decode=str)
    assert [t.rewards for t in trajs] == [{"score_errors": 1.0, "score": 0.0}] * 2 and trajs[0].reward == 1.0
    assert sum("scored 0" in r.message for r in caplog.records) == 1   # one warning, then counted


def test_a_reward_function_that_runs_long_is_named_in_the_log_while_it_runs(plugin_dir, monkeypatch, caplog):
    """A function that may hang (an API call without a timeout) is named with its prompt while it
    runs past rewards.functions.SLOW_CALL_S, instead of a run stalled in silence; its value counts."""
    from turnrl.rewards import functions
    monkeypatch.setattr(functions, "SLOW_CALL_S", 0.3)
    _write(plugin_dir, "mytask_slow.py", "import time\ndef score(prompt, completion, answer, **info):\n"
                                         "    time.sleep(1.5)\n    return 1.0\n")
    trajs = [_traj(0.0)]
    with caplog.at_level("WARNING", logger="turnrl.rewards.functions"):
        RewardFunctions(["mytask_slow:score"]).score(trajs, decode=str)
    said = [r.message for r in caplog.records if "has run" in r.message]
    assert said and said[0].startswith("reward function mytask_slow:score on the trajectory of prompt 'q1' has run")
    assert trajs[0].rewards == {"score": 1.0}
    caplog.clear()
    time.sleep(0.7)   # after the call: the watcher says nothing more of it
    assert not [r for r in caplog.records if "has run" in r.message]


# ----------------------------------------------------------------------------- benchmarks from files
OLYMPIAD = [{"question": "Find x with x^2 = 4.", "final_answer": ["2", "-2"]},
            {"question": "What is half of one?", "final_answer": ["\\frac{1}{2}"]},
            {"question": "Name the odd prime below 4.", "final_answer": ["3"]}]
MINERVA = [{"problem": "Compute 3/4.", "solution": "We divide: $\\boxed{0.75}$ and that is \\boxed{\\frac{3}{4}}."},
           {"problem": "Compute 2+2.", "solution": "So \\boxed{4}."}]


def test_benchmark_files_with_list_and_boxed_answers_graded_by_math_verify(tmp_path, tiny_model_dir, monkeypatch):
    """OlympiadBench's shape (question, final_answer as a list: any element is right) and
    Minerva's (problem, the answer in the solution's last \\boxed{}), through the single protocol:
    answers math-verify finds equal in another form (-2 for [2, -2], 0.5 for \\frac{1}{2}) are
    right; `turnrl evaluate` reads the files itself."""
    from transformers import AutoTokenizer

    from turnrl.config import Config
    from turnrl.pipeline.evaluate import evaluate, source_benchmarks
    from turnrl.pipeline.preprocess import preprocess
    monkeypatch.delenv("TURNRL_DATA_DIR", raising=False)
    (tmp_path / "olympiad.jsonl").write_text("".join(json.dumps(r) + "\n" for r in OLYMPIAD))
    (tmp_path / "minerva.jsonl").write_text("".join(json.dumps(r) + "\n" for r in MINERVA))
    cfg = Config.model_validate({
        "data": {"train_examples": 8, "heldout_examples": 2}, "eval": {"greedy": False, "benchmarks": [
            {"name": "olympiad", "path": str(tmp_path / "olympiad.jsonl"),
             "fields": {"prompt": "question", "answer": "final_answer"}},
            {"name": "minerva", "path": str(tmp_path / "minerva.jsonl"),
             "fields": {"prompt": "problem", "answer": "solution"}, "answer_from": "boxed"},
            {"name": "minerva_exact", "path": str(tmp_path / "minerva.jsonl"),
             "fields": {"prompt": "problem", "answer": "solution"}, "answer_from": "boxed", "grader": "exact"}]}})
    manifest = preprocess(cfg, tmp_path / "data")
    assert manifest["benchmarks"]["olympiad"]["n"] == 3 and manifest["benchmarks"]["minerva"]["n"] == 2
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    # the task (code_tool, 2 problems) answers wrong; then olympiad: -2, 0.5, 5; minerva: 3/4 as 0.75, 5; exact: same
    said = ["<answer>0</answer>", "\\boxed{-2}", "\\boxed{0.5}", "\\boxed{5}", "\\boxed{0.75}", "\\boxed{5}",
            "\\boxed{0.75}", "\\boxed{4}"]

    class InOrder(ScriptedEngine):   # one scripted answer per prompt, in the order asked
        def generate(self, prompts, **kw):
            from turnrl.rollout.multi_turn import Sample
            out = []
            for _ in prompts:
                ids = self.tokenizer(said.pop(0), add_special_tokens=False)["input_ids"]
                out.append(Sample(ids, [-0.1] * len(ids), "stop"))
            return out

    said = [said[0], said[0]] + said[1:]
    metrics = evaluate(cfg, InOrder(tokenizer, []), tokenizer, tmp_path / "data", tmp_path / "eval",
                       benchmarks=source_benchmarks(cfg))
    assert metrics["olympiad"]["correct"] == 2 and metrics["olympiad"]["n"] == 3
    assert metrics["minerva"]["correct"] == 1 and metrics["minerva"]["grader"] == "math"   # 0.75 = 3/4
    assert metrics["minerva_exact"]["correct"] == 1 and metrics["minerva_exact"]["grader"] == "exact"   # 4 only
    import pandas as pd
    rows = pd.read_parquet(tmp_path / "eval" / "minerva.parquet")
    assert rows["answer"].tolist() == ["\\frac{3}{4}", "4"]   # the last \boxed{} of each solution


# ----------------------------------------------------------------------------- the example through the pipeline


@pytest.mark.slow
@pytest.mark.long   # ~230 s; CI covers the example's parts in this file in-process, and a pipeline run in test_pipeline_e2e
def test_the_example_task_package_through_the_pipeline(tmp_path):
    """examples/guess (an environment with an options model and demonstrations, a reward function,
    training data and a benchmark file with its own field names) through `dvc exp run` from a
    clean copy of the project: its environment steps in the Ray rollout actor (the module ships
    with the job), its reward is logged every step, its benchmark gets a block."""
    project = tmp_path / "project"
    project.mkdir()
    copy_project(project)
    params = yaml.safe_load((project / "params.yaml").read_text())
    params["model"]["warmstart"].update(demonstrations=200, skill_steps=60, prior_steps=5)
    params["train"].update(steps=2, prompts_per_step=4)
    params["rollout"].update(n=4, engine="hf", max_turns=4, max_tokens_per_turn=12)
    params["data"].update(heldout_examples=8)
    params["eval"].update(greedy=False, limit=8, protocol="multi")
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    bench = "eval.benchmarks=[{name: guess_wide, path: examples/guess/bench_wide.jsonl, " \
            "fields: {prompt: question, answer: target}}]"
    sets = [*EXAMPLE, "++env.options.max_guesses=4", bench]
    proc = run_dvc(project, "exp", "run", *[a for kv in sets for a in ("-S", kv)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    baseline = json.loads((project / "metrics/baseline.json").read_text())
    final = json.loads((project / "metrics/eval.json").read_text())
    assert baseline.keys() == final.keys() == {"task", "guess_wide"}
    assert final["task"]["n"] == 8 and final["guess_wide"]["n"] == 8 and final["guess_wide"]["env"].endswith(":ENV")
    assert "reward_fewer_guesses_mean" in final["task"]
    import pandas as pd
    curve = pd.read_csv(project / "plots/train.csv")
    assert len(curve) == 2 and {"reward_fewer_guesses_mean", "env_guesses_mean", "turn1_reward_mean"} <= set(curve)
    assert math.isfinite(curve["loss"].iloc[-1]) and curve["finish_env_error_frac"].max() == 0.0
    demos = json.loads((project / "metrics/prepare_model.json").read_text())
    assert demos["env"] == "examples.guess.env:ENV" and demos["demonstrations"] > 0

    # a bad option fails at once, naming it, before any stage works
    proc = run_dvc(project, "exp", "run", *[a for kv in [*EXAMPLE, "++env.options.max_guesses=-1"] for a in ("-S", kv)])
    assert proc.returncode != 0
    assert "env.options.max_guesses = -1: must be greater than 0" in proc.stdout + proc.stderr


# ----------------------------------------------------------------------------- an algorithm of one's own
def test_an_algorithm_by_import_path_gets_the_batch_and_its_options(plugin_dir):
    """docs/plugins.md's example: GRPO's advantage on the last policy turn only, a plain function
    named by path, its own setting in algorithm.options."""
    import torch

    from turnrl.training.loop import advantages_for, collate
    _write(plugin_dir, "mytask_algo.py", """
        import torch
        from turnrl.algos import group_normalize

        def last_turn_only(inputs, cfg):
            a = group_normalize(inputs.rewards, inputs.group_ids) * cfg.options.get("scale", 1.0)
            last = inputs.turn_ids == inputs.turn_ids.max(dim=1, keepdim=True).values
            return torch.where(inputs.mask.bool() & last, a[:, None], 0.0)
    """)
    cfg = parse_config({"algorithm": {"name": "mytask_algo:last_turn_only", "options": {"scale": 2.0}},
                        "rollout": {"n": 2}})
    trajs = [Trajectory(example={}, prompt_ids=[1, 2], response_ids=[3, 4, 5, 6], loss_mask=[1, 0, 1, 1],
                        turn_ids=[0, 0, 1, 1], engine_logprobs=[0.0] * 4, levels=["low", "low"], outcome=r)
             for r in (1.0, 0.0)]
    adv = advantages_for(cfg.algorithm, cfg.rollout.n, trajs, collate(trajs, pad_id=0))
    s = 2.0 * 0.5 / torch.tensor([1.0, 0.0]).std().item()
    assert torch.allclose(adv, torch.tensor([[0, 0, 0, 0, s, s], [0, 0, 0, 0, -s, -s]]), atol=1e-5)


@pytest.mark.slow
def test_a_plugin_ships_with_the_job_to_a_cluster_node_that_does_not_have_it(tmp_path):
    """On a Ray cluster started elsewhere (`ray start --head` in another folder), with the driver
    outside the project too (DVC_ROOT names it, as for a stage), the rollout actor's environment
    plugin imports because start_ray ships the project's plugin package as a py_module; a driver
    that connects without it gets ModuleNotFoundError in the actor (what a node without the
    project's files would get)."""
    import shutil
    import tempfile

    import psutil

    from turnrl.training.cluster import rendezvous_port
    port = rendezvous_port()
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", "DVC_ROOT": str(ROOT),
           "PYTHONPATH": str(ROOT / "src"), "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    node, driver_dir = tmp_path / "node", tmp_path / "driver"
    node.mkdir()
    driver_dir.mkdir()
    ray_dir = Path(tempfile.mkdtemp(prefix="trl", dir="/tmp"))   # short: Ray's socket paths must fit 107 bytes
    node_env = {k: v for k, v in env.items() if k not in ("DVC_ROOT", "PYTHONPATH")}   # a node knows no project
    start = subprocess.run(["ray", "start", "--head", "--port", str(port), "--num-cpus", "1", "--include-dashboard",
                            "false", "--temp-dir", str(ray_dir), "--disable-usage-stats"],
                           cwd=node, env=node_env, capture_output=True, text=True, timeout=180)
    assert start.returncode == 0, start.stderr[-2000:]
    driver = textwrap.dedent(f"""
        import sys
        import ray
        from turnrl.config import load_config
        from turnrl.training.cluster import start_ray
        cfg = load_config({str(ROOT / "params.yaml")!r}, {EXAMPLE + [f"cluster.address=127.0.0.1:{port}"]!r})
        if sys.argv[1] == "shipped":
            start_ray(cfg)
        else:
            ray.init(address=cfg.cluster.address)

        @ray.remote(num_cpus=0)
        def play():
            env = cfg.env.factory(max_turns=cfg.rollout.max_turns, seed=cfg.seed)()
            env.reset({{"prompt": "Game 1: I picked a number from 1 to 8. Guess it.", "answer": "5"}})
            return type(env).__module__, env.step("<guess>4</guess>").observation

        try:
            print(ray.get(play.remote()))
        except Exception as exc:
            print("failed:", type(exc).__name__, repr(getattr(exc, "cause", None))[:200])
    """)
    try:
        runs = {mode: subprocess.run([sys.executable, "-c", driver, mode], cwd=driver_dir, env=env,
                                     capture_output=True, text=True, timeout=300) for mode in ("shipped", "plain")}
    finally:   # this node's processes only (`ray stop` would stop every Ray on the machine)
        for proc in psutil.process_iter(["cmdline"]):
            if any(str(ray_dir) in arg for arg in proc.info["cmdline"] or []):
                proc.kill()
        shutil.rmtree(ray_dir, ignore_errors=True)
    assert runs["shipped"].returncode == 0, runs["shipped"].stderr[-3000:]
    assert "('examples.guess.env', 'Higher.')" in runs["shipped"].stdout
    assert "failed: RayTaskError" in runs["plain"].stdout and "no module named 'examples'" in runs["plain"].stdout, runs["plain"].stdout[-2000:] + runs["plain"].stderr[-2000:]


# ----------------------------------------------------------------------------- the warm start runs the environment
BROKEN_RESET = '''
from turnrl.data.synthetic import Demonstration, SyntheticTask
from turnrl.envs import EnvSpec, StepResult


class Fragile:
    system_prompt = "Answer."
    stop = ("</a>",)
    observation_role = "user"

    def reset(self, example):
        raise KeyError("case")            # a row field the environment expected

    def step(self, text):
        return StepResult(None, 1.0, True, {"outcome": 1.0, "reason": "answer"})


def rows(count, *, seed, split, exclude):
    return [{"id": f"{split}-{i}", "prompt": f"Say {i}.", "answer": str(i), "answers": [str(i)],
             "subject": None, "level": None, "source": "fragile"} for i in range(count)]


ENV = EnvSpec(factory=Fragile, task=SyntheticTask(
    "fragile", rows=rows, demonstration=lambda row, rng, good: Demonstration([f"{row['answer']}</a>"])))
'''


def test_an_environment_that_raises_in_the_warm_start_is_one_line_and_exit_2(tmp_path):
    """`python stages/prepare_model.py` (what `dvc repro` runs) with model.path: tiny replays the
    demonstrations through the plugin's environment: its reset raising ends the stage with exit 2
    and one line naming the plugin, the row and the exception, no traceback."""
    (tmp_path / "stages").mkdir()
    shutil.copy(ROOT / "stages/prepare_model.py", tmp_path / "stages/prepare_model.py")
    (tmp_path / "fragile_env.py").write_text(BROKEN_RESET)
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["env"] = {"name": "fragile_env:ENV", "options": {}}
    params["model"]["path"] = "tiny"
    params["model"]["warmstart"].update(demonstrations=8, skill_steps=1, prior_steps=1)
    params["data"].update(train_set="synthetic", heldout_set="synthetic", train_examples=8, heldout_examples=2)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    proc = subprocess.run([sys.executable, "stages/prepare_model.py"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, env={"PATH": str(Path(sys.executable).parent), "HOME": str(tmp_path),
                                            "PYTHONPATH": str(tmp_path), "MLFLOW_DISABLE_TELEMETRY": "true"})
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("turnrl prepare_model:")]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith("turnrl prepare_model: env.name = 'fragile_env:ENV': the warm start (model.path: tiny) "
                               "replayed a demonstration through reset() on row 'train-")
    assert "raised KeyError: 'case'" in lines[0] and "set model.path to a checkpoint" in lines[0]


# ----------------------------------------------------------------------------- turnrl env
def test_turnrl_env_prints_options_tools_the_first_observation_and_steps(tmp_path, monkeypatch, capsys):
    from turnrl.cli import main
    monkeypatch.setenv("DVC_ROOT", str(ROOT))
    monkeypatch.chdir(tmp_path)                                    # no data/processed here
    data = str(ROOT / "examples/guess/heldout.jsonl")
    code = main(["env", "examples.guess.env:ENV", "-S", "max_guesses=2", "--data", data, "--row", "1",
                 "--step", "<guess>6</guess>", "--step", "<guess>3</guess>", "--step", "<guess>1</guess>"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert 'options: {"max_guesses": 2}' in out and "stop: ['</guess>']" in out
    assert "first observation: Game 10001: I picked a number from 1 to 12. Guess it." in out
    assert "step 1: '<guess>6</guess>'\n  observation: Lower.\n  reward: 1.0    done: False" in out
    assert '"reason": "max_turns"' in out and '"guesses": 2' in out      # two guesses allowed: done
    assert '"grade": "not found in 2 guesses (last 3, the number was 2)"' in out
    assert "done after step 2: the remaining 1 step(s) are not run" in out
    # the tools environment shows the schema it generated from the function; rows: its synthetic ones
    code = main(["env", "tools", "-S", "functions=[examples.tools.calc:calculator]", "--step",
                 '<tool_call>{"name": "calculator", "arguments": {"expression": "2*21"}}</tool_call>'])
    out = capsys.readouterr().out
    assert code == 0, out
    assert '"name": "calculator"' in out and '"required": [\n' in out and "row 0 (synthetic held-out rows)" in out
    assert 'observation: ["42"]' in out
    # bad input: one line, exit 2
    assert main(["env", "examples.guess.env:ENV", "-S", "max_guesses=0"]) == 2
    assert capsys.readouterr().err.strip() == ("turnrl env: env.options.max_guesses = 0: must be greater than 0")
    assert main(["env", "examples.guess.env:ENV"]) == 2
    assert "run `dvc repro preprocess` or give --data FILE" in capsys.readouterr().err
    # data/processed, when the preprocess stage wrote it, gives the rows (their own fields included)
    from turnrl.data.sources import write_rows
    write_rows([{"id": "p0", "prompt": "I picked a number from 1 to 4.", "answer": "3", "answers": ["3"],
                 "subject": None, "level": None, "source": "mine", "case": {"seed": 7}}],
               tmp_path / "data/processed/heldout.parquet")
    assert main(["env", "examples.guess.env:ENV", "--step", "<guess>3</guess>"]) == 0
    out = capsys.readouterr().out
    assert "row 0 (data/processed/heldout.parquet)" in out and '"seed": 7' in out and '"outcome": 1.0' in out


def test_reward_functions_that_are_async_classes_or_misweighted(plugin_dir):
    """An async reward function is awaited (each call on a loop of its own); a class is refused
    when params name it (calling it makes an instance, not a score), an instance with __call__ is
    fine; weights must be one per function."""
    _write(plugin_dir, "mytask_shapes.py", """
        import asyncio
        async def waits(prompt, completion, answer, **info):
            await asyncio.sleep(0)
            return 0.5
        class Scorer:
            def __call__(self, prompt, completion, answer, **info):
                return 0.25
        SCORER = Scorer()
    """)
    fns = RewardFunctions(["mytask_shapes:waits", "mytask_shapes:SCORER"])
    trajs = [_traj(1.0)]
    fns.score(trajs, decode=str)
    assert trajs[0].rewards == {"waits": 0.5, "SCORER": 0.25} and trajs[0].reward == pytest.approx(1.75)
    with pytest.raises(PluginError, match="mytask_shapes:Scorer'?: Scorer is a class; name a function"):
        RewardFunctions(["mytask_shapes:Scorer"])
    with pytest.raises(ValueError, match="1 weights for 2 reward functions"):
        RewardFunctions(["mytask_shapes:waits", "mytask_shapes:SCORER"], [2.0])


def test_reward_functions_that_answer_with_a_verdict_or_lack_info_and_scorers_of_one_name(plugin_dir):
    """True / False (numpy's too) and a Decimal are values; a function without **info is told to
    add it; two scorers logged under one name (a judge named overlong replaced the penalty, a
    function named like a judge shared its metric) are refused, naming both."""
    import decimal
    _write(plugin_dir, "mytask_verdicts.py", """
        import decimal
        import numpy as np
        def says(prompt, completion, answer, **info):
            return answer in completion
        def np_says(prompt, completion, answer, **info):
            return np.bool_(False)
        def exact(prompt, completion, answer, **info):
            return decimal.Decimal("0.25")
        def noinfo(prompt, completion, answer):
            return 1.0
        def overlong(prompt, completion, answer, **info):
            return 0.0
    """)
    fns = RewardFunctions(["mytask_verdicts:says", "mytask_verdicts:np_says", "mytask_verdicts:exact"])
    trajs = [_traj(0.0)]
    fns.score(trajs, decode=lambda ids: "7")
    assert trajs[0].rewards == {"says": 1.0, "np_says": 0.0, "exact": 0.25}
    assert all(type(v) is float for v in trajs[0].rewards.values()) and decimal   # numbers, not their types
    with pytest.raises(PluginError, match=r"noinfo\(prompt, completion, answer\) cannot be called as .* add \*\*kwargs"):
        RewardFunctions(["mytask_verdicts:noinfo"])
    judge = {"base_url": "http://127.0.0.1:1/v1", "template": "{response}"}
    for reward, said in (
            ({"functions": ["mytask_verdicts:overlong"], "overlong": {"buffer": 32}},
             "reward.overlong and reward.functions (mytask_verdicts:overlong) are both scored as 'overlong'"),
            ({"overlong": {"buffer": 32}, "judges": [{**judge, "name": "overlong"}]},
             "reward.judges[0] (overlong) and reward.overlong are both scored as 'overlong'"),
            ({"functions": ["mytask_verdicts:says"], "judges": [{**judge, "name": "says_errors"}]},
             "both scored as 'says_errors'")):
        with pytest.raises(ConfigError, match=re.escape(said)):
            parse_config({"reward": reward})
