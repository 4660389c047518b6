"""Off-policy corrections (turnrl.algos.corrections): hand-computed cases."""
import math

import pytest
import torch

from turnrl.algos.corrections import (effective_sample_size, importance_stats, importance_weights,
                                      interpolated_proximal_logprobs, log_ratio, rejection_mask)
from turnrl.algos.losses import policy_loss

LN = math.log


def _t(*rows):
    return torch.tensor(rows, dtype=torch.float)


def test_log_ratio_is_proximal_minus_behaviour_and_zero_outside_the_mask():
    out = log_ratio(_t([-1.0, -2.0, 5.0]), _t([-1.5, -1.0, float("nan")]), _t([1, 1, 0]))
    assert torch.allclose(out, _t([0.5, -1.0, 0.0]))


def test_token_weights_are_truncated_at_the_cap():
    w = importance_weights(_t([LN(3), LN(0.5), LN(1.5), 7.0]), _t([1, 1, 1, 0]), "token", cap=2.0)
    assert torch.allclose(w, _t([2.0, 0.5, 1.5, 0.0]))


def test_sequence_weights_are_the_product_of_the_rows_ratios_then_truncated():
    log_rho = _t([LN(2), LN(2), 3.0], [LN(0.5), LN(1.5), 0.0])
    mask = _t([1, 1, 0], [1, 1, 0])
    assert torch.allclose(importance_weights(log_rho, mask, "sequence"), _t([4.0, 4.0, 0.0], [0.75, 0.75, 0.0]))
    assert torch.allclose(importance_weights(log_rho, mask, "sequence", cap=3.0), _t([3.0, 3.0, 0.0], [0.75, 0.75, 0.0]))


def test_rejection_by_token_sequence_and_geometric_mean():
    log_rho = _t([LN(3), LN(0.4), LN(1.2)])
    mask = _t([1, 1, 1])
    assert torch.equal(rejection_mask(log_rho, mask, upper=2.0, level="token"), _t([0, 0, 1]))
    # product 3 * 0.4 * 1.2 = 1.44, inside [0.5, 2]: the whole sequence stays
    assert torch.equal(rejection_mask(log_rho, mask, upper=2.0, level="sequence"), _t([1, 1, 1]))
    # geometric mean 1.44 ** (1/3) = 1.129, outside [1/1.1, 1.1]: the whole sequence goes
    assert torch.equal(rejection_mask(log_rho, mask, upper=1.1, level="geometric"), _t([0, 0, 0]))
    assert torch.equal(rejection_mask(log_rho, mask, upper=1.2, level="geometric"), _t([1, 1, 1]))


def test_rejection_never_adds_tokens_outside_the_loss_mask():
    assert torch.equal(rejection_mask(_t([0.0, 0.0]), _t([1, 0]), upper=2.0), _t([1, 0]))


def test_interpolated_proximal_logprobs_follow_the_versions():
    behaviour, current = _t([-2.0, -2.0, -2.0]), _t([-1.0, -1.0, -1.0])
    versions = torch.tensor([[3, 4, 5]])
    # current version 5, proximal 4: alpha = (4 - 3) / (5 - 3) = 0.5; a token of version 4 is the
    # proximal policy's own (alpha 0); one of version 5 was sampled by the current weights (alpha 0)
    out = interpolated_proximal_logprobs(behaviour, current, versions, current_version=5)
    assert torch.allclose(out, _t([-1.5, -2.0, -2.0]))


def test_effective_sample_size():
    mask = _t([1, 1, 1, 1])
    assert effective_sample_size(_t([1.0, 1.0, 1.0, 1.0]), mask).item() == pytest.approx(1.0)
    assert effective_sample_size(_t([4.0, 0.0, 0.0, 0.0]), mask).item() == pytest.approx(0.25)
    assert effective_sample_size(_t([2.0, 1.0, 1.0, 0.0]), mask).item() == pytest.approx(16 / 24)
    # equal weights: float32 sums round the unclamped ratio above 1 in 14 of these 28 cases (up to
    # 1.000001; a training run logged 1.0000001), which is_ess_min's health check must never see
    equal = [effective_sample_size(torch.full((n,), v), torch.ones(n)).item()
             for n in (3, 7, 10, 33, 100, 1000, 4097) for v in (0.1, 0.3, 1.7, 0.9999)]
    assert all(0.99999 < e <= 1.0 for e in equal)


def test_importance_stats_count_truncated_and_masked_tokens():
    log_rho, mask = _t([LN(3), LN(0.5), LN(1.5), LN(1.0)]), _t([1, 1, 1, 1])
    raw = importance_weights(log_rho, mask)
    weights = importance_weights(log_rho, mask, cap=2.0)
    kept = rejection_mask(log_rho, mask, upper=2.5)   # 3 is rejected
    stats = importance_stats(raw, weights, mask, kept)
    assert stats["is_truncated_frac"].item() == pytest.approx(0.25)
    assert stats["is_masked_frac"].item() == pytest.approx(0.25)
    assert stats["is_weight_mean"].item() == pytest.approx((0.5 + 1.5 + 1.0) / 3)
    assert stats["is_weight_max"].item() == pytest.approx(1.5)
    assert stats["is_raw_weight_max"].item() == pytest.approx(3.0)


def test_weighted_policy_loss_and_its_gradient():
    """ratio 1, A = [1, -1], w = [2, 0.5], token-mean: loss = mean(-A w) = (-2 + 0.5) / 2, and
    d loss / d logp_t = -A_t w_t / 2 (the weights are constants)."""
    logp = torch.zeros(1, 2, requires_grad=True)
    loss, _ = policy_loss(logp, torch.zeros(1, 2), _t([1.0, -1.0]), _t([1, 1]), weights=_t([2.0, 0.5]))
    loss.backward()
    assert loss.item() == pytest.approx(-0.75)
    assert torch.allclose(logp.grad, _t([-1.0, 0.25]))


def test_unit_weights_leave_the_policy_loss_unchanged():
    g = torch.Generator().manual_seed(0)
    logp, old, adv = (torch.randn(3, 5, generator=g) for _ in range(3))
    mask = (torch.rand(3, 5, generator=g) > 0.3).float()
    plain, _ = policy_loss(logp, old, adv, mask, agg="seq-mean-token-mean")
    weighted, _ = policy_loss(logp, old, adv, mask, agg="seq-mean-token-mean", weights=torch.ones(3, 5))
    assert torch.equal(plain, weighted)


@pytest.mark.parametrize("bad", [dict(level="word"), dict(cap=0.0)])
def test_bad_settings_are_refused(bad):
    with pytest.raises(ValueError):
        importance_weights(_t([0.0]), _t([1]), **bad)
    with pytest.raises(ValueError):
        rejection_mask(_t([0.0]), _t([1]), upper=0.5)


def _batch(**over):
    """A mini-batch as the policy worker hands it to a loss: logp carries the gradient."""
    b = {"logp": torch.tensor([[-1.0, -1.0, -1.0]], requires_grad=True), "old_logp": _t([-1.0, -1.0, -1.0]),
         "ref_logp": _t([-1.0, -1.0, -1.0]), "advantages": _t([1.0, 1.0, -1.0]), "mask": _t([1, 1, 1]),
         "engine_logprobs": _t([-1.0 - LN(3), -1.0 - LN(0.5), -1.0])}   # rho = [3, 0.5, 1]
    b.update(over)
    return b


class _Cfg:
    kl_coef, kl_estimator, clip_low, clip_high, dual_clip, loss_agg = 0.0, "k3", 0.2, 0.28, None, "token-mean"

    def __init__(self, name, **options):
        from turnrl.algos.registry import resolve_loss
        self.loss = resolve_loss(name)
        self.policy_loss_options = options   # the registered options model checks and fills them


def _loss_and_grad(name, batch, **options):
    cfg = _Cfg(name, **options)
    loss, metrics = cfg.loss.fn(batch, cfg)
    loss.backward()
    return loss.item(), batch["logp"].grad, metrics


def test_tis_loss_weights_each_token_by_its_truncated_ratio():
    """ratio pi/pi_prox = 1, so loss = mean(-A w) with w = min(rho, 2) = [2, 0.5, 1]:
    (-2 - 0.5 + 1) / 3, and d loss / d logp_t = -A_t w_t / 3."""
    loss, grad, metrics = _loss_and_grad("tis", _batch(), cap=2.0)
    assert loss == pytest.approx(-0.5)
    assert torch.allclose(grad, _t([-2 / 3, -0.5 / 3, 1 / 3]))
    assert metrics["is_truncated_frac"].item() == pytest.approx(1 / 3)


def test_mis_loss_drops_the_rejected_tokens_from_the_gradient():
    loss, grad, metrics = _loss_and_grad("mis", _batch(), upper=2.0)   # rho 3 is rejected, 0.5 and 1 stay
    # the rejected token leaves the normalizer too: token-mean over the 2 kept tokens
    assert torch.allclose(grad, _t([0.0, -1 / 2, 1 / 2]))
    assert metrics["is_masked_frac"].item() == pytest.approx(1 / 3)


def test_decoupled_loss_weights_by_the_untruncated_ratio_and_can_interpolate():
    _, grad, _ = _loss_and_grad("decoupled", _batch(), cap=None)   # untruncated: rho = [3, 0.5, 1]
    assert torch.allclose(grad, _t([-3 / 3, -0.5 / 3, 1 / 3]))
    _, grad, _ = _loss_and_grad("decoupled", _batch())               # the default cap 2
    assert torch.allclose(grad, _t([-2 / 3, -0.5 / 3, 1 / 3]))
    # interpolate: tokens of version 4 under trainer version 5 have pi_prox = mu exactly (rho 1), so
    # the surrogate clips pi_theta / mu = [3, 0.5, 1]: token 0 (A > 0, ratio 3 > 1.28) is clipped
    batch = _batch(versions=torch.tensor([[4, 4, 4]]), trainer_version=torch.tensor([[5, 5, 5]]))
    _, grad, metrics = _loss_and_grad("decoupled", batch, proximal="interpolate")
    assert torch.allclose(grad, _t([0.0, -0.5 / 3, 1 / 3]), atol=1e-6)
    assert metrics["is_weight_max"].item() == pytest.approx(1.0)


def test_tis_and_decoupled_are_one_loss_at_their_defaults():
    """With pi_prox recomputed (async training), decoupled's defaults (token level, cap 2) and
    tis's (token level, cap 2) weight the same surrogate by the same min(rho, 2): loss, gradient
    and metrics agree, clipping included. (benchmarks/ASYNC.md compares runs of both: their
    differences are run-to-run variance.)"""
    gen = torch.Generator().manual_seed(0)
    shape = (4, 16)
    base = {"old_logp": -torch.rand(shape, generator=gen) * 3, "ref_logp": -torch.rand(shape, generator=gen) * 3,
            "advantages": torch.randn(shape, generator=gen), "mask": (torch.rand(shape, generator=gen) > 0.2).float()}
    base["engine_logprobs"] = base["old_logp"] + 0.5 * torch.randn(shape, generator=gen)
    start = base["old_logp"] + 0.3 * torch.randn(shape, generator=gen)     # ratios outside the clip range too
    out = {}
    for name in ("tis", "decoupled"):
        batch = {**base, "logp": start.clone().requires_grad_(True)}
        out[name] = _loss_and_grad(name, batch)
    (tis_loss, tis_grad, tis_m), (dec_loss, dec_grad, dec_m) = out["tis"], out["decoupled"]
    assert tis_m["clip_fraction"].item() > 0 and tis_m["is_truncated_frac"].item() > 0
    assert dec_loss == pytest.approx(tis_loss, abs=1e-7) and torch.allclose(dec_grad, tis_grad, atol=1e-7)
    assert set(tis_m) == set(dec_m) and all(torch.allclose(tis_m[k], dec_m[k]) for k in tis_m)
