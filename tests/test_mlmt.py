"""MLMT's terms that need the models: per-turn KL in the turn rewards, and the context-utilization
reward (the solver's log-likelihood gain on its refinement from the feedback)."""
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from turnrl.algos import mlmt
from turnrl.algos.hierarchy import mlmt_slots, prepare, without_feedback
from turnrl.algos.registry import Scorer
from turnrl.config import Config, ConfigError, parse_config
from turnrl.envs.math_refine import REFINE_REQUEST, MathRefineEnv
from turnrl.rollout.chat import ChatFormat
from turnrl.rollout.multi_turn import replay
from turnrl.training.loop import advantages_for, collate
from turnrl.training.workers import token_logprobs

from conftest import train_two_steps

TWELVE = {"prompt": "What is 3 * 4?", "answer": "12"}


@pytest.fixture(scope="module")
def fmt(tiny_model_dir):
    return ChatFormat(AutoTokenizer.from_pretrained(str(tiny_model_dir)))


# ----------------------------------------------------------------------------- config
def test_mlmt_keys_are_validated():
    cfg = parse_config({"algorithm": {"name": "mlmt", "options": {"betas": [0.1, 0, 0.2], "context_coef": 0.5}},
                        "env": {"name": "math_refine"}})
    assert cfg.algorithm.options["betas"] == [0.1, 0.0, 0.2] and cfg.algorithm.options["context_cap"] == 1.0
    with pytest.raises(ConfigError, match="options.betas.*three non-negative"):
        parse_config({"algorithm": {"name": "mlmt", "options": {"betas": [0.1, -1, 0]}}})
    with pytest.raises(ConfigError, match="options.betas.*three non-negative"):
        parse_config({"algorithm": {"name": "mlmt", "options": {"betas": [0.1, 0.1]}}})
    with pytest.raises(ConfigError, match="algorithm.options.betas: unknown option"):
        parse_config({"algorithm": {"name": "grpo", "options": {"betas": [0.1, 0, 0]}}})


# ----------------------------------------------------------------------------- KL terms
def test_mlmt_turn_kl_and_bonus_enter_the_turn_rewards():
    # One group of 2, stage II, alpha 0, betas (β₁, β_H, β_L) = (1, 0.5, 2):
    # row 0: R = 1, R1 = 0, KL = (0.2, 0.4, 0.1) -> turn rewards (-0.2, 0.8, 0.8)
    # row 1: R = 1, R1 = 0, KL = (0.0, 0.0, 0.3) -> turn rewards ( 0.0, 1.0, 0.4)
    # group-normalized per turn: each column of two distinct values gives +-0.7071 (the larger +).
    # With refine_bonus (0, 0.5) turn 3 becomes (0.8, 0.9): row 1 now gets the + on turn 3.
    turn_ids = torch.tensor([[0, 1, 2], [0, 1, 2]])
    mask = torch.ones(2, 3)
    kw = dict(rewards=torch.tensor([1.0, 1.0]), first_rewards=torch.tensor([0.0, 0.0]), turn_ids=turn_ids,
              mask=mask, group_ids=torch.tensor([0, 0]), mlmt_stage=2, alpha=0.0,
              turn_kl=torch.tensor([[0.2, 0.4, 0.1], [0.0, 0.0, 0.3]]), betas=(1.0, 0.5, 2.0))
    s = 0.70710
    assert torch.allclose(mlmt(**kw), torch.tensor([[-s, -s, s], [s, s, -s]]), atol=1e-4)
    with_bonus = mlmt(**kw, refine_bonus=torch.tensor([0.0, 0.5]))
    assert torch.allclose(with_bonus, torch.tensor([[-s, -s, -s], [s, s, s]]), atol=1e-4)
    assert torch.equal(mlmt(**{**kw, "betas": (0.0, 0.0, 0.0)}), mlmt(**{**kw, "turn_kl": None}))


def test_mlmt_slots_come_from_the_turns_levels():
    """The attempt is the first low-level turn, the feedback the high-level turns, the
    refinement the later low-level turns, whatever the turns' indices: math_refine with the
    policy's feedback (low, high, low) and with an endpoint's (low, low: the feedback is an
    observation, the second turn the refinement)."""
    turn_ids = torch.tensor([[-1, 0, 0, 1, 1, 2], [-1, 0, 0, 1, 1, -1]])
    high = torch.tensor([[0, 0, 0, 1, 1, 0], [0, 0, 0, 0, 0, 0]], dtype=torch.bool)
    assert mlmt_slots(turn_ids, high).tolist() == [[-1, 0, 0, 1, 1, 2], [-1, 0, 0, 2, 2, -1]]


def test_the_environments_roles_reach_the_batch(fmt):
    shared = replay(MathRefineEnv(), fmt, TWELVE, ["<answer>13</answer>", "<feedback>x</feedback>", "<answer>12</answer>"])
    assert shared.levels == ["low", "high", "low"]
    batch = collate([shared], pad_id=0)
    assert batch["high"][0].tolist() == [k == 1 for k in batch["turn_ids"][0].tolist()]


# ----------------------------------------------------------------------------- without feedback
def test_without_feedback_by_hand():
    # attempt [5, 6], request [E, 7] (E = eos closes the attempt), feedback [8], refine request
    # [E, 9], refinement [10, 11]: without c = attempt, E once, 9, refinement.
    E = 2
    ids = [5, 6, E, 7, 8, E, 9, 10, 11]
    mask = [1, 1, 0, 0, 1, 0, 0, 1, 1]
    turns = [0, 0, 0, 0, 1, 1, 1, 2, 2]
    assert without_feedback(ids, mask, turns, E) == ([5, 6, E, 9, 10, 11], [0, 0, 0, 0, 1, 1])
    # the attempt wrote its eos itself (request without one), the feedback did not: still one eos
    ids = [5, E, 7, 8, E, 9, 10]
    mask = [1, 1, 0, 1, 0, 0, 1]
    turns = [0, 0, 0, 1, 1, 1, 2]
    assert without_feedback(ids, mask, turns, E) == ([5, E, 9, 10], [0, 0, 0, 1])
    with pytest.raises(ValueError, match="segments"):     # ended before the refinement
        without_feedback([5, 6, E, 7, 8], [1, 1, 0, 0, 1], [0, 0, 0, 0, 1], E)


@pytest.mark.parametrize("attempt", ["<answer>13</answer>", "13"])   # "13": ended by the eos token
def test_without_feedback_is_the_conversation_with_no_teacher(fmt, attempt):
    turns = [attempt, "<feedback>3 * 4 is 12.</feedback>", "<answer>12</answer>"]
    t = replay(MathRefineEnv(), fmt, TWELVE, turns)
    response, y = without_feedback(t.response_ids, t.loss_mask, t.turn_ids, fmt.eos_id)   # slots = turns here
    attempt_ids = fmt.encode(attempt) + ([fmt.eos_id] if attempt == "13" else [])
    expected = attempt_ids + fmt.observation_ids(REFINE_REQUEST, "user", after_eos=attempt == "13") \
        + fmt.encode(turns[2])
    assert response == expected
    assert [tok for tok, m in zip(response, y) if m] == fmt.encode(turns[2])
    # exactly what the chat template renders for (problem, attempt, refine request, refinement)
    messages = [{"role": "system", "content": MathRefineEnv().system_prompt}, {"role": "user", "content": TWELVE["prompt"]},
                {"role": "assistant", "content": attempt}, {"role": "user", "content": REFINE_REQUEST},
                {"role": "assistant", "content": turns[2]}]
    rendered = fmt.tokenizer.apply_chat_template(messages, tokenize=False)
    text = fmt.tokenizer.decode(t.prompt_ids + response, skip_special_tokens=False)
    assert rendered.startswith(text)


# ----------------------------------------------------------------------------- both terms, on a real model
def test_mlmt_extras_on_the_tiny_model(fmt, tiny_model_dir):
    """KL per turn and the context gain scored by a real (untrained) model, checked against
    scoring the token lists directly; the bonus moves only the refinement's advantages."""
    policy = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir)).eval()
    reference = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir)).eval()
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(0.05 * torch.randn_like(p))

    def scorer(model):
        @torch.no_grad()
        def logprobs(batch):
            return token_logprobs(model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits,
                                  batch["input_ids"])
        return logprobs

    scripts = [["<answer>13</answer>", "<feedback>3 * 4 is 12.</feedback>", "<answer>12</answer>"],
               ["<answer>12</answer>", "<feedback>Looks right.</feedback>", "<answer>13</answer>"],
               ["<answer>12</answer>", "<feedback>Right.</feedback>"]]   # ended before the refinement
    trajs = [replay(MathRefineEnv(), fmt, TWELVE, s) for s in scripts]
    cfg = Config.model_validate({"env": {"name": "math_refine"}, "rollout": {"n": 3}, "algorithm": {
        "name": "mlmt", "options": {"betas": [0.1, 0.2, 0.3], "context_coef": 0.5, "context_cap": 100.0}}})
    batch = collate(trajs, pad_id=0)
    inputs, metrics = prepare(trajs, batch, Scorer(scorer(policy), scorer(reference), eos_id=fmt.eos_id), cfg.algorithm)

    def scored(model, ids):   # one sequence alone, unpadded
        return scorer(model)({"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids))})[0]

    gains = []
    for row, t in enumerate(trajs):
        full = t.prompt_ids + t.response_ids
        lp, ref = scored(policy, full), scored(reference, full)
        at = {k: [len(t.prompt_ids) + i for i, (m, turn) in enumerate(zip(t.loss_mask, t.turn_ids)) if m and turn == k]
              for k in range(3)}
        for k in range(3):
            kl = float(sum(lp[i] - ref[i] for i in at[k]))
            assert inputs["turn_kl"][row, k].item() == pytest.approx(kl, abs=1e-4)
        if row < 2:
            response, y = without_feedback(t.response_ids, t.loss_mask, t.turn_ids, fmt.eos_id)
            without = scored(policy, t.prompt_ids + response)
            gains.append(float(sum(lp[i] for i in at[2]))
                         - float(sum(without[len(t.prompt_ids) + i] for i, m in enumerate(y) if m)))
    assert inputs["refine_bonus"].tolist() == pytest.approx([0.5 * g for g in gains] + [0.0], abs=1e-4)
    assert metrics["mlmt_context_gain_mean"] == pytest.approx(sum(gains) / 2, abs=1e-4)
    assert metrics["mlmt_context_rows_frac"] == pytest.approx(2 / 3)
    assert inputs["betas"] == (0.1, 0.2, 0.3) and {"mlmt_turn1_kl_mean", "mlmt_context_bonus_mean"} <= metrics.keys()

    plain = advantages_for(cfg.algorithm, cfg.rollout.n, trajs, batch, {"turn_kl": inputs["turn_kl"], "betas": inputs["betas"]})
    shaped = advantages_for(cfg.algorithm, cfg.rollout.n, trajs, batch, inputs)
    not_refinement = (batch["turn_ids"] != 2) & (batch["loss_mask"] > 0)
    assert torch.equal(plain[not_refinement], shaped[not_refinement])
    assert not torch.allclose(plain[batch["turn_ids"] == 2], shaped[batch["turn_ids"] == 2])
    # off: no model call at all
    off = Config.model_validate({"env": {"name": "math_refine"}, "algorithm": {"name": "mlmt"}})
    assert prepare(trajs, batch, Scorer(None, None), off.algorithm) == ({}, {})


# ----------------------------------------------------------------------------- the loop, real stack
@pytest.mark.slow
def test_mlmt_kl_and_context_reward_through_the_training_loop(tiny_model_dir, tmp_path):
    """Two MLMT steps on the real stack (Ray, DeepSpeed, vLLM) with the KL terms and the context
    reward on: at step 1 the policy is the reference (KL 0); after one update (an entropy bonus: the
    untrained model earns no reward) it is not. (The
    untrained model seldom reaches the refinement, so the gain's value is checked on a real
    model in test_mlmt_extras_on_the_tiny_model; here only that it is computed and reported.)"""
    history = train_two_steps(tiny_model_dir, tmp_path, {"name": "math_refine"},
                              {"name": "mlmt", "options": {"betas": [0.01, 0.01, 0.01], "context_coef": 0.1,
                                                           "context_cap": 2.0}, "entropy_coef": 0.1},   # moves the policy
                              train={"lr": 1e-2})
    first, second = history
    for h in history:
        assert 0 <= h["mlmt_context_rows_frac"] <= 1 and h["mlmt_context_bonus_mean"] <= 0.1 * 2.0 + 1e-6   # capped by λτ
        assert h["logp_gap_max"] < 1e-3
    assert all(abs(first[f"mlmt_turn{k}_kl_mean"]) < 1e-4 for k in (1, 2, 3))
    assert abs(second["mlmt_turn1_kl_mean"]) > 1e-4     # every trajectory has an attempt
