"""skyrl_gym: skyrl-gym environments run through turnrl give the library's own rewards,
termination and observations (recorded policy texts replayed through both), the loss mask
covers exactly the policy's tokens, bad input is one line, and two training steps run on the
real stack."""
from __future__ import annotations

import json
import sys
import time

import pytest

skyrl_gym = pytest.importorskip("skyrl_gym", reason="pip install skyrl-gym==0.4.0")

from omegaconf import OmegaConf   # noqa: E402
from skyrl_gym.envs.base_text_env import BaseTextEnv   # noqa: E402
from transformers import AutoTokenizer   # noqa: E402

from turnrl import envs   # noqa: E402
from turnrl.config import Config, ConfigError   # noqa: E402
from turnrl.config.loading import parse_config   # noqa: E402
from turnrl.envs.base import EnvContext, step_result_problem   # noqa: E402
from turnrl.pipeline.prepare_model import WarmStartError, build_tiny   # noqa: E402
from turnrl.plugins import PluginError   # noqa: E402
from turnrl.rollout.chat import ChatFormat   # noqa: E402
from turnrl.rollout.multi_turn import Trajectory, replay   # noqa: E402

QUESTION = "Natalia sold clips to 48 friends in April, and half as many in May. How many in all?"
# Recorded policy texts: right, right with a thousands comma, wrong, malformed (no '####'),
# a number in another format ('72.0': the library's strict match says no).
RIGHT = "In May she sold 48 / 2 = 24 clips, so 48 + 24 = 72 in all.\n#### 72"
TEXTS = [RIGHT, "#### 1,072", "48 + 12 = 60\n#### 60", "The answer is 72.", "#### 72.0"]
ROW = {"id": "q1", "prompt": QUESTION, "answer": "72", "answers": ["72"], "subject": None, "level": None,
       "source": "mine"}


def _library(env_id: str, ground_truth: str, texts: list[str], max_turns: int) -> list[tuple]:
    """The texts stepped through skyrl_gym itself, built as SkyRL's generator builds it:
    [(reward, done, observation contents, metadata)] up to done."""
    env = skyrl_gym.make(env_id, env_config=OmegaConf.create({}),
                         extras={"reward_spec": {"method": "rule", "ground_truth": ground_truth},
                                 "reward_model": {"ground_truth": ground_truth}, "max_turns": max_turns})
    env.init([{"role": "user", "content": QUESTION}])
    out = []
    for text in texts:
        step = env.step(text)
        out.append((float(step["reward"]), step["done"], [m["content"] for m in step["observations"]],
                    step["metadata"]))
        if step["done"]:
            break
    return out


def _turnrl(env_id: str, row: dict, texts: list[str], max_turns: int) -> tuple[Trajectory, list]:
    env = envs.resolve("skyrl_gym").bind(envs.check_options(envs.resolve("skyrl_gym"), {"id": env_id}),
                                         EnvContext(max_turns=max_turns))()
    t = Trajectory(example=row, prompt_ids=[1])
    assert env.reset(row) == row["prompt"]
    results = []
    for text in texts:
        result = env.step(text)
        assert step_result_problem(result) is None
        results.append(result)
        if t.record(result):
            break
    return t, results


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("env_id", ["gsm8k", "aime"])
def test_single_turn_rewards_equal_the_librarys(env_id, text):
    truth = "1072" if "1,072" in text else "72"
    [(reward, done, observations, metadata)] = _library(env_id, truth, [text], max_turns=3)
    t, [result] = _turnrl(env_id, {**ROW, "answer": truth}, [text], max_turns=3)
    assert done is True and result.done is True and observations == []
    assert result.reward == pytest.approx(reward, abs=1e-9) and t.outcome == pytest.approx(reward, abs=1e-9)
    if env_id == "aime":   # numeric metadata (acc) goes into info; the string pred does not
        assert result.info["acc"] == float(metadata["acc"]) and "pred" not in result.info
    assert t.finish == "done"


def test_recorded_rewards_span_the_cases():
    """The recorded texts are not all scored alike: the parity above compares real differences."""
    assert [_library("gsm8k", "1072" if "1,072" in x else "72", [x], 3)[0][0] for x in TEXTS] == [1, 1, 0, 0, 0]
    assert [_library("aime", "72", [x], 3)[0][0] for x in (RIGHT, "Answer: 72", "Answer: 60")] == [-1.0, 1.0, -1.0]


@pytest.mark.parametrize("texts", [
    ["#### 70", "I am not sure yet.", "#### 72"],      # wrong, malformed, right: per-turn rewards
    ["#### 72", "never reached"],                      # right at once
    ["no idea", "still none", "#### 5", "unused"],     # the library's max_turns ends it
])
def test_multi_turn_rewards_observations_and_termination_equal_the_librarys(texts):
    lib = _library("gsm8k_multi_turn", "72", texts, max_turns=3)
    t, results = _turnrl("gsm8k_multi_turn", ROW, texts, max_turns=3)
    assert len(results) == len(lib)
    for result, (reward, done, observations, _) in zip(results, lib):
        assert result.reward == pytest.approx(reward, abs=1e-9) and result.done == done
        if not done:
            assert [result.observation] == observations
    # the outcome is the episode's return: SkyRL sums its per-turn rewards
    assert t.outcome == pytest.approx(sum(r for r, *_ in lib), abs=1e-9)
    assert t.turn_rewards == pytest.approx([r for r, *_ in lib], abs=1e-9) and t.finish == "done"
    assert results[-1].info["steps"] == len(lib)   # get_metrics() at the end


def test_the_rows_own_reward_spec_is_the_ground_truth():
    row = {**ROW, "answer": "", "reward_spec": {"method": "rule", "ground_truth": "60"}}
    t, _ = _turnrl("gsm8k", row, ["#### 60"], max_turns=1)
    assert t.outcome == 1.0
    t, _ = _turnrl("gsm8k", {**ROW, "extras": {"reward_spec": {"ground_truth": "5"}}}, ["#### 72"], max_turns=1)
    assert t.outcome == 0.0   # the row's extras win over its answer


class Echo(BaseTextEnv):
    """A skyrl_gym environment of one's own (by import path): echoes the action as a tool
    message, 0.5 per turn, never done by itself, metadata numeric and not."""

    def __init__(self, env_config=None, extras=None):
        super().__init__()
        self.scale = float(env_config.get("scale", 1.0))

    def step(self, action):
        return {"observations": [{"role": "tool", "content": f"echo {action}"}], "reward": 0.5 * self.scale,
                "done": False, "metadata": {"length": len(action), "note": "text"}}


def test_own_env_by_import_path_keeps_roles_metadata_and_is_truncated_at_max_turns():
    env = envs.make("skyrl_gym", id="test_ecosystem_skyrl_gym:Echo", kwargs={"scale": 2.0})
    env.max_turns = 2
    env.reset(ROW)
    first, second = env.step("ab"), env.step("abc")
    assert (first.observation, env.observation_role, first.info) == ("echo ab", "tool", {"length": 2.0})
    assert first.reward == 1.0 and not first.done
    assert second.done and second.info["reason"] == "truncated" and second.info["outcome"] == 2.0


def test_loss_mask_covers_exactly_the_policys_tokens(tiny_model_dir):
    fmt = ChatFormat(AutoTokenizer.from_pretrained(tiny_model_dir))
    env = envs.make("skyrl_gym", id="gsm8k_multi_turn")
    turns = ["#### 70", "#### 72"]
    t = replay(env, fmt, ROW, turns)
    expected = [fmt.encode(x) + [fmt.end_of_turn_id] for x in turns]
    policy = [i for i, m in zip(t.response_ids, t.loss_mask) if m]
    assert policy == expected[0] + expected[1]
    # the masked-out run between the turns is exactly the library's observation, framed
    first_turn = len(expected[0])
    obs_end = t.loss_mask.index(1, first_turn)
    assert t.loss_mask[:first_turn] == [1] * first_turn and obs_end > first_turn
    observation = _library("gsm8k_multi_turn", "72", ["#### 70"], 3)[0][2][0]
    assert observation in fmt.tokenizer.decode(t.response_ids[first_turn:obs_end])
    assert t.outcome == pytest.approx(0.2 / 3 + 1.0, abs=1e-9)


def test_unknown_id_is_one_line_listing_the_known_ids():
    with pytest.raises(PluginError) as err:
        envs.make("skyrl_gym", id="gsm9k")
    msg = str(err.value)
    assert msg.startswith("env.options.id = 'gsm9k': ") and "\n" not in msg
    assert "gsm8k, gsm8k_multi_turn" in msg


def test_library_not_installed_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "skyrl_gym", None)   # `import skyrl_gym` raises ImportError
    with pytest.raises(PluginError) as err:
        envs.check_options(envs.resolve("skyrl_gym"), {"id": "gsm8k"})
    msg = str(err.value)
    assert msg.startswith("env.options.id = 'gsm8k': the skyrl-gym library is not importable") and "\n" not in msg
    assert "pip install -e '.[ecosystem]'" in msg


def _skyrl_rows(path, count: int):
    """Rows as SkyRL's gsm8k data has them: a chat prompt, env_class, reward_spec, extra_info."""
    with open(path, "w") as fh:
        for i in range(count):
            fh.write(json.dumps({
                "data_source": "mine", "env_class": "gsm8k",
                "prompt": [{"role": "user", "content": f"What is {i} + {i + 1}? End with '#### <number>'."}],
                "reward_spec": {"method": "rule", "ground_truth": str(2 * i + 1)},
                "extra_info": {"index": i}}) + "\n")
    return {"train_set": str(path), "heldout_set": str(path),
            "fields": {"prompt": "prompt.0.content", "answer": "reward_spec.ground_truth"}}


def test_tiny_model_and_synthetic_data_fail_before_any_work(tmp_path):
    data = _skyrl_rows(tmp_path / "rows.jsonl", 10)
    env = {"name": "skyrl_gym", "options": {"id": "gsm8k"}}
    with pytest.raises(ConfigError) as err:
        parse_config({"env": env, "data": data})            # model.path: tiny is the default
    assert "\n" not in str(err.value) and "model.path" in str(err.value) and "'skyrl_gym'" in str(err.value)
    with pytest.raises(WarmStartError):
        build_tiny(Config.model_validate({"env": env, "data": data}), tmp_path / "model")
    assert not (tmp_path / "model").exists()
    with pytest.raises(ConfigError) as err:
        parse_config({"env": env, "model": {"path": "Qwen/Qwen2.5-0.5B-Instruct"}})   # data: synthetic
    assert "\n" not in str(err.value) and "synthetic" in str(err.value) and "'skyrl_gym'" in str(err.value)


@pytest.mark.slow
def test_two_training_steps_on_skyrl_format_rows_resumed_between_them(tiny_model_dir, tmp_path):
    """Step 2 in a second run, resumed from step 1's checkpoint."""
    from conftest import train_two_steps
    start = time.time()
    history = train_two_steps(tiny_model_dir, tmp_path, {"name": "skyrl_gym", "options": {"id": "gsm8k"}},
                              {"name": "grpo"}, resume=True, data={**_skyrl_rows(tmp_path / "rows.jsonl", 40),
                                                      "train_examples": 16, "heldout_examples": 4},
                              # the adapter through Ray actors, the trainer and the rollout loop; the HF
                              # engine spares CI a vLLM start (~100 s; the vLLM path has its own tests)
                              rollout={"n": 2, "max_tokens_per_turn": 8, "max_turns": 1, "engine": "hf"})
    print(f"skyrl_gym: two training steps in {time.time() - start:.1f} s")
    assert all(0.0 <= h["reward_mean"] <= 1.0 for h in history)
