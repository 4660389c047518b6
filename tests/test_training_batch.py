"""From trajectories to the trainer's batch: token alignment and advantages per algorithm."""
import pytest
import torch
from transformers import AutoTokenizer

from turnrl import envs
from turnrl.config import AlgorithmCfg, Config
from turnrl.rollout.chat import ChatFormat
from turnrl.rollout.multi_turn import replay
from turnrl.training.loop import PromptSampler, advantage_metrics, advantages_for, collate, rollout_metrics

EXAMPLE = {"prompt": "Compute 123 * 456.", "answer": "56088"}
TOOL_RIGHT = ["<code>print(123 * 456)</code>", "<answer>56088</answer>"]
TOOL_WRONG = ["<code>print(123 * 456)</code>", "<answer>1</answer>"]
BAD_TOOL = ["<code>print(123 / 0)</code>", "<answer>56088</answer>"]
GUESS = ["<answer>56000</answer>"]


@pytest.fixture(scope="module")
def fmt(tiny_model_dir):
    return ChatFormat(AutoTokenizer.from_pretrained(tiny_model_dir))


def trajectories(fmt, scripts):
    return [replay(envs.make("code_tool"), fmt, EXAMPLE, s) for s in scripts]


def test_collate_aligns_every_tensor_with_the_tokens(fmt):
    trajs = trajectories(fmt, [TOOL_RIGHT, GUESS])
    batch = collate(trajs, pad_id=0)
    width = max(len(t.prompt_ids) + len(t.response_ids) for t in trajs)
    assert all(v.shape == (2, width) for v in batch.values())
    for row, t in enumerate(trajs):
        p, r = len(t.prompt_ids), len(t.response_ids)
        assert batch["input_ids"][row, :p + r].tolist() == t.prompt_ids + t.response_ids
        assert batch["attention_mask"][row].sum() == p + r
        assert batch["loss_mask"][row, :p].sum() == 0 and batch["loss_mask"][row, p:p + r].tolist() == t.loss_mask
        assert batch["turn_ids"][row, :p].eq(-1).all() and batch["turn_ids"][row, p + r:].eq(-1).all()
    assert batch["loss_mask"][1, len(trajs[1].prompt_ids) + len(trajs[1].response_ids):].sum() == 0


def test_grpo_advantages_follow_the_outcome_and_only_on_policy_tokens(fmt):
    trajs = trajectories(fmt, [TOOL_RIGHT, GUESS])          # one group of 2: outcomes 1 and 0
    batch = collate(trajs, pad_id=0)
    adv = advantages_for(AlgorithmCfg(), 2, trajs, batch)
    # (1 - 0.5) / (std([1, 0]) = 0.7071) = 0.7071 on every policy token of the winner
    winner = adv[0][batch["loss_mask"][0] == 1]
    assert torch.allclose(winner, torch.full_like(winner, 0.7071), atol=1e-3)
    assert (adv[1][batch["loss_mask"][1] == 1] < 0).all()
    assert adv[batch["loss_mask"] == 0].abs().sum() == 0


def test_mt_grpo_adds_turn_credit_before_the_first_tool_result(fmt):
    # same outcome (both right), different first turns: the tool call ran / failed
    trajs = trajectories(fmt, [TOOL_RIGHT, BAD_TOOL])
    assert [t.turn_rewards[0] for t in trajs] == [1.0, 0.0] and [t.outcome for t in trajs] == [1.0, 1.0]
    batch = collate(trajs, pad_id=0)
    grpo = advantages_for(AlgorithmCfg(), 2, trajs, batch)
    mt = advantages_for(AlgorithmCfg(name="mt_grpo"), 2, trajs, batch)
    assert grpo.abs().sum() == 0                              # equal outcomes: GRPO learns nothing
    p = len(trajs[0].prompt_ids)
    first_turn = slice(p, p + trajs[0].first_observation)
    assert (mt[0, first_turn] > 0.7).all() and (mt[1, p:p + trajs[1].first_observation] < -0.7).all()
    after = batch["loss_mask"][0].clone()
    after[:p + trajs[0].first_observation] = 0
    assert mt[0][after == 1].abs().sum() == 0                  # after the tool result: outcome only
    zero = advantages_for(Config.model_validate({"algorithm": {"name": "mt_grpo", "turn_coef": 0}}).algorithm, 2,
                          trajs, batch)
    assert torch.equal(zero, grpo)


def test_rollout_metrics(fmt):
    trajs = trajectories(fmt, [TOOL_RIGHT, TOOL_WRONG, GUESS, GUESS])
    m = rollout_metrics(trajs, n=2)
    assert m["reward_mean"] == 0.25 and m["tool_calls_mean"] == 0.5 and m["finish_answer_frac"] == 1.0
    assert m["groups_all_same_frac"] == 0.5                  # the two guesses are one flat group
    # per-turn parts: turn 1 = the tool ran (2 of 4), turn 2 = the tool users' answers (1 right of 4)
    assert m["turn1_reward_mean"] == 0.5 and m["turn2_reward_mean"] == 0.25 and "turn3_reward_mean" not in m
    assert m["env_tool_calls_mean"] == 0.5                   # the env's numeric info, averaged
    assert m["tool_call_rate"] == 0.5 and m["tool_success_rate"] == 0.5   # as the evaluation counts them
    bad = rollout_metrics(trajectories(fmt, [BAD_TOOL, GUESS]), n=2)
    assert bad["turn1_reward_mean"] == 0.0 and bad["env_tool_ok_mean"] == 0.0
    assert bad["tool_call_rate"] == 0.5 and bad["tool_success_rate"] == 0.0


def test_advantage_metrics_per_turn(fmt):
    # Row 0: turn 0 gets +1 on 2 tokens, turn 1 gets +1 on 1 token; row 1: turn 0 gets -1 on
    # 2 tokens. Masked tokens (the 9s) are left out.
    adv = torch.tensor([[1.0, 1.0, 9.0, 1.0], [-1.0, -1.0, 9.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0, 1.0], [1.0, 1.0, 0.0, 0.0]])
    turn_ids = torch.tensor([[0, 0, 0, 1], [0, 0, -1, -1]])
    m = advantage_metrics(adv, mask, turn_ids)
    assert m["advantage_abs_mean"] == 1.0
    assert m["advantage_turn1_mean"] == 0.0 and m["advantage_turn1_std"] == 1.0
    assert m["advantage_turn2_mean"] == 1.0 and m["advantage_turn2_std"] == 0.0


def test_prompt_sampler_is_a_seeded_function_of_its_position():
    rows = [{"i": i} for i in range(10)]
    a = PromptSampler(rows, seed=0)
    first = a.next(7) + a.next(7)                             # crosses an epoch boundary
    assert sorted(r["i"] for r in first[:10]) == list(range(10))
    resumed = PromptSampler(rows, seed=0, position=7)
    assert resumed.next(7) == first[7:]
    tiny = PromptSampler([{"i": 0}, {"i": 1}], seed=0).next(4)   # each row twice: four prompts, four objects
    assert sorted(r["i"] for r in tiny) == [0, 0, 1, 1] and len({id(r) for r in tiny}) == 4
