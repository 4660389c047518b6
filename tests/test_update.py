"""The policy update's forward passes (in this process, world size 1, real DeepSpeed): with
one epoch of one mini-batch it does not score the batch a second time for the old logprobs,
and logprobs handed in (MLMT computes them first) replace its own; either way the update and
its stats are the ones of the plain path."""
import math
import socket

import pytest
import torch

from turnrl.config import Config


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _batch(rows: int = 6, length: int = 16) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 200, (rows, length), generator=g)
    mask = torch.zeros(rows, length)
    for r in range(rows):
        mask[r, 6:6 + 2 + r] = 1
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": mask,
            "turn_ids": torch.zeros(rows, length, dtype=torch.long),
            "advantages": torch.randn(rows, 1, generator=g).expand(rows, length) * mask}


def test_packed_weights_come_back_bit_identical_whatever_the_dtype_and_shape():
    from turnrl.training.workers import ALIGN, pack_tensors, unpack_tensors
    g = torch.Generator().manual_seed(0)
    named = [("embed.weight", torch.randn(7, 5, generator=g)),
             ("norm.weight", torch.randn(3, generator=g).to(torch.bfloat16)),   # 6 bytes: the next one is realigned
             ("scale", torch.randn((), generator=g, dtype=torch.float64)),
             ("empty", torch.zeros(0, 4)),
             ("lm_head.weight", torch.randn(5, 7, generator=g).t())]            # not contiguous
    array, index = pack_tensors(named)
    assert array.dtype.name == "uint8" and all(start % ALIGN == 0 for *_, start, _ in index)
    array.setflags(write=False)   # as the object store hands it over
    back = list(unpack_tensors((array, index)))
    assert [name for name, _ in back] == [name for name, _ in named]
    for (_, want), (_, got) in zip(named, back):
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)


def test_the_learning_rate_warms_up_then_follows_its_schedule_to_the_floor():
    from turnrl.training.workers import lr_factor
    assert [lr_factor(k, 2, 10, "constant", 0.0) for k in range(4)] == pytest.approx([1 / 3, 2 / 3, 1, 1])
    assert [lr_factor(k, 0, 4, "linear", 0.0) for k in range(4)] == pytest.approx([1, 0.75, 0.5, 0.25])
    # cosine to a floor of 0.1 over 4 steps after a warmup of 2: halfway down at its third step
    cosine = [lr_factor(k, 2, 6, "cosine", 0.1) for k in range(6)]
    assert cosine[:3] == pytest.approx([1 / 3, 2 / 3, 1.0])
    assert cosine[4] == pytest.approx(0.1 + 0.9 * 0.5)
    assert cosine[5] == pytest.approx(0.1 + 0.9 * (1 + math.cos(0.75 * math.pi)) / 2)
    assert lr_factor(99, 2, 6, "cosine", 0.1) == pytest.approx(0.1)   # a resume with more steps stays at the floor


class Counting:
    """Counts calls of a worker's no-grad scoring methods."""

    def __init__(self, worker):
        self.calls = {"old": 0, "ref": 0}
        for name, key in (("_logprobs", "old"), ("_reference_logprobs", "ref")):
            inner = getattr(worker, name)

            def counted(batch, inner=inner, key=key):
                self.calls[key] += 1
                return inner(batch)
            setattr(worker, name, counted)


def _weights(worker) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in worker.named_weights().items()}


@pytest.fixture(scope="module")
def workers(tiny_model_dir):
    """Two policies from the same start, each trained for two steps on the same batches: one
    takes the on-policy shortcut, the other is handed the old and reference logprobs of the
    whole batch (what a separate forward returns: the path of several epochs or mini-batches)."""
    from turnrl.training.workers import PolicyWorker, TrainerParams, combine_rank_stats
    cfg = Config.model_validate({"train": {"lr": 1e-2, "steps": 4, "lr_schedule": "linear"},
                                 "algorithm": {"kl_coef": 0.05, "entropy_coef": 0.01}})
    out = {}
    for name in ("shortcut", "handed_in"):
        worker = PolicyWorker(str(tiny_model_dir), TrainerParams.of(cfg), master_port=_port())
        counting = Counting(worker)
        stats = []
        for step in (1, 2):
            batch = _batch()
            batch["engine_logprobs"] = worker.logprobs(batch) + 0.01 * batch["loss_mask"]   # a small known gap
            if name == "handed_in":
                batch["old_logprobs"] = worker.logprobs(batch)
                batch["ref_logprobs"] = worker.reference_logprobs(batch)
            counting.calls = {"old": 0, "ref": 0}
            stats.append(combine_rank_stats([worker.train(batch, step)]))
        out[name] = {"stats": stats, "calls": counting.calls, "weights": _weights(worker)}
    return out


@pytest.mark.slow
def test_on_policy_update_runs_no_separate_old_logprob_forward(workers):
    assert workers["shortcut"]["calls"] == {"old": 0, "ref": 1}
    assert workers["handed_in"]["calls"] == {"old": 0, "ref": 0}   # both handed in: nothing scored twice


@pytest.mark.slow
def test_shortcut_and_handed_in_logprobs_give_the_same_update_and_stats(workers, tiny_model_dir):
    from safetensors.torch import load_file
    a, b = workers["shortcut"], workers["handed_in"]
    initial = load_file(tiny_model_dir / "model.safetensors")
    assert max(float((a["weights"][k] - initial[k]).abs().max()) for k in initial) > 1e-3   # it trained
    for k in a["weights"]:
        assert torch.allclose(a["weights"][k], b["weights"][k], atol=1e-6, rtol=0), k
    for sa, sb in zip(a["stats"], b["stats"]):
        for key in ("loss", "entropy", "kl_ref", "logp_gap_max", "grad_norm", "clip_fraction"):
            assert sa[key] == pytest.approx(sb[key], rel=1e-5, abs=1e-7), key
        assert sa["logp_gap_max"] == pytest.approx(0.01, abs=1e-5)    # the gap put into engine_logprobs
    assert abs(a["stats"][0]["kl_ref"]) < 1e-7 < a["stats"][1]["kl_ref"]
    # train.lr_schedule linear over train.steps 4: DeepSpeed stepped the schedule at each update
    assert [st["lr"] for st in a["stats"]] == pytest.approx([1e-2, 0.75e-2])


def test_a_run_s_optimizer_steps_are_its_steps_epochs_and_mini_batches():
    """What a decaying learning rate spreads over (sft: one optimizer step per sft step)."""
    from turnrl.training.workers import TrainerParams
    cfg = Config.model_validate({"train": {"steps": 3}, "algorithm": {"epochs": 2, "mini_batches": 4}})
    assert TrainerParams.of(cfg).optimizer_steps == 24


@pytest.mark.slow
def test_several_epochs_still_score_the_old_policy_once_before_the_update(tiny_model_dir):
    from turnrl.training.workers import PolicyWorker, TrainerParams, combine_rank_stats
    cfg = Config.model_validate({"algorithm": {"epochs": 2}})
    worker = PolicyWorker(str(tiny_model_dir), TrainerParams.of(cfg), master_port=_port())
    counting = Counting(worker)
    batch = _batch()
    batch["engine_logprobs"] = worker.logprobs(batch)
    counting.calls = {"old": 0, "ref": 0}
    stats = combine_rank_stats([worker.train(batch, 1)])
    assert counting.calls == {"old": 1, "ref": 1}
    assert stats["logp_gap_max"] < 1e-5 and stats["ratio_max"] > 1.0   # the second epoch is off-policy


@pytest.mark.slow
def test_overlapped_rollouts_train_on_batches_one_update_old(tiny_model_dir, tmp_path):
    """train.overlap_rollout through the real loop (Ray, DeepSpeed, vLLM): step 1's batch
    comes from the weights the trainer holds; step 2's was sampled during update 1, by the
    starting weights, so the trainer's logprobs have moved away from the engine's; the run
    ends with the configured steps and a saved model."""
    from conftest import train_two_steps
    # the untrained model earns no reward (zero advantages): the entropy bonus moves the weights
    history = train_two_steps(tiny_model_dir, tmp_path, {"name": "code_tool"}, {"name": "grpo", "entropy_coef": 0.5},
                              train={"overlap_rollout": True, "lr": 2e-2})
    assert history[0]["logp_gap_max"] < 1e-4
    assert history[1]["logp_gap_max"] > 1e-2
    assert all(h["trained_tokens"] > 0 for h in history)
    assert (tmp_path / "final" / "model.safetensors").exists()


def test_engine_gap_is_not_measured_without_fresh_tokens():
    """An asynchronous batch whose tokens all came from older weights has no token to compare
    engine and trainer on: the gap is NaN (not measured), not 0 (a perfect match); kl_ref stays."""
    from types import SimpleNamespace

    from turnrl.training.workers import PolicyWorker
    me = SimpleNamespace(params=Config.model_validate({}))
    logp, engine = torch.tensor([[-1.0, -2.0, -3.0]]), torch.tensor([[-1.5, -2.0, -3.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    fresh = PolicyWorker._sampling_stats(me, logp, logp, engine, mask)
    assert fresh["logp_gap_max"] == pytest.approx(0.5) and fresh["logp_gap_mean"] == pytest.approx(0.25)
    none = PolicyWorker._sampling_stats(me, logp, logp, engine, mask, gap_mask=torch.zeros_like(mask))
    assert all(none[k] != none[k] for k in ("logp_gap_max", "logp_gap_mean", "logp_gap_p99"))   # NaN
    assert none["kl_ref"] == fresh["kl_ref"] == 0.0
    # a mini-batch share without policy tokens adds 0 to the sums and maxes; a real NaN (kl_ref of a
    # diverged policy) is not turned into 0 on the way
    share = PolicyWorker._sampling_stats(me, logp, logp, engine, torch.zeros_like(mask), no_tokens=0.0)
    assert share["logp_gap_max"] == share["logp_gap_mean"] == share["logp_gap_p99"] == 0.0
    bad = PolicyWorker._sampling_stats(me, logp, torch.full_like(logp, math.nan), engine, mask, no_tokens=0.0)
    assert bad["kl_ref"] != bad["kl_ref"]


def test_micro_batches_group_rows_of_like_length_and_cut_the_padding():
    from turnrl.training.workers import micro_batch_count, micro_batches, take_rows
    lengths = [5, 2, 7, 2, 4]
    attention = torch.tensor([[1] * n + [0] * (8 - n) for n in lengths])
    parts = micro_batches(attention, 3)
    assert [(idx.tolist(), width) for idx, width in parts] == [([1, 3], 2), ([4, 0], 5), ([2], 7)]
    assert [(idx.tolist(), width) for idx, width in micro_batches(attention, 0)] == [([0, 1, 2, 3, 4], 8)]
    batch = {"attention_mask": attention, "loss_mask": attention.float(), "reward": torch.arange(5.0),
             "other": torch.zeros(5, 3)}   # [B] and a [B, K] that is not token-aligned: rows only
    part = take_rows(batch, *parts[1])
    assert part["attention_mask"].shape == (2, 5) and part["reward"].tolist() == [4.0, 0.0]
    assert part["other"].shape == (2, 3)
    # every rank makes as many passes (ZeRO-3 gathers weights in each), none of them empty
    assert micro_batch_count(128, 1, 32) == 4 and micro_batch_count(32, 1, 32) == 1
    assert micro_batch_count(65, 2, 32) == 2       # shares of 33 and 32 rows: two passes each
    assert micro_batch_count(5, 2, 1) == 2         # shares of 3 and 2 rows: not 3 passes, one would be empty
    assert micro_batch_count(128, 4, 0) == 0       # 0: the whole share in one pass


@pytest.mark.slow
@pytest.mark.parametrize("zero_stage", [0, 2])
def test_micro_batched_update_is_the_whole_mini_batch_update(tiny_model_dir, zero_stage):
    """train.micro_batch_rows splits each mini-batch into passes whose gradients accumulate into
    one optimizer step: the weights, the stats and the scored logprobs are those of one pass over
    the whole mini-batch (to float rounding) on every attended token."""
    from turnrl.training.workers import PolicyWorker, TrainerParams, combine_rank_stats
    rows, length = 10, 24
    batch = _batch(rows, length)
    lengths = torch.tensor([10, 24, 14, 17, 12, 24, 9, 20, 16, 15])
    batch["attention_mask"] = (torch.arange(length) < lengths[:, None]).long()
    batch["loss_mask"] = batch["loss_mask"] * batch["attention_mask"]
    batch["advantages"] = batch["advantages"] * batch["attention_mask"]
    out = {}
    for micro in (0, 3):
        cfg = Config.model_validate({"train": {"lr": 1e-2, "zero_stage": zero_stage, "micro_batch_rows": micro},
                                     "algorithm": {"mini_batches": 2, "kl_coef": 0.05, "entropy_coef": 0.01}})
        worker = PolicyWorker(str(tiny_model_dir), TrainerParams.of(cfg), master_port=_port())
        scored = worker.logprobs(batch)
        step_batch = {**batch, "engine_logprobs": scored + 0.01 * batch["loss_mask"]}
        stats = combine_rank_stats([worker.train(step_batch, 1)])
        out[micro] = {"scored": scored, "stats": stats, "weights": _weights(worker)}
    whole, split = out[0], out[3]
    attended = batch["attention_mask"].bool()
    assert torch.allclose(whole["scored"][attended], split["scored"][attended], atol=1e-5)
    start = _weights(PolicyWorker(str(tiny_model_dir), TrainerParams.of(Config.model_validate({})),
                                  master_port=_port()))
    # Adam's steps are about lr whatever the gradient's size, so the float rounding of tiny gradients shows at
    # that scale: compare what the update did as a whole, the direction and length of the weights' move
    moves = [torch.cat([(run["weights"][k] - start[k]).flatten() for k in start]) for run in (whole, split)]
    assert float(moves[0].abs().max()) > 1e-3   # it trained
    assert float(torch.nn.functional.cosine_similarity(*moves, dim=0)) > 0.9999
    assert float(moves[1].norm() / moves[0].norm()) == pytest.approx(1.0, abs=1e-3)
    for key in ("loss", "entropy", "kl_ref", "logp_gap_max", "grad_norm", "ratio_max", "clip_fraction"):
        assert whole["stats"][key] == pytest.approx(split["stats"][key], rel=1e-4, abs=1e-6), key


def test_the_micro_batch_benchmark_batch_is_right_padded_and_its_micro_batches_are_narrower():
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from micro_batch import batch

    from turnrl.training.workers import micro_batch_count, micro_batches
    data = batch(128, 60, 220)
    lengths = data["attention_mask"].sum(-1)
    assert data["input_ids"].shape == (128, 220) and 60 <= int(lengths.min()) and int(lengths.max()) <= 220
    assert (data["attention_mask"].cumsum(-1) == torch.minimum(torch.arange(1, 221), lengths[:, None])).all()
    assert (data["loss_mask"] <= data["attention_mask"]).all() and (data["loss_mask"].sum(-1) > 0).all()
    parts = micro_batches(data["attention_mask"], micro_batch_count(128, 1, 32))
    assert [len(idx) for idx, _ in parts] == [32] * 4
    assert [width for _, width in parts] == sorted(width for _, width in parts) and parts[0][1] < 120
