"""benchmarks/gpu_check.py's pieces that decide what the GPU comparison means: the seeded
multi-turn batch, the machine-independent weights, the fp32-master update and the comparison."""
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import gpu_check as G  # noqa: E402

SMALL = dict(G.QWEN2_190M, hidden_size=32, num_hidden_layers=1, intermediate_size=64, vocab_size=97,
             num_attention_heads=4, num_key_value_heads=2)


def small_model():
    from transformers import Qwen2Config, Qwen2ForCausalLM
    model = Qwen2ForCausalLM(Qwen2Config(**SMALL))
    G.seeded_init(model, 5)
    return model


def test_batch_is_seeded_and_shaped_like_multi_turn_rows():
    a, b = G.make_batch(97, 4, 512, seed=3), G.make_batch(97, 4, 512, seed=3)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["input_ids"], G.make_batch(97, 4, 512, seed=4)["input_ids"])
    mask, attn, adv = a["loss_mask"], a["attention_mask"], a["advantages"]
    assert ((mask == 1) <= (attn == 1)).all()            # policy tokens only inside the sequence
    assert (adv[mask == 0] == 0).all()
    turns = []
    for row in range(4):
        starts = int((mask[row, 1:] > mask[row, :-1]).sum() + (mask[row, 0] > 0))
        turns.append(starts)
        assert mask[row, :64].sum() == 0                 # the prompt is never trained on
        assert adv[row][mask[row] == 1].unique().numel() <= starts   # one advantage per turn
    assert min(turns) >= 3                               # several assistant turns per row
    assert attn.sum(dim=1).unique().numel() > 1          # rows of different lengths, right-padded


def test_seeded_weights_do_not_depend_on_transformers_init():
    torch.manual_seed(0)
    a = small_model()
    torch.manual_seed(1)   # transformers' own init draws from the global generator: ignored
    b = small_model()
    assert G.fingerprint(a) == G.fingerprint(b)
    norms = [p for n, p in a.named_parameters() if n.endswith("norm.weight")]
    assert norms and all((p == 1).all() for p in norms)


def test_bf16_update_steps_fp32_master_weights():
    model = small_model().to(torch.bfloat16)
    update = G.Update(model)
    assert update.master is not None and update.master[0].dtype == torch.float32
    batch = G.make_batch(97, 2, 64, seed=1)
    logp = G.score(model, batch)
    before = [m.clone() for m in update.master]
    out = G.train_step(model, update, batch, logp + 0.1, logp - 0.1)
    assert out["grad_norm"] > 0 and torch.isfinite(torch.tensor(out["loss"]))
    # AdamW's first step moves every weight with a gradient by about lr: below bf16's resolution
    # for most, so only the fp32 masters show it, and the bf16 weights are their rounding.
    moved = sum(int((m != b).sum()) for m, b in zip(update.master, before))
    assert moved > 0.5 * sum(m.numel() for m in before)
    assert all(torch.equal(p, m.to(torch.bfloat16)) for p, m in zip(update.params, update.master))
    assert G.Update(small_model()).master is None          # fp32: the optimizer steps the weights


def test_compare_is_zero_against_itself_and_flags_other_weights():
    numbers = {"weights": {"parameters": 10, "sum": 1.5, "sum_sq": 2.0}, "step_ms": {"median": 2.0},
               "first_step": {"loss": 0.5, "grad_norm": 2.0, "entropy": 3.0}}
    mask = torch.tensor([[0.0, 1.0, 1.0]])
    tensors = {"batch": {"loss_mask": mask}, "logp": torch.tensor([[9.0, -1.0, -2.0]]),
               "logp_after_step": torch.tensor([[0.0, -1.0, -2.0]])}
    same = G.compare(numbers, tensors, numbers, tensors)
    assert same["weights_match_reference"] and same["logp_abs_diff"]["max"] == 0 and same["loss_rel_diff"] == 0
    moved = {**tensors, "logp": torch.tensor([[0.0, -1.5, -2.0]])}   # position 0 is unmasked: ignored
    other = {**numbers, "weights": {**numbers["weights"], "sum": 1.6},
             "first_step": {**numbers["first_step"], "loss": 0.55}}
    diff = G.compare(other, moved, numbers, tensors)
    assert not diff["weights_match_reference"]
    assert diff["logp_abs_diff"]["max"] == pytest.approx(0.5) and diff["logp_abs_diff"]["mean"] == pytest.approx(0.25)
    assert diff["loss_rel_diff"] == pytest.approx(0.1)


def test_bad_arguments_name_the_flag():
    with pytest.raises(SystemExit, match="--models: unknown model 'gpt'"):
        G.main(["--models", "gpt"])
    with pytest.raises(SystemExit, match="--device cpu: the reference is float32 only"):
        G.main(["--dtype", "bfloat16"])


def test_decoupled_step_is_clipped_when_the_sampler_was_the_proximal_policy():
    """The async loss as the check runs it: with mu == pi_prox every importance weight is 1 and
    the update is `clipped`'s; with mu != pi_prox the weights leave 1, and where `clipped` would
    clip (ratio e^0.5 > 1 + 0.28 on positive advantages) the decoupled step does not."""
    batch = G.make_batch(97, 2, 64, seed=2)
    logp = G.score(small_model(), batch)
    old, ref = logp - 0.5, logp - 0.1

    def first_step(loss, prox):
        model = small_model()
        return G.train_step(model, G.Update(model), batch, old, ref, loss, prox)

    clipped, same = first_step("clipped", None), first_step("decoupled", old)
    assert same["loss"] == pytest.approx(clipped["loss"], rel=1e-6)
    assert same["grad_norm"] == pytest.approx(clipped["grad_norm"], rel=1e-5)
    assert same["is_weight_mean"] == pytest.approx(1.0)
    assert clipped["clip_fraction"] > 0
    off = first_step("decoupled", logp)          # pi_prox = the score; mu = logp - 0.5
    assert off["is_weight_mean"] == pytest.approx(float(torch.exp(torch.tensor(0.5))), rel=1e-5)
    assert off["clip_fraction"] == 0
    assert off["loss"] != pytest.approx(clipped["loss"], rel=1e-3)
