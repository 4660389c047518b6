"""A newcomer's first hour with the ecosystem adapters (issue 53, part 5): what they met, each a
one-line error that says what happened and what to do, or a behaviour shown."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from turnrl import envs
from turnrl.errors import first_line, one_line
from turnrl.plugins import PluginError

ROOT = Path(__file__).resolve().parents[1]
CHECKPOINT = ("-S", "model.path=Qwen/Qwen2.5-0.5B-Instruct")   # a game has no warm start: only a checkpoint plays it

# NLTK's LookupError, as TextArena's Wordle-v0 raises it offline: a blank line, a row of asterisks,
# the resource name in ANSI colour
NLTK_MESSAGE = ("\n" + "*" * 70 + "\n  Resource \x1b[93mwords\x1b[0m not found.\n  Please use the NLTK Downloader "
                "to obtain the resource:\n\n  >>> import nltk\n  >>> nltk.download('words')\n  \n" + "*" * 70 + "\n")


# --------------------------------------------------------------------------- a. one line, never empty
def test_one_line_is_the_type_and_the_first_line_that_says_something():
    assert one_line(LookupError(NLTK_MESSAGE)) == "LookupError: Resource words not found."
    assert one_line(RuntimeError("\n\n  boom  \n second")) == "RuntimeError: boom"
    assert one_line(KeyError()) == "KeyError" and one_line(ValueError("\n***\n")) == "ValueError"
    assert first_line("----\n\x1b[1mcolour\x1b[0m here") == "colour here"
    assert one_line(ValueError("x" * 500), 20) == "ValueError: " + "x" * 17 + "..."


def test_one_line_names_pydantic_fields_not_their_count():
    from pydantic import BaseModel, ValidationError

    class Model(BaseModel):
        size: int

    with pytest.raises(ValidationError) as err:
        Model(size="big")
    assert one_line(err.value).startswith("ValidationError: size: Input should be a valid integer")


@pytest.fixture
def wordle_offline(monkeypatch):
    """textarena.make failing as Wordle-v0 does without NLTK's word list."""
    ta = pytest.importorskip("textarena")

    def make(env_id, **kwargs):
        raise LookupError(NLTK_MESSAGE)
    monkeypatch.setattr(ta, "make", make)


def test_a_game_that_cannot_start_says_why_in_one_line(wordle_offline):
    env = envs.make("gym_text", make="textarena:Wordle-v0")
    with pytest.raises(PluginError) as err:
        env.reset({"game_seed": 1})
    text = str(err.value)
    assert "\n" not in text
    assert text.startswith("env.options.make = textarena:Wordle-v0: the game cannot start: "
                           "LookupError: Resource words not found; NLTK's 'words' data is missing: download it once "
                           "where the network is reachable (python -m nltk.downloader words)")


def test_an_environment_error_in_a_trajectory_is_never_an_empty_reason():
    from turnrl.rollout.multi_turn import error_result
    assert error_result(LookupError(NLTK_MESSAGE)).info["env_error"] == "LookupError: Resource words not found."


def test_turnrl_config_catches_a_game_that_cannot_start(wordle_offline, capsys):
    from turnrl.config import main
    code = main([str(ROOT / "params.yaml"), *CHECKPOINT, "-S", "env.name=gym_text",
                 "-S", "env.options={make: textarena:Wordle-v0}"])
    err = capsys.readouterr().err
    assert code == 2
    assert ("turnrl config: env.options.make = textarena:Wordle-v0: the game cannot start: LookupError: "
            "Resource words") in err


def test_turnrl_config_passes_a_game_that_starts(capsys):
    pytest.importorskip("textarena")
    from turnrl.config import main
    assert main([str(ROOT / "params.yaml"), "-q", *CHECKPOINT, "-S", "env.name=gym_text",
                 "-S", "env.options={make: textarena:GuessTheNumber-v0}"]) == 0


# --------------------------------------------------------------------------- b. models/initial as model.path
@pytest.mark.parametrize("path", ["models/initial", "./models/initial/", "models/initial/sub"])
def test_prepare_models_own_output_as_model_path_is_refused_before_any_work(path, tmp_path, monkeypatch, capsys):
    from turnrl.config import main
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models" / "initial" / "sub").mkdir(parents=True)
    assert main([str(ROOT / "params.yaml"), "-S", f"model.path={path}"]) == 2
    err = capsys.readouterr().err
    assert f"turnrl config: model.path = {path!r}: that is the prepare_model stage's own output (models/initial)" in err
    assert "cp -r models/initial my-start" in err and "-S model.path=my-start" in err
    assert "hub" not in err and "gone" not in err


def test_a_deleted_models_initial_says_it_is_gone_and_how_to_get_it_back_not_the_hub(tmp_path, monkeypatch):
    import huggingface_hub

    from turnrl.config import ConfigError
    from turnrl.pipeline.prepare_model import resolve_checkpoint
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda *a, **k: pytest.fail("asked the hub"))
    with pytest.raises(ConfigError) as err:   # DVC removed the stage's output before the stage ran
        resolve_checkpoint("models/initial", Path("models/initial"))
    assert "prepare_model stage's own output" in str(err.value)
    assert "dvc checkout models/initial brings it back" in str(err.value)


@pytest.mark.parametrize("path", ["tiny", "Qwen/Qwen2.5-0.5B-Instruct", "my-start", "models/initial-copy"])
def test_other_model_paths_pass_that_check(path):
    from turnrl.config.checks import initial_model_problem
    assert initial_model_problem(path) is None


# --------------------------------------------------------------------------- c. env.options left by the last run
def test_options_left_by_the_previous_environment_are_named_with_how_to_clear_them(tmp_path, monkeypatch, capsys):
    from turnrl.config import main
    monkeypatch.chdir(tmp_path)
    (tmp_path / "dvc.lock").write_text("schema: '2.0'\nstages:\n  prepare_model:\n    params:\n      params.yaml:\n"
                                       "        env:\n          name: search\n          options: {top_k: 3}\n")
    assert main([str(ROOT / "params.yaml"), "-S", "env.name=code_tool", "-S", "env.options={top_k: 3}"]) == 2
    err = capsys.readouterr().err
    assert "env.options.top_k: unknown option" in err
    assert ("env.options: top_k is not an option of 'code_tool': likely left from the previous run's environment, 'search' "
            "(dvc.lock)") in err
    assert "dvc exp run -S '~env.options' -S env.name=code_tool" in err


def test_without_a_lock_the_environments_that_take_the_keys_are_named(tmp_path, monkeypatch, capsys):
    from turnrl.config import main
    monkeypatch.chdir(tmp_path)
    assert main([str(ROOT / "params.yaml"), "-S", "env.name=code_tool", "-S",
                 "env.options={top_k: 3, max_searches: 2}"]) == 2
    err = capsys.readouterr().err
    assert "top_k, max_searches are not options of 'code_tool': likely left from a previous environment ('search' takes them)" \
        in err


def test_a_typo_gets_no_previous_environment_hint(tmp_path, monkeypatch, capsys):
    from turnrl.config import main
    monkeypatch.chdir(tmp_path)
    assert main([str(ROOT / "params.yaml"), "-S", "env.options={timeout_sx: 3}"]) == 2
    err = capsys.readouterr().err
    assert "env.options.timeout_sx: unknown option" in err and "previous" not in err


def test_the_clearing_overrides_are_what_dvc_applies(tmp_path):
    """The hint's `-S '~env.options' -S env.name=...` through DVC's own -S code: the old keys go."""
    hydra = pytest.importorskip("dvc.utils.hydra")
    params = tmp_path / "params.yaml"
    params.write_text("env:\n  name: search\n  options: {top_k: 3}\n  workers: 4\n")
    hydra.apply_overrides(str(params), ["~env.options", "env.name=code_tool", "++env.options.timeout_s=2"])
    import yaml
    assert yaml.safe_load(params.read_text())["env"] == {"name": "code_tool", "options": {"timeout_s": 2},
                                                         "workers": 4}


# --------------------------------------------------------------------------- d. turnrl env: its hint, its row
def test_turnrl_env_says_its_own_form_of_setting_a_required_option(tmp_path, monkeypatch, capsys):
    from turnrl.cli import main
    monkeypatch.chdir(tmp_path)
    assert main(["env", "gym_text"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == "turnrl env: env.options.make: required, set it (e.g. -S make=...)"
    # config keeps DVC's form
    from turnrl.envs import check_options, resolve
    with pytest.raises(PluginError, match=r"e\.g\. -S \+\+env\.options\.make=\.\.\."):
        check_options(resolve("gym_text"), {})


def _processed(tmp_path: Path, env: dict | None) -> None:
    import json

    from turnrl.data.sources import write_rows
    write_rows([{"id": "s0", "prompt": "a search question", "answer": "x", "answers": ["x"], "subject": None,
                 "level": None, "source": "search"}], tmp_path / "data/processed/heldout.parquet")
    if env is not None:
        (tmp_path / "data/processed/manifest.json").write_text(json.dumps({"env": env}))


def test_turnrl_env_shows_no_row_of_another_environments_data(tmp_path, monkeypatch, capsys):
    from turnrl.cli import main
    monkeypatch.setenv("DVC_ROOT", str(ROOT))
    monkeypatch.chdir(tmp_path)
    _processed(tmp_path, {"name": "search", "options": {}})
    assert main(["env", "tools", "-S", "functions=[examples.tools.calc:calculator]"]) == 0
    out = capsys.readouterr().out
    assert ("row 0 (synthetic held-out rows; data/processed/heldout.parquet holds the rows preprocess made for "
            "env.name 'search', not shown)") in out
    assert "a search question" not in out
    # an environment without synthetic rows: how to get one
    assert main(["env", "examples.guess.env:ENV"]) == 2
    err = capsys.readouterr().err
    assert "no rows of examples.guess.env:ENV to reset it with: data/processed/heldout.parquet holds the rows " \
           "preprocess made for env.name 'search'" in err
    assert "give --data FILE" in err and "dvc exp run -S env.name=examples.guess.env:ENV preprocess" in err


def test_turnrl_env_shows_the_processed_row_of_its_own_environment(tmp_path, monkeypatch, capsys):
    from turnrl.cli import main
    monkeypatch.chdir(tmp_path)
    _processed(tmp_path, {"name": "math_answer", "options": {}})
    assert main(["env", "math_answer"]) == 0
    out = capsys.readouterr().out
    assert "row 0 (data/processed/heldout.parquet)" in out and "a search question" in out
    # the same environment with other options than the data was made with: its own rows
    _processed(tmp_path, {"name": "code_tool", "options": {"timeout_s": 9}})
    assert main(["env", "code_tool"]) == 0
    out = capsys.readouterr().out
    assert ("(synthetic held-out rows; data/processed/heldout.parquet holds the rows preprocess made for env.name "
            "'code_tool' with other options, not shown)") in out


def test_which_environment_made_the_data_is_read_from_dvc_lock_without_a_manifest_entry(tmp_path, monkeypatch):
    from turnrl.pipeline import env_cli
    monkeypatch.chdir(tmp_path)
    _processed(tmp_path, None)
    assert env_cli._made_by() is None
    (tmp_path / "dvc.lock").write_text("stages:\n  preprocess:\n    params:\n      params.yaml:\n        env:\n"
                                       "          name: math_answer\n          options: {}\n")
    assert env_cli._made_by() == ("math_answer", {})


def test_preprocess_records_the_environment_it_made_the_rows_for(tmp_path):
    from turnrl.config import load_config
    from turnrl.pipeline.preprocess import preprocess
    cfg = load_config(ROOT / "params.yaml", ["eval.benchmarks=[]", "data.train_examples=4", "data.heldout_examples=2",
                                             "env.options={timeout_s: 3}"])
    assert preprocess(cfg, tmp_path)["env"] == {"name": "code_tool", "options": {"timeout_s": 3}}


# --------------------------------------------------------------------------- e. stop strings for every adapter
class _Game:
    """A gymnasium-style text game of one's own (gym_text's module:factory): one turn, reward 1."""

    def reset(self, seed=None):
        return "Say a number.", {}

    def step(self, action):
        return "", 1.0, True, False, {}


def make_game():
    return _Game()


ADAPTERS = {   # each adapter with options that make it without its library's work (that starts at reset)
    "gym_text": {"make": "test_first_hour:make_game"},
    "skyrl_gym": {"id": "gsm8k_multi_turn"},
    "verifiers": {"environment": "arith_vf", "path": [str(ROOT / "examples" / "verifiers_env")]},
    "openenv": {"env_class": "examples.openenv_guess.env:GuessEnvironment"},
    "tools": {"functions": ["examples.tools.calc:calculator"]},
    "code_tool": {},
}


@pytest.mark.parametrize("name", sorted(ADAPTERS))
def test_env_stop_replaces_every_environments_own(name, monkeypatch):
    monkeypatch.setenv("DVC_ROOT", str(ROOT))
    try:
        spec = envs.resolve(name)
        options = envs.check_options(spec, ADAPTERS[name])
    except PluginError as exc:   # the adapter's library is not installed here
        pytest.skip(str(exc))
    own = spec.bind(options)()
    assert envs.with_stop(spec.bind(options), None)().stop == own.stop   # null: the environment's own
    assert envs.with_stop(spec.bind(options), ["</answer>", "\n\n"])().stop == ("</answer>", "\n\n")


def test_env_stop_is_a_params_key_the_factory_applies():
    from turnrl.config import load_config
    cfg = load_config(ROOT / "params.yaml", ["env.stop=[</answer>]"])
    assert cfg.env.factory(max_turns=3, seed=0)().stop == ("</answer>",)
    assert load_config(ROOT / "params.yaml").env.factory(max_turns=3, seed=0)().stop == envs.make("code_tool").stop


def test_the_rollout_stops_at_env_stop_else_at_the_templates_end_of_turn(tiny_model_dir, monkeypatch):
    from transformers import AutoTokenizer

    from conftest import ScriptedEngine
    from turnrl.rollout.chat import ChatFormat
    from turnrl.rollout.multi_turn import Budgets, run_rollouts
    monkeypatch.setenv("DVC_ROOT", str(ROOT))
    fmt = ChatFormat(AutoTokenizer.from_pretrained(tiny_model_dir))
    assert fmt.end_of_turn == "<|im_end|>"
    make = envs.resolve("gym_text").bind({"make": "test_first_hour:make_game", "kwargs": {},
                                          "system_prompt": "Play."})
    engine = ScriptedEngine(fmt.tokenizer, ["7"])
    [t] = run_rollouts(engine, [{"game_seed": 1}], make, fmt, Budgets(2, 16, 200))
    assert engine.calls[0]["stop"] == ("<|im_end|>",) and t.outcome == 1.0   # no stop strings of its own
    engine = ScriptedEngine(fmt.tokenizer, ["<answer>7</answer>"])
    run_rollouts(engine, [{"game_seed": 1}], envs.with_stop(make, ["</answer>"]), fmt, Budgets(2, 16, 200))
    assert engine.calls[0]["stop"] == ("</answer>",)


def test_turnrl_env_shows_the_stop_strings_and_what_ends_a_turn_without_them(tmp_path, monkeypatch, capsys):
    from turnrl.cli import main
    monkeypatch.setenv("DVC_ROOT", str(ROOT))
    monkeypatch.chdir(tmp_path)
    assert main(["env", "gym_text", "-S", "make=test_first_hour:make_game"]) == 0
    assert "stop: [] (none: a turn ends at the model's chat-template end-of-turn token; env.stop or --stop sets " \
           "strings)" in capsys.readouterr().out
    assert main(["env", "gym_text", "-S", "make=test_first_hour:make_game", "--stop", "</answer>"]) == 0
    assert "stop: ['</answer>'] (env.stop)" in capsys.readouterr().out


# --------------------------------------------------------------------------- f. the prompt column: what the model saw
def test_generations_prompt_is_the_games_first_observation_not_the_episode_seed(tiny_model_dir, monkeypatch):
    from transformers import AutoTokenizer

    from turnrl.envs.ecosystem.gym_text import episode_rows
    from turnrl.pipeline.evaluate import records
    from turnrl.rollout.chat import ChatFormat
    from turnrl.rollout.multi_turn import Trajectory, replay
    from turnrl.training.loop import sample_table
    monkeypatch.setenv("DVC_ROOT", str(ROOT))
    fmt = ChatFormat(AutoTokenizer.from_pretrained(tiny_model_dir))
    [row] = episode_rows(1, seed=0, split="heldout", exclude=set())
    assert row["prompt"].startswith("episode seed ")
    t = replay(envs.make("gym_text", make="test_first_hour:make_game"), fmt, row, ["7"])
    assert t.shown_prompt == "Say a number."
    assert records([t], fmt.tokenizer.decode, "greedy", "heldout")[0]["prompt"] == "Say a number."
    assert sample_table([t], fmt.tokenizer.decode)["prompt"] == ["Say a number."]
    # no conversation recorded (an agent program's episode): the row's prompt
    assert Trajectory(example={"prompt": "Compute 2 + 2."}, prompt_ids=[1]).shown_prompt == "Compute 2 + 2."


def test_a_textarena_games_prompt_is_its_first_observation(tiny_model_dir):
    pytest.importorskip("textarena")
    from transformers import AutoTokenizer

    from turnrl.rollout.chat import ChatFormat
    from turnrl.rollout.multi_turn import replay
    fmt = ChatFormat(AutoTokenizer.from_pretrained(tiny_model_dir))
    env = envs.make("gym_text", envs.EnvContext(max_turns=1), make="textarena:GuessTheNumber-v0")
    t = replay(env, fmt, {"game_seed": 3, "prompt": "episode seed 3"}, ["[5]"])
    assert "episode seed" not in t.shown_prompt and "Guess" in t.shown_prompt


# --------------------------------------------------------------------------- g. the tools warm start with one's own tools
def population(city: str) -> str:
    """The population of a city.

    Args:
        city: The city's name, e.g. Paris.
    """
    return {"Paris": "2100000"}.get(city, "unknown")


def demonstrate_population(row: dict, rng, good: bool) -> list[str]:
    """The warm start's turns for the population tool: call it, then answer."""
    import json
    call = json.dumps({"name": "population", "arguments": {"city": "Paris"}})
    return [f"<tool_call>\n{call}\n</tool_call>", "<answer>2100000</answer>"]


def test_own_tools_with_the_tiny_model_and_no_demonstration_are_refused_before_any_work(tmp_path, monkeypatch,
                                                                                         capsys):
    from turnrl.config import main
    monkeypatch.setenv("DVC_ROOT", str(ROOT))
    assert main([str(ROOT / "params.yaml"), "-S", "env.name=tools",
                 "-S", "env.options={functions: [test_first_hour:population]}"]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if "model.path" in line]
    assert lines == ["turnrl config: params.yaml: model.path = tiny: the tools environment's warm start demonstrates "
                     "calls to the built-in calculator, which the configured tools (test_first_hour:population) do "
                     "not include; set env.options.demonstration to module:function ((row, rng, good) -> the turns "
                     "calling your tools, then the answer), add turnrl.envs.tools:calculator to "
                     "env.options.functions, or set model.path to a checkpoint"]
    from turnrl.pipeline.prepare_model import WarmStartError, demonstrable
    task = envs.resolve("tools").task_for(envs.check_options(envs.resolve("tools"),
                                                             {"functions": ["test_first_hour:population"]}))
    with pytest.raises(WarmStartError, match="warm start demonstrates calls to the built-in calculator"):
        demonstrable(task, "tools")


def test_a_demonstration_hook_beside_the_functions_demonstrates_the_configured_tools(tiny_model_dir, monkeypatch,
                                                                                     capsys):
    import random

    from transformers import AutoTokenizer

    from turnrl.config import main
    from turnrl.rollout.chat import ChatFormat
    from turnrl.rollout.multi_turn import replay
    monkeypatch.setenv("DVC_ROOT", str(ROOT))
    options = {"functions": ["test_first_hour:population"], "demonstration": "test_first_hour:demonstrate_population"}
    assert main([str(ROOT / "params.yaml"), "-q", "-S", "env.name=tools", "-S",
                 "env.options={functions: [test_first_hour:population], "
                 "demonstration: test_first_hour:demonstrate_population}"]) == 0, capsys.readouterr().err
    spec = envs.resolve("tools")
    resolved = envs.check_options(spec, options)
    task = spec.task_for(resolved)
    demo = task.demonstrate({"prompt": "How many people live in Paris?", "answer": "2100000"}, random.Random(0), True)
    fmt = ChatFormat(AutoTokenizer.from_pretrained(tiny_model_dir))
    t = replay(spec.bind(resolved)(), fmt, {"prompt": "How many people live in Paris?", "answer": "2100000"},
               demo.turns)
    assert t.info["tool_calls"] == 1 and t.info["tool_errors"] == 0 and t.outcome == 1.0


@pytest.mark.parametrize("functions", [["turnrl.envs.tools:calculator"], ["examples.tools.calc:calculator"]])
def test_the_calculators_demonstrations_stay_where_a_calculator_is_configured(functions, monkeypatch):
    from turnrl.envs.tools import TASK
    monkeypatch.setenv("DVC_ROOT", str(ROOT))
    spec = envs.resolve("tools")
    assert spec.task_for(envs.check_options(spec, {"functions": functions})) is TASK


def test_the_agent_gateway_takes_env_stop_for_calls_that_send_none(tiny_model_dir):
    """env.name: agent: the program's calls choose their own stop strings (OpenAI's `stop`); a
    call that sends none gets env.stop."""
    from openai import OpenAI
    from transformers import AutoTokenizer

    from turnrl.gateway.program import make_program
    from turnrl.gateway.runner import AgentRunner, ScriptedEngine
    from turnrl.rollout.chat import ChatFormat
    from turnrl.rollout.multi_turn import Budgets
    fmt = ChatFormat(AutoTokenizer.from_pretrained(tiny_model_dir))
    program = envs.with_stop(lambda: make_program(program="examples.agents.calculator_agent:run"), ["</answer>"])()
    assert program.stop == ("</answer>",)   # AgentProgram is a frozen dataclass: replaced, not set
    limits = AgentRunner.limits(program, Budgets(4, 16, 256, 1024), 1.0, 1.0)
    assert limits.stop == ("</answer>",)
    seen = []

    class Recording(ScriptedEngine):
        def stepper(self, **_):
            stepper = super().stepper()
            add = stepper.add

            def recording(key, prompt, max_tokens, seed, options=None):
                seen.append(tuple((options or {}).get("stop", ())))
                add(key, prompt, max_tokens, seed, options)
            stepper.add = recording
            return stepper
    runner = AgentRunner()
    try:
        _, gateway = runner.gateway(Recording(fmt), fmt, program)
        ep = gateway.open({"prompt": "Compute 2 * 3."}, limits)
        client = OpenAI(base_url=gateway.base_url, api_key=ep.key, max_retries=0)
        client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "Compute 2 * 3."}])
        client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "Compute 2 * 3."}],
                                       stop=["\n"])
    finally:
        runner.close()
    assert seen == [("</answer>",), ("\n",)]


# --------------------------------------------------------------------------- f. what `turnrl env` refuses
def test_turnrl_env_refuses_what_a_rollout_refuses(tmp_path, monkeypatch, capsys):
    """`turnrl env`, the command users check an environment with, says what a rollout would end
    env_error for (a reset that is no text, a step that is no StepResult), one line, exit 1,
    instead of printing it as if it were fine."""
    from turnrl.pipeline import env_cli
    (tmp_path / "my_faulty.py").write_text(
        "from turnrl.envs.base import StepResult\n"
        "class Base:\n"
        "    system_prompt, stop, observation_role = 'Guess.', '</answer>', 'user'\n"
        "    def reset(self, example):\n        return example['prompt']\n"
        "    def step(self, text):\n        return StepResult(None, 1.0, 'False', {})\n"
        "class ResetNone(Base):\n    def reset(self, example):\n        return None\n")
    (tmp_path / "rows.jsonl").write_text('{"id": "r0", "prompt": "Pick a number.", "answer": "1"}\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    assert env_cli.main(["my_faulty:Base", "--data", "rows.jsonl", "--step", "<answer>1</answer>"]) == 1
    out = capsys.readouterr()
    assert "stop: ['</answer>']" in out.out   # one stop string given alone, not its characters
    assert "turnrl env: my_faulty.Base.step returned done = 'False' (str), not a bool" in out.err
    assert env_cli.main(["my_faulty:ResetNone", "--data", "rows.jsonl"]) == 1
    assert "turnrl env: my_faulty.ResetNone: reset returned NoneType None; it must return the first user message" \
        in capsys.readouterr().err


def test_turnrl_env_search_without_preprocessed_data_says_what_to_run_or_uses_the_corpus_given(
        tmp_path, monkeypatch, capsys):
    from turnrl.pipeline import env_cli
    monkeypatch.chdir(tmp_path)   # no data/processed here
    assert env_cli.main(["search"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("turnrl env: the search environment needs the preprocessed data folder") and \
        "dvc repro preprocess" in err and "Traceback" not in err
    (tmp_path / "passages.jsonl").write_text('{"id": "1", "title": "A", "text": "The code of Agent 4 is 77."}\n')
    assert env_cli.main(["search", "-S", "corpus=passages.jsonl", "--step", "<search>Agent 4</search>"]) == 0
    assert "The code of Agent 4 is 77." in capsys.readouterr().out


def test_a_demonstration_of_the_wrong_shape_is_said_so():
    """A demonstration function returning one string (not a list of turns) or turns that are not
    text: a TypeError saying what to return, never a warm start on its characters."""
    import random
    from turnrl.data.synthetic import SyntheticTask
    rng = random.Random(0)
    for returned, said in (("<answer>1</answer>", "returned str '<answer>1</answer>'"), ([1, 2], "turns of int")):
        task = SyntheticTask("mine", demonstration=lambda row, rng, good, r=returned: r)
        with pytest.raises(TypeError, match=re.escape(said)):
            task.demonstrate({"id": "r0"}, rng, True)
    assert SyntheticTask("mine", demonstration=lambda row, rng, good: ["a", "b"]).demonstrate({}, rng, True).turns == \
        ["a", "b"]


def test_an_options_model_that_does_not_fit_its_factory_is_named_before_any_work(tmp_path, monkeypatch):
    from turnrl.config import Config
    from turnrl.config.loading import check_plugins
    (tmp_path / "my_misfit.py").write_text(
        "from pydantic import BaseModel\n"
        "from turnrl.envs import EnvSpec\n"
        "class Opts(BaseModel):\n    max_guesess: int = 4\n"
        "class Guess:\n    def __init__(self, max_guesses: int = 4):\n        pass\n"
        "ENV = EnvSpec(factory=Guess, options=Opts)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    problems = check_plugins(Config.model_validate({"env": {"name": "my_misfit:ENV"}, "model": {"path": "x"},
                                                    "data": {"train_set": "a.jsonl", "heldout_set": "a.jsonl"}}))
    assert any(p.startswith("env.options: the factory Guess(max_guesses: int = 4) cannot be called with the options "
                            "['max_guesess'] (got an unexpected keyword argument 'max_guesess')") for p in problems), \
        problems
