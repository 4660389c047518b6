"""KL estimators and the two ways of applying them (CPU, fast)."""

import math

import pytest
import torch

from turnrl.algos import kl_estimate, kl_loss, kl_penalized_rewards, masked_mean, off_policy_kl_mean

LN2 = math.log(2)


def t(x, dtype=torch.float32):
    return torch.tensor(x, dtype=dtype)


def close(actual, expected, atol=1e-5):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=atol, rtol=0)


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_zero_when_policy_equals_reference(kind):
    logp = t([[-0.3, -2.0, -7.5]])
    assert torch.all(kl_estimate(logp, logp.clone(), kind) == 0)


def test_known_points():
    # Δ = [ln 2, -ln 2, 2]
    # k1 = Δ
    # k2 = ½Δ² = [0.2402265, 0.2402265, 2.0]
    # k3 = e^{-Δ} + Δ - 1 = [0.5 + 0.6931472 - 1, 2 - 0.6931472 - 1, e^{-2} + 1]
    #    = [0.1931472, 0.3068528, 1.1353353]
    logp = t([LN2, -LN2, 2.0])
    ref = torch.zeros(3)
    close(kl_estimate(logp, ref, "k1"), [LN2, -LN2, 2.0])
    close(kl_estimate(logp, ref, "k2"), [0.5 * LN2**2, 0.5 * LN2**2, 2.0])
    close(kl_estimate(logp, ref, "k3"), [0.1931472, 0.3068528, 1.1353353])


def test_invariants_on_random_points():
    torch.manual_seed(0)
    logp, ref = torch.randn(64) * 3, torch.randn(64) * 3
    delta = logp - ref
    assert torch.all(kl_estimate(logp, ref, "k3") >= 0)
    close(kl_estimate(logp, ref, "k2"), 0.5 * delta**2)
    close(kl_estimate(logp, ref, "k1"), delta)


def test_clamp_prevents_overflow():
    # Δ = -100: e^{100} overflows fp32 without the clamp; with clamp 20, k3 = e^{20} - 21.
    logp, ref = t([-100.0, 100.0]), torch.zeros(2)
    assert torch.isinf(kl_estimate(logp, ref, "k3", clamp=None)[0])
    out = kl_estimate(logp, ref, "k3", clamp=20.0)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, t([math.exp(20) - 21, math.exp(-20) + 19]), rtol=1e-6, atol=0)
    close(kl_estimate(logp, ref, "k1", clamp=20.0), [-20.0, 20.0])


def test_unknown_kind_raises():
    with pytest.raises(ValueError, match="k3"):
        kl_estimate(torch.zeros(1), torch.zeros(1), "k4")


def test_kl_penalized_rewards_hand_values():
    # k1, β = 0.5, Δ = [0.1, 0.2, 0.3, 0.9], mask [1, 1, 1, 0]:
    # r - β·kl = [0 - 0.05, 0 - 0.1, 1 - 0.15, 7 (masked: unchanged)]
    rewards = t([[0.0, 0.0, 1.0, 7.0]])
    logp = t([[0.1, 0.2, 0.3, 0.9]])
    mask = t([[1, 1, 1, 0]])
    new, kl = kl_penalized_rewards(rewards, logp, torch.zeros(1, 4), mask, beta=0.5, kind="k1")
    close(new, [[-0.05, -0.1, 0.85, 7.0]])
    close(kl, [[0.1, 0.2, 0.3, 0.0]])


def test_kl_loss_value_and_gradient():
    # k3 at Δ = [ln 2, -ln 2]: [0.1931472, 0.3068528], token-mean 0.25.
    # d k3 / d logp = 1 - e^{-Δ} = [0.5, -1], divided by 2 tokens -> [0.25, -0.5].
    logp = t([[LN2, -LN2, 5.0]]).requires_grad_(True)
    mask = t([[1, 1, 0]])
    loss = kl_loss(logp, torch.zeros(1, 3), mask, kind="k3")
    close(loss, 0.25)
    loss.backward()
    close(logp.grad, [[0.25, -0.5, 0.0]])


def test_off_policy_kl_mean_known_points():
    # two tokens sampled by mu; policy/mu = [2, 1/2] (log-weights ±ln 2), k1 = Δ = [1, -1]:
    # (2 * 1 + 0.5 * -1) / 2.5 = 0.6; the third token is masked out
    logp = t([[-1.0, -2.0, -3.0]])
    ref = logp - t([[1.0, -1.0, 5.0]])
    mu = logp - t([[LN2, -LN2, 0.0]])
    mask = t([[1.0, 1.0, 0.0]])
    close(off_policy_kl_mean(logp, ref, mu, mask, kind="k1"), 0.6)
    # mu = the policy: the plain masked mean, for every estimator
    for kind in ("k1", "k2", "k3"):
        close(off_policy_kl_mean(logp, ref, logp, mask, kind=kind), masked_mean(kl_estimate(logp, ref, kind), mask))
    close(off_policy_kl_mean(logp, ref, mu, torch.zeros_like(mask)), 0.0)


def test_off_policy_kl_mean_estimates_the_policys_kl_from_another_policys_samples():
    # a 3-token vocabulary: the reference, an old policy mu that liked token 2, and a policy that
    # has since made token 2 near-impossible; 20000 tokens sampled from mu
    torch.manual_seed(0)
    ref, mu, pi = (torch.log(t(p)) for p in ([0.3, 0.3, 0.4], [0.1, 0.1, 0.8], [0.5, 0.5 - 1e-6, 1e-6]))
    exact = float((pi.exp() * (pi - ref)).sum())
    tokens = torch.multinomial(mu.exp(), 20000, replacement=True)[None]
    mask = torch.ones_like(tokens, dtype=torch.float32)
    weighted = off_policy_kl_mean(pi[tokens], ref[tokens], mu[tokens], mask, kind="k3")
    assert abs(float(weighted) - exact) < 0.05 * exact
    # the plain mean of k3 over mu's tokens: token 2's exp(-Δ) = 0.4 / 1e-6 swamps it
    assert float(masked_mean(kl_estimate(pi[tokens], ref[tokens], "k3"), mask)) > 1000 * exact
