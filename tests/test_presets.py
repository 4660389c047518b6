"""Method presets (configs/*.yaml): each is valid over params.yaml and becomes `-S` args or
params.yaml edits that keep the file's comments."""
import shutil
from pathlib import Path

import pytest

from turnrl import presets
from turnrl.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", ["mutis", "mlmt", "mt_grpo", "ms_grpo", "ms_po", "mtgrpo"])
def test_every_method_has_a_valid_preset(name):
    keys = presets.load(name, ROOT / "params.yaml", ROOT / "configs")
    args = presets.set_args(keys)
    overrides = [a for a in args if a != "-S"]
    cfg = load_config(ROOT / "params.yaml", overrides)
    assert cfg.env.name == keys["env.name"] and cfg.algorithm.name == keys["algorithm.name"]


def test_method_pairs():
    pairs = {n: (presets.load(n, ROOT / "params.yaml", ROOT / "configs")["env.name"],
                 presets.load(n, ROOT / "params.yaml", ROOT / "configs")["algorithm.name"]) for n in presets.names(ROOT / "configs")}
    assert pairs["mutis"] == ("intervention", "ppo")
    assert pairs["mlmt"] == ("math_refine", "mlmt")
    assert pairs["mt_grpo"] == ("code_tool", "mt_grpo")
    assert pairs["ms_grpo"] == ("search", "ms_grpo") and pairs["ms_po"] == ("search", "ms_po")


def test_apply_writes_the_keys_and_keeps_comments(tmp_path):
    params = tmp_path / "params.yaml"
    shutil.copy(ROOT / "params.yaml", params)
    presets.apply(presets.load("mutis", params, ROOT / "configs"), params)
    text = params.read_text()
    assert "# grpo, dr_grpo" in text            # comments survive
    cfg = load_config(params)
    assert cfg.algorithm.name == "ppo" and cfg.env.name == "intervention"
    # only the preset's lines change: the other lines keep how they were written (null, "", 1.0e-05)
    keys = presets.load("mt_grpo", ROOT / "params.yaml", ROOT / "configs")
    shutil.copy(ROOT / "params.yaml", params)
    presets.apply({**keys, "sft.lr": 1e-05}, params)   # a value params already has: its line stays
    before, after = (ROOT / "params.yaml").read_text().splitlines(), params.read_text().splitlines()
    changed = [(a, b) for a, b in zip(before, after) if a != b]
    assert len(before) == len(after) and [b.split("#")[0].strip() for _, b in changed] == ["name: mt_grpo"]


def test_unknown_preset_and_bad_key(tmp_path):
    with pytest.raises(ConfigError, match="presets: .*mutis"):
        presets.load("nope", ROOT / "params.yaml", ROOT / "configs")
    (tmp_path / "bad.yaml").write_text("algorithm: {nam: ppo}\n")
    with pytest.raises(ConfigError, match="algorithm.nam: unknown key"):
        presets.load("bad", ROOT / "params.yaml", tmp_path)


def test_mlmt_preset_pulls_a_drifted_policy_back_when_every_group_is_identical():
    """The cause of issue 23's MLMT collapse: once every group scored alike (all advantages 0)
    and the shared weights had drifted (kl_ref 1.8), the preset's loss had no gradient left to
    bring them back. The policy worker's loss with the preset's keys must push a drifted
    policy's logprobs back toward the reference's."""
    import torch

    from turnrl.algos.kl import kl_estimate, policy_loss_with_kl
    from turnrl.algos.losses import masked_mean

    keys = presets.load("mlmt", ROOT / "params.yaml", ROOT / "configs")
    alg = load_config(ROOT / "params.yaml", [a for a in presets.set_args(keys) if a != "-S"]).algorithm
    generator = torch.Generator().manual_seed(0)
    ref = -torch.rand(4, 6, generator=generator) * 3                                  # [B, T]
    drifted = (ref + torch.randn(4, 6, generator=generator)).clamp(max=-1e-3)         # kl_ref well above 0.1
    mask = torch.ones(4, 6)
    logp = drifted.clone().requires_grad_(True)
    loss, _ = policy_loss_with_kl(logp, logp.detach(), ref, torch.zeros(4, 6), mask, kl_coef=alg.kl_coef,
                                  kl_kind=alg.kl_estimator, clip_low=alg.clip_low, clip_high=alg.clip_high,
                                  dual_clip=alg.dual_clip, agg=alg.loss_agg)
    loss.backward()
    assert logp.grad.abs().sum() > 0, "no gradient: nothing holds the shared weights near the start"
    stepped = drifted - 0.1 * logp.grad
    before = masked_mean(kl_estimate(drifted, ref, alg.kl_estimator), mask)
    assert masked_mean(kl_estimate(stepped, ref, alg.kl_estimator), mask) < before
