"""One registration site per extension point: a built-in and a user's plugin (a module of the
project, named by import path or registered by name) resolve through the same
`turnrl.plugins.Registry` with the same checks and the same errors; the policy-loss registry the
worker calls; method options under `algorithm.options`, the old `mlmt_*` keys still accepted."""
from __future__ import annotations

import socket
import sys
import textwrap
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import pytest
import torch

from turnrl import envs
from turnrl.algos import policy_loss_with_kl
from turnrl.algos import registry as algos
from turnrl.config import ConfigError, load_config, parse_config
from turnrl.plugins import PluginError
from turnrl.rewards import functions, graders
from turnrl.training.checkpoint import run_fingerprint

from conftest import ROOT


def _write(folder, name: str, source: str) -> None:
    (folder / name).write_text(textwrap.dedent(source))


@pytest.fixture
def plugin_dir(tmp_path, monkeypatch):
    """A project folder on sys.path holding the user's modules, and the registries as they were
    before the test (what a test registers is gone after it)."""
    monkeypatch.setenv("DVC_ROOT", str(tmp_path))
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m.startswith("myreg")]:
        monkeypatch.delitem(sys.modules, name)
    algos.names()   # the built-ins registered before the snapshot
    for registry in (algos._ALGORITHMS, algos._LOSSES, envs._REGISTRY, graders._REGISTRY, functions._REGISTRY):
        monkeypatch.setattr(registry, "entries", dict(registry.entries))
        monkeypatch.setattr(registry, "resolved", dict(registry.resolved))
    return tmp_path


# ----------------------------------------------------------------------------- every registry
@dataclass
class Kind:
    """One extension point: how to register and resolve, a built-in's name, a good and a bad
    plugin (source code defining `good` and `bad`), and the type every resolved one has."""
    register: Callable[[str, Any], Any]
    resolve: Callable[[str], Any]
    builtin: str
    source: str
    resolved_type: type | None
    bad_call: str   # what the error says the plugin must be callable as
    kind: str


KINDS = {
    "algorithm": Kind(algos.register, algos.resolve, "grpo", """
        import torch
        def good(inputs, cfg):
            return torch.zeros_like(inputs.mask, dtype=torch.float)
        def bad(inputs):
            return inputs
    """, algos.Algorithm, "advantages(inputs, cfg)", "algorithm"),
    "policy_loss": Kind(algos.register_loss, algos.resolve_loss, "clipped", """
        def good(batch, cfg):
            return batch["logp"].sum(), {}
        def bad(batch):
            return batch
    """, algos.PolicyLoss, "loss(batch, cfg)", "policy loss"),
    "environment": Kind(envs.register, envs.resolve, "code_tool", """
        def good(max_guesses: int = 3):
            return object()
        bad = 42
    """, envs.EnvSpec, "neither an EnvSpec nor a factory", "environment"),
    "grader": Kind(graders.register, graders.grader, "math", """
        def good(completion, answers):
            return completion in answers
        def bad(completion):
            return True
    """, graders.Grader, "grade(completion, answers)", "grader"),
    "reward_function": Kind(functions.register, functions.resolve, None, """
        def good(prompt, completion, answer, **info):
            return 1.0
        def bad(prompt):
            return 1.0
    """, None, "fn(prompt, completion, answer, **info)", "reward function"),
}


@pytest.mark.parametrize("name", list(KINDS))
def test_a_builtin_and_a_plugin_resolve_alike(plugin_dir, name):
    kind = KINDS[name]
    module = f"myreg_{name}"
    _write(plugin_dir, f"{module}.py", kind.source)
    by_path = kind.resolve(f"{module}:good")
    kind.register("my_own", f"{module}:good")          # a name for the same import path
    by_name = kind.resolve("my_own")
    import importlib
    kind.register("my_object", importlib.import_module(module).good)   # or the object itself
    by_object = kind.resolve("my_object")
    resolved = [by_path, by_name, by_object]
    if kind.builtin:
        resolved.append(kind.resolve(kind.builtin))
    if kind.resolved_type is not None:
        assert all(isinstance(r, kind.resolved_type) for r in resolved), resolved
    else:
        assert all(callable(r) for r in resolved)


@pytest.mark.parametrize("name", list(KINDS))
def test_a_bad_plugin_fails_the_same_way_by_path_and_by_name(plugin_dir, name):
    kind = KINDS[name]
    module = f"myreg_bad_{name}"
    _write(plugin_dir, f"{module}.py", kind.source)
    with pytest.raises(PluginError) as by_path:
        kind.resolve(f"{module}:bad")
    kind.register("my_bad", f"{module}:bad")
    with pytest.raises(PluginError) as by_name:
        kind.resolve("my_bad")
    assert kind.bad_call in str(by_path.value)
    assert str(by_name.value) == str(by_path.value).replace(f"'{module}:bad'", "'my_bad'")
    with pytest.raises(PluginError, match=f"'nope': not a registered {kind.kind} "):
        kind.resolve("nope")
    with pytest.raises(PluginError, match=f"no module named 'myreg_missing'"):
        kind.resolve("myreg_missing:good")


def test_built_in_algorithms_are_registered_by_their_decorators():
    from turnrl.algos import builtin
    assert {"grpo", "dr_grpo", "rloo", "mt_grpo", "ms_grpo", "ms_po", "mlmt", "ppo"} <= set(algos.names())
    assert algos.resolve("ms_grpo").advantages.__wrapped__ is builtin.mt_grpo is \
        algos.resolve("mt_grpo").advantages.__wrapped__   # two names, one function
    assert algos.resolve("ppo").critic and algos.resolve("mlmt").prepare is not None
    assert algos.loss_names() == ["clipped", "decoupled", "mis", "tis"]   # the off-policy corrections too


def test_a_plugin_registers_with_the_decorator_and_its_options_are_checked(plugin_dir):
    _write(plugin_dir, "myreg_decorated.py", """
        import torch
        from pydantic import BaseModel, Field
        from turnrl.algos.registry import register

        class Scale(BaseModel):
            scale: float = Field(1.0, gt=0)

        @register("scaled", options=Scale)
        def scaled(inputs, cfg):
            return torch.where(inputs.mask.bool(), cfg.options["scale"], 0.0)
    """)
    import myreg_decorated
    assert callable(myreg_decorated.scaled)   # the decorator hands the function back
    cfg = parse_config({"algorithm": {"name": "scaled", "options": {"scale": 3.0}}})
    assert cfg.algorithm.options == {"scale": 3.0}
    mask = torch.tensor([[0, 1, 1]])
    inputs = algos.AdvantageInputs(rewards=torch.zeros(1), turn_rewards=torch.zeros(1, 0), mask=mask,
                                   turn_ids=mask - 1, high=mask.bool() & False, group_ids=torch.zeros(1),
                                   first_obs_pos=torch.tensor([3]))
    assert algos.resolve("scaled").advantages(inputs, cfg.algorithm).tolist() == [[0.0, 3.0, 3.0]]
    with pytest.raises(ConfigError, match=r"algorithm.options.scale = -1.0: must be greater than 0"):
        parse_config({"algorithm": {"name": "scaled", "options": {"scale": -1.0}}})
    with pytest.raises(ConfigError, match=r"algorithm.options.scael: unknown option; options of this plugin: scale"):
        parse_config({"algorithm": {"name": "scaled", "options": {"scael": 2}}})
    # named by its import path, the decorated function brings what it declared (its options model)
    with pytest.raises(ConfigError, match=r"algorithm.options.scale = -1.0: must be greater than 0"):
        parse_config({"algorithm": {"name": "myreg_decorated:scaled", "options": {"scale": -1.0}}})
    assert parse_config({"algorithm": {"name": "myreg_decorated:scaled"}}).algorithm.options == {"scale": 1.0}


def test_a_builtin_without_options_rejects_them_a_plain_plugin_takes_any(plugin_dir):
    with pytest.raises(ConfigError, match=r"algorithm.options.betas: unknown option"):
        parse_config({"algorithm": {"name": "grpo", "options": {"betas": [0.1, 0, 0]}}})
    _write(plugin_dir, "myreg_plain.py", "def adv(inputs, cfg):\n    return inputs.mask * cfg.options['k']\n")
    assert parse_config({"algorithm": {"name": "myreg_plain:adv", "options": {"k": 2}}}).algorithm.options == {"k": 2}


# ----------------------------------------------------------------------------- method options
def test_mlmt_options_are_checked_and_filled_in():
    cfg = parse_config({"algorithm": {"name": "mlmt", "options": {"betas": [0.1, 0, 0.2], "context_coef": 0.5}},
                        "env": {"name": "math_refine"}})
    assert cfg.algorithm.options == {"stage": 2, "alpha": 1.0, "betas": [0.1, 0.0, 0.2], "context_coef": 0.5,
                                     "context_cap": 1.0}
    with pytest.raises(ConfigError, match=r"algorithm.options.betas = \[0.1, -1, 0\]: must be three non-negative"):
        parse_config({"algorithm": {"name": "mlmt", "options": {"betas": [0.1, -1, 0]}}})
    with pytest.raises(ConfigError, match=r"algorithm.options.stage = 3: must be 1 or 2"):
        parse_config({"algorithm": {"name": "mlmt", "options": {"stage": 3}}})


def test_the_old_mlmt_keys_still_work_named_as_moved_and_hash_the_same_training():
    old = {"algorithm": {"name": "mlmt", "mlmt_stage": 1, "mlmt_betas": [0.1, 0, 0.2], "mlmt_context_coef": 0.5},
           "env": {"name": "math_refine"}}
    new = {"algorithm": {"name": "mlmt", "options": {"stage": 1, "betas": [0.1, 0.0, 0.2], "context_coef": 0.5}},
           "env": {"name": "math_refine"}}
    with pytest.warns(FutureWarning, match=r"algorithm.mlmt_betas moved to algorithm.options.betas"):
        a = parse_config(old)
    b = parse_config(new)
    assert a.algorithm.options == b.algorithm.options and a.algorithm.options["stage"] == 1   # the value is used
    assert run_fingerprint(a) == run_fingerprint(b)
    other = parse_config({**new, "algorithm": {**new["algorithm"], "options": {"stage": 1, "betas": [0.1, 0, 0.3]}}})
    assert run_fingerprint(other) != run_fingerprint(b)
    # for another algorithm an old key at its default did nothing: dropped; any other value is an error
    with pytest.warns(FutureWarning):
        assert parse_config({"algorithm": {"name": "grpo", "mlmt_betas": [0, 0, 0]}}).algorithm.options == {}
    with pytest.warns(FutureWarning), pytest.raises(ConfigError, match="algorithm.name: mlmt only; remove it for grpo"):
        parse_config({"algorithm": {"name": "grpo", "mlmt_betas": [0.1, 0, 0]}})
    with pytest.warns(FutureWarning), pytest.raises(ConfigError, match="both set and differ"):
        parse_config({"algorithm": {"name": "mlmt", "mlmt_stage": 1, "options": {"stage": 2}}})


def test_params_and_the_mlmt_preset_use_the_new_keys():
    from turnrl import presets
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)   # nothing in the project's own files uses an old key
        cfg = load_config(ROOT / "params.yaml")
        keys = presets.load("mlmt", ROOT / "params.yaml")
        mlmt = load_config(ROOT / "params.yaml", [f"{k.lstrip('+')}={v}" for k, v in keys.items()])
    assert cfg.algorithm.policy_loss == "clipped" and cfg.algorithm.options == {}
    assert mlmt.algorithm.options == {"stage": 2, "alpha": 1.0, "betas": [0.0, 0.0, 0.0], "context_coef": 0.0,
                                      "context_cap": 1.0}


# ----------------------------------------------------------------------------- policy losses
def _loss_batch(seed: int = 0, B: int = 4, T: int = 7) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(B, T, generator=g) > 0.3).float()
    logp = (-torch.rand(B, T, generator=g) * 3).requires_grad_()
    return {"logp": logp, "old_logp": -torch.rand(B, T, generator=g) * 3, "ref_logp": -torch.rand(B, T, generator=g) * 3,
            "advantages": torch.randn(B, T, generator=g) * mask, "mask": mask, "loss_mask": mask,
            "engine_logprobs": -torch.rand(B, T, generator=g) * 3}


@pytest.mark.parametrize("overrides", [
    {}, {"kl_coef": 0.1, "kl_estimator": "k1"}, {"kl_coef": 0.05, "dual_clip": 3.0, "loss_agg": "seq-mean-token-sum"},
    {"clip_low": 0.1, "clip_high": 0.4, "loss_agg": "seq-mean-token-mean", "kl_coef": 0.2, "kl_estimator": "k2"}])
def test_the_default_loss_is_policy_loss_with_kl_bit_for_bit(overrides):
    alg = parse_config({"algorithm": overrides}).algorithm
    assert alg.policy_loss == "clipped"
    for seed in range(3):
        batch, ref = _loss_batch(seed), _loss_batch(seed)
        loss, metrics = algos.compute_policy_loss(algos.resolve_loss(alg.policy_loss), batch, alg)
        want, want_metrics = policy_loss_with_kl(ref["logp"], ref["old_logp"], ref["ref_logp"], ref["advantages"],
                                                 ref["mask"], kl_coef=alg.kl_coef, kl_kind=alg.kl_estimator,
                                                 clip_low=alg.clip_low, clip_high=alg.clip_high,
                                                 dual_clip=alg.dual_clip, agg=alg.loss_agg)
        assert torch.equal(loss, want)
        assert metrics.keys() == want_metrics.keys() and all(torch.equal(metrics[k], want_metrics[k]) for k in metrics)
        loss.backward()
        want.backward()
        assert torch.equal(batch["logp"].grad, ref["logp"].grad)


_TRUNCATED_IS = """
    import torch
    from pydantic import BaseModel, Field
    from turnrl.algos import aggregate
    from turnrl.algos.registry import PolicyLoss

    CALLS = []

    class Options(BaseModel):
        cap: float = Field(2.0, gt=1)

    def loss(batch, cfg):
        # a truncated importance weight to the behaviour policy, read from the batch by name
        CALLS.append(sorted(batch))
        w = torch.exp(batch["old_logp"] - batch["engine_logprobs"]).clamp(max=cfg.policy_loss_options["cap"])
        ratio = torch.exp(batch["logp"] - batch["old_logp"])
        value = aggregate(-batch["advantages"] * w * ratio, batch["mask"], cfg.loss_agg)
        return value, {"is_weight_mean": w.mean().detach(), "is_weight_max": w.max().detach()}

    TIS = PolicyLoss(loss, options=Options)

    def not_a_pair(batch, cfg):
        return batch["logp"].sum()
"""


def test_a_plugin_loss_gets_the_batch_by_name_and_its_checked_options(plugin_dir):
    _write(plugin_dir, "myreg_tis.py", _TRUNCATED_IS)
    alg = parse_config({"algorithm": {"policy_loss": "myreg_tis:TIS", "policy_loss_options": {"cap": 1.5}}}).algorithm
    assert alg.policy_loss_options == {"cap": 1.5}
    batch = _loss_batch()
    loss, metrics = algos.compute_policy_loss(algos.resolve_loss(alg.policy_loss), batch, alg)
    import myreg_tis
    assert "engine_logprobs" in myreg_tis.CALLS[-1]
    w = torch.exp(batch["old_logp"] - batch["engine_logprobs"]).clamp(max=1.5)
    assert float(metrics["is_weight_max"]) == pytest.approx(float(w.max())) and float(w.max()) <= 1.5
    loss.backward()
    assert batch["logp"].grad is not None and batch["logp"].grad.abs().sum() > 0
    with pytest.raises(ConfigError, match=r"algorithm.policy_loss_options.cap = 0.5: must be greater than 1"):
        parse_config({"algorithm": {"policy_loss": "myreg_tis:TIS", "policy_loss_options": {"cap": 0.5}}})
    with pytest.raises(ConfigError, match=r"algorithm.policy_loss_options.kappa: unknown option"):
        parse_config({"algorithm": {"policy_loss_options": {"kappa": 1}}})   # the default loss has none
    with pytest.raises(PluginError, match=r"'myreg_tis:not_a_pair' returned Tensor; it must return \(loss"):
        algos.compute_policy_loss(algos.resolve_loss("myreg_tis:not_a_pair"), _loss_batch(), alg)


def test_an_algorithms_loss_term_joins_every_policy_loss_with_the_logits_and_is_checked():
    """Algorithm.loss_term: added to algorithm.policy_loss's loss (whichever it is), given the
    logits; a term that returns no (loss, metrics) pair is named, like a loss."""
    seen = {}

    def term(batch, cfg):
        seen.update(batch)
        return batch["logits"].sum() * 0 + 2.0, {"extra": batch["logits"].new_tensor(1.0)}
    alg = parse_config({}).algorithm
    base = algos.resolve_loss(alg.policy_loss)
    batch, logits = _loss_batch(), torch.zeros(4, 7, 5)
    plain, _ = algos.compute_policy_loss(base, batch, alg)
    with_term, metrics = algos.compute_policy_loss(base, batch, alg, algos.Algorithm(lambda x, cfg: 0, loss_term=term,
                                                                                     name="mine"), logits)
    assert float(with_term) == pytest.approx(float(plain) + 2.0) and float(metrics["extra"]) == 1.0
    assert seen["logits"] is logits and "advantages" in seen
    broken = algos.Algorithm(lambda x, cfg: 0, loss_term=lambda batch, cfg: batch["logp"].sum(), name="mine")
    with pytest.raises(PluginError, match=r"algorithm.name = 'mine': its loss_term returned Tensor; it must return"):
        algos.compute_policy_loss(base, batch, alg, broken, logits)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_the_policy_worker_calls_a_plugin_loss(plugin_dir, tiny_model_dir):
    """A real PolicyWorker (DeepSpeed, the tiny model) trains one step with the plugin loss: it
    sees the mini-batch's tensors by name and its metrics come back in the step's stats (a
    `_max` one as the largest)."""
    from turnrl.config import Config
    from turnrl.training.workers import PolicyWorker, TrainerParams, combine_rank_stats
    _write(plugin_dir, "myreg_tis.py", _TRUNCATED_IS)
    cfg = Config.model_validate({"algorithm": {"policy_loss": "myreg_tis:TIS", "policy_loss_options": {"cap": 1.5}}})
    worker = PolicyWorker(str(tiny_model_dir), TrainerParams.of(cfg), master_port=_port())
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 200, (4, 12), generator=g)
    mask = torch.zeros(4, 12)
    mask[:, 6:10] = 1
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": mask,
             "turn_ids": torch.zeros(4, 12, dtype=torch.long), "advantages": torch.randn(4, 1, generator=g) * mask}
    batch["engine_logprobs"] = worker.logprobs(batch) - 0.5 * mask   # the behaviour policy, a known gap
    stats = combine_rank_stats([worker.train(batch, 1)])
    import myreg_tis
    assert myreg_tis.CALLS and {"engine_logprobs", "logp", "old_logp", "ref_logp", "mask"} <= set(myreg_tis.CALLS[-1])
    assert stats["is_weight_max"] == pytest.approx(1.5, rel=1e-5)   # exp(0.5) = 1.65, truncated at the cap
    assert "clip_fraction" not in stats   # the default loss's metrics: not computed
