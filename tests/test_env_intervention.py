"""intervention (MuTIS): the first answer marker of a turn, math-verify grading, intervention
messages, the turn budget, and scripted rollouts through the real loop."""
import pytest

from turnrl.envs.intervention import INTERVENTION, InterventionEnv, find_answer
from turnrl.rollout.chat import ChatFormat
from turnrl.rollout.multi_turn import Budgets, run_rollouts

from conftest import ScriptedEngine

HALF = {"prompt": "What is 1/2 as a fraction?", "answer": "\\frac{1}{2}"}
TWELVE = {"prompt": "What is 3 * 4?", "answer": "12"}


# ----------------------------------------------------------------------------- markers
@pytest.mark.parametrize("text, kind, content", [
    ("so <answer> 12 </answer> and more", "tag", "12"),
    ("Final Answer: 12\n\nLet me double check: 13?", "paragraph", "12"),
    ("We get it.\n**Final Answer:** $\\frac{1}{2}$\n\nDone.", "paragraph", "$\\frac{1}{2}$"),
    ("Step 1.\n\nAnswer:\n\n\\boxed{3}\n\nbye", "paragraph", "\\boxed{3}"),   # empty marker line: next paragraph
    ("### Answer: 7", "paragraph", "7"),
    ("thus \\boxed{\\frac{1}{\\sqrt{2}}} and then \\boxed{7}", "boxed", "\\frac{1}{\\sqrt{2}}"),
    ("first \\boxed{1}, later <answer>2</answer>", "boxed", "1"),              # the first marker wins
    ("<answer>2</answer> on reflection \\boxed{1}", "tag", "2"),
    ("<answer> </answer> so \\boxed{4}", "boxed", "4"),                      # blank markers are skipped
    ("Final Answer: \\boxed{5}", "paragraph", "\\boxed{5}"),                 # the boxed belongs to it
])
def test_find_answer(text, kind, content):
    marker = find_answer(text)
    assert marker is not None and marker.kind == kind and marker.content == content
    span = text[marker.start:marker.end]
    if kind == "tag":
        assert span.startswith("<answer>") and span.endswith("</answer>")
    elif kind == "boxed":
        assert span.startswith("\\boxed{") and span.endswith("}")
    else:
        assert "answer" in span.lower() and span.rstrip().endswith(content)
        assert text[marker.end:] == "" or text[marker.end:].startswith("\n\n")   # up to the paragraph's end


@pytest.mark.parametrize("text", [
    "so the answer is 5",
    "so the answer: 5",                       # not at the start of a line
    "Answer:",                                # a marker with nothing after it
    "\\boxed{3",                              # unbalanced
    "<answer>3",                              # unclosed
    "Answering the question requires care.",
])
def test_no_answer_marker(text):
    assert find_answer(text) is None


def test_the_cut_is_right_after_the_first_balanced_boxed():
    text = "so \\boxed{\\frac{a}{b^{2}}} wait \\boxed{9}"
    marker = find_answer(text)
    assert text[:marker.end] == "so \\boxed{\\frac{a}{b^{2}}}"


# ----------------------------------------------------------------------------- stepping
def test_an_answer_tag_ends_the_trajectory_and_only_the_text_before_the_cut_is_graded():
    env = InterventionEnv()
    assert env.reset(TWELVE) == "What is 3 * 4?"
    assert env.stop == ("</answer>",) and env.observation_role == "user"
    text = "3 * 4 = 12. <answer>12</answer> Hmm, or <answer>13</answer>"
    r = env.step(text)
    assert r.done and r.observation is None and r.reward == 1.0
    assert r.info["outcome"] == 1.0 and r.info["reason"] == "answer" and r.info["marker"] == "tag"
    assert r.info["extracted"] == "12" and r.info["turns_used"] == 1 and r.info["interventions"] == 0
    cut = text.index("</answer>") + len("</answer>")
    assert r.info["chars_used"] == cut and r.info["chars_after_answer"] == len(text) - cut

    env.reset(TWELVE)
    r = env.step("<answer>13</answer> no wait, <answer>12</answer>")
    assert r.done and r.info["outcome"] == 0.0 and r.reward == 0.0 and r.info["reason"] == "answer"


def test_a_final_answer_paragraph_is_graded():
    env = InterventionEnv()
    env.reset(TWELVE)
    r = env.step("Three fours.\n\nFinal Answer: 12\n\nActually, maybe 13.")
    assert r.done and r.info["outcome"] == 1.0 and r.info["marker"] == "paragraph"
    env.reset({"prompt": "p", "answer": "13"})
    assert env.step("Three fours.\n\nFinal Answer: 12\n\nActually, maybe 13.").info["outcome"] == 0.0


def test_the_first_balanced_boxed_is_graded_with_math_verify():
    env = InterventionEnv()
    env.reset({"prompt": "p", "answer": "0.5"})
    r = env.step("It is \\boxed{\\frac{1}{2}}. Or maybe \\boxed{0.7}")
    assert r.done and r.info["outcome"] == 1.0 and r.info["marker"] == "boxed"
    assert r.info["extracted"] == "\\frac{1}{2}"
    env.reset(HALF)
    assert env.step("<answer>0.5</answer>").info["outcome"] == 1.0           # 0.5 == \frac{1}{2}
    env.reset(HALF)
    assert env.step("\\boxed{\\frac{2}{4}}").info["outcome"] == 1.0
    env.reset(HALF)
    assert env.step("Answer: 0.25").info["outcome"] == 0.0


def test_no_answer_gets_the_intervention_then_the_answer_counts():
    env = InterventionEnv()
    env.reset(TWELVE)
    first = "Let me think: 3 * 4 is three fours."
    r = env.step(first)
    assert not r.done and r.reward == 0.0 and r.observation == INTERVENTION
    assert r.info == {"intervention": True, "interventions": 1, "turns_used": 1, "chars_used": len(first)}
    r = env.step("<answer>12</answer>")
    assert r.done and r.info["outcome"] == 1.0 and r.info["turns_used"] == 2 and r.info["interventions"] == 1
    assert r.info["chars_used"] == len(first) + len("<answer>12</answer>")


def test_the_turn_budget_ends_with_max_turns():
    env = InterventionEnv(max_turns=3)
    env.reset(TWELVE)
    results = [env.step(f"thinking {i}") for i in range(3)]
    assert [r.done for r in results] == [False, False, True]
    assert [r.observation for r in results] == [INTERVENTION, INTERVENTION, None]
    last = results[-1]
    assert last.reward == 0.0 and last.info["outcome"] == 0.0 and last.info["reason"] == "max_turns"
    assert last.info["turns_used"] == 3 and last.info["interventions"] == 2
    assert last.info["chars_used"] == 3 * len("thinking 0")

    env.reset(TWELVE)                                        # reset restores the budget
    assert not env.step("hmm").done


def test_one_turn_budget_and_a_custom_message():
    env = InterventionEnv(max_turns=1)
    env.reset(TWELVE)
    r = env.step("hmm")
    assert r.done and r.info["reason"] == "max_turns" and r.info["interventions"] == 0
    env = InterventionEnv(max_turns=2, intervention="Answer now, in <answer></answer>.")
    env.reset(TWELVE)
    assert env.step("hmm").observation == "Answer now, in <answer></answer>."
    with pytest.raises(ValueError):
        InterventionEnv(max_turns=0)


# ----------------------------------------------------------------------------- through the loop
@pytest.fixture(scope="module")
def fmt():
    from turnrl.envs.intervention import SYSTEM_PROMPT
    from turnrl.models.tiny import build_tokenizer

    texts = [SYSTEM_PROMPT, INTERVENTION, HALF["prompt"], "Let me think about one half.",
             "It is \\boxed{\\frac{1}{2}}. Or maybe \\boxed{0.7}", "<answer>0.5</answer>"]
    return ChatFormat(build_tokenizer(texts * 4, 512))


def test_a_scripted_rollout_through_the_loop(fmt):
    tok = fmt.tokenizer
    turns = ["Let me think about one half.", "It is \\boxed{\\frac{1}{2}}. Or maybe \\boxed{0.7}"]
    engine = ScriptedEngine(tok, turns)
    [t] = run_rollouts(engine, [HALF], lambda: InterventionEnv(max_turns=3), fmt, Budgets(3, 64, 1000))

    assert engine.calls[0]["stop"] == ("</answer>",)
    assert t.finish == "answer" and t.outcome == 1.0 and t.turn_rewards == [0.0, 1.0]
    assert t.observations == [INTERVENTION] and t.info["turns_used"] == 2 and t.info["marker"] == "boxed"
    turn1, turn2 = (tok(x, add_special_tokens=False)["input_ids"] for x in turns)
    obs = fmt.observation_ids(INTERVENTION, "user")
    # the loop keeps every sampled token, the text after the first \boxed{} included
    assert t.response_ids == turn1 + obs + turn2
    assert t.loss_mask == [1] * len(turn1) + [0] * len(obs) + [1] * len(turn2)
    assert t.info["chars_after_answer"] == len(". Or maybe \\boxed{0.7}")
    # the intervention is a user message between two assistant messages
    assert tok.decode(obs) == f"<|im_end|>\n<|im_start|>user\n{INTERVENTION}<|im_end|>\n<|im_start|>assistant\n"


def test_the_environment_ends_at_its_own_turn_budget_in_the_loop(fmt):
    engine = ScriptedEngine(fmt.tokenizer, ["Let me think about one half."] * 3)
    [t] = run_rollouts(engine, [HALF], lambda: InterventionEnv(max_turns=3), fmt, Budgets(10, 64, 1000))
    assert t.finish == "max_turns" and t.num_turns == 3 and t.outcome == 0.0
    assert t.observations == [INTERVENTION] * 2 and t.loss_mask[-1] == 1
    assert sum(1 for a, b in zip(t.loss_mask, t.loss_mask[1:]) if a == 1 and b == 0) == 2   # two masked blocks
    assert len(engine.calls) == 3
