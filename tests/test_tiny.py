"""The embedded tiny model: tokenizer, chat template, Qwen2 architecture, HF folder."""
import json

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from turnrl.config import TinyModel
from turnrl.models.tiny import build_model, build_tokenizer, warm_start


def test_digits_are_single_tokens_and_text_round_trips(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    pieces = tok.tokenize("Compute 347 * 8215.")
    assert [p for p in pieces if p.strip("Ġ").isdigit()] == list("3478215")
    text = "Any text, even ∑ unicode and \\boxed{x^2}!"
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text   # byte-level: nothing lost


def test_chat_template_is_chatml_with_a_tool_role(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = tok.apply_chat_template([{"role": "system", "content": "S"}, {"role": "user", "content": "U"},
                                    {"role": "assistant", "content": "A"}, {"role": "tool", "content": "T"}],
                                   tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n"
                    "<|im_start|>assistant\nA<|im_end|>\n<|im_start|>tool\nT<|im_end|>\n<|im_start|>assistant\n")
    assert tok.convert_tokens_to_ids("<|im_end|>") == tok.eos_token_id


def test_saved_folder_is_a_qwen2_model_vllm_can_serve(tiny_model_dir):
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    assert config["hidden_size"] // config["num_attention_heads"] == 32    # head dim vLLM's CPU attention takes
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert 0.5e6 < sum(p.numel() for p in model.parameters()) < 2e6
    out = model(input_ids=torch.tensor([[1, 2, 3]])).logits
    assert out.shape == (1, 3, config["vocab_size"])


def test_build_is_deterministic_for_a_seed(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    a, b = build_model(tok, TinyModel(), seed=3), build_model(tok, TinyModel(), seed=3)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_warm_start_learns_only_the_masked_in_tokens():
    tok = build_tokenizer(["abc 123"], 300)
    model = build_model(tok, TinyModel(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1), seed=0)
    ids = tok("abc 123 abc 123", add_special_tokens=False)["input_ids"]
    # the policy part is the second half; the first half is context (mask 0)
    half = len(ids) // 2
    sequences = [(ids, [0] * half + [1] * (len(ids) - half))] * 32
    losses = warm_start(model, sequences, steps=40, batch_size=8, lr=3e-3, seed=0)
    assert losses[-1] < 0.3 * losses[0]


def test_warm_start_progress_bar_keeps_to_its_interval(monkeypatch, capsys):
    """Under Prefect a stage's output is logged a line per tqdm refresh: the flow sets
    TQDM_MININTERVAL, and the loss in the postfix must not force a refresh on every step (the
    warm start logged 1,200 lines a phase)."""
    monkeypatch.setenv("TQDM_MININTERVAL", "60")
    tok = build_tokenizer(["abc 123"], 300)
    model = build_model(tok, TinyModel(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1), seed=0)
    ids = tok("abc 123 abc 123", add_special_tokens=False)["input_ids"]
    warm_start(model, [(ids, [1] * len(ids))] * 8, steps=60, batch_size=4, lr=3e-3, seed=0)
    updates = capsys.readouterr().err.count("\r")
    assert 1 <= updates <= 20, updates   # a few refreshes (tqdm's own timing), not one per step (60)
