"""Scale-out: the placement plan and the data-parallel arithmetic (fast), and on a real local
Ray (slow): two ZeRO-3 ranks update exactly like one rank on the same global batch, every
engine holds the trainer's weights after a push, and a dead actor is named."""
from __future__ import annotations

import random
import socket

import pytest
import torch

from turnrl.algos import aggregate
from turnrl.config import Config, ConfigError
from turnrl.training.cluster import check_cluster, plan_placement, threads_per_actor, weight_sync_mode
from turnrl.training.workers import combine_rank_stats, normalizer, rank_rows, share_weight


# --------------------------------------------------------------------------- fast
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_weighted_shares_add_up_to_the_whole_batch_loss(agg):
    torch.manual_seed(0)
    loss_tokens = torch.randn(7, 9)
    mask = (torch.rand(7, 9) > 0.4).float()
    mask[3] = 0                                       # a row without policy tokens
    whole = aggregate(loss_tokens, mask, agg)
    for world in (1, 2, 3):
        parts = [rank_rows(torch.arange(7), r, world) for r in range(world)]
        assert sorted(torch.cat(parts).tolist()) == list(range(7))
        total = sum(share_weight(mask[p], mask, agg) * aggregate(loss_tokens[p], mask[p], agg) for p in parts)
        assert torch.allclose(total, whole, atol=1e-6), (agg, world)
    assert share_weight(mask[:0], mask[:0], agg) == 0.0 and normalizer(mask[3:4], agg) == 0.0


def test_rank_stats_combine_to_one_rank_view():
    ranks = [{"sum": {"loss": [0.25, 0.5]}, "max": {"ratio_max": [1.1, 1.0]}, "same": {"kl_ref": 0.1}},
             {"sum": {"loss": [0.75, 0.5]}, "max": {"ratio_max": [1.3, 0.9]}, "same": {"kl_ref": 0.1}}]
    assert combine_rank_stats(ranks) == {"loss": 1.0, "ratio_max": (1.3 + 1.0) / 2, "kl_ref": 0.1}


def test_placement_colocated_shares_bundles_and_separate_gives_each_actor_one():
    cfg = Config.model_validate({"algorithm": {"name": "ppo"}, "cluster": {
        "trainer_ranks": 2, "rollout_engines": 3, "trainer_gpus": 1, "engine_gpus": 1,
        "trainer_cpus": 2, "engine_cpus": 1}})
    bundles, slots = plan_placement(cfg)
    assert bundles == [{"CPU": 5, "GPU": 1}, {"CPU": 5, "GPU": 1}, {"CPU": 1, "GPU": 1}]
    by_bundle = {b: sorted(s.name for s in slots if s.bundle == b) for b in range(3)}
    assert by_bundle[0] == ["critic rank 0", "policy rank 0", "rollout engine 0"]
    assert all(s.gpus == pytest.approx(1 / 3) for s in slots if s.bundle < 2)   # one device, three actors

    separate = cfg.model_copy(update={"cluster": cfg.cluster.model_copy(update={"placement": "separate"})})
    bundles, slots = plan_placement(separate)
    assert len(bundles) == len(slots) == 7 and len({s.bundle for s in slots}) == 7
    assert {s.gpus for s in slots} == {1}
    assert weight_sync_mode(separate) == "nccl" and weight_sync_mode(cfg) == "object_store"


def test_cluster_params_that_cannot_work_fail_before_anything_starts():
    ok = Config.model_validate({"cluster": {"trainer_ranks": 2}, "train": {"prompts_per_step": 1}, "rollout": {"n": 2}})
    check_cluster(ok)
    with pytest.raises(ConfigError, match="cluster.trainer_ranks = 4"):
        check_cluster(Config.model_validate({"cluster": {"trainer_ranks": 4}, "train": {"prompts_per_step": 1},
                                             "rollout": {"n": 2}}))
    with pytest.raises(ConfigError, match="GPUs"):
        check_cluster(Config.model_validate({"cluster": {"weight_sync": "nccl"}}))
    with pytest.raises(ConfigError, match="one GPU"):
        check_cluster(Config.model_validate({"cluster": {"weight_sync": "nccl", "trainer_gpus": 1, "engine_gpus": 1}}))
    cfg = Config.model_validate({"cluster": {"trainer_ranks": 2, "rollout_engines": 1, "num_cpus": 4}})
    slot = plan_placement(cfg)[1][0]
    assert threads_per_actor(cfg, slot) == 2
    overlap = Config.model_validate({"cluster": {"num_cpus": 4}, "train": {"overlap_rollout": True}})
    assert threads_per_actor(overlap, plan_placement(overlap)[1][0]) == 2    # trainer and engine busy at once
    asynchronous = Config.model_validate({"cluster": {"num_cpus": 4}, "train": {"mode": "async"},
                                          "algorithm": {"policy_loss": "decoupled"}})
    assert threads_per_actor(asynchronous, plan_placement(asynchronous)[1][0]) == 2   # so in async too
    assert threads_per_actor(cfg.model_copy(update={"train": asynchronous.train}), slot) == 1   # 4 // (2 + 1)
    with pytest.raises(ConfigError, match="overlap_rollout"):
        check_cluster(Config.model_validate({"train": {"overlap_rollout": True},
                                             "cluster": {"trainer_gpus": 1, "engine_gpus": 1}}))


# --------------------------------------------------------------------------- on a real local Ray
def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ray_session(tmp_path_factory):
    import tempfile

    import os

    import ray
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")       # as start_ray does for a local Ray
    ray_tmp = tempfile.mkdtemp(prefix="ray", dir="/tmp")   # short: Ray's socket paths have a length limit
    ray.init(num_cpus=2, include_dashboard=False, _temp_dir=ray_tmp,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    yield
    ray.shutdown()


CFG = {"train": {"zero_stage": 3, "lr": 1e-3}, "algorithm": {"mini_batches": 2, "entropy_coef": 0.01}}


def _trainers(model_dir, world_size: int):
    import ray

    from turnrl.training.cluster import TrainerGroup
    from turnrl.training.workers import PolicyWorker, TrainerParams
    params, port = TrainerParams.of(Config.model_validate(CFG)), _port()
    actor = ray.remote(num_cpus=0.25)(PolicyWorker).options(runtime_env={"env_vars": {"DS_ACCELERATOR": "cpu"}})
    handles = [actor.remote(str(model_dir), params, rank=r, world_size=world_size, master_port=port)
               for r in range(world_size)]
    return TrainerGroup([f"policy rank {r}" for r in range(world_size)], handles)


def _batch(seed: int, rows: int = 6, length: int = 14) -> dict[str, torch.Tensor]:
    """A rollout-like batch: prompts, then policy tokens of varied lengths with advantages."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 200, (rows, length), generator=g)     # within the tiny vocabulary
    mask = torch.zeros(rows, length)
    for r in range(rows):
        mask[r, 5:5 + int(torch.randint(2, length - 5, (1,), generator=g))] = 1
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": mask,
            "engine_logprobs": torch.zeros(rows, length), "turn_ids": torch.zeros(rows, length, dtype=torch.long),
            "advantages": torch.randn(rows, 1, generator=g).expand(rows, length) * mask}


@pytest.fixture(scope="module")
def two_ranks_trained(ray_session, tiny_model_dir):
    """Three steps on the same batches: one rank, and two ZeRO-3 ranks (each trains on half
    of every mini-batch)."""
    one, two = _trainers(tiny_model_dir, 1), _trainers(tiny_model_dir, 2)
    history = {1: [], 2: []}
    for step in range(1, 4):
        batch = _batch(step)
        for world, group in ((1, one), (2, two)):
            history[world].append(group.train(batch, step)[0])
    return one, two, history


@pytest.mark.slow
def test_two_zero3_ranks_update_like_one_rank_on_the_same_global_batch(two_ranks_trained, tiny_model_dir):
    one, two, history = two_ranks_trained
    for a, b in zip(history[1], history[2]):
        for key in ("loss", "entropy", "grad_norm", "clip_fraction"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), key
        # kl_ref is a small mean (~0.014) of functions of logprob differences (logprobs ~ -5): float32
        # sums over other batch shapes move it by ~1e-7 absolute per logprob, which is 2e-5 of it (seen:
        # 0.0143207 against 0.0143210 on one CPU, the same on every rerun); 2e-6 absolute still fails a
        # rank that left out or double-counted any token
        assert b["kl_ref"] == pytest.approx(a["kl_ref"], abs=2e-6), "kl_ref"
    w1 = one.results("named_weights")[0]
    w2, w2_rank1 = two.results("named_weights")
    from safetensors.torch import load_file
    initial = load_file(tiny_model_dir / "model.safetensors")
    # fp32: the ranks sum in another order, and Adam turns that noise on near-zero gradients
    # (k_proj.bias has none in exact arithmetic; the embedding rows of tokens no batch holds) into
    # single elements off by up to 1e-4 on some CPUs (3e-6 on others) over 3 steps. So each tensor's
    # update is compared as a whole: the two ranks' update differs from one rank's by under 2% of
    # its size (a rank that trained on the wrong rows, or twice, differs by tens of percent)
    assert min(float((w1[k] - initial[k]).abs().max()) for k in initial) > 1e-3
    for k in w1:
        assert torch.equal(w2[k], w2_rank1[k])                                 # ZeRO-3 gathers one model
        start = initial[k] if k in initial else initial["model.embed_tokens.weight"]   # lm_head: tied to it
        moved = float((w1[k] - start).norm())
        assert float((w2[k] - w1[k]).norm()) < 0.02 * moved, (k, float((w2[k] - w1[k]).norm()) / moved)


@pytest.mark.slow
def test_every_engine_has_the_trainers_weights_after_a_push(two_ranks_trained, tiny_model_dir, tmp_path):
    import ray

    from turnrl.rollout.engines import cpu_env_defaults
    from turnrl.training.cluster import ActorFailure, ObjectStoreSync, RolloutGroup
    from turnrl.training.rollout_worker import RolloutWorker
    from turnrl.training.workers import RolloutParams
    _, trainer, _ = two_ranks_trained
    cfg = Config.model_validate({**CFG, "rollout": {"max_tokens_per_turn": 12, "max_tokens_total": 30}})
    (tmp_path / "data").mkdir()
    actor = ray.remote(num_cpus=0.25)(RolloutWorker).options(runtime_env={"env_vars": cpu_env_defaults(1.0)})
    engines = RolloutGroup(["rollout engine 0", "rollout engine 1"],
                           [actor.remote(str(tiny_model_dir), RolloutParams.of(cfg), str(tmp_path / "data"))
                            for _ in range(2)], seed=0)
    probe = _batch(99)
    sequences = probe["input_ids"].tolist()
    mask = probe["attention_mask"].clone().float()
    mask[:, 0] = 0                                               # no logprob for the first token

    def gaps() -> list[float]:
        ours = trainer.results("logprobs", probe)[0]
        return [float(((torch.tensor(theirs) - ours).abs() * mask).max())
                for theirs in engines.results("prompt_logprobs", sequences)]

    assert min(gaps()) > 1e-3                                   # engines still hold the initial weights
    ObjectStoreSync(trainer, engines, bucket_mb=1).push()      # several buckets for a 4 MB model
    after = gaps()
    assert max(after) < 1e-4, after                             # fp32 noise on both engines

    # each engine's sampling is a function of its generator seed, whatever it did before
    examples = [{"prompt": "Compute 12 * 34.", "answer": "408"}]
    first = engines.results("rollout", examples, 2, generator_seed=7)
    engines.results("rollout", examples, 2, generator_seed=8)
    again = engines.results("rollout", examples, 2, generator_seed=7)
    ids = lambda part: [t.response_ids for t in part]  # noqa: E731
    assert ids(first[0]) == ids(first[1]) == ids(again[0]) == ids(again[1])

    # an engine that dies stops the next call with its name
    ray.kill(engines.handles[1], no_restart=True)
    with pytest.raises(ActorFailure, match="rollout engine 1 failed: .*(Actor|actor)"):
        engines.rollout(examples, 2, step=1)


def test_the_gpu_preset_asks_for_eight_gpus_and_nccl():
    from turnrl import presets
    from turnrl.config import load_config
    root = __import__("pathlib").Path(__file__).resolve().parents[1]
    keys = presets.load("gpu_8", root / "params.yaml", folder=root / "configs")
    cfg = load_config(root / "params.yaml", [f"{k}={v}" for k, v in keys.items()])
    check_cluster(cfg)
    bundles, slots = plan_placement(cfg)
    assert sum(b.get("GPU", 0) for b in bundles) == 8 and weight_sync_mode(cfg) == "nccl"
    assert cfg.train.zero_stage == 3 and cfg.rollout.engine == "vllm"


def test_rendezvous_port_is_free_and_outside_the_kernels_ephemeral_range():
    """Ports from the ephemeral range can be handed to another process between choosing one and
    rank 0 binding it (EADDRINUSE in CI); Ray's worker ports end at 19999."""
    from pathlib import Path

    from turnrl.training.cluster import rendezvous_port
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = {rendezvous_port() for _ in range(20)}
    assert all(20000 <= p < low for p in ports) and len(ports) > 1
    for port in ports:
        with socket.socket() as s:
            s.bind(("", port))
    # runs that seeded Python's generator alike (the rollout worker seeds it) still pick apart
    random.seed(0)
    first = [rendezvous_port() for _ in range(5)]
    random.seed(0)
    assert [rendezvous_port() for _ in range(5)] != first
