"""The multi-turn rollout loop: token in, token out; environment tokens masked; budgets."""
import pytest
from transformers import AutoTokenizer

from turnrl import envs
from turnrl.rollout.chat import ChatFormat
from turnrl.rollout.loop import Budgets, Sample, replay, run_rollouts

from conftest import ScriptedEngine

EXAMPLE = {"prompt": "Compute 123 * 456.", "answer": "56088"}


@pytest.fixture(scope="module")
def fmt(tiny_model_dir):
    return ChatFormat(AutoTokenizer.from_pretrained(tiny_model_dir))


def test_two_turn_tool_trajectory_is_exact(fmt):
    tok = fmt.tokenizer
    engine = ScriptedEngine(tok, ["<code>print(123 * 456)</code>", "<answer>56088</answer>"])
    [t] = run_rollouts(engine, [EXAMPLE], lambda: envs.make("code_tool"), fmt, Budgets(3, 32, 200))
    turn1 = tok("<code>print(123 * 456)</code>", add_special_tokens=False)["input_ids"]
    turn2 = tok("<answer>56088</answer>", add_special_tokens=False)["input_ids"]
    obs = fmt.observation_ids("<output>56088</output>", "tool")
    # token in, token out: the response is exactly sampled ids + observation ids + sampled ids
    assert t.response_ids == turn1 + obs + turn2
    assert t.loss_mask == [1] * len(turn1) + [0] * len(obs) + [1] * len(turn2)
    assert t.turn_ids == [0] * (len(turn1) + len(obs)) + [1] * len(turn2)
    assert t.engine_logprobs == [-0.5] * len(turn1) + [0.0] * len(obs) + [-0.5] * len(turn2)
    assert t.turn_rewards == [1.0, 1.0] and t.outcome == 1.0 and t.finish == "answer"
    assert t.first_observation == len(turn1)
    # the second call continued the exact token sequence of the first
    assert engine.calls[1]["prompts"][0] == t.prompt_ids + turn1 + obs
    # the observation sits in the chat template's tool role
    assert tok.decode(obs) == "<|im_end|>\n<|im_start|>tool\n<output>56088</output><|im_end|>\n<|im_start|>assistant\n"


def test_groups_are_contiguous_and_finished_trajectories_drop_out(fmt):
    engine = ScriptedEngine(fmt.tokenizer, ["<answer>1</answer>"])
    trajs = run_rollouts(engine, [EXAMPLE, {"prompt": "Compute 1 * 1.", "answer": "1"}],
                         lambda: envs.make("code_tool"), fmt, Budgets(3, 32, 200), n=3)
    assert [t.example["answer"] for t in trajs] == ["56088"] * 3 + ["1"] * 3
    assert [t.outcome for t in trajs] == [0.0] * 3 + [1.0] * 3
    assert len(engine.calls) == 1            # everyone answered in turn 1: no second call


def test_max_turns_ends_the_trajectory(fmt):
    engine = ScriptedEngine(fmt.tokenizer, ["<code>print(1)</code>"] * 2)
    [t] = run_rollouts(engine, [EXAMPLE], lambda: envs.make("code_tool"), fmt, Budgets(2, 32, 500))
    assert t.finish == "max_turns" and t.num_turns == 2 and len(t.observations) == 1
    assert t.loss_mask[-1] == 1              # no observation after the last allowed turn


def test_a_turn_cut_by_the_token_limit_is_truncated(fmt):
    engine = ScriptedEngine(fmt.tokenizer, ["<code>print(123456789 * 987654321)</code>"])
    [t] = run_rollouts(engine, [EXAMPLE], lambda: envs.make("code_tool"), fmt, Budgets(3, 5, 200))
    assert t.finish == "truncated" and len(t.response_ids) == 5 and t.outcome == 0.0


def test_the_total_token_budget_caps_each_turn_and_ends_the_trajectory(fmt):
    turn = "<code>print(123 * 456)</code>"
    n_turn = len(fmt.encode(turn))
    n_obs = len(fmt.observation_ids("<output>56088</output>", "tool"))
    engine = ScriptedEngine(fmt.tokenizer, [turn, turn])
    [t] = run_rollouts(engine, [EXAMPLE], lambda: envs.make("code_tool"), fmt,
                       Budgets(3, 64, n_turn + n_obs + 3))
    assert engine.calls[1]["max_tokens"] == [3]       # only what is left of the budget
    assert t.finish == "truncated" and len(t.response_ids) == n_turn + n_obs + 3


def test_the_context_length_is_respected(fmt):
    engine = ScriptedEngine(fmt.tokenizer, [])
    [t] = run_rollouts(engine, [EXAMPLE], lambda: envs.make("code_tool"), fmt, Budgets(3, 32, 200, max_context=5))
    assert t.finish == "token_budget" and t.response_ids == [] and engine.calls == []


def test_replay_matches_the_loop(fmt):
    turns = ["<code>print(123 * 456)</code>", "<answer>56088</answer>"]
    looped = run_rollouts(ScriptedEngine(fmt.tokenizer, turns), [EXAMPLE], lambda: envs.make("code_tool"), fmt,
                          Budgets(3, 32, 200))[0]
    replayed = replay(envs.make("code_tool"), fmt, EXAMPLE, turns)
    assert replayed.prompt_ids + replayed.response_ids == looped.prompt_ids + looped.response_ids
    assert replayed.loss_mask == looped.loss_mask and replayed.outcome == looped.outcome == 1.0


def check_token_in_token_out(t, fmt):
    """Decoded policy tokens equal what was sampled; every other response token is an
    observation, exactly as the chat template renders it."""
    segments, current, mask_now = [], [], None
    for tok, m in zip(t.response_ids, t.loss_mask):
        if m != mask_now and current:
            segments.append((mask_now, current))
            current = []
        mask_now = m
        current.append(tok)
    if current:
        segments.append((mask_now, current))
    policy = [ids for m, ids in segments if m == 1]
    observations = [ids for m, ids in segments if m == 0]
    assert [fmt.tokenizer.decode(ids, skip_special_tokens=False) for ids in policy] == t.turn_texts[:len(policy)]
    assert observations == [fmt.observation_ids(o, "tool") for o in t.observations]
    assert all(lp <= 0 for lp, m in zip(t.engine_logprobs, t.loss_mask) if m) 
    assert all(lp == 0 for lp, m in zip(t.engine_logprobs, t.loss_mask) if not m)


def test_real_transformers_engine_keeps_sampled_ids(tiny_model_dir, fmt):
    from turnrl.rollout.engines import HFEngine
    engine = HFEngine(str(tiny_model_dir))
    trajs = run_rollouts(engine, [EXAMPLE] * 4, lambda: envs.make("code_tool"), fmt, Budgets(3, 16, 80), n=2)
    assert len(trajs) == 8
    for t in trajs:
        assert t.finish in {"answer", "no_action", "max_turns", "token_budget", "truncated"}
        check_token_in_token_out(t, fmt)


def test_a_turn_ended_by_the_model_is_not_closed_twice(fmt):
    """A ramble has no stop string: the model ends it with the end-of-turn token itself, and
    the conversation is exactly what the chat template renders for the same messages."""
    from turnrl.envs.intervention import INTERVENTION, InterventionEnv
    env = InterventionEnv(max_turns=3)
    example = {"prompt": "Compute 12 + 34.", "answer": "46"}
    t = replay(env, fmt, example, ["Let me think about it again.", "<answer>46</answer>"])
    eos = fmt.tokenizer.eos_token_id
    first_turn = [i for i, k in zip(t.response_ids, t.turn_ids) if k == 0]
    assert t.outcome == 1.0 and eos in first_turn
    assert t.response_ids[t.loss_mask.index(0) - 1] == eos          # the ramble's last policy token
    messages = [{"role": "system", "content": env.system_prompt}, {"role": "user", "content": example["prompt"]},
                {"role": "assistant", "content": "Let me think about it again."},
                {"role": "user", "content": INTERVENTION},
                {"role": "assistant", "content": "<answer>46</answer>"}]
    rendered = fmt.tokenizer.apply_chat_template(messages, tokenize=False)
    text = fmt.tokenizer.decode(t.prompt_ids + t.response_ids, skip_special_tokens=False)
    assert rendered.startswith(text) and rendered[len(text):].strip() == fmt.tokenizer.eos_token


def test_two_models_each_play_their_level_of_one_conversation(fmt):
    """math_refine with a second model for the feedback: turns 0 and 2 come from the solver's
    engine, turn 1 from the feedback model's, each batched over the live trajectories."""
    tok = fmt.tokenizer
    low = ScriptedEngine(tok, ["<answer>57</answer>", "<answer>123</answer>"])
    high = ScriptedEngine(tok, ["<feedback>5+8=13 7+4+1=12</feedback>"])
    example = {"prompt": "Compute 75 + 48.", "answer": "123"}
    trajs = run_rollouts({"low": low, "high": high}, [example], lambda: envs.make("math_refine"), fmt,
                         Budgets(3, 32, 400), n=2)
    assert len(low.calls) == 2 and len(high.calls) == 1
    assert all(len(c["prompts"]) == 2 for c in low.calls + high.calls)   # the group shares each call
    for t in trajs:
        assert t.turn_texts == ["<answer>57</answer>", "<feedback>5+8=13 7+4+1=12</feedback>", "<answer>123</answer>"]
        assert t.outcome == 1.0 and t.info["attempt_correct"] == 0.0 and t.finish == "answer"
        # the feedback model continued exactly the solver's tokens and the environment's
        attempt = tok("<answer>57</answer>", add_special_tokens=False)["input_ids"]
        assert high.calls[0]["prompts"][0][len(t.prompt_ids):][:len(attempt)] == attempt
        assert sorted(set(t.turn_ids)) == [0, 1, 2]
    # one engine for both levels is the shared-weights mode: three calls
    shared = ScriptedEngine(tok, ["<answer>57</answer>", "<feedback>ok</feedback>", "<answer>123</answer>"])
    run_rollouts(shared, [example], lambda: envs.make("math_refine"), fmt, Budgets(3, 32, 400))
    assert len(shared.calls) == 3
