"""code_tool: action parsing, tool execution through the sandbox, turn and outcome rewards."""
import pytest

from turnrl import envs
from turnrl.envs.code_tool import parse_action


@pytest.mark.parametrize("text, expected", [
    ("<code>print(2 * 3)</code>", ("code", "print(2 * 3)")),
    ("let me compute <code>\nx = 4\nprint(x)\n</code>", ("code", "x = 4\nprint(x)")),
    ("<answer> 42 </answer>", ("answer", "42")),
    ("<answer>7</answer><code>print(1)</code>", ("answer", "7")),      # the first complete tag wins
    ("<code>print(1)</code> then <answer>1</answer>", ("code", "print(1)")),
    ("<code>print(1)", ("none", None)),                                  # unfinished: no action
    ("I think it is 12", ("none", None)),
])
def test_parse_action(text, expected):
    assert parse_action(text) == expected


def test_a_tool_turn_returns_the_output_and_turn_reward_1():
    env = envs.make("code_tool")
    assert env.reset({"prompt": "Compute 123 * 456.", "answer": "56088"}) == "Compute 123 * 456."
    result = env.step("<code>print(123 * 456)</code>")
    assert result.observation == "<output>56088</output>"
    assert result.reward == 1.0 and not result.done and result.info["tool_ok"] is True


def test_a_failing_tool_call_returns_the_error_as_text_and_turn_reward_0():
    env = envs.make("code_tool")
    env.reset({"prompt": "p", "answer": "1"})
    result = env.step("<code>print(1/0)</code>")
    assert not result.done and result.reward == 0.0
    assert result.observation.startswith("<output>Error:") and "ZeroDivisionError" in result.observation


def test_a_timeout_comes_back_as_an_observation():
    env = envs.make("code_tool", timeout_s=1.0)
    env.reset({"prompt": "p", "answer": "1"})
    result = env.step("<code>while True: pass</code>")
    assert not result.done and result.reward == 0.0 and "timeout" in result.observation.lower()


@pytest.mark.parametrize("answer, outcome", [("56088", 1.0), ("56,088", 1.0), ("56089", 0.0), ("", 0.0)])
def test_the_answer_is_graded(answer, outcome):
    env = envs.make("code_tool")
    env.reset({"prompt": "Compute 123 * 456.", "answer": "56088"})
    result = env.step(f"<answer>{answer}</answer>")
    assert result.done and result.reward == outcome and result.info["outcome"] == outcome
    assert result.info["reason"] == "answer"


def test_a_turn_without_action_ends_with_outcome_0():
    env = envs.make("code_tool")
    env.reset({"prompt": "p", "answer": "1"})
    result = env.step("hmm")
    assert result.done and result.info == {"outcome": 0.0, "reason": "no_action", "tool_calls": 0}


def test_output_is_truncated_to_the_budget():
    env = envs.make("code_tool", max_output_chars=50)
    env.reset({"prompt": "p", "answer": "1"})
    result = env.step("<code>print('x' * 10000)</code>")
    assert len(result.observation) < 200


def test_unknown_environment_names_the_known_ones():
    with pytest.raises(ValueError, match="'chess': not a registered environment .*code_tool"):
        envs.make("chess")


def test_registered_environments_are_made_by_name(tmp_path):
    from turnrl.data.sources import write_parquet
    write_parquet([{"id": "0", "title": "Paris", "text": "Paris is the capital of France."}],
                  tmp_path / "corpus.parquet")
    assert envs.make("intervention", context=envs.EnvContext(max_turns=2)).max_turns == 2
    assert envs.make("search", context=envs.EnvContext(data_dir=tmp_path)).stop == ("</search>", "</answer>")
    assert {"code_tool", "math_answer", "search", "intervention"} <= set(envs.names())
    with pytest.raises(ValueError, match="env.options.timeout_s = -1.0: must be greater than 0"):
        envs.make("code_tool", timeout_s=-1.0)
