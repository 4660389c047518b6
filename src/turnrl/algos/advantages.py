"""Advantage estimators and turn-level reward shaping (pure functions over tensors).

Conventions shared by every function here (B trajectories, T response tokens, K turns):
- mask [B, T]: 1/True on tokens the policy sampled and we train on; 0 on prompt padding,
  environment text (observations, tool results, feedback, interventions) and padding.
- rewards [B]: the outcome reward of each trajectory.
- group_ids [B] long: trajectories sampled from the same prompt share an id. Ids need not be
  sorted, contiguous or equal-sized; `contiguous_group_ids(B, n)` builds the usual layout.
- turn_rewards [B]: the turn-level reward (MT-GRPO) / step reward R_step (RoSTE) of the
  first turn, e.g. "the tool call ran" or "the answer is in the retrieved passages".
- first_obs_pos [B] long: index of the first observation (tool-result) token in the
  response, or T if the trajectory has none. `first_obs_position(obs_mask)` computes it.
- turn_ids [B, T] long: 0-based turn index of each token (only read where mask is set).
Estimators return token-level advantages [B, T] float32, exactly 0 where mask is 0. The
registered algorithms (`turnrl.algos.builtin`) call them from a batch's `AdvantageInputs`.

Group statistics use the Bessel-corrected std (torch.std's default, as GRPO references do).
A group of one has no baseline: its advantage is 0. A group with identical rewards gets 0
(never NaN) thanks to eps.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch

from .losses import masked_whiten

# ---------------------------------------------------------------------------- helpers


def contiguous_group_ids(batch_size: int, group_size: int, device=None) -> torch.Tensor:
    """Group ids [B] for a batch laid out prompt by prompt: [0]*n + [1]*n + ..."""
    if batch_size % group_size:
        raise ValueError(f"batch size {batch_size} is not a multiple of group size {group_size}")
    return torch.arange(batch_size, device=device) // group_size


def group_normalize(
    values: torch.Tensor, group_ids: torch.Tensor, norm_by_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """(v - mean_g) / (std_g + eps) within each group, or v - mean_g if not norm_by_std.

    values, group_ids: [B] -> [B] float32.
    """
    # float64: a group of identical rewards then centres to ~1e-17, not to fp32 rounding
    # noise that dividing by (0 + eps) would blow up.
    v = values.double()
    _, inverse = torch.unique(group_ids, return_inverse=True)
    n_groups = int(inverse.max()) + 1 if inverse.numel() else 0
    zeros = torch.zeros(n_groups, dtype=v.dtype, device=v.device)
    count = zeros.index_add(0, inverse, torch.ones_like(v))
    mean = zeros.index_add(0, inverse, v) / count
    centered = v - mean[inverse]
    if norm_by_std:
        sq_dev = zeros.index_add(0, inverse, centered**2)
        std = torch.sqrt(sq_dev / (count - 1).clamp(min=1))  # a singleton gets std 0
        centered = centered / (std[inverse] + eps)
    return centered.float()


def _to_tokens(per_traj: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Broadcast a per-trajectory value [B] to every trained token: [B, T]."""
    return torch.where(mask.bool(), per_traj[:, None].float(), 0.0)


def first_obs_position(obs_mask: torch.Tensor) -> torch.Tensor:
    """Index of the first observation token per row: obs_mask [B, T] bool -> [B] long.

    obs_mask is True on environment tokens (tool results) inside the response. Rows with no
    observation get T.
    """
    B, T = obs_mask.shape
    pos = torch.arange(T, device=obs_mask.device).expand(B, T)
    return torch.where(obs_mask.bool(), pos, T).min(dim=1).values


def before_first_obs(first_obs_pos: torch.Tensor, T: int) -> torch.Tensor:
    """[B] positions -> [B, T] bool, True on tokens before the first observation.

    A row with no observation (first_obs_pos == T) is True everywhere.
    """
    pos = torch.arange(T, device=first_obs_pos.device)
    return pos[None, :] < first_obs_pos[:, None]


def per_turn_sum(
    x: torch.Tensor, mask: torch.Tensor, turn_ids: torch.Tensor, num_turns: int
) -> torch.Tensor:
    """Sum x over the trained tokens of each turn: x, mask, turn_ids [B, T] -> [B, K].

    E.g. the MLMT per-turn KL: per_turn_sum(logp - logp_ref, mask, turn_ids, 3).
    """
    m = mask.bool()
    tid = torch.where(m, turn_ids, 0).long()  # masked tokens may carry any turn id
    out = torch.zeros(x.shape[0], num_turns, dtype=torch.float32, device=x.device)
    return out.scatter_add(1, tid, torch.where(m, x.float(), 0.0))


def per_turn_mean_std(
    x: torch.Tensor, mask: torch.Tensor, turn_ids: torch.Tensor, num_turns: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mean and (population) std of x over the trained tokens of each turn, pooled over the
    batch, and the token count: x, mask, turn_ids [B, T] -> (mean [K], std [K], count [K]).
    A turn with no trained token gets mean 0, std 0, count 0. E.g. advantage statistics per
    turn: per_turn_mean_std(advantages, mask, turn_ids, max_turns)."""
    m = mask.bool() & (turn_ids >= 0) & (turn_ids < num_turns)
    tid = torch.where(m, turn_ids, 0).long().flatten()
    weight = m.flatten().double()
    values = torch.where(m, x.double(), 0.0).flatten()
    zeros = torch.zeros(num_turns, dtype=torch.float64, device=x.device)
    count = zeros.index_add(0, tid, weight)
    mean = zeros.index_add(0, tid, values) / count.clamp(min=1)
    sq = zeros.index_add(0, tid, weight * (values - mean[tid]) ** 2) / count.clamp(min=1)
    return mean.float(), sq.sqrt().float(), count.long()


def turn_rewards_to_tokens(
    per_turn_rewards: torch.Tensor, turn_ids: torch.Tensor, mask: torch.Tensor, at: str = "all"
) -> torch.Tensor:
    """Map per-turn values [B, K] onto tokens via turn_ids [B, T] -> [B, T].

    at="all": every trained token of turn k gets value k (turn-level GRPO advantages).
    at="last": only the last trained token of each turn gets it, the rest 0 (sparse token
    rewards for GAE). Masked tokens are 0 either way.
    """
    m = mask.bool()
    tid = torch.where(m, turn_ids, 0).long()
    out = per_turn_rewards.float().gather(1, tid)
    if at == "last":
        B, T = tid.shape
        pos = torch.arange(T, device=tid.device).expand(B, T)
        # last_pos[b, k] = largest trained position of turn k in row b (-1 if none)
        last_pos = torch.full_like(per_turn_rewards, -1, dtype=torch.long)
        last_pos = last_pos.scatter_reduce(1, tid, torch.where(m, pos, -1), reduce="amax")
        m = m & (pos == last_pos.gather(1, tid))
    elif at != "all":
        raise ValueError(f"at must be 'all' or 'last', got {at!r}")
    return torch.where(m, out, 0.0)


# ------------------------------------------------------- outcome-reward estimators


def grpo(
    *,
    rewards: torch.Tensor,
    mask: torch.Tensor,
    group_ids: torch.Tensor,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """GRPO: A = (R - mean_g) / (std_g + eps) on every trained token. -> [B, T]

    norm_by_std=False gives R - mean_g (Dr. GRPO).
    """
    return _to_tokens(group_normalize(rewards, group_ids, norm_by_std, eps), mask)


def role_baseline(*, rewards: torch.Tensor, mask: torch.Tensor, roles: Sequence[str],
                  baselines: Mapping[str, float], decay: float) -> tuple[torch.Tensor, dict[str, float]]:
    """Role-conditioned advantage estimation (SPIRAL's RAE): a baseline per role kept across
    steps, b_role <- decay * b_role + (1 - decay) * mean(rewards of the role's trajectories in
    this batch) (a role seen first starts from 0), then A = R - b_role on every trained token.
    In a game whose first mover wins more often, each role is measured against its own expected
    return, not the mixture. rewards [B], mask [B, T], roles [B] -> (advantages [B, T], the
    updated baselines)."""
    updated = dict(baselines)
    for role in dict.fromkeys(roles):
        mine = [float(r) for r, k in zip(rewards.tolist(), roles) if k == role]
        updated[role] = decay * updated.get(role, 0.0) + (1 - decay) * sum(mine) / len(mine)
    base = torch.tensor([updated[k] for k in roles], dtype=rewards.dtype)
    return _to_tokens(rewards - base, mask), updated


def dr_grpo(*, rewards: torch.Tensor, mask: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Dr. GRPO: A = R - mean_g (no std division, which over-weights easy/hard prompts)."""
    return grpo(rewards=rewards, mask=mask, group_ids=group_ids, norm_by_std=False)


def rloo(*, rewards: torch.Tensor, mask: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """RLOO: A_i = R_i - mean of the *other* rewards in i's group. -> [B, T]

    Singleton groups (no other sample) get 0.
    """
    r = rewards.double()
    _, inverse = torch.unique(group_ids, return_inverse=True)
    zeros = torch.zeros(int(inverse.max()) + 1, dtype=r.dtype, device=r.device)
    count = zeros.index_add(0, inverse, torch.ones_like(r))[inverse]
    total = zeros.index_add(0, inverse, r)[inverse]
    baseline = (total - r) / (count - 1).clamp(min=1)
    adv = torch.where(count > 1, r - baseline, 0.0)
    return _to_tokens(adv.float(), mask)


def mt_grpo(
    *,
    rewards: torch.Tensor,
    turn_rewards: torch.Tensor,
    first_obs_pos: torch.Tensor,
    mask: torch.Tensor,
    group_ids: torch.Tensor,
    turn_coef: float = 1.0,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """MT-GRPO: A = A_out + c * A_turn * 1[token before the first tool result]. -> [B, T]

    A_out = group_normalize(rewards), A_turn = group_normalize(turn_rewards), c = turn_coef.
    A trajectory with no tool result (first_obs_pos == T) gets A_out only. With c = 0 this is
    exactly grpo().
    """
    T = mask.shape[1]
    a_out = group_normalize(rewards, group_ids, norm_by_std, eps)
    a_turn = group_normalize(turn_rewards, group_ids, norm_by_std, eps)
    has_obs = first_obs_pos < T
    gets_turn = before_first_obs(first_obs_pos, T) & has_obs[:, None]
    adv = a_out[:, None] + torch.where(gets_turn, turn_coef * a_turn[:, None], 0.0)
    return torch.where(mask.bool(), adv, 0.0)


# MS-GRPO (RoSTE) is the same estimator as MT-GRPO under the paper's naming.
ms_grpo = mt_grpo


def ms_po(
    *,
    rewards: torch.Tensor,
    turn_rewards: torch.Tensor,
    first_obs_pos: torch.Tensor,
    mask: torch.Tensor,
    group_ids: torch.Tensor,
    gamma: float = 1.0,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """MS-PO (RoSTE): tokens before the first tool result get norm(R_step + gamma * R_out),
    tokens after it get norm(R_out). -> [B, T]

    turn_rewards is R_step, rewards is R_out, norm is group_normalize. A trajectory with no
    tool result is "before" everywhere, so all its tokens get norm(R_tot).
    """
    T = mask.shape[1]
    r_tot = turn_rewards.double() + gamma * rewards.double()
    a_tot = group_normalize(r_tot, group_ids, norm_by_std, eps)
    a_out = group_normalize(rewards, group_ids, norm_by_std, eps)
    adv = torch.where(before_first_obs(first_obs_pos, T), a_tot[:, None], a_out[:, None])
    return torch.where(mask.bool(), adv, 0.0)


def per_turn_grpo(
    *,
    per_turn_rewards: torch.Tensor,
    turn_ids: torch.Tensor,
    mask: torch.Tensor,
    group_ids: torch.Tensor,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """GRPO applied turn by turn (MLMT): per_turn_rewards [B, K] -> advantages [B, T].

    Each turn's rewards are group-normalized separately (turn k against turn k of the other
    samples), then every trained token of turn k gets its turn's advantage.
    """
    cols = [group_normalize(per_turn_rewards[:, k], group_ids, norm_by_std, eps)
            for k in range(per_turn_rewards.shape[1])]
    return turn_rewards_to_tokens(torch.stack(cols, dim=1), turn_ids, mask, at="all")


# ----------------------------------------------------------------- PPO with a critic


def on_policy_distillation(
    *,
    logprobs: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    mask: torch.Tensor,
    rewards: torch.Tensor | None = None,
    group_ids: torch.Tensor | None = None,
    reward_weight: float = 0.0,
    sampled_weight: float = 1.0,
) -> torch.Tensor:
    """On-policy distillation: A_t = sampled_weight x (log pi_T(x_t) - log pi(x_t)) on every
    sampled token x_t (the negative per-token reverse KL to the teacher, estimated on the
    policy's own sample: top-1), plus `reward_weight` x GRPO's group-normalised reward. All
    [B, T] (rewards, group_ids [B]); 0 off the mask. Not whitened: a token the teacher agrees
    with more than the policy does is pushed up by exactly that log-ratio."""
    out = sampled_weight * (teacher_logprobs.double() - logprobs.double()) * mask
    if reward_weight:
        out = out + reward_weight * grpo(rewards=rewards, mask=mask, group_ids=group_ids).double()
    return out.to(logprobs.dtype)


def outcome_token_rewards(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """rewards [B], mask [B, T] -> [B, T]: each trajectory's reward on its last policy token
    (mask 1), 0 elsewhere: the sparse token rewards GAE takes. A row with no policy token
    gets nothing."""
    T = mask.shape[1]
    positions = torch.arange(T, device=mask.device).expand_as(mask)
    last = torch.where(mask.bool(), positions, -1).max(dim=1).values      # [B], -1 if none
    out = torch.zeros(mask.shape, dtype=torch.float, device=mask.device)
    has = last >= 0
    out[has.nonzero().squeeze(1), last[has]] = rewards.float()[has]
    return out


def gae(
    *,
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
    whiten: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation over the policy's tokens only.

    token_rewards, values, mask: [B, T] -> (advantages [B, T], returns [B, T]).
    Going backwards over policy tokens (mask 1):
        δ_t = r_t + γ V_next - V_t,   A_t = δ_t + γλ A_next,   V_next <- V_t
    At mask-0 tokens (observations inside a trajectory, trailing padding) V_next and A_next
    pass through unchanged, so the policy's turns chain as if the environment text were not
    there. Rewards and values at mask-0 tokens are ignored: put rewards on policy tokens
    (e.g. the last one). After the last policy token V_next = 0 (no bootstrap).
    returns = A + V (before whitening). With whiten=True the advantages are whitened over
    the mask (batch mean 0, std 1). Both outputs are 0 where mask is 0.
    """
    m = mask.bool()
    r = token_rewards.detach().float()
    v = values.detach().float()
    B, T = v.shape
    next_value = v.new_zeros(B)
    running = v.new_zeros(B)
    columns = []
    for t in reversed(range(T)):
        delta = r[:, t] + gamma * next_value - v[:, t]
        # torch.where keeps the carried state at mask-0 tokens (and ignores NaN there).
        running = torch.where(m[:, t], delta + gamma * lam * running, running)
        next_value = torch.where(m[:, t], v[:, t], next_value)
        columns.append(running)
    advantages = torch.stack(columns[::-1], dim=1)
    returns = torch.where(m, advantages + v, 0.0)
    advantages = torch.where(m, advantages, 0.0)
    if whiten:
        advantages = masked_whiten(advantages, m)
    return advantages, returns


# ------------------------------------------------------------ MLMT turn rewards (K = 3)
# Turns: 1 = solver's attempt, 2 = high-level feedback, 3 = solver's refinement.
# turn_kl [B, 3] is Σ(logp - logp_ref) over each turn's tokens, e.g.
# per_turn_sum(logp - logp_ref, mask, turn_ids, 3) with turn ids 0, 1, 2.


def mlmt_stage1_rewards(
    *, rewards: torch.Tensor, turn_kl: torch.Tensor, beta_2: float, beta_h: float, beta_l: float
) -> torch.Tensor:
    """MLMT stage I per-turn rewards [B, 3], R = rewards [B] (the refined answer's reward):
    turn 1 = -β₂·KL1, turn 2 (feedback) = R - β_H·KL2, turn 3 = R - β_L·KL3.
    """
    R = rewards.float()
    kl = turn_kl.float()
    return torch.stack([-beta_2 * kl[:, 0], R - beta_h * kl[:, 1], R - beta_l * kl[:, 2]], dim=1)


def mlmt_stage2_rewards(
    *,
    rewards: torch.Tensor,
    first_rewards: torch.Tensor,
    turn_kl: torch.Tensor,
    beta_1: float,
    beta_h: float,
    beta_l: float,
    alpha: float,
) -> torch.Tensor:
    """MLMT stage II per-turn rewards [B, 3], R = final reward, R₁ = first_rewards (turn 1's):
    turn 1 = R₁ - β₁·KL1, turn 3 = R + α(R - R₁) - β_L·KL3 (α rewards improvement).
    Turn 2 keeps the stage I form R - β_H·KL2 (the design gives no other for stage II).
    """
    R, R1 = rewards.float(), first_rewards.float()
    kl = turn_kl.float()
    return torch.stack(
        [R1 - beta_1 * kl[:, 0], R - beta_h * kl[:, 1], R + alpha * (R - R1) - beta_l * kl[:, 2]],
        dim=1,
    )


def context_utilization_bonus(
    logp_with_context: torch.Tensor, logp_without_context: torch.Tensor, lam: float, tau: float
) -> torch.Tensor:
    """λ · min(log p(y | x, c) - log p(y | x), τ): [B], [B] -> [B], added to the solver's reward.

    The inputs are the solver's summed log-likelihood of its final answer y with and without
    the feedback c; τ caps the bonus.
    """
    gain = logp_with_context.float() - logp_without_context.float()
    return lam * torch.clamp(gain, max=tau)


def mlmt(
    *,
    rewards: torch.Tensor,
    first_rewards: torch.Tensor,
    turn_ids: torch.Tensor,
    mask: torch.Tensor,
    group_ids: torch.Tensor,
    mlmt_stage: int = 2,
    alpha: float = 1.0,
    turn_kl: torch.Tensor | None = None,
    betas: tuple[float, float, float] = (0.0, 0.0, 0.0),
    refine_bonus: torch.Tensor | None = None,
) -> torch.Tensor:
    """MLMT's hierarchical turn rewards, then GRPO turn by turn: advantages [B, T].

    rewards [B] = R (the refined answer), first_rewards [B] = R₁ (the attempt), turn_ids and
    mask [B, T] with turns 0, 1, 2 = attempt, feedback, refinement. Stage I or II rewards
    (`mlmt_stage1_rewards` / `mlmt_stage2_rewards`, with β = `betas` = (β₁ or β₂, β_H, β_L) on
    `turn_kl` [B, 3]; no KL terms when turn_kl is None), plus `refine_bonus` [B] (the
    context-utilization reward, `context_utilization_bonus`) on the refinement turn,
    group-normalized per turn.
    """
    kl = turn_kl if turn_kl is not None else torch.zeros(rewards.shape[0], 3)
    b_low1, b_high, b_low = betas
    if mlmt_stage == 1:
        per_turn = mlmt_stage1_rewards(rewards=rewards, turn_kl=kl, beta_2=b_low1, beta_h=b_high, beta_l=b_low)
    else:
        per_turn = mlmt_stage2_rewards(rewards=rewards, first_rewards=first_rewards, turn_kl=kl, beta_1=b_low1,
                                       beta_h=b_high, beta_l=b_low, alpha=alpha)
    if refine_bonus is not None:
        per_turn[:, 2] += refine_bonus.float()
    return per_turn_grpo(per_turn_rewards=per_turn, turn_ids=turn_ids, mask=mask, group_ids=group_ids)
