"""Algorithm math: advantage estimators, policy/value losses and KL, as pure functions.

No Ray, DeepSpeed or vLLM here; everything takes and returns torch tensors. The training loop
picks an outcome-reward estimator by `algorithm.name` through `compute_advantages` (or the
`ADVANTAGE_ESTIMATORS` registry); PPO with a critic uses `gae`.
"""

from .advantages import (
    ADVANTAGE_ESTIMATORS,
    before_first_obs,
    compute_advantages,
    context_utilization_bonus,
    contiguous_group_ids,
    dr_grpo,
    first_obs_position,
    gae,
    group_normalize,
    grpo,
    mlmt_stage1_rewards,
    mlmt_stage2_rewards,
    ms_grpo,
    ms_po,
    mt_grpo,
    per_turn_grpo,
    per_turn_sum,
    rloo,
    turn_rewards_to_tokens,
)
from .kl import KL_KINDS, kl_estimate, kl_loss, kl_penalized_rewards
from .losses import (
    AGGREGATION_MODES,
    aggregate,
    entropy_from_logits,
    explained_variance,
    logprobs_from_logits,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    policy_loss,
    value_loss,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AGGREGATION_MODES",
    "KL_KINDS",
    "aggregate",
    "before_first_obs",
    "compute_advantages",
    "context_utilization_bonus",
    "contiguous_group_ids",
    "dr_grpo",
    "entropy_from_logits",
    "explained_variance",
    "first_obs_position",
    "gae",
    "group_normalize",
    "grpo",
    "kl_estimate",
    "kl_loss",
    "kl_penalized_rewards",
    "logprobs_from_logits",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "mlmt_stage1_rewards",
    "mlmt_stage2_rewards",
    "ms_grpo",
    "ms_po",
    "mt_grpo",
    "per_turn_grpo",
    "per_turn_sum",
    "policy_loss",
    "rloo",
    "turn_rewards_to_tokens",
    "value_loss",
]
