"""The built-in algorithms and policy losses, each registered where it is defined, with the
decorators a plugin uses (`turnrl.algos.registry.register` / `register_loss`): an algorithm is
an advantage function of (AdvantageInputs, the algorithm params), a loss a function of (the
mini-batch's tensors, the algorithm params). `turnrl.algos.registry` imports this module the
first time a name is looked up."""
from __future__ import annotations

from typing import Mapping

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from turnrl.algos import advantages as adv
from turnrl.algos import hierarchy
from turnrl.algos import corrections  # noqa: F401  (registers the off-policy losses: tis, mis, decoupled)
from turnrl.algos.kl import policy_loss_with_kl
from turnrl.algos.losses import aggregate, top_k_distillation
from turnrl.algos.registry import AdvantageInputs, NoOptions, register, register_loss


def _first_turn_reward(x: AdvantageInputs) -> torch.Tensor:
    """[B]: the first policy turn's reward (MT-GRPO's "the tool call ran", RoSTE's R_step; MLMT's R1)."""
    return x.turn_rewards[:, 0] if x.turn_rewards.shape[1] else torch.zeros_like(x.rewards)


def needs_groups(params) -> str | None:
    """A group baseline (each reward against its prompt's other samples) over groups of one: every
    advantage would be 0."""
    if params.rollout.n < 2:
        return (f"algorithm.name = {params.algorithm.name} scores each sample against the other samples of its prompt, "
                f"and rollout.n = {params.rollout.n} gives it none, so every advantage is 0: set rollout.n to 2 or "
                "more (params.yaml: 8), or use an algorithm without a group baseline (ppo)")
    return None


@register("grpo", options=NoOptions, check_params=needs_groups)
def grpo(x: AdvantageInputs, cfg) -> torch.Tensor:
    return adv.grpo(rewards=x.rewards, mask=x.mask, group_ids=x.group_ids)


@register("dr_grpo", options=NoOptions, check_params=needs_groups)
def dr_grpo(x: AdvantageInputs, cfg) -> torch.Tensor:
    return adv.dr_grpo(rewards=x.rewards, mask=x.mask, group_ids=x.group_ids)


@register("rloo", options=NoOptions, check_params=needs_groups)
def rloo(x: AdvantageInputs, cfg) -> torch.Tensor:
    return adv.rloo(rewards=x.rewards, mask=x.mask, group_ids=x.group_ids)


@register("ms_grpo", options=NoOptions, check_params=needs_groups)   # the same estimator under RoSTE's name
@register("mt_grpo", options=NoOptions, check_params=needs_groups)
def mt_grpo(x: AdvantageInputs, cfg) -> torch.Tensor:
    """MT-GRPO / RoSTE's MS-GRPO: A_out + turn_coef * A_turn before the first tool result."""
    return adv.mt_grpo(rewards=x.rewards, turn_rewards=_first_turn_reward(x), first_obs_pos=x.first_obs_pos,
                       mask=x.mask, group_ids=x.group_ids, turn_coef=cfg.turn_coef)


@register("ms_po", options=NoOptions, check_params=needs_groups)
def ms_po(x: AdvantageInputs, cfg) -> torch.Tensor:
    return adv.ms_po(rewards=x.rewards, turn_rewards=_first_turn_reward(x), first_obs_pos=x.first_obs_pos,
                     mask=x.mask, group_ids=x.group_ids, gamma=cfg.gamma)


@register("mlmt", prepare=hierarchy.prepare, options=hierarchy.MlmtOptions)
def mlmt(x: AdvantageInputs, cfg) -> torch.Tensor:
    """MLMT-RL: stage I / II turn rewards on the attempt, feedback and refinement slots (from the
    turns' roles), GRPO per slot; `algorithm.options` as hierarchy.MlmtOptions."""
    opts = hierarchy.mlmt_options(cfg)
    return adv.mlmt(rewards=x.rewards, first_rewards=_first_turn_reward(x),
                    turn_ids=hierarchy.mlmt_slots(x.turn_ids, x.high), mask=x.mask, group_ids=x.group_ids,
                    mlmt_stage=opts.stage, alpha=opts.alpha, turn_kl=x.extras.get("turn_kl"),
                    betas=x.extras.get("betas", (0.0, 0.0, 0.0)), refine_bonus=x.extras.get("refine_bonus"))


class RaeOptions(BaseModel):
    """`algorithm.options` of rae."""
    model_config = ConfigDict(extra="forbid")
    decay: float = Field(0.95, ge=0, lt=1, description=(
        "the role baselines' EMA decay: b <- decay * b + (1 - decay) * the role's mean reward this step"))


@register("rae", options=RaeOptions)
def rae(x: AdvantageInputs, cfg) -> torch.Tensor:
    """SPIRAL's role-conditioned advantage estimation (`advantages.role_baseline`): a baseline per
    game and role (`AdvantageInputs.roles`; trajectories of no role share the "" one), kept across
    the run's steps in `inputs.state` (a resumed run starts them from 0 again)."""
    opts = RaeOptions.model_validate(cfg.options or {})
    roles = x.roles or ("",) * len(x.rewards)
    advantages, x.state["role_baselines"] = adv.role_baseline(
        rewards=x.rewards, mask=x.mask, roles=roles, baselines=x.state.get("role_baselines", {}), decay=opts.decay)
    return advantages


class OpdOptions(BaseModel):
    """`algorithm.options` of opd."""
    model_config = ConfigDict(extra="forbid")
    sampled_weight: float = Field(1.0, ge=0, description=(
        "x the teacher's signal on the sampled token (log pi_T - log pi, the per-token reverse KL): the "
        "advantage. 0 with reward.teacher.top_k: the teacher's top-k distribution alone (a supervised "
        "forward KL on the policy's own samples, GKD's beta 0), no policy-gradient noise"))
    reward_weight: float = Field(0.0, ge=0, description=(
        "x GRPO's group-normalised reward added to the distillation signal (0: the teacher alone)"))
    top_k_weight: float = Field(1.0, ge=0, description=(
        "with reward.teacher.top_k: x the KL from the teacher's top-k distribution to the policy's, added to the "
        "policy loss on every sampled position (losses.top_k_distillation; aggregated like the loss)"))

    @model_validator(mode="after")
    def _some_signal(self) -> "OpdOptions":
        if not (self.sampled_weight or self.reward_weight or self.top_k_weight):
            raise ValueError("sampled_weight, reward_weight and top_k_weight are all 0: opd has no signal")
        return self


def opd_top_k(batch: Mapping[str, torch.Tensor], cfg) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """opd's loss term: top_k_weight x the top-k KL (reward.teacher.top_k; 0 without it),
    aggregated over the loss mask by algorithm.loss_agg; logged as top_k_kl."""
    opts = OpdOptions.model_validate(cfg.options or {})
    if "teacher_top_ids" not in batch:
        if not (opts.sampled_weight or opts.reward_weight):
            raise ValueError("algorithm.options.sampled_weight and reward_weight are 0 without reward.teacher.top_k: "
                             "opd has no signal; set reward.teacher.top_k (e.g. 8) or a weight above 0")
        return batch["logp"].new_zeros(()), {}
    kl = top_k_distillation(batch["logits"], batch["teacher_top_ids"], batch["teacher_top_logprobs"])
    mean = aggregate(kl, batch["mask"], cfg.loss_agg)
    return opts.top_k_weight * mean, {"top_k_kl": mean.detach()}


def opd_params_problem(params) -> str | None:
    """opd whose weights leave only the top-k term, without reward.teacher.top_k to feed it."""
    try:
        opts = OpdOptions.model_validate(params.algorithm.options or {})
    except ValueError:   # the options' own error, said by their check
        return None
    if not (opts.sampled_weight or opts.reward_weight or params.reward.teacher.top_k):
        return ("algorithm.options.sampled_weight and reward_weight are 0 and reward.teacher.top_k is 0: opd has no "
                "signal; set reward.teacher.top_k (e.g. 8) or a weight above 0")
    return None


@register("opd", options=OpdOptions, teacher=True, loss_term=opd_top_k, check_params=opd_params_problem)
def opd(x: AdvantageInputs, cfg) -> torch.Tensor:
    """On-policy distillation (the policy samples, reward.teacher scores every sampled token):
    A_t = sampled_weight x (log pi_T - log pi_engine) per token, + reward_weight x GRPO
    (advantages.on_policy_distillation);
    with reward.teacher.top_k, the loss also takes the KL from the teacher's top k (opd_top_k)."""
    if x.teacher_logprobs is None:
        raise ValueError("algorithm.name = opd needs the teacher's logprobs: set reward.teacher.serve (a checkpoint) "
                         "or reward.teacher.base_url (a vLLM server)")
    opts = OpdOptions.model_validate(cfg.options or {})
    return adv.on_policy_distillation(logprobs=x.logprobs, teacher_logprobs=x.teacher_logprobs, mask=x.mask,
                                      rewards=x.rewards, group_ids=x.group_ids, reward_weight=opts.reward_weight,
                                      sampled_weight=opts.sampled_weight)


@register("ppo", critic=True, options=NoOptions)
def ppo(x: AdvantageInputs, cfg) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO with a critic: GAE over the policy's tokens on the outcome at the last policy token;
    returns (whitened advantages, the critic's targets)."""
    return adv.gae(token_rewards=adv.outcome_token_rewards(x.rewards, x.mask), values=x.values, mask=x.mask,
                   gamma=cfg.gamma, lam=cfg.lam)


@register_loss("clipped", options=NoOptions)
def clipped(batch: Mapping[str, torch.Tensor], cfg) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped surrogate (clip_low, clip_high, dual_clip) + kl_coef * KL to the reference
    (kl_estimator), aggregated by loss_agg: `turnrl.algos.kl.policy_loss_with_kl`."""
    return policy_loss_with_kl(batch["logp"], batch["old_logp"], batch["ref_logp"], batch["advantages"],
                               batch["mask"], kl_coef=cfg.kl_coef, kl_kind=cfg.kl_estimator, clip_low=cfg.clip_low,
                               clip_high=cfg.clip_high, dual_clip=cfg.dual_clip, agg=cfg.loss_agg)
