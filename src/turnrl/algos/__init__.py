"""Algorithm math: advantage estimators, policy/value losses and KL, as pure functions.

No Ray, DeepSpeed or vLLM here; everything takes and returns torch tensors. Algorithms and
policy losses are registered by name in `turnrl.algos.registry` (one signature each); the
built-ins are defined and registered in `turnrl.algos.builtin`, exactly as a plugin's are.
"""
from turnrl.algos.advantages import (before_first_obs, context_utilization_bonus, contiguous_group_ids, dr_grpo,
                                     first_obs_position, gae, group_normalize, grpo, mlmt, mlmt_stage1_rewards,
                                     mlmt_stage2_rewards, ms_grpo, ms_po, mt_grpo, outcome_token_rewards,
                                     per_turn_grpo, per_turn_mean_std, per_turn_sum, rloo, turn_rewards_to_tokens)
from turnrl.algos.kl import (KL_KINDS, kl_estimate, kl_loss, kl_penalized_rewards, off_policy_kl_mean,
                             policy_loss_with_kl)
from turnrl.algos.losses import (AGGREGATION_MODES, aggregate, entropy_from_logits, explained_variance,
                                 logprobs_from_logits, masked_mean, masked_sum, masked_var, masked_whiten, nll_loss,
                                 policy_loss, top_k_distillation, value_loss)

__all__ = [
    "AGGREGATION_MODES", "KL_KINDS", "aggregate", "before_first_obs", "context_utilization_bonus",
    "contiguous_group_ids", "dr_grpo", "entropy_from_logits", "explained_variance", "first_obs_position", "gae",
    "group_normalize", "grpo", "kl_estimate", "kl_loss", "kl_penalized_rewards", "logprobs_from_logits",
    "masked_mean", "masked_sum", "masked_var", "masked_whiten", "mlmt", "mlmt_stage1_rewards", "mlmt_stage2_rewards",
    "ms_grpo", "ms_po", "mt_grpo", "nll_loss", "off_policy_kl_mean", "outcome_token_rewards", "per_turn_grpo",
    "per_turn_mean_std", "per_turn_sum", "policy_loss", "policy_loss_with_kl", "rloo", "top_k_distillation",
    "turn_rewards_to_tokens", "value_loss",
]
