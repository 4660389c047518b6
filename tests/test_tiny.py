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


def test_the_llama3_chat_format_renders_as_llama_3_1_and_rollouts_frame_it(tmp_path):
    """model.tiny.chat_format: llama3 gives the tiny model Llama 3.1's layout and special tokens
    (a teacher or student of another chat format than the default's): the rollouts' prompt,
    observation frame and end of turn are the template's own, and the model config's ids match."""
    from turnrl.rollout.chat import ChatFormat
    corpus = ["<|start_header_id|>user<|end_header_id|>\n\nCompute 12 * 34.<|eot_id|> 408"] * 4
    tokenizer = build_tokenizer(corpus, 400, "llama3")
    fmt = ChatFormat(tokenizer)
    assert fmt.end_of_turn == "<|eot_id|>" and fmt.end_of_turn_id == tokenizer.convert_tokens_to_ids("<|eot_id|>")
    assert fmt.prompt_text("Be brief.", "Hi") == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")
    # a tool's result in Llama 3.1's ipython role, framed as the template renders the whole conversation
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "<code>1</code>"},
                {"role": "tool", "content": "1"}]
    whole = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert whole == fmt.prompt_text("", "Hi") + "<code>1</code>" + fmt.observation_text("1", "tool")
    assert "<|start_header_id|>ipython<|end_header_id|>" in whole
    for special in ("<|begin_of_text|>", "<|start_header_id|>", "<|eot_id|>"):
        assert len(fmt.encode(special)) == 1   # special tokens, not bytes
    model = build_model(tokenizer, TinyModel(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                                             chat_format="llama3"), seed=0)
    assert model.config.eos_token_id == tokenizer.eos_token_id == fmt.end_of_turn_id
    assert model.config.bos_token_id == tokenizer.convert_tokens_to_ids("<|begin_of_text|>")
