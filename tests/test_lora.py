"""model.lora: the config's fix-it checks, peft adapters on the model (only they train, the
merged weight is W + (alpha / r) B A under the base model's name, the start computes what the
base did), and, on the real stack, the modelcheck with LoRA: a ZeRO-2 update of the adapters,
merged weights pushed into vLLM, vLLM's logprobs against the trainer's, the saved merged model
and its adapter/ folder reloaded (transformers, vLLM, peft over the starting model)."""
from __future__ import annotations

import pytest
import torch

from turnrl.models import miniatures
from turnrl.models import check as modelcheck
from turnrl.config import ConfigError, LoraCfg, parse_config
from turnrl.training.workers import (LoraTargetError, base_name, export_plan, lora_layers, lora_model,
                                     merged_weight)


# --------------------------------------------------------------------------- params
@pytest.mark.parametrize("lora, words", [
    ({"r": 8, "target_modules": "attention"}, "must be all-linear or a list of module names"),
    ({"r": 8, "target_modules": []}, "target_modules is empty"),
    ({"r": 8, "target_modules": ["q_proj", "lm_head"]}, "not the embeddings or the LM head"),
    ({"r": 8, "target_modules": ["q_proj", "q_proj"]}, "listed twice"),
    ({"r": 8, "target_modules": ["q_proj", " "]}, "a module name is empty"),
    ({"r": -1}, "model.lora.r = -1"),
    ({"r": 8, "alpha": 0}, "model.lora.alpha = 0"),
    ({"r": 8, "dropout": 1.0}, "model.lora.dropout = 1.0"),
])
def test_bad_lora_params_name_the_key_and_the_fix(lora, words):
    with pytest.raises(ConfigError) as info:
        parse_config({"model": {"lora": lora}}, plugins=False)
    assert "model.lora" in str(info.value) and words in str(info.value), str(info.value)


def test_lora_is_off_by_default_and_on_with_a_rank():
    assert not parse_config({}, plugins=False).model.lora.enabled
    cfg = parse_config({"model": {"lora": {"r": 4, "target_modules": ["q_proj", "v_proj"]}}}, plugins=False)
    assert cfg.model.lora.enabled and cfg.model.lora.alpha == 16


# --------------------------------------------------------------------------- adapters on a model
@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    return miniatures.build("qwen2", tmp_path_factory.mktemp("qwen2"), warmstart_steps=0)


def _model(folder):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def test_only_the_adapters_train_and_the_start_is_the_base_model(qwen2):
    base = _model(qwen2)
    ids = torch.tensor([[5, 9, 13, 21, 34, 55]])
    with torch.no_grad():
        before = base(input_ids=ids).logits.clone()
    model = lora_model(base, LoraCfg(r=4, alpha=8, target_modules=["q_proj", "v_proj"]), seed=0)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_A" in n or "lora_B" in n for n in trainable)
    assert {n.rsplit(".", 1)[-1] for n in lora_layers(model)} == {"q_proj", "v_proj"}
    with torch.no_grad():   # B starts at zero: the adapted model computes what the base did
        assert torch.equal(model(input_ids=ids).logits, before)


def test_the_engines_get_the_merged_weight_under_the_base_models_name(qwen2):
    model = lora_model(_model(qwen2), LoraCfg(r=4, alpha=8, target_modules="all-linear"), seed=0)
    for layer in lora_layers(model).values():   # as after some updates: B no longer zero
        torch.nn.init.normal_(layer.lora_B["default"].weight, std=0.05)
    plan = {e.name: e for e in export_plan(model)}
    assert sorted(plan) == sorted(e.name for e in export_plan(_model(qwen2)))   # the plain model's names
    name, layer = next(iter(lora_layers(model).items()))
    export = plan[f"{name}.weight"]
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    expected = layer.get_base_layer().weight + (8 / 4) * (b @ a)
    assert torch.allclose(export.value(), expected, atol=1e-6)
    assert torch.allclose(merged_weight(layer.get_base_layer().weight, layer), expected, atol=1e-6)
    # the merged model computes what the adapted one does
    ids = torch.tensor([[5, 9, 13, 21, 34, 55]])
    merged = _model(qwen2)
    merged.load_state_dict({n: e.value() for n, e in plan.items()}, strict=False)
    with torch.no_grad():
        assert torch.allclose(merged(input_ids=ids).logits, model(input_ids=ids).logits, atol=1e-4)


def test_peft_names_map_back_to_the_base_models():
    assert base_name("model.layers.0.self_attn.q_proj.base_layer.weight") == "model.layers.0.self_attn.q_proj.weight"
    assert base_name("model.layers.0.self_attn.q_proj.lora_A.default.weight") is None
    assert base_name("model.norm.weight") == "model.norm.weight"


def test_modules_the_model_does_not_have_are_named_with_the_ones_it_has(qwen2):
    with pytest.raises(LoraTargetError) as info:
        lora_model(_model(qwen2), LoraCfg(r=4, target_modules=["query_key_value"]), seed=0)
    assert "query_key_value" in str(info.value) and "q_proj" in str(info.value)


# --------------------------------------------------------------------------- the real stack
@pytest.mark.slow   # DeepSpeed ZeRO-2 and a vLLM engine: about a minute
def test_a_lora_update_reaches_vllm_and_the_saved_adapters_reload(tmp_path_factory):
    folder = miniatures.build("qwen2", tmp_path_factory.mktemp("qwen2-warm"))
    report = modelcheck.check_model_folder(folder, zero_stages=(2,), engines=("vllm",), rollout=False, fresh_engine=False,
                                    lora={"r": 4, "alpha": 8, "target_modules": "all-linear"},
                                    work_dir=tmp_path_factory.mktemp("lora-check"))
    checks = {c.name: c for c in report.checks}
    m = report.metrics
    assert checks["zero2"].status == "OK", checks["zero2"].detail
    assert m["zero2_moved"] > 1e-2            # the adapters' update changed what vLLM computes
    assert m["zero2_gap"] <= 1e-4             # ... exactly as the trainer does (fp32)
    assert checks["save"].status == "OK", checks["save"].detail
    assert m["saved_hf_gap"] <= 1e-4 and m["saved_vllm_gap"] <= 1e-4
    assert m["saved_adapter_gap"] <= 1e-4     # peft's adapter/ over the starting model: the same policy
