"""A second trained model for the high level (`levels.high_model: separate`; math_refine's
feedback turns): config, placement, per-level masks and KL, and (slow) the real stack training
one level only."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from turnrl.algos.hierarchy import prepare
from turnrl.algos.registry import Scorer
from turnrl.config import Config, ConfigError, parse_config
from turnrl.training.folders import high_level_folder
from turnrl.training.cluster import check_cluster, plan_placement
from turnrl.training.loop import HIGH_LEVEL, level_mask, train_levels, trained_level


def _cfg(**levels) -> Config:
    return Config.model_validate({"env": {"name": "math_refine"}, "levels": {"high_model": "separate", **levels}})


# ----------------------------------------------------------------------------- config and plan
def test_level_keys_are_validated():
    assert _cfg().levels.high_model_path == ""
    with pytest.raises(ConfigError, match="high_model_path.*needs high_model: separate"):
        parse_config({"env": {"name": "math_refine"}, "levels": {"high_model_path": "other/"}})
    with pytest.raises(ConfigError, match="alternate"):
        parse_config({"levels": {"alternate": [1]}})
    # the old keys say where they went
    with pytest.raises(ConfigError, match="env.math_refine moved to env.options.*levels section"):
        parse_config({"env": {"name": "math_refine", "math_refine": {"feedback": "model"}}})
    with pytest.raises(ConfigError, match="feedback: model moved.*levels.high_model: separate"):
        parse_config({"env": {"name": "math_refine", "options": {"feedback": "model"}}})


def test_the_feedback_model_gets_as_many_trainer_ranks_as_the_solver():
    cfg = _cfg().model_copy(deep=True)
    cfg.cluster.trainer_ranks, cfg.cluster.rollout_engines = 2, 2
    _, slots = plan_placement(cfg)
    names = sorted(s.name for s in slots)
    assert names == ["high rank 0", "high rank 1", "policy rank 0", "policy rank 1",
                     "rollout engine 0", "rollout engine 1"]   # each engine actor also holds the feedback model's
    assert {s.name for s in slots if s.bundle == 0} == {"high rank 0", "policy rank 0", "rollout engine 0"}
    nccl = cfg.model_copy(deep=True)
    nccl.cluster.weight_sync, nccl.cluster.engine_gpus, nccl.cluster.trainer_gpus = "nccl", 1, 1
    nccl.cluster.placement = "separate"
    with pytest.raises(ConfigError, match="levels.high_model: separate use cluster.weight_sync: object_store"):
        check_cluster(nccl)


def test_the_feedback_model_needs_the_solvers_tokenizer(tiny_model_dir, tmp_path):
    from turnrl.models.tiny import build_tokenizer
    assert high_level_folder(_cfg().levels.high_model_path, tiny_model_dir) == str(tiny_model_dir)   # empty: the solver's start
    same = _cfg(high_model_path=str(tiny_model_dir))
    assert high_level_folder(same.levels.high_model_path, tiny_model_dir) == str(tiny_model_dir)
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text((Path(tiny_model_dir) / "config.json").read_text())
    build_tokenizer(["completely different text 0123456789"] * 4, 300).save_pretrained(other)
    with pytest.raises(ValueError, match="tokenizer .* is not the policy's"):
        high_level_folder(str(other), tiny_model_dir)


# ----------------------------------------------------------------------------- masks and KL
def test_each_level_trains_its_own_turns_and_a_frozen_level_is_not_called():
    turn_ids = torch.tensor([[-1, 0, 0, 1, 1, 2, -1]])
    high = torch.tensor([[0, 0, 0, 1, 1, 0, 0]], dtype=torch.bool)   # turn 1 (and its observation) is high
    loss_mask = torch.tensor([[0., 1, 0, 1, 0, 1, 0]])   # 0s: prompt, observations, padding
    assert level_mask(high, "high").tolist() == [[0, 0, 0, 1, 1, 0, 0]]
    assert (level_mask(high, "low") * loss_mask).tolist() == [[0, 1, 0, 0, 0, 1, 0]]
    assert level_mask(high, "both").tolist() == [[1] * 7]
    # alternate: [1, 2]: step 1 trains the high level, steps 2 and 3 the low, then again
    alternate = _cfg(alternate=[1, 2]).levels
    assert [trained_level(alternate, step) for step in range(1, 7)] == ["high", "low", "low", "high", "low", "low"]
    assert trained_level(_cfg(train="low").levels, 1) == "low"

    class Group:   # records what the loop hands a trainer group (stands in for the Ray actors)
        def __init__(self, gap):
            self.masks, self.gap = [], gap

        def train(self, batch, step):
            self.masks.append(batch["loss_mask"].tolist())
            return {"logp_gap_max": self.gap, "loss": 1.0}, [0.5]

    class Workers:
        def __init__(self):
            self.policy, self.high, self.sync, self.high_sync = Group(1e-5), Group(2e-5), "low sync", "high sync"

    batch = {"turn_ids": turn_ids, "high": high, "loss_mask": loss_mask}
    w = Workers()
    stats, busy, pushes = train_levels(_cfg(train="high").levels, w, batch, step=1)
    assert w.policy.masks == [] and w.high.masks == [[[0, 0, 0, 1, 0, 0, 0]]]   # the solver is not called
    assert pushes == ["high sync"] and stats == {"high_logp_gap_max": 2e-5, "high_loss": 1.0, "logp_gap_max": 2e-5}
    w = Workers()
    stats, busy, pushes = train_levels(_cfg().levels, w, batch, step=1)
    assert w.policy.masks == [[[0, 1, 0, 0, 0, 1, 0]]] and w.high.masks == [[[0, 0, 0, 1, 0, 0, 0]]]
    assert pushes == ["low sync", "high sync"] and busy == [0.5, 0.5] and stats["logp_gap_max"] == 2e-5


def test_the_feedback_turns_kl_is_the_feedback_models_own():
    """Turn KL_k = Σ over turn k's policy tokens of (logp − logp_ref): turns 0 and 2 from the
    solver's pair, turn 1 from the feedback model's pair."""
    cfg = _cfg().model_copy(update={"algorithm": Config.model_validate(
        {"algorithm": {"name": "mlmt", "mlmt_betas": [0.1, 0.2, 0.3]}}).algorithm})
    batch = {"turn_ids": torch.tensor([[-1, 0, 0, 1, 1, 2]]), "loss_mask": torch.tensor([[0., 1, 0, 1, 1, 1]]),
             "high": torch.tensor([[0, 0, 0, 1, 1, 0]], dtype=torch.bool)}
    const = lambda value: (lambda b: torch.full(b["turn_ids"].shape, value))   # noqa: E731
    extra, stats = prepare([], batch, Scorer(const(-1.0), const(-1.5), high=(const(-2.0), const(-4.0))),
                           cfg.algorithm)
    # solver: -1 - (-1.5) = 0.5 per token: turn 0 one token -> 0.5, turn 2 one token -> 0.5
    # feedback model: -2 - (-4) = 2 per token, two tokens -> 4
    assert extra["turn_kl"].tolist() == [[0.5, 4.0, 0.5]]
    assert stats["mlmt_turn2_kl_mean"] == 4.0


def test_the_evaluation_plays_the_feedback_turns_on_the_second_model(tmp_path, tiny_model_dir, monkeypatch):
    from transformers import AutoTokenizer

    from conftest import ScriptedEngine
    from turnrl.pipeline.evaluate import evaluate
    from turnrl.pipeline.preprocess import preprocess
    monkeypatch.delenv("TURNRL_DATA_DIR", raising=False)
    cfg = Config.model_validate({"env": {"name": "math_refine"}, "levels": {"high_model": "separate"},
                                 "data": {"train_examples": 8, "heldout_examples": 4},
                                 "eval": {"benchmarks": [], "temperature": 0.0},
                                 "rollout": {"max_tokens_total": 2000}})   # the tiny tokenizer spends many tokens on the requests
    preprocess(cfg, tmp_path / "data")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    low = ScriptedEngine(tokenizer, ["<answer>-1</answer>", "<answer>-2</answer>"])
    high = ScriptedEngine(tokenizer, ["<feedback>check it</feedback>"])
    task = evaluate(cfg, {"low": low, "high": high}, tokenizer, tmp_path / "data", tmp_path / "eval")["task"]
    assert len(low.calls) == 2 and len(high.calls) == 1 and task["n"] == 4 and task["mean_turns"] == 3.0


# ----------------------------------------------------------------------------- the real stack
def _weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "model.safetensors"))


def quick_solver(model_dir: Path, out: Path) -> Path:
    """A copy of the untrained tiny model that ends every turn at once with the end-of-turn
    token, so that every trajectory reaches the feedback turn (the untrained model rambles past
    any per-turn budget). Its last layer writes one large constant into the residual stream (a
    value bias: attention weights sum to 1, so it comes out whatever the input) and the eos
    row of the output layer points along the normed constant."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    last = model.model.layers[-1]
    with torch.no_grad():
        last.mlp.down_proj.weight.zero_()
        last.self_attn.v_proj.weight.zero_()
        last.self_attn.v_proj.bias.copy_(10 * torch.randn(last.self_attn.v_proj.bias.shape,
                                                          generator=torch.Generator().manual_seed(0)))
        ids = torch.tensor([tokenizer("Compute 1 + 2.", add_special_tokens=False)["input_ids"]])
        normed = model(ids, output_hidden_states=True).hidden_states[-1][0, -1]
        model.lm_head.weight[tokenizer.eos_token_id] = 50 * normed / normed.norm()
        assert int(model(ids).logits[0, -1].argmax()) == tokenizer.eos_token_id
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


@pytest.mark.slow
def test_a_second_model_trains_the_feedback_level_while_the_solver_stays(tiny_model_dir, tmp_path):
    """Two steps on Ray + DeepSpeed + vLLM with levels high_model: separate and train: high (an
    entropy bonus moves the trained model: the untrained tiny model earns no reward). The
    solver (`quick_solver`) and the feedback model (the untrained tiny model) start apart.
    The solver's final weights are byte-equal to its start, the feedback model's are not; at
    step 2 the feedback model's engine samples with its trainer's new weights (the push
    reached it, and only it: the solver's engine holds its own weights, or the gap would show)."""
    import ray

    from turnrl.pipeline.preprocess import load_split, preprocess
    from turnrl.training.checkpoint import CheckpointStore
    from turnrl.training.loop import train
    cfg = Config.model_validate({
        "env": {"name": "math_refine"}, "levels": {"high_model": "separate", "train": "high"},
        "algorithm": {"name": "grpo", "entropy_coef": 0.1},
        "data": {"train_examples": 16, "heldout_examples": 8}, "eval": {"benchmarks": []},
        "train": {"steps": 2, "prompts_per_step": 2, "lr": 1e-2},
        # the tiny tokenizer spends ~1 token per character on the English requests: room for all three turns
        "rollout": {"n": 2, "max_tokens_per_turn": 12, "max_tokens_total": 600}})
    preprocess(cfg, tmp_path / "data")
    solver = quick_solver(tiny_model_dir, tmp_path / "solver")
    cfg.levels.high_model_path = str(tiny_model_dir)
    store = CheckpointStore(tmp_path / "checkpoints", "two-models", keep=1)
    try:
        history = train(cfg, str(solver), str(tmp_path / "data"), load_split(tmp_path / "data", "train"),
                        str(tmp_path / "final"), checkpoints=store)
    finally:
        ray.shutdown()
    first, second = history
    assert first["turns_mean"] >= 2 and second["turns_mean"] >= 2, history   # every trajectory has a feedback turn
    assert "loss" not in first and "high_loss" in first          # only the feedback model trained
    assert abs(first["high_kl_ref"]) < 1e-6 and second["high_kl_ref"] > 0, history   # ... and moved
    assert second["high_logp_gap_max"] < 1e-3                    # its engine got the new weights
    solver_start, high_start = _weights(solver), _weights(Path(tiny_model_dir))
    solver_end, high_end = _weights(tmp_path / "final"), _weights(tmp_path / "final" / HIGH_LEVEL)
    assert all(torch.equal(solver_end[k], v) for k, v in solver_start.items())
    assert any(not torch.equal(high_end[k], v) for k, v in high_start.items())
    (step, folder), = store.complete()
    assert step == 2 and (folder / "policy").is_dir() and (folder / HIGH_LEVEL).is_dir()
