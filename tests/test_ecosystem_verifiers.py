"""`env.name: verifiers` against the real library (verifiers 0.4.0) in its own virtualenv
(`.venv-verifiers`, made by setup.sh), through the bridge, on the example environments of
examples/verifiers_env: `arith_vf` (single turn, two weighted rewards) and `guess_vf` (a
multi-turn `vf.Env` with max_turns 4 and a `@vf.stop`). The reference is the library itself,
called directly inside that virtualenv by a script of this test."""
from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from conftest import needs_setup
from turnrl import envs
from turnrl.envs.ecosystem import verifiers as vfe
from turnrl.plugins import PluginError

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = str(REPO / "examples" / "verifiers_env")
VENV_PYTHON = REPO / ".venv-verifiers" / "bin" / "python"

needs_setup(VENV_PYTHON, "verifiers 0.4.0 cannot share turnrl's environment")

# The library's own score of a conversation: its taskset's task, a vf.Trace of the messages,
# Task.score (the weighted @vf.reward methods), run in the verifiers virtualenv.
LIBRARY_SCORE = r"""
import asyncio, json, sys
import verifiers.v1 as vf
from verifiers.v1.graph import MessageNode
from verifiers.v1.trace import AgentInfo, Trace, TraceTask
from verifiers.v1.utils.loaders import load_taskset, taskset_config_type
kinds = {"system": vf.SystemMessage, "user": vf.UserMessage, "assistant": vf.AssistantMessage}
answers = []
for req in json.loads(sys.argv[1]):
    config = taskset_config_type(req["environment"]).model_validate({"id": req["environment"], **req["args"]})
    task = list(load_taskset(config))[req["index"]]
    trace = Trace(task=TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
                  agent=AgentInfo(config=vf.AgentConfig()))
    for i, (role, text) in enumerate([("system", task.data.system_prompt)] + req["messages"]):
        trace.nodes.append(MessageNode(parent=i - 1 if i else None, message=kinds[role](content=text),
                                       sampled=role == "assistant"))
    asyncio.run(task.score(trace))
    answers.append({"reward": trace.reward, "rewards": {k: r.score for k, r in trace.rewards.items()},
                    "prompt": task.data.prompt_text, "answer": task.data.answer,
                    "system_prompt": task.data.system_prompt})
print(json.dumps(answers))
"""


def library_scores(environment: str, index: int, conversations: list[list[tuple[str, str]]]) -> list[dict]:
    """The library's score of each conversation (one subprocess: importing verifiers takes seconds)."""
    reqs = [{"environment": environment, "index": index, "messages": c, "args": {}} for c in conversations]
    out = subprocess.run([str(VENV_PYTHON), "-c", LIBRARY_SCORE, json.dumps(reqs)], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": EXAMPLES}, timeout=300, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def play(environment: str, index: int, replies: list[str], max_turns: int = 8,
         **options) -> tuple[list, list[tuple[str, str]], object]:
    """Replies stepped until done, under rollout.max_turns = `max_turns`: (the step results,
    the conversation, the env)."""
    env = envs.make("verifiers", envs.EnvContext(max_turns=max_turns), environment=environment, path=[EXAMPLES],
                    **options)
    conversation = [("user", env.reset({"verifiers_index": index}))]
    results = []
    for reply in replies:
        result = env.step(reply)
        results.append(result)
        conversation.append(("assistant", reply))
        if result.done:
            break
        assert isinstance(result.observation, str) and result.reward == 0.0
        conversation.append(("user", result.observation))
    return results, conversation, env


def assert_parity(result, library: dict) -> None:
    """turnrl's outcome, reward and per-reward info equal the library's score, to 1e-9."""
    assert result.done
    assert abs(result.info["outcome"] - library["reward"]) <= 1e-9
    assert abs(result.reward - library["reward"]) <= 1e-9
    assert set(library["rewards"]) <= set(result.info)
    for name, score in library["rewards"].items():
        assert abs(result.info[name] - score) <= 1e-9, name


def test_single_turn_rewards_equal_the_librarys():
    """arith_vf: right, wrong, and right but wordy (correct weight 1, concise weight 0.5)."""
    env = envs.make("verifiers", environment="arith_vf", path=[EXAMPLES])
    first = env.reset({"verifiers_index": 1})
    (task,) = library_scores("arith_vf", 1, [[]])
    assert first == task["prompt"] and env.system_prompt == task["system_prompt"] and env.observation_role == "user"
    answer = task["answer"]
    expected = {answer: 1.5, str(int(answer) + 1): 0.5, " ".join(["well"] * 25) + f" {answer}": 1.0}
    played = [play("arith_vf", 1, [reply]) for reply in expected]
    library = library_scores("arith_vf", 1, [conversation for _, conversation, _ in played])
    for (results, _, _), reference, reward in zip(played, library, expected.values()):
        assert len(results) == 1 and results[0].done and results[0].observation is None
        assert_parity(results[0], reference)
        assert reference["reward"] == pytest.approx(reward)


def test_multi_turn_stop_conditions_and_rewards():
    """guess_vf's task 0 (target 50): run() returns on the right guess; the agent's max_turns (4)
    and the task's @vf.stop (gave_up) end the exchange before the next turn, as in the library."""
    cases = {("10", "70", "50"): (3, "user_closed", ["Higher.", "Lower."]),
             ("1", "2", "3", "4", "5"): (4, "max_turns", ["Higher."] * 3),
             ("10", "I give up", "50"): (2, "gave_up", ["Higher."])}
    played = [play("guess_vf", 0, list(replies)) for replies in cases]
    library = library_scores("guess_vf", 0, [conversation for _, conversation, _ in played])
    for (turns, reason, observations), (results, _, _), reference in zip(cases.values(), played, library):
        assert len(results) == turns, reason
        assert [r.done for r in results] == [False] * (turns - 1) + [True]
        assert [r.observation for r in results[:-1]] == observations
        assert results[-1].info["reason"] == reason
        assert_parity(results[-1], reference)
    assert results[-1].info["solved"] == 0.0 and results[-1].info["few_turns"] == pytest.approx(0.5)
    assert played[0][0][-1].info["solved"] == 1.0


def test_rollout_max_turns_below_the_agents_stops_and_scores_the_trace_as_the_library_does():
    """rollout.max_turns 2 under guess_vf's own 4: the third turn is refused, the trace stops with
    "max_turns" and its score is the library's for the two-turn conversation (not turnrl's 0)."""
    results, conversation, _ = play("guess_vf", 0, ["10", "20", "30"], max_turns=2)
    assert [r.done for r in results] == [False, True]
    assert results[-1].info["reason"] == "max_turns"
    (reference,) = library_scores("guess_vf", 0, [conversation])
    assert_parity(results[-1], reference)
    assert reference["reward"] > 0          # its few_turns reward: a cut trace is not worth 0 there
    assert results[-1].info["few_turns"] > 0


def test_rows_index_the_taskset_and_the_splits_are_disjoint():
    train = vfe.TASK.rows(32, seed=0, split="train", exclude=set())
    heldout = vfe.TASK.rows(8, seed=0, split="heldout", exclude=set())
    assert {r["verifiers_index"] for r in train}.isdisjoint(r["verifiers_index"] for r in heldout)
    assert max(r["verifiers_index"] for r in train) == 63   # arith_vf's default 64 tasks suffice
    with pytest.raises(PluginError, match="data.train_set and data.heldout_set to synthetic"):
        envs.make("verifiers", environment="arith_vf", path=[EXAMPLES]).reset({"prompt": "x", "answer": "1"})


def test_bad_input_is_one_line():
    cases = [({"environment": "no_such_vf"}, "env.options.environment = 'no_such_vf': .*not found"),
             ({"environment": "arith_vf", "args": {"bogus": 1}},
              "env.options.environment = 'arith_vf': .*taskset.bogus: Extra inputs are not permitted"),
             ({"environment": "arith_vf", "python": "/no/such/python"},
              "env.options.python = '/no/such/python': no such file; run ./setup.sh"),
             ({"environment": "arith_vf", "path": ["no/such/folder"]}, "env.options.path: 'no/such/folder'")]
    for options, message in cases:
        with pytest.raises(PluginError, match=message) as err:
            envs.make("verifiers", **{"path": [EXAMPLES], **options}).reset({"verifiers_index": 0})
        assert "\n" not in str(err.value)
    with pytest.raises(PluginError, match="the taskset has 4 tasks"):
        envs.make("verifiers", environment="arith_vf", path=[EXAMPLES], args={"size": 4}).reset({"verifiers_index": 9})


def test_no_bridge_venv_stops_with_the_options(tmp_path, monkeypatch):
    """Without .venv-verifiers the options are refused (turnrl config, preprocess: before any work)."""
    monkeypatch.delenv(vfe.PYTHON_ENV_VAR, raising=False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(vfe, "_repo_root", lambda: tmp_path)
    with pytest.raises(PluginError, match="env.options.python = None: no .venv-verifiers.*run ./setup.sh, or set "
                                          "env.options.python") as err:
        envs.make("verifiers", environment="arith_vf")
    assert "\n" not in str(err.value)


def test_a_bridge_that_dies_is_an_error_then_a_new_bridge():
    env = envs.make("verifiers", environment="guess_vf", path=[EXAMPLES], timeout_s=30)
    env.reset({"verifiers_index": 0})
    env.bridge.proc.kill()
    start = time.monotonic()
    with pytest.raises(PluginError, match="bridge"):
        env.step("10")
    assert time.monotonic() - start < 30
    fresh = envs.make("verifiers", environment="guess_vf", path=[EXAMPLES])
    assert fresh.reset({"verifiers_index": 0}).startswith("I am thinking")
    assert fresh.bridge is not env.bridge and fresh.bridge.alive
    assert fresh.step("50").done


BROKEN_ENV = """
import verifiers.v1 as vf

class Task(vf.Task[vf.TaskData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def one(self) -> float:
        return 1.0

class Tasks(vf.Taskset[Task, vf.TasksetConfig]):
    def load(self):
        yield Task(vf.TaskData(prompt="Say something."), self.config.task)

class Config(vf.EnvConfig):
    solver: vf.AgentConfig = vf.AgentConfig()

class BrokenEnv(vf.Env[Config]):
    async def run(self, task, agents):
        async with agents.solver.interaction(task) as solver:
            await solver.turn()
            raise ValueError("the env broke after the first reply")

__all__ = ["Tasks", "BrokenEnv"]
"""


def test_an_env_that_raises_is_a_one_line_error_not_a_hang(tmp_path):
    (tmp_path / "broken_vf.py").write_text(BROKEN_ENV)
    env = envs.make("verifiers", environment="broken_vf", path=[str(tmp_path)], timeout_s=60)
    assert env.reset({"verifiers_index": 0}) == "Say something."
    start = time.monotonic()
    with pytest.raises(PluginError, match="ValueError: the env broke after the first reply") as err:
        env.step("hello")
    assert time.monotonic() - start < 30 and "\n" not in str(err.value)
    again = envs.make("verifiers", environment="broken_vf", path=[str(tmp_path)], timeout_s=60)
    assert again.reset({"verifiers_index": 0}) == "Say something."   # the same bridge serves on


# --------------------------------------------------------------------------- the real stack
@pytest.mark.slow
def test_two_training_steps_on_a_verifiers_environment(tiny_model_dir, tmp_path):
    """GRPO through Ray, DeepSpeed and vLLM; the rollout worker starts its bridge."""
    from conftest import train_two_steps
    start = time.time()
    history = train_two_steps(tiny_model_dir, tmp_path,
                              {"name": "verifiers", "options": {"environment": "arith_vf", "path": [EXAMPLES]}},
                              {"name": "grpo"}, data={"train_examples": 16, "heldout_examples": 4},
                              rollout={"n": 2, "max_tokens_per_turn": 8, "max_turns": 1})
    print(f"\nMEASURED verifiers: two training steps in {time.time() - start:.1f} s")
    assert all(h["finish_env_error_frac"] == 0.0 for h in history)
    assert all(0.0 <= h["reward_mean"] <= 1.5 for h in history)
    # each reward by name, over the trajectories that reached the environment (a turn cut by the
    # token limit does not: the untrained model rarely ends one within 8 tokens)
    assert any("env_correct_mean" in h and "env_concise_mean" in h for h in history)
