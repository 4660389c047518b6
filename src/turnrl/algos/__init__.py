"""Algorithm math: advantage estimators, policy/value losses and KL, as pure functions.

No Ray, DeepSpeed or vLLM here; everything takes and returns torch tensors. Algorithms are
registered in `turnrl.algos.registry` (one signature: an advantage function of the batch's
inputs); the built-ins are in `turnrl.algos.builtin`. Importing this package is cheap: its
functions load on first use, so the params check (`turnrl.algos.registry`) needs no torch.
"""
import importlib

_WHERE = {
    "before_first_obs": "advantages",
    "context_utilization_bonus": "advantages",
    "contiguous_group_ids": "advantages",
    "dr_grpo": "advantages",
    "first_obs_position": "advantages",
    "gae": "advantages",
    "group_normalize": "advantages",
    "grpo": "advantages",
    "mlmt": "advantages",
    "mlmt_stage1_rewards": "advantages",
    "mlmt_stage2_rewards": "advantages",
    "ms_grpo": "advantages",
    "ms_po": "advantages",
    "mt_grpo": "advantages",
    "outcome_token_rewards": "advantages",
    "per_turn_grpo": "advantages",
    "per_turn_mean_std": "advantages",
    "per_turn_sum": "advantages",
    "rloo": "advantages",
    "turn_rewards_to_tokens": "advantages",
    "KL_KINDS": "kl",
    "kl_estimate": "kl",
    "kl_loss": "kl",
    "kl_penalized_rewards": "kl",
    "policy_loss_with_kl": "kl",
    "AGGREGATION_MODES": "losses",
    "aggregate": "losses",
    "entropy_from_logits": "losses",
    "explained_variance": "losses",
    "logprobs_from_logits": "losses",
    "masked_mean": "losses",
    "masked_sum": "losses",
    "masked_var": "losses",
    "masked_whiten": "losses",
    "policy_loss": "losses",
    "value_loss": "losses",
}


def __getattr__(name: str):
    if name in _WHERE:
        value = getattr(importlib.import_module(f"turnrl.algos.{_WHERE[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'turnrl.algos' has no attribute {name!r}")


__all__ = sorted(_WHERE)
