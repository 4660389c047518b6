"""Advantage estimators: hand-worked values and invariants (CPU, fast)."""

import math

import pytest
import torch

from types import SimpleNamespace

from turnrl.algos import registry
from turnrl.plugins import PluginError
from turnrl.algos import (
    before_first_obs,
    context_utilization_bonus,
    contiguous_group_ids,
    dr_grpo,
    first_obs_position,
    gae,
    group_normalize,
    grpo,
    masked_mean,
    masked_var,
    masked_whiten,
    mlmt_stage1_rewards,
    mlmt_stage2_rewards,
    ms_grpo,
    ms_po,
    outcome_token_rewards,
    mt_grpo,
    per_turn_grpo,
    per_turn_mean_std,
    per_turn_sum,
    rloo,
    top_k_distillation,
    turn_rewards_to_tokens,
)

# Group {1, 0, 0, 1}: mean 0.5, Bessel std sqrt(4 * 0.25 / 3) = sqrt(1/3),
# so A = ±0.5 / sqrt(1/3) = ±sqrt(3)/2.
A = math.sqrt(3) / 2  # 0.8660254


def t(x, dtype=torch.float32):
    return torch.tensor(x, dtype=dtype)


def close(actual, expected, atol=1e-5):
    torch.testing.assert_close(actual, t(expected), atol=atol, rtol=0)


def test_grpo_hand_values_with_unsorted_group_ids():
    # Group 7 = rows 0, 2, 3, 5 with rewards {1, 0, 0, 1}: A = ±sqrt(3)/2.
    # Group 3 = rows 1, 4 with rewards {2, 4}: mean 3, std sqrt((1 + 1) / 1) = sqrt(2),
    # so A = ∓1/sqrt(2) = ∓0.7071068.
    rewards = t([1, 2, 0, 0, 4, 1])
    group_ids = t([7, 3, 7, 7, 3, 7], torch.long)
    mask = torch.ones(6, 2)
    adv = grpo(rewards=rewards, mask=mask, group_ids=group_ids)
    r2 = 1 / math.sqrt(2)
    expected = [A, -r2, -A, -A, r2, A]
    close(adv, [[e, e] for e in expected])


def test_grpo_without_std_is_dr_grpo():
    # Centred only: group 7 mean 0.5 -> {0.5, -0.5, -0.5, 0.5}; group 3 mean 3 -> {-1, 1}.
    rewards = t([1, 2, 0, 0, 4, 1])
    group_ids = t([7, 3, 7, 7, 3, 7], torch.long)
    mask = torch.ones(6, 1)
    expected = [[0.5], [-1.0], [-0.5], [-0.5], [1.0], [0.5]]
    close(grpo(rewards=rewards, mask=mask, group_ids=group_ids, norm_by_std=False), expected)
    close(dr_grpo(rewards=rewards, mask=mask, group_ids=group_ids), expected)


def test_rloo_hand_values():
    # Group 0 {1, 0, 0, 1}: row 0 baseline = (0 + 0 + 1) / 3 = 1/3 -> 2/3; row 1 -> 0 - 2/3.
    # Group 1 {3, 5}: 3 - 5 = -2, 5 - 3 = 2.
    rewards = t([1, 0, 0, 1, 3, 5])
    group_ids = t([0, 0, 0, 0, 1, 1], torch.long)
    adv = rloo(rewards=rewards, mask=torch.ones(6, 1), group_ids=group_ids)
    close(adv, [[2 / 3], [-2 / 3], [-2 / 3], [2 / 3], [-2.0], [2.0]])


@pytest.mark.parametrize("estimator", [grpo, dr_grpo, rloo])
def test_advantages_sum_to_zero_within_each_group(estimator):
    torch.manual_seed(0)
    group_ids = contiguous_group_ids(12, 4)
    rewards = torch.randn(12)
    adv = estimator(rewards=rewards, mask=torch.ones(12, 1), group_ids=group_ids)[:, 0]
    sums = torch.zeros(3).index_add(0, group_ids, adv)
    torch.testing.assert_close(sums, torch.zeros(3), atol=1e-5, rtol=0)
    assert adv.abs().max() > 0.1  # not trivially zero


def _multi_turn_inputs():
    # 4 samples of one prompt, T = 4.
    return dict(
        rewards=t([1, 0, 0, 1]),  # A_out = [A, -A, -A, A]
        turn_rewards=t([1, 1, 0, 0]),  # A_turn = [A, A, -A, -A]
        first_obs_pos=t([2, 4, 1, 2], torch.long),  # row 1 has no tool result (4 == T)
        mask=torch.ones(4, 4),
        group_ids=torch.zeros(4, dtype=torch.long),
    )


# the outcome-reward algorithms; mlmt (turn-structured rewards) and ppo (a critic) have their own tests
# group-relative reward estimators (opd: below; rae keeps a baseline across steps: tests/test_games.py)
ALL_ESTIMATOR_NAMES = sorted(set(registry.names()) - {"mlmt", "ppo", "opd", "rae"})


def compute_advantages(name, *, rewards, mask, group_ids, turn_rewards=None, first_obs_pos=None,
                       turn_coef=1.0, gamma=1.0):
    """The registered algorithm `name` on these inputs, as the training loop calls it."""
    B, T = mask.shape
    inputs = registry.AdvantageInputs(
        rewards=rewards, turn_rewards=(turn_rewards if turn_rewards is not None else torch.zeros(B))[:, None],
        mask=mask, turn_ids=torch.zeros(B, T, dtype=torch.long), high=torch.zeros(B, T, dtype=torch.bool),
        group_ids=group_ids, first_obs_pos=first_obs_pos if first_obs_pos is not None else torch.full((B,), T))
    return registry.resolve(name).advantages(inputs, SimpleNamespace(turn_coef=turn_coef, gamma=gamma, lam=1.0))


@pytest.mark.parametrize("name", ALL_ESTIMATOR_NAMES)
def test_masked_positions_get_exactly_zero(name):
    inputs = _multi_turn_inputs()
    mask = t([[1, 1, 0, 1], [0, 1, 1, 0], [1, 0, 0, 0], [0, 0, 1, 1]])
    inputs["mask"] = mask
    # turn_coef 0.5 and gamma 0.5 keep every unmasked advantage nonzero for mt_grpo and ms_po.
    adv = compute_advantages(name, **inputs, turn_coef=0.5, gamma=0.5)
    assert adv.shape == (4, 4)
    assert torch.all(adv[mask == 0] == 0)
    assert torch.all(adv[mask == 1] != 0)  # these rewards give nonzero advantages everywhere


@pytest.mark.parametrize("name", ALL_ESTIMATOR_NAMES)
def test_identical_rewards_give_zero_advantage_without_nan(name):
    inputs = _multi_turn_inputs()
    inputs["rewards"] = torch.full((4,), 0.7)
    inputs["turn_rewards"] = torch.full((4,), 0.3)
    adv = compute_advantages(name, **inputs)
    assert torch.isfinite(adv).all()
    torch.testing.assert_close(adv, torch.zeros(4, 4), atol=1e-6, rtol=0)


@pytest.mark.parametrize("estimator", [grpo, dr_grpo, rloo])
def test_singleton_group_gets_zero(estimator):
    # Row 2 is alone in group 9: no baseline, so 0 rather than NaN or its raw reward.
    adv = estimator(rewards=t([1, 0, 5]), mask=torch.ones(3, 1), group_ids=t([0, 0, 9], torch.long))
    assert torch.isfinite(adv).all()
    assert adv[2, 0] == 0
    assert adv[0, 0] > 0


def test_first_obs_position_and_before_mask():
    obs_mask = t([[0, 0, 1, 1, 0], [0, 0, 0, 0, 0]], torch.bool)
    pos = first_obs_position(obs_mask)
    assert pos.tolist() == [2, 5]  # no observation -> T = 5
    before = before_first_obs(pos, 5)
    assert before.tolist() == [[True, True, False, False, False], [True] * 5]


def test_mt_grpo_hand_values():
    # c = 0.5. Turn term added only before the first tool result, and only if there is one.
    # row 0 (obs at 2): [A + A/2, A + A/2, A, A]
    # row 1 (no obs):   A_out only = [-A] * 4
    # row 2 (obs at 1): [-A - A/2, -A, -A, -A]
    # row 3 (obs at 2): [A - A/2, A - A/2, A, A]
    adv = mt_grpo(**_multi_turn_inputs(), turn_coef=0.5)
    h = 1.5 * A
    close(adv, [[h, h, A, A], [-A] * 4, [-h, -A, -A, -A], [A / 2, A / 2, A, A]])


def test_mt_grpo_with_zero_coef_equals_grpo_exactly():
    torch.manual_seed(1)
    B, T = 8, 6
    mask = (torch.rand(B, T) > 0.3).float()
    group_ids = contiguous_group_ids(B, 4)
    rewards = torch.randint(0, 2, (B,)).float()
    turn_rewards = torch.rand(B)
    first_obs_pos = torch.randint(0, T + 1, (B,))
    a = mt_grpo(rewards=rewards, turn_rewards=turn_rewards, first_obs_pos=first_obs_pos,
                mask=mask, group_ids=group_ids, turn_coef=0.0)
    b = grpo(rewards=rewards, mask=mask, group_ids=group_ids)
    assert torch.equal(a, b)
    # ...and a nonzero coefficient does change something (the test above can fail).
    c = mt_grpo(rewards=rewards, turn_rewards=turn_rewards, first_obs_pos=first_obs_pos,
                mask=mask, group_ids=group_ids, turn_coef=1.0)
    assert not torch.equal(c, b)


def test_ms_grpo_is_mt_grpo():
    inputs = _multi_turn_inputs()
    assert torch.equal(ms_grpo(**inputs, turn_coef=0.3), mt_grpo(**inputs, turn_coef=0.3))
    assert torch.equal(compute_advantages("ms_grpo", **inputs), compute_advantages("mt_grpo", **inputs))


def test_ms_po_hand_values():
    # gamma = 0.5: R_tot = R_step + 0.5 R_out = [1.5, 1, 0, 0.5]; mean 0.75,
    # deviations [0.75, 0.25, -0.75, -0.25], Bessel var = 1.25 / 3, std = 0.6454972,
    # so norm(R_tot) = [1.1618950, 0.3872983, -1.1618950, -0.3872983]; norm(R_out) = [A, -A, -A, A].
    # Before the first tool result: norm(R_tot); after: norm(R_out); no tool result: all norm(R_tot).
    adv = ms_po(**_multi_turn_inputs(), gamma=0.5)
    big, small = 0.75 / math.sqrt(1.25 / 3), 0.25 / math.sqrt(1.25 / 3)
    close(adv, [
        [big, big, A, A],             # obs at 2
        [small] * 4,                  # no obs
        [-big, -A, -A, -A],           # obs at 1
        [-small, -small, A, A],       # obs at 2
    ])


def test_gae_hand_values():
    # gamma = 0.5, lam = 0.5 (gamma*lam = 0.25), V = [1, 2, 3], r = [0, 0, 1]:
    # t=2: δ = 1 + 0.5*0 - 3 = -2             A2 = -2
    # t=1: δ = 0 + 0.5*3 - 2 = -0.5           A1 = -0.5 + 0.25*(-2) = -1
    # t=0: δ = 0 + 0.5*2 - 1 = 0              A0 = 0 + 0.25*(-1) = -0.25
    # returns = A + V = [0.75, 1, 1]
    adv, ret = gae(token_rewards=t([[0, 0, 1]]), values=t([[1, 2, 3]]), mask=torch.ones(1, 3),
                   gamma=0.5, lam=0.5, whiten=False)
    close(adv, [[-0.25, -1.0, -2.0]])
    close(ret, [[0.75, 1.0, 1.0]])


def test_gae_passes_through_observation_tokens():
    # Same policy tokens as test_gae_hand_values, with a 2-token observation (mask 0) between
    # positions 1 and 2 and trailing padding. The observation carries a large value, a NaN
    # value and rewards: all must be ignored, and gamma must not be applied per observation
    # token. So the answer equals the compact one, with 0 at the mask-0 positions.
    # If observation tokens were treated as steps, A1 would use V=100 (or NaN) and differ.
    mask = t([[1, 1, 0, 0, 1, 0]])
    values = t([[1, 2, 100, float("nan"), 3, 50]])
    rewards = t([[0, 0, 5, 5, 1, 9]])
    adv, ret = gae(token_rewards=rewards, values=values, mask=mask, gamma=0.5, lam=0.5, whiten=False)
    close(adv, [[-0.25, -1.0, 0, 0, -2.0, 0]])
    close(ret, [[0.75, 1.0, 0, 0, 1.0, 0]])


def test_gae_whitening_over_mask():
    torch.manual_seed(2)
    mask = t([[1, 1, 0, 1, 1, 0], [1, 0, 1, 1, 0, 0]])
    adv, ret = gae(token_rewards=torch.randn(2, 6), values=torch.randn(2, 6), mask=mask,
                   gamma=0.9, lam=0.95, whiten=True)
    raw, ret_raw = gae(token_rewards=torch.zeros(2, 6), values=torch.zeros(2, 6), mask=mask, whiten=False)
    assert torch.all(adv[mask == 0] == 0)
    torch.testing.assert_close(masked_mean(adv, mask), torch.tensor(0.0), atol=1e-5, rtol=0)
    torch.testing.assert_close(masked_var(adv, mask), torch.tensor(1.0), atol=1e-4, rtol=0)
    assert torch.all(raw == 0) and torch.all(ret_raw == 0)


def test_per_turn_sum_hand_values():
    # Turn 0: 1 + 2 = 3; turn 1: only token 3 (value 3) and it is masked -> 0; turn 2: 4 + 5 = 9.
    x = t([[1, 2, 3, 4, 5]])
    mask = t([[1, 1, 0, 1, 1]])
    turn_ids = t([[0, 0, 1, 2, 2]], torch.long)
    close(per_turn_sum(x, mask, turn_ids, 3), [[3.0, 0.0, 9.0]])


def test_per_turn_mean_std_hand_values():
    # Turn 0 holds 1, 3 (row 0) and 5 (row 1): mean 3, population std sqrt((4 + 0 + 4) / 3).
    # Turn 1 holds 2 (row 0) only: mean 2, std 0. Masked tokens (the 100s) and turn 2 (never
    # trained) are left out; turn 2 gets mean 0, std 0, count 0.
    x = t([[1, 3, 100, 2], [5, 100, 100, 100]])
    mask = t([[1, 1, 0, 1], [1, 0, 0, 1]])
    turn_ids = t([[0, 0, 0, 1], [0, 1, 2, -1]], torch.long)
    mean, std, count = per_turn_mean_std(x, mask, turn_ids, 3)
    close(mean, [3, 2, 0])
    close(std, [math.sqrt(8 / 3), 0, 0])
    assert count.tolist() == [3, 1, 0]


def test_turn_rewards_to_tokens_all_and_last():
    per_turn = t([[10, 20, 30]])
    turn_ids = t([[0, 0, 1, 1, 2, 2]], torch.long)
    mask = t([[1, 1, 0, 1, 1, 0]])
    # "all": each trained token gets its turn's value.
    close(turn_rewards_to_tokens(per_turn, turn_ids, mask, at="all"), [[10, 10, 0, 20, 30, 0]])
    # "last": last trained token per turn: turn 0 -> pos 1, turn 1 -> pos 3, turn 2 -> pos 4
    # (pos 5 is masked, so pos 4 is the last trained token of turn 2).
    close(turn_rewards_to_tokens(per_turn, turn_ids, mask, at="last"), [[0, 10, 0, 20, 30, 0]])
    with pytest.raises(ValueError):
        turn_rewards_to_tokens(per_turn, turn_ids, mask, at="first")


def test_per_turn_grpo_hand_values():
    # Two samples. Turn 0 rewards {1, 0}: mean 0.5, std sqrt(0.5) -> ±0.7071068.
    # Turn 1 rewards {0, 0}: identical -> 0. Turn 2 rewards {1, 3}: -> ∓0.7071068.
    per_turn = t([[1, 0, 1], [0, 0, 3]])
    turn_ids = t([[0, 1, 2], [0, 1, 2]], torch.long)
    adv = per_turn_grpo(per_turn_rewards=per_turn, turn_ids=turn_ids, mask=torch.ones(2, 3),
                        group_ids=t([0, 0], torch.long))
    r2 = 1 / math.sqrt(2)
    close(adv, [[r2, 0, -r2], [-r2, 0, r2]])


def test_mlmt_stage1_hand_values():
    # R = 1, KL = [0.2, 0.4, 0.6], β₂ = 0.5, β_H = 0.1, β_L = 0.2:
    # turn 1 = -0.5*0.2 = -0.1; turn 2 = 1 - 0.1*0.4 = 0.96; turn 3 = 1 - 0.2*0.6 = 0.88.
    out = mlmt_stage1_rewards(rewards=t([1.0]), turn_kl=t([[0.2, 0.4, 0.6]]),
                              beta_2=0.5, beta_h=0.1, beta_l=0.2)
    close(out, [[-0.1, 0.96, 0.88]])


def test_mlmt_stage2_hand_values():
    # R = 1, R₁ = 0, KL = [0.2, 0.4, 0.6], β₁ = 0.5, β_H = 0.1, β_L = 0.2, α = 2:
    # turn 1 = 0 - 0.1 = -0.1; turn 2 = 1 - 0.04 = 0.96; turn 3 = 1 + 2*(1 - 0) - 0.12 = 2.88.
    # Row 2: R = 0, R₁ = 1 (got worse): turn 1 = 1 - 0.1 = 0.9; turn 2 = -0.04;
    # turn 3 = 0 + 2*(0 - 1) - 0.12 = -2.12.
    out = mlmt_stage2_rewards(rewards=t([1.0, 0.0]), first_rewards=t([0.0, 1.0]),
                              turn_kl=t([[0.2, 0.4, 0.6], [0.2, 0.4, 0.6]]),
                              beta_1=0.5, beta_h=0.1, beta_l=0.2, alpha=2.0)
    close(out, [[-0.1, 0.96, 2.88], [0.9, -0.04, -2.12]])


def test_context_utilization_bonus_hand_values():
    # gain = [0.5, 3.0, -1.0], τ = 1 caps the second; λ = 0.1 -> [0.05, 0.1, -0.1].
    out = context_utilization_bonus(t([-1.0, 0.0, -3.0]), t([-1.5, -3.0, -2.0]), lam=0.1, tau=1.0)
    close(out, [0.05, 0.1, -0.1])


def test_registry_dispatch_and_errors():
    inputs = _multi_turn_inputs()
    # Inputs an algorithm does not read (turn_rewards, first_obs_pos, turn_coef) change nothing for grpo.
    a = compute_advantages("grpo", **inputs, turn_coef=0.5, gamma=0.9)
    b = grpo(rewards=inputs["rewards"], mask=inputs["mask"], group_ids=inputs["group_ids"])
    assert torch.equal(a, b)
    assert torch.equal(compute_advantages("mt_grpo", **inputs, turn_coef=0.5),
                       mt_grpo(**inputs, turn_coef=0.5))
    with pytest.raises(ValueError, match="ppo_typo.*not a registered algorithm"):
        registry.resolve("ppo_typo")
    assert set(registry.names()) >= {"grpo", "dr_grpo", "rloo", "mt_grpo", "ms_grpo", "ms_po", "mlmt", "ppo"}
    assert registry.resolve("ppo").critic and not registry.resolve("grpo").critic
    assert registry.resolve("mlmt").prepare is not None


def test_group_helpers():
    assert contiguous_group_ids(6, 3).tolist() == [0, 0, 0, 1, 1, 1]
    with pytest.raises(ValueError):
        contiguous_group_ids(7, 3)
    # group_normalize returns float32 and treats ids as labels, not positions.
    out = group_normalize(t([0, 2], torch.long), t([42, 42], torch.long), norm_by_std=False)
    assert out.dtype == torch.float32 and out.tolist() == [-1.0, 1.0]


def test_masked_whiten_used_by_gae_is_the_losses_helper():
    # [2, 4, 6] (+ a masked 99): mean 4, Bessel var (4 + 0 + 4) / 2 = 4 -> [-1, 0, 1], masked -> 0.
    x = t([[2, 4, 99, 6]])
    mask = t([[1, 1, 0, 1]])
    close(masked_whiten(x, mask), [[-1, 0, 0, 1]])


def test_outcome_token_rewards_on_the_last_policy_token():
    from turnrl.algos import outcome_token_rewards
    mask = torch.tensor([[0., 1., 1., 0., 1., 0.],    # last policy token at 4 (an observation at 3)
                         [0., 1., 0., 0., 0., 0.],
                         [0., 0., 0., 0., 0., 0.]])   # no policy token: nothing
    out = outcome_token_rewards(torch.tensor([1.0, -0.5, 7.0]), mask)
    assert out.tolist() == [[0, 0, 0, 0, 1.0, 0], [0, -0.5, 0, 0, 0, 0], [0] * 6]


def test_mlmt_stage2_turn_by_turn():
    from turnrl.algos import mlmt
    # one group of 2: sample 0 improved (R1=0 -> R=1), sample 1 stayed wrong (0 -> 0)
    turn_ids = torch.tensor([[0, 0, 1, 2, 2], [0, 1, 1, 2, -1]])
    mask = torch.tensor([[1., 1., 1., 1., 1.], [1., 1., 1., 1., 0.]])
    adv = mlmt(rewards=torch.tensor([1.0, 0.0]), first_rewards=torch.tensor([0.0, 0.0]), turn_ids=turn_ids,
               mask=mask, group_ids=torch.tensor([0, 0]), mlmt_stage=2, alpha=1.0)
    # stage II: turn 1 = R1 = (0, 0) -> 0; turn 2 = R = (1, 0) -> +-0.7071 (std unbiased of
    # (1, 0) is 0.7071, so (1 - 0.5) / 0.7071); turn 3 = R + (R - R1) = (2, 0) -> +-0.7071
    s = 0.5 / torch.tensor([1.0, 0.0]).std().item()
    assert torch.allclose(adv, torch.tensor([[0, 0, s, s, s], [0, -s, -s, -s, 0]]), atol=1e-5)
    stage1 = mlmt(rewards=torch.tensor([1.0, 0.0]), first_rewards=torch.tensor([0.0, 0.0]), turn_ids=turn_ids,
                  mask=mask, group_ids=torch.tensor([0, 0]), mlmt_stage=1)
    # stage I: turn 1 = 0 for both (no KL terms) -> 0; turns 2, 3 = R
    assert torch.allclose(stage1, torch.tensor([[0, 0, s, s, s], [0, -s, -s, -s, 0]]), atol=1e-5)


def test_gae_on_an_untrained_critic_is_unit_scale_noise_where_grpo_is_zero():
    """Why PPO's critic warms up first (algorithm.critic_warmup): with identical rewards there is
    no signal, GRPO's advantages are 0, but GAE on a fresh critic's values (noise around 0)
    whitens that noise to unit scale on every token, and the policy update follows it."""
    torch.manual_seed(0)
    B, T = 8, 10
    mask = torch.ones(B, T)
    rewards = torch.zeros(B)
    noise_values = 0.05 * torch.randn(B, T)
    adv, _ = gae(token_rewards=outcome_token_rewards(rewards, mask), values=noise_values, mask=mask)
    assert torch.allclose(adv.pow(2).mean(), torch.tensor(1.0), atol=0.02)          # unit scale
    assert torch.corrcoef(torch.stack([adv.flatten(), -noise_values.flatten()]))[0, 1] > 0.99   # = -V, whitened
    assert compute_advantages("grpo", rewards=rewards, mask=mask, group_ids=contiguous_group_ids(B, 4)).abs().max() == 0


def test_on_policy_distillation_is_the_teachers_log_ratio_on_every_sampled_token_by_hand():
    """A_t = log pi_T(x_t) - log pi(x_t) on the mask; + w x GRPO with reward_weight; x
    sampled_weight (0: no signal on the sampled token, the reward's alone)."""
    mask = t([[1, 1, 0, 1], [1, 0, 0, 0]])
    student = t([[-1.0, -2.0, 0.0, -0.5], [-3.0, 0.0, 0.0, 0.0]])
    teacher = t([[-0.5, -2.5, -7.0, -0.5], [-1.0, -9.0, 0.0, 0.0]])   # -7, -9: off the mask, ignored
    inputs = registry.AdvantageInputs(
        rewards=t([1.0, 0.0]), turn_rewards=torch.zeros(2, 1), mask=mask, turn_ids=torch.zeros(2, 4, dtype=torch.long),
        high=torch.zeros(2, 4, dtype=torch.bool), group_ids=torch.tensor([0, 0]), first_obs_pos=torch.full((2,), 4),
        logprobs=student, teacher_logprobs=teacher)
    opd = registry.resolve("opd")
    assert opd.teacher
    adv = opd.advantages(inputs, SimpleNamespace(options={}))
    assert torch.allclose(adv, t([[0.5, -0.5, 0.0, 0.0], [2.0, 0.0, 0.0, 0.0]]))
    mixed = opd.advantages(inputs, SimpleNamespace(options={"reward_weight": 0.5}))
    grpo = registry.resolve("grpo").advantages(inputs, SimpleNamespace())
    assert grpo[0, 0] > 0 > grpo[1, 0]   # the right answer above its group's mean
    assert torch.allclose(mixed - adv, 0.5 * grpo) and torch.all(mixed[mask == 0] == 0)
    halved = opd.advantages(inputs, SimpleNamespace(options={"sampled_weight": 0.5}))
    assert torch.allclose(halved, 0.5 * adv)
    reward_only = opd.advantages(inputs, SimpleNamespace(options={"sampled_weight": 0.0, "reward_weight": 0.5}))
    assert torch.allclose(reward_only, 0.5 * grpo * mask)
    without = registry.AdvantageInputs(**{**inputs.__dict__, "teacher_logprobs": None})
    with pytest.raises(ValueError, match="reward.teacher.serve"):
        opd.advantages(without, SimpleNamespace(options={}))


def test_top_k_distillation_is_the_kl_from_the_teachers_renormalised_top_k_by_hand():
    """KL_t = sum_j q_j (log q_j - log pi(top_j)), q the teacher's top-k renormalised, pi the
    policy's full softmax at token t's position (logits entry t - 1); entry 0 is 0."""
    logits = t([[[0.0, 0.0, 0.0], [math.log(3.0), 0.0, 0.0], [0.0, 0.0, 0.0]]])   # [1, 3, V=3]
    top_ids = torch.tensor([[[0, 0], [0, 1], [2, 1]]])
    top_lps = t([[[0.0, 0.0], [math.log(0.6), math.log(0.2)], [math.log(0.25), math.log(0.25)]]])
    kl = top_k_distillation(logits, top_ids, top_lps)
    # token 1: pi = softmax(0, 0, 0) = 1/3 each; q = (0.75, 0.25)
    kl_1 = 0.75 * math.log(0.75 * 3) + 0.25 * math.log(0.25 * 3)
    # token 2: pi = (3, 1, 1) / 5; q = (0.5, 0.5) over ids 2 and 1, each at 1/5
    kl_2 = 2 * 0.5 * math.log(0.5 * 5)
    assert torch.allclose(kl, t([[0.0, kl_1, kl_2]]), atol=1e-6)
    # the policy that gives the top k the teacher's probabilities and nothing else: 0
    exact = t([[[math.log(0.75), math.log(0.25), -1e4], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]]).requires_grad_()
    zero = top_k_distillation(exact, top_ids, top_lps)[0, 1]
    assert abs(float(zero.detach())) < 1e-6
    policy = logits.clone().requires_grad_()
    top_k_distillation(policy, top_ids, top_lps)[0, 1].backward()
    # d KL / d z_v = pi_v - q_v: every logit of the position gets a gradient, sampled or not
    assert torch.allclose(policy.grad[0, 0], t([1 / 3 - 0.75, 1 / 3 - 0.25, 1 / 3]), atol=1e-6)


def test_opds_loss_term_adds_the_weighted_top_k_kl_only_when_the_teacher_gave_its_top_k():
    opd = registry.resolve("opd")
    logits = torch.zeros(1, 3, 3, requires_grad=True)
    batch = {"logp": torch.zeros(1, 3), "mask": t([[0, 1, 1]]), "logits": logits,
             "teacher_top_ids": torch.tensor([[[0, 0], [0, 1], [2, 1]]]),
             "teacher_top_logprobs": t([[[0.0, 0.0], [math.log(0.6), math.log(0.2)], [0.0, 0.0]]])}
    cfg = SimpleNamespace(options={"top_k_weight": 2.0}, loss_agg="token-mean")
    loss, info = opd.loss_term(batch, cfg)
    per_token = top_k_distillation(logits, batch["teacher_top_ids"], batch["teacher_top_logprobs"])
    assert torch.allclose(info["top_k_kl"], per_token[0, 1:].mean()) and torch.allclose(loss, 2 * info["top_k_kl"])
    loss.backward()
    assert logits.grad[0, 0].abs().sum() > 0   # the position of token 1
    no_top = {k: v for k, v in batch.items() if not k.startswith("teacher_top")}
    term, info = opd.loss_term(no_top, cfg)
    assert float(term) == 0.0 and info == {}
    silent = SimpleNamespace(options={"sampled_weight": 0.0}, loss_agg="token-mean")   # no top-k, no reward
    with pytest.raises(ValueError, match="reward.teacher.top_k"):
        opd.loss_term(no_top, silent)
    only_top_k, _ = opd.loss_term(batch, silent)   # the top-k KL alone, weight 1
    assert torch.allclose(only_top_k, per_token[0, 1:].mean()) and only_top_k > 0
    with pytest.raises(PluginError, match="opd has no signal"):
        registry.check_options(opd, {"sampled_weight": 0, "top_k_weight": 0}, "algorithm.options")
    assert registry.resolve("grpo").loss_term is None
