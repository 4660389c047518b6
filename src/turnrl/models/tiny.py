"""The embedded model: a byte-level BPE tokenizer and a tiny Qwen2 model built locally,
warm-started with supervised fine-tuning on synthetic multi-turn demonstrations.

Everything here runs offline in about a minute on 2 cores. The folder it writes is an
ordinary Hugging Face folder: transformers and vLLM load it like any hub checkpoint.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import torch
from tqdm.auto import tqdm

from turnrl.config import TinyModel

# ChatML, as Qwen models use it; `tool` messages get their own role header. With `tools=` (the
# `tools` environment) their JSON schemas open the system message in a <tools> block and an
# assistant message's structured `tool_calls` render as <tool_call>JSON</tool_call>, as Qwen2.5's
# template does; without tools the text is exactly plain ChatML.
CHAT_TEMPLATE = (
    "{%- if tools -%}"
    "{{- '<|im_start|>system\n' -}}"
    "{%- if messages[0]['role'] == 'system' -%}{{- messages[0]['content'] + '\n\n' -}}{%- endif -%}"
    "{{- '# Tools\n<tools>\n' -}}"
    "{%- for tool in tools -%}{{- (tool | tojson) + '\n' -}}{%- endfor -%}"
    "{{- '</tools>\nCall a tool as <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>.<|im_end|>\n' -}}"
    "{%- endif -%}"
    "{% for message in messages %}"
    "{%- if not (tools and loop.first and message['role'] == 'system') -%}"
    "{{ '<|im_start|>' + message['role'] + '\n' + (message['content'] or '') }}"
    "{%- for call in message.get('tool_calls') or [] -%}"
    "{{- '<tool_call>\n' + ((call['function'] if call['function'] is defined else call) | tojson) + '\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{ '<|im_end|>' + '\n' }}"
    "{%- endif -%}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# Llama 3.1's layout, with its special tokens: a begin-of-text token, role headers, <|eot_id|> after
# every message, tool results in the `ipython` role, tools listed in the system message and a
# call written as {"name": ..., "parameters": {...}}. A teacher or student of another chat format
# than the default's, for measuring distillation across formats on CPU.
LLAMA3_TEMPLATE = (
    "{{- '<|begin_of_text|>' -}}"
    "{%- if tools -%}"
    "{{- '<|start_header_id|>system<|end_header_id|>\n\n' -}}"
    "{%- if messages[0]['role'] == 'system' -%}{{- messages[0]['content'] + '\n\n' -}}{%- endif -%}"
    "{{- 'You may call these functions, as {\"name\": ..., \"parameters\": {...}}:\n' -}}"
    "{%- for tool in tools -%}{{- (tool | tojson) + '\n' -}}{%- endfor -%}"
    "{{- '<|eot_id|>' -}}"
    "{%- endif -%}"
    "{% for message in messages %}"
    "{%- if not (tools and loop.first and message['role'] == 'system') -%}"
    "{{- '<|start_header_id|>' + ('ipython' if message['role'] == 'tool' else message['role'])"
    " + '<|end_header_id|>\n\n' + (message['content'] or '') -}}"
    "{%- for call in message.get('tool_calls') or [] -%}"
    "{%- set fn = call['function'] if call['function'] is defined else call -%}"
    "{{- {'name': fn['name'], 'parameters': fn['arguments']} | tojson -}}"
    "{%- endfor -%}"
    "{{- '<|eot_id|>' -}}"
    "{%- endif -%}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)


@dataclass(frozen=True)
class TinyChatFormat:
    """A chat format the tiny model can be built with (model.tiny.chat_format): its template and
    special tokens (`bos`: the model config's begin-of-sequence token)."""
    template: str
    special_tokens: tuple[str, ...]
    eos: str
    pad: str
    bos: str


CHAT_FORMATS = {
    "chatml": TinyChatFormat(CHAT_TEMPLATE, tuple(SPECIAL_TOKENS), eos="<|im_end|>", pad="<|endoftext|>",
                             bos="<|endoftext|>"),
    "llama3": TinyChatFormat(LLAMA3_TEMPLATE, ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                                               "<|end_header_id|>", "<|eot_id|>"),
                             eos="<|eot_id|>", pad="<|end_of_text|>", bos="<|begin_of_text|>"),
}


def build_tokenizer(corpus: Iterable[str], vocab_size: int, chat_format: str = "chatml"):
    """Byte-level BPE trained on `corpus`, with the special tokens and chat template of
    `chat_format` (CHAT_FORMATS); digits are always single tokens, which makes copying numbers
    (the skill the tiny task needs) easy to learn."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    fmt = CHAT_FORMATS[chat_format]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(fmt.special_tokens),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(corpus, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=fmt.eos, pad_token=fmt.pad,
                                   chat_template=fmt.template, model_max_length=4096)


def tiny_config(spec: TinyModel, vocab_size: int, **special_token_ids: int | None):
    """The tiny architecture (a Qwen2 config) of `spec` over a vocabulary of `vocab_size`;
    `special_token_ids`: bos_token_id, eos_token_id, pad_token_id."""
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=vocab_size, hidden_size=spec.hidden_size,
        intermediate_size=4 * spec.hidden_size, num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings, rope_theta=10000.0,
        tie_word_embeddings=True, torch_dtype="float32", **special_token_ids,
    )


def build_model(tokenizer, spec: TinyModel, seed: int):
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(seed)
    return Qwen2ForCausalLM(tiny_config(
        spec, len(tokenizer), bos_token_id=tokenizer.convert_tokens_to_ids(CHAT_FORMATS[spec.chat_format].bos),
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id))


def warm_start(model, sequences: list[tuple[list[int], list[int]]], steps: int, batch_size: int,
               lr: float, seed: int, desc: str = "warm start",
               log: Callable[[int, dict], None] | None = None) -> list[float]:
    """Supervised fine-tuning on (token ids, loss mask) pairs: the loss covers only the
    policy's tokens, exactly as RL will. Batches are drawn with replacement, seeded.
    Returns the loss per optimizer step."""
    if steps == 0:
        return []
    torch.set_flush_denormal(True)   # subnormal floats slow CPU training down several-fold over time
    rng = random.Random(f"{seed}:{desc}")
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    # Warm up over 5%, hold, decay linearly over the last 20%: copying is learned in a sudden
    # transition whose timing varies with the seed, so the rate stays high until late.
    warm, decay = max(1, steps // 20), max(1, steps // 5)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / warm, 1.0, (steps - s) / decay))
    model.train()
    losses: list[float] = []
    bar = tqdm(range(steps), desc=desc, unit="step")
    for step in bar:
        ids, attn, mask = _pad(rng.sample(sequences, min(batch_size, len(sequences))))
        logits = model(input_ids=ids, attention_mask=attn).logits
        logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
        target_mask = mask[:, 1:]
        nll = -logp.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
        loss = (nll * target_mask).sum() / target_mask.sum().clamp(min=1)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.3f}", refresh=False)   # shown at the next refresh: TQDM_MININTERVAL holds
        if log is not None and (step + 1) % 10 == 0:
            log(step + 1, {"warmstart_loss": losses[-1]})
    model.eval()
    return losses


def _pad(batch: list[tuple[list[int], list[int]]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-pad to [B, L]: token ids (0 past the end), attention mask, loss mask."""
    width = max(len(ids) for ids, _ in batch)
    ids = torch.zeros((len(batch), width), dtype=torch.long)
    attn = torch.zeros((len(batch), width), dtype=torch.long)
    mask = torch.zeros((len(batch), width))
    for row, (seq, m) in enumerate(batch):
        ids[row, :len(seq)] = torch.tensor(seq)
        attn[row, :len(seq)] = 1
        mask[row, :len(m)] = torch.tensor(m, dtype=torch.float)
    return ids, attn, mask


def seeded_rng(seed: int, name: str) -> random.Random:
    return random.Random(f"{seed}:{name}")


def save(model, tokenizer, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
