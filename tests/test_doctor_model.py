"""`turnrl doctor -S model.path=FOLDER`: the model checks on a user's checkpoint, and what they say
when something is wrong (a template without a generation prompt, no end-of-turn token, an
end-of-turn token generation does not stop on, a template that cannot go on after an assistant
message, no template, an architecture vLLM cannot load). The checkpoints are miniatures
(turnrl.models.miniatures) with one thing broken each."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from turnrl.models import doctor
from turnrl.models import miniatures
from turnrl.config import Config
from turnrl.models.miniatures import CHATML


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> dict[str, Path]:
    """Untrained miniatures (seconds to build): the checks below do not need a trained model."""
    root = tmp_path_factory.mktemp("doctor")
    return {name: miniatures.build(name, root / name, warmstart_steps=0) for name in ("qwen2", "gemma2")}


def _variant(base: Path, tmp_path: Path, template: str | None = None, generation_eos: list[int] | None = None) -> Path:
    """A copy of `base` with its chat template or generation_config.json's eos_token_id replaced."""
    folder = tmp_path / "model"
    shutil.copytree(base, folder)
    if template is not None or generation_eos is not None:
        config = json.loads((folder / "tokenizer_config.json").read_text())
        if template is not None:
            (folder / "chat_template.jinja").unlink(missing_ok=True)
            config.pop("chat_template", None)
            if template:
                (folder / "chat_template.jinja").write_text(template)
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
        if generation_eos is not None:
            gen = json.loads((folder / "generation_config.json").read_text())
            gen["eos_token_id"] = generation_eos
            (folder / "generation_config.json").write_text(json.dumps(gen))
    return folder


def _template_checks(folder: Path) -> dict[str, doctor.Check]:
    """The template-level model checks as the doctor reports them (no engine needed)."""
    from transformers import AutoTokenizer

    from turnrl.models import check as modelcheck
    results, _ = modelcheck.template_checks(AutoTokenizer.from_pretrained(folder))
    return {r.name: r for r in results}


def test_a_template_without_a_generation_prompt_fails_with_the_header_to_add(base, tmp_path):
    no_prompt = CHATML.replace("{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}", "")
    assert no_prompt != CHATML
    checks = _template_checks(_variant(base["qwen2"], tmp_path, template=no_prompt))
    assert checks["template"].status == "FAIL"
    assert "add_generation_prompt adds nothing" in checks["template"].detail
    assert "'<|im_start|>assistant\\n'" in checks["template"].fix


def test_a_generation_prompt_that_stops_short_of_the_assistant_header_fails(base, tmp_path):
    short = CHATML.replace("{{- '<|im_start|>assistant\\n' }}{%- endif %}", "{{- '<|im_start|>' }}{%- endif %}")
    assert short != CHATML
    checks = _template_checks(_variant(base["qwen2"], tmp_path, template=short))
    assert checks["template"].status == "FAIL" and "'assistant\\n' is missing" in checks["template"].detail


def test_a_template_that_closes_turns_without_a_special_token_fails(base, tmp_path):
    plain = ("{%- for m in messages %}{{- m.role + ': ' + m.content + '\\n\\n' }}{%- endfor %}"
             "{%- if add_generation_prompt %}{{- 'assistant: ' }}{%- endif %}")
    checks = _template_checks(_variant(base["qwen2"], tmp_path, template=plain))
    assert checks["end_of_turn"].status == "FAIL"
    assert "does not start with a special token" in checks["end_of_turn"].detail
    assert "end-of-turn token" in checks["end_of_turn"].fix


def test_an_end_of_turn_token_generation_does_not_stop_on_fails_with_the_id_to_add(base, tmp_path):
    """Gemma ends turns with <end_of_turn>, its tokenizer's eos is <eos>: a generation_config.json
    without <end_of_turn> among its eos ids lets the model talk past the end of its turn."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(base["gemma2"])
    folder = _variant(base["gemma2"], tmp_path, generation_eos=[tok.eos_token_id])
    checks = _template_checks(folder)
    eot = tok.convert_tokens_to_ids("<end_of_turn>")
    assert checks["end_of_turn"].status == "FAIL"
    assert "'<end_of_turn>'" in checks["end_of_turn"].detail and "go on past the end of the turn" in checks["end_of_turn"].detail
    assert f"add {eot} to eos_token_id in generation_config.json" in checks["end_of_turn"].fix
    assert _template_checks(base["gemma2"])["end_of_turn"].status == "OK"      # as shipped: stops on it


def test_a_template_that_cannot_go_on_after_an_assistant_message_fails(base, tmp_path):
    single = ("{%- if messages | length > 2 %}{{- raise_exception('Only single-turn conversations') }}{%- endif %}"
              + CHATML)
    checks = _template_checks(_variant(base["qwen2"], tmp_path, template=single))
    assert checks["template"].status == "FAIL"
    assert "cannot render a user message after an assistant message" in checks["template"].detail
    assert "Only single-turn conversations" in checks["template"].detail


def test_no_chat_template_fails_and_points_at_the_base_template(base, tmp_path):
    checks = _template_checks(_variant(base["qwen2"], tmp_path, template=""))
    assert checks["template"].status == "FAIL" and "model.template_type: base" in checks["template"].fix


def test_the_tiny_default_and_a_missing_folder(tmp_path):
    assert [c.status for c in doctor.check_model(Config())] == ["OK"]
    [missing] = doctor.check_model(Config.model_validate({"model": {"path": str(tmp_path / "nowhere")}}))
    assert missing.status == "FAIL" and "neither a local folder" in missing.detail and "--local-dir" in missing.fix


@pytest.mark.slow
def test_an_architecture_vllm_cannot_load_fails_and_points_at_the_hf_engine(base, tmp_path):
    """GPT-Neo: transformers has it, vLLM 0.32 does not. The rest still runs on transformers."""
    from transformers import GPTNeoConfig, GPTNeoForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(base["qwen2"])
    config = GPTNeoConfig(vocab_size=len(tok), hidden_size=64, num_layers=2, num_heads=2, attention_types=[[["global"], 2]],
                          max_position_embeddings=512, bos_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    folder = tmp_path / "gptneo"
    GPTNeoForCausalLM(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    checks = {c.name: c for c in doctor.check_model(Config.model_validate({"model": {"path": str(folder)}}))}
    assert checks["model vllm"].status == "FAIL"
    assert "has no implementation of GPTNeoForCausalLM" in checks["model vllm"].detail
    assert "rollout.engine: hf" in checks["model vllm"].fix
    assert checks["model hf"].status == "OK" and checks["model zero2"].status == "OK"
    assert checks["model"].status == "FAIL"


@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_turnrl_doctor_checks_a_checkpoint_folder(base, tmp_path, monkeypatch, capsys, lora):
    """`turnrl doctor -S model.path=FOLDER` on a Qwen2.5-style miniature: every model check runs
    and passes (about 40 s on 2 cores: two vLLM starts, one DeepSpeed update); with
    `-S model.lora.r=4` the update trains adapters and the merged weights are pushed."""
    params = Path(__file__).resolve().parents[1] / "params.yaml"
    monkeypatch.setattr(doctor, "CHECKS", [doctor.check_model])     # the environment checks: test_doctor.py
    folder = _variant(base["qwen2"], tmp_path)
    code = doctor.main([str(params), "-S", f"model.path={folder}", *(["-S", "model.lora.r=4"] if lora else [])])
    out = capsys.readouterr().out
    assert code == 0, out
    assert ("a LoRA update (r=4" in out) == lora, out
    for name in ("template", "end_of_turn", "trajectory", "vllm", "hf", "logprobs", "zero2", "save", "rollout"):
        assert any(line.split()[:3] == ["OK", "model", name] for line in out.splitlines()), (name, out)
    assert "largest logprob gap" in out and "all checks passed" in out


def test_the_template_check_says_how_tools_and_tool_calls_reach_the_template(base, tmp_path):
    """A template with neither `tools=` nor `tool_calls` (the qwen2 miniature's) is told so; one
    that renders both (the same template writing them the Hermes way) is told that instead."""
    detail = _template_checks(base["qwen2"])["template"].detail
    assert "no tools=: tools described in the system text" in detail and "no tool_calls: calls written" in detail
    with_tools = CHATML.replace(
        "{%- for message in messages %}",
        "{%- if tools %}{{- '<|im_start|>system\\n' }}{%- for t in tools %}{{- t | tojson }}{%- endfor %}"
        "{{- '<|im_end|>\\n' }}{%- endif %}{%- for message in messages %}{%- if message.tool_calls %}"
        "{%- for c in message.tool_calls %}{{- '<tool_call>' + c.function.name + '</tool_call>' }}{%- endfor %}"
        "{%- endif %}", 1)
    assert with_tools != CHATML
    detail = _template_checks(_variant(base["qwen2"], tmp_path, template=with_tools))["template"].detail
    assert "tools= rendered" in detail and "tool_calls rendered" in detail
