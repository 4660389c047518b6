"""Policy/value losses, aggregation and masked statistics: hand-worked values (CPU, fast)."""

import math

import pytest
import torch

from turnrl.algos import (
    aggregate,
    entropy_from_logits,
    explained_variance,
    logprobs_from_logits,
    masked_mean,
    masked_whiten,
    policy_loss,
    value_loss,
)

LN15, LN05 = math.log(1.5), math.log(0.5)


def t(x, dtype=torch.float32):
    return torch.tensor(x, dtype=dtype)


def close(actual, expected, atol=1e-5):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=atol, rtol=0)


def _ppo_example():
    # Four tokens, clip 0.2 both ways:
    #   A=+1, ratio 1.5: max(-1.5, -1.2) = -1.2   (clipped)
    #   A=+1, ratio 0.5: max(-0.5, -0.8) = -0.5   (unclipped)
    #   A=-1, ratio 1.5: max( 1.5,  1.2) =  1.5   (unclipped)
    #   A=-1, ratio 0.5: max( 0.5,  0.8) =  0.8   (clipped)
    logp = t([[LN15, LN05, LN15, LN05]])
    return logp, torch.zeros(1, 4), t([[1.0, 1.0, -1.0, -1.0]]), torch.ones(1, 4)


def test_policy_loss_hand_values_and_metrics():
    logp, logp_old, adv, mask = _ppo_example()
    loss, m = policy_loss(logp, logp_old, adv, mask, clip_low=0.2, clip_high=0.2)
    # token-mean: (-1.2 - 0.5 + 1.5 + 0.8) / 4 = 0.15
    close(loss, 0.15)
    close(m["clip_fraction"], 0.5)  # tokens 0 and 3
    close(m["ratio_mean"], 1.0)  # (1.5 + 0.5 + 1.5 + 0.5) / 4
    close(m["ratio_max"], 1.5)
    # approx_kl = mean((r - 1) - ln r): r=1.5 -> 0.0945349, r=0.5 -> 0.1931472; mean 0.1438410
    close(m["approx_kl"], 0.1438410)
    close(m["dual_clip_fraction"], 0.0)


def test_policy_loss_gradient_is_zero_on_clipped_tokens():
    logp, logp_old, adv, mask = _ppo_example()
    logp.requires_grad_(True)
    loss, _ = policy_loss(logp, logp_old, adv, mask)
    loss.backward()
    # d/dlogp of -A * exp(logp - logp_old) / 4 on unclipped tokens:
    # token 1: -1 * 0.5 / 4 = -0.125; token 2: +1 * 1.5 / 4 = 0.375; clipped tokens: 0.
    close(logp.grad, [[0.0, -0.125, 0.375, 0.0]])


def test_policy_loss_asymmetric_clip_high():
    # A=+1, ratio 1.5 with clip_high 0.28: max(-1.5, -1.28) = -1.28 (vs -1.2 with 0.2).
    logp, old, adv, mask = t([[LN15]]), torch.zeros(1, 1), t([[1.0]]), torch.ones(1, 1)
    close(policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28)[0], -1.28)
    close(policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.2)[0], -1.2)


def test_dual_clip_bounds_negative_advantage_loss():
    # A=-1, log ratio 5 -> ratio e^5 = 148.41: max(148.41, 1.2) = 148.41 without dual clip;
    # with c = 3 it becomes min(148.41, 3 * |A|) = 3.
    logp, old, adv, mask = t([[5.0]]), torch.zeros(1, 1), t([[-1.0]]), torch.ones(1, 1)
    close(policy_loss(logp, old, adv, mask)[0], math.exp(5), atol=1e-3)
    loss, m = policy_loss(logp, old, adv, mask, dual_clip=3.0)
    close(loss, 3.0)
    close(m["dual_clip_fraction"], 1.0)
    # Positive advantages are untouched by the dual clip: A=+1, ratio e^5 -> -1.2 either way.
    close(policy_loss(logp, old, -adv, mask, dual_clip=3.0)[0], -1.2)


def test_dual_clip_bound_holds_on_random_tokens():
    torch.manual_seed(0)
    logp = torch.rand(4, 16) * 8 - 3  # log ratios in [-3, 5]
    adv = -torch.rand(4, 16) * 2 - 0.1  # all negative
    mask = torch.ones(4, 16)
    for row in range(4):  # per row and per token: each token's loss ≤ 3 |A|
        for col in range(16):
            sl = (slice(row, row + 1), slice(col, col + 1))
            loss, _ = policy_loss(logp[sl], torch.zeros(1, 1), adv[sl], mask[sl], dual_clip=3.0)
            assert loss <= 3.0 * adv[sl].abs().item() + 1e-6
    with pytest.raises(ValueError):
        policy_loss(logp, torch.zeros_like(logp), adv, mask, dual_clip=0.5)


def test_log_ratio_is_clamped_to_20():
    # logp - logp_old = 100 would give ratio e^100 = inf in fp32; clamped, ratio = e^20, and
    # with A = -1 (no dual clip) the loss is max(e^20, 1.2) = e^20 = 4.85e8, finite.
    loss, m = policy_loss(t([[100.0]]), torch.zeros(1, 1), t([[-1.0]]), torch.ones(1, 1))
    assert torch.isfinite(loss)
    torch.testing.assert_close(loss, torch.tensor(math.exp(20)), rtol=1e-6, atol=0)


def test_policy_loss_ignores_masked_tokens_even_if_nan():
    logp, logp_old, adv, mask = _ppo_example()
    logp = torch.cat([logp, t([[float("nan")]])], dim=1)
    logp_old = torch.cat([logp_old, t([[0.0]])], dim=1)
    adv = torch.cat([adv, t([[1e6]])], dim=1)
    mask = torch.cat([mask, t([[0.0]])], dim=1)
    loss, m = policy_loss(logp, logp_old, adv, mask)
    close(loss, 0.15)
    close(m["ratio_max"], 1.5)


def test_aggregation_modes_hand_values():
    # Masked positions hold 100 and NaN: they must not count.
    loss = t([[1, 2, 3], [4, 100, float("nan")]])
    mask = t([[1, 1, 1], [1, 0, 0]])
    close(aggregate(loss, mask, "token-mean"), 2.5)  # (1+2+3+4) / 4
    close(aggregate(loss, mask, "seq-mean-token-sum"), 5.0)  # (6 + 4) / 2
    close(aggregate(loss, mask, "seq-mean-token-mean"), 3.0)  # (2 + 4) / 2
    with pytest.raises(ValueError, match="seq-mean-token-mean"):
        aggregate(loss, mask, "sum")


def test_aggregation_skips_empty_rows_and_empty_mask_is_zero():
    loss = t([[1, 3], [5, 7]])
    mask = t([[1, 1], [0, 0]])  # row 1 has no trained token: left out of the sequence mean
    close(aggregate(loss, mask, "seq-mean-token-mean"), 2.0)
    close(aggregate(loss, mask, "seq-mean-token-sum"), 4.0)
    for mode in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean"):
        close(aggregate(loss, torch.zeros(2, 2), mode), 0.0)


def test_value_loss_hand_values():
    # Token 0: v=1.5, old=1.0, R=2.0: unclipped (1.5-2)^2 = 0.25; clipped v=1.2 -> 0.64; max 0.64.
    # Token 1: v=1.1, old=1.0, R=1.0: within the clip, both 0.01.
    # loss = 0.5 * (0.64 + 0.01) / 2 = 0.1625; one of two tokens uses the clipped error.
    values, old, ret, mask = t([[1.5, 1.1]]), t([[1.0, 1.0]]), t([[2.0, 1.0]]), torch.ones(1, 2)
    loss, m = value_loss(values, old, ret, mask, clip=0.2)
    close(loss, 0.1625)
    close(m["vf_clip_fraction"], 0.5)
    close(m["value_mean"], 1.3)
    # No clipping: 0.5 * (0.25 + 0.01) / 2 = 0.065.
    close(value_loss(values, old, ret, mask, clip=None)[0], 0.065)


def test_masked_mean_and_whiten():
    x = t([[1, 2, 9], [3, float("inf"), 5]])
    mask = t([[1, 1, 0], [1, 0, 1]])
    close(masked_mean(x, mask), 11 / 4)  # (1 + 2 + 3 + 5) / 4
    close(masked_mean(x, mask, dim=-1), [1.5, 4.0])
    # [2, 4, 6]: mean 4, Bessel std 2 -> [-1, 0, 1]; keeping the mean -> [3, 4, 5].
    y, ym = t([[2, 4, 6, 0]]), t([[1, 1, 1, 0]])
    close(masked_whiten(y, ym), [[-1, 0, 1, 0]])
    close(masked_whiten(y, ym, shift_mean=False), [[3, 4, 5, 0]])


def test_explained_variance():
    target, mask = t([[1, 2, 3]]), torch.ones(1, 3)
    close(explained_variance(target.clone(), target, mask), 1.0)  # perfect critic
    close(explained_variance(t([[2, 2, 2]]), target, mask), 0.0)  # residual var == target var
    assert torch.isnan(explained_variance(t([[1, 2, 3]]), t([[2, 2, 2]]), mask))


def test_logprobs_from_logits_hand_values_and_fp32():
    # logits [0, ln 3] -> p = [1/4, 3/4]; token 1 -> ln 0.75 = -0.2876821, token 0 -> ln 0.25.
    logits = t([[[0.0, math.log(3)], [0.0, math.log(3)]]])
    out = logprobs_from_logits(logits, t([[1, 0]], torch.long))
    close(out, [[math.log(0.75), math.log(0.25)]])
    # bf16 in -> fp32 out; huge logits stay finite: [1000, 0] -> [0, -1000].
    big = t([[[1000.0, 0.0]]]).to(torch.bfloat16)
    out = logprobs_from_logits(big, t([[1]], torch.long))
    assert out.dtype == torch.float32
    close(out, [[-1000.0]])
    close(logprobs_from_logits(big, t([[0]], torch.long)), [[0.0]])


def test_entropy_from_logits_hand_values():
    # Uniform over 4 -> ln 4 = 1.3862944. p = [1/4, 3/4] -> -(0.25 ln 0.25 + 0.75 ln 0.75) = 0.5623351.
    # Near-deterministic [0, -1e4] -> 0, and finite.
    logits = t([[[0.0, 0.0, 0.0, 0.0], [0.0, math.log(3), -1e9, -1e9], [0.0, -1e4, -1e4, -1e4]]])
    ent = entropy_from_logits(logits)
    assert ent.shape == (1, 3)
    close(ent, [[math.log(4), 0.5623351, 0.0]])
