"""The built-in algorithms, registered by name in `turnrl.algos.registry` exactly as a plugin's
would be: each is an advantage function of (AdvantageInputs, the algorithm params)."""
from __future__ import annotations

import torch

from turnrl.algos import advantages as adv
from turnrl.algos import hierarchy
from turnrl.algos.registry import AdvantageInputs, Algorithm


def _first_turn_reward(x: AdvantageInputs) -> torch.Tensor:
    """[B]: the first policy turn's reward (MT-GRPO's "the tool call ran", RoSTE's R_step; MLMT's R1)."""
    return x.turn_rewards[:, 0] if x.turn_rewards.shape[1] else torch.zeros_like(x.rewards)


def grpo(x: AdvantageInputs, cfg) -> torch.Tensor:
    return adv.grpo(rewards=x.rewards, mask=x.mask, group_ids=x.group_ids)


def dr_grpo(x: AdvantageInputs, cfg) -> torch.Tensor:
    return adv.dr_grpo(rewards=x.rewards, mask=x.mask, group_ids=x.group_ids)


def rloo(x: AdvantageInputs, cfg) -> torch.Tensor:
    return adv.rloo(rewards=x.rewards, mask=x.mask, group_ids=x.group_ids)


def mt_grpo(x: AdvantageInputs, cfg) -> torch.Tensor:
    """MT-GRPO / RoSTE's MS-GRPO: A_out + turn_coef * A_turn before the first tool result."""
    return adv.mt_grpo(rewards=x.rewards, turn_rewards=_first_turn_reward(x), first_obs_pos=x.first_obs_pos,
                       mask=x.mask, group_ids=x.group_ids, turn_coef=cfg.turn_coef)


def ms_po(x: AdvantageInputs, cfg) -> torch.Tensor:
    return adv.ms_po(rewards=x.rewards, turn_rewards=_first_turn_reward(x), first_obs_pos=x.first_obs_pos,
                     mask=x.mask, group_ids=x.group_ids, gamma=cfg.gamma)


def mlmt(x: AdvantageInputs, cfg) -> torch.Tensor:
    """MLMT-RL: stage I / II turn rewards on the attempt, feedback and refinement slots (from the
    turns' roles), GRPO per slot."""
    return adv.mlmt(rewards=x.rewards, first_rewards=_first_turn_reward(x),
                    turn_ids=hierarchy.mlmt_slots(x.turn_ids, x.high), mask=x.mask, group_ids=x.group_ids,
                    mlmt_stage=cfg.mlmt_stage, alpha=cfg.mlmt_alpha, turn_kl=x.extras.get("turn_kl"),
                    betas=x.extras.get("betas", (0.0, 0.0, 0.0)), refine_bonus=x.extras.get("refine_bonus"))


def ppo(x: AdvantageInputs, cfg) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO with a critic: GAE over the policy's tokens on the outcome at the last policy token;
    returns (whitened advantages, the critic's targets)."""
    return adv.gae(token_rewards=adv.outcome_token_rewards(x.rewards, x.mask), values=x.values, mask=x.mask,
                   gamma=cfg.gamma, lam=cfg.lam)


GRPO = Algorithm(grpo, name="grpo")
DR_GRPO = Algorithm(dr_grpo, name="dr_grpo")
RLOO = Algorithm(rloo, name="rloo")
MT_GRPO = Algorithm(mt_grpo, name="mt_grpo")
MS_GRPO = Algorithm(mt_grpo, name="ms_grpo")   # the same estimator under RoSTE's name
MS_PO = Algorithm(ms_po, name="ms_po")
MLMT = Algorithm(mlmt, prepare=hierarchy.prepare, name="mlmt")
PPO = Algorithm(ppo, critic=True, name="ppo")
