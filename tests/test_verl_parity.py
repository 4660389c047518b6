"""turnrl's off-policy corrections (turnrl.algos.corrections) against verl's rollout-correction
functions (verl 0.9.1, verl/trainer/ppo/rollout_corr_helper.py) on the same log-ratios
log pi_prox / mu and masks: truncated IS at token and sequence level, masked IS (rejection) by
token, by sequence product and by geometric mean, and the effective sample size.

verl is not a dependency: setup.sh puts it, without its dependencies, in .cache/verl-0.9.1, and
it runs in a subprocess so that nothing of it is imported beside turnrl.

    ours                                         verl
    importance_weights(level, cap=C)             compute_rollout_correction_weights(rollout_is=level, threshold=C)
    rejection_mask(level="token", [lo, up])      compute_rollout_rejection_mask("token_k1", "1/up_1/lo")
    rejection_mask(level="sequence", ...)        ... "seq_sum_k1"    (k1 = -log ratio: the bounds flip)
    rejection_mask(level="geometric", ...)       ... "seq_mean_k1"
    effective_sample_size(w)                     metrics["rollout_is_eff_sample_size"]
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import needs_setup
from turnrl.algos.corrections import effective_sample_size, importance_weights, log_ratio, rejection_mask

ROOT = Path(__file__).resolve().parents[1]
VERL = ROOT / ".cache" / "verl-0.9.1"

VERL_SIDE = r"""
import json, sys, torch
from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_weights, compute_rollout_rejection_mask
data = torch.load(sys.argv[1])
out = {}
for name, (level, cap) in data["tis"].items():
    w, metrics = compute_rollout_correction_weights(data["log_rho"], data["mask"], rollout_is=level,
                                                    rollout_is_threshold=cap)
    out[name] = w
    out[name + "_ess"] = torch.tensor(metrics["rollout_is_eff_sample_size"])
for name, (option, spec) in data["mis"].items():
    out[name] = compute_rollout_rejection_mask(data["log_rho"], data["mask"], rollout_rs=option,
                                               rollout_rs_threshold=spec)[0]
torch.save(out, sys.argv[2])
"""


def _ratios(seed: int = 0, batch: int = 12, length: int = 20):
    """Log-ratios of a stale batch [B, T]: mostly near 0, a few far off, ragged masks."""
    g = torch.Generator().manual_seed(seed)
    logp_prox = -torch.rand(batch, length, generator=g) * 3
    logp_mu = logp_prox - torch.randn(batch, length, generator=g) * 0.15
    logp_mu[0, 3] -= 2.5                        # one token the behaviour policy found unlikely
    logp_mu[1] += 0.2                           # a whole sequence off one way ...
    logp_mu[2, :4] -= 1.0                       # ... and one with a few tokens off the other
    lengths = torch.randint(3, length + 1, (batch,), generator=g)
    mask = (torch.arange(length)[None, :] < lengths[:, None]).float()
    mask[5] = 0.0                               # a row with no policy tokens
    return log_ratio(logp_prox, logp_mu, mask), mask


needs_setup(VERL / "verl", "verl 0.9.1's rollout-correction module")


def test_truncated_and_masked_importance_sampling_equal_verls(tmp_path):
    log_rho, mask = _ratios()
    tis = {"tis_token_2": ("token", 2.0), "tis_token_1.2": ("token", 1.2), "tis_sequence_2": ("sequence", 2.0),
           "tis_sequence_5": ("sequence", 5.0)}
    bounds = {"sym": (0.5, 2.0), "asym": (0.8, 1.5)}   # ours: [lower, upper] on the ratio
    levels = {"token": "token_k1", "sequence": "seq_sum_k1", "geometric": "seq_mean_k1"}
    mis = {f"mis_{level}_{b}": (option, f"{1 / up!r}_{1 / lo!r}")
           for level, option in levels.items() for b, (lo, up) in bounds.items()}
    torch.save({"log_rho": log_rho, "mask": mask, "tis": tis, "mis": mis}, tmp_path / "in.pt")
    proc = subprocess.run([sys.executable, "-c", VERL_SIDE, str(tmp_path / "in.pt"), str(tmp_path / "out.pt")],
                          env={"PYTHONPATH": str(VERL), "PATH": "/usr/bin:/bin", "RAY_USAGE_STATS_ENABLED": "0"},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    verl = torch.load(tmp_path / "out.pt")

    diffs = {}
    for name, (level, cap) in tis.items():
        ours = importance_weights(log_rho, mask, level, cap=cap)
        torch.testing.assert_close(ours, verl[name], rtol=1e-6, atol=1e-7, msg=name)
        assert float(effective_sample_size(ours, mask)) == pytest.approx(float(verl[name + "_ess"]), rel=1e-6)
        diffs[name] = float((ours - verl[name]).abs().max())
    for name, (option, _) in mis.items():
        level = name.split("_")[1]
        lower, upper = bounds[name.split("_")[2]]
        ours = rejection_mask(log_rho, mask, upper, lower, level)
        assert torch.equal(ours, verl[name].float()), name
        diffs[name] = int((ours != verl[name].float()).sum())
    # the cases differ from each other: a cap or a bound that never bit would prove nothing
    assert not torch.equal(verl["tis_token_2"], verl["tis_token_1.2"])
    assert 0 < float((1 - verl["mis_token_sym"]).mul(mask).sum()) < float(mask.sum())
    assert not torch.equal(verl["mis_sequence_sym"], verl["mis_geometric_sym"])
    assert not torch.equal(verl["mis_token_sym"], verl["mis_token_asym"])
    print("\nMEASURED verl parity, max |difference| (weights) or tokens differing (masks):", json.dumps(diffs))
