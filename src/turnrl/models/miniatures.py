"""Miniature checkpoints of real model families, built offline in seconds.

Each family's miniature is what a user's checkpoint of that family looks like to turnrl,
shrunk: the family's transformers config class and model class (a few hundred thousand
random-initialised parameters, head dim 32, which vLLM's CPU attention takes), a byte-level
BPE tokenizer with the family's special tokens, a chat template written to the family's
documented format (where the generation prompt goes, which token ends a turn, how a system
message or a tool result is rendered or refused), and a `generation_config.json` with the
family's stop tokens. A short supervised warm start on conversations rendered by that template
teaches it to end its turns with the family's end-of-turn token and gives it peaked,
realistic next-token distributions (a freshly initialised model's are nearly uniform, which
would make every logprob comparison look better than it is).

    build("gemma2", "/tmp/gemma2")     # an HF folder: config, weights, tokenizer, template

`FAMILIES` lists them; `turnrl.models.check` checks any folder, these or a user's.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import torch

# --------------------------------------------------------------------------- chat templates
# Written to each family's documented format (not copied from any checkpoint). The traps they
# keep: Qwen puts tool results in a user turn inside <tool_response>; Llama 3.1 calls the tool
# role `ipython`, always renders a system header and trims contents; Mistral and Gemma refuse
# any role but user/assistant alternating, Gemma 2 refuses a system message (Gemma 3 and
# Mistral fold it into the first user turn) and Gemma calls the assistant `model`; Phi-3 drops
# unknown roles silently and ends a conversation without a generation prompt with eos; Gemma,
# Phi-3 and Llama 3 end a turn with a token that is not the tokenizer's eos.

CHATML = (
    "{%- if messages[0].role != 'system' and default_system is defined %}"
    "{{- '<|im_start|>system\\n' + default_system + '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
QWEN25_TEMPLATE = ("{%- set default_system = 'You are Qwen, created by Alibaba Cloud. You are a helpful "
                   "assistant.' %}" + CHATML)

# Qwen3: ChatML; an assistant turn before the last user message loses its <think> block; with
# enable_thinking=false the generation prompt carries an empty one.
QWEN3_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for message in messages %}{%- if message.role == 'user' %}{%- set ns.last_user = loop.index0 %}"
    "{%- endif %}{%- endfor %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- elif message.role == 'assistant' %}"
    "{%- set content = message.content %}"
    "{%- if loop.index0 < ns.last_user and '</think>' in content %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}{%- endif %}"
)

LLAMA3_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if messages[0].role == 'system' %}{%- set system = messages[0].content | trim %}"
    "{%- set messages = messages[1:] %}{%- else %}{%- set system = '' %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{{- 'Cutting Knowledge Date: December 2023\\nToday Date: 26 Jul 2024\\n\\n' }}"
    "{{- system + '<|eot_id|>' }}"
    "{%- for message in messages %}"
    "{%- set role = 'ipython' if message.role == 'tool' else message.role %}"
    "{{- '<|start_header_id|>' + role + '<|end_header_id|>\\n\\n' + message.content | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

# Mistral (v0.1/v0.2, Mixtral Instruct): [INST] ... [/INST] answer</s>; the prompt ends at
# [/INST], so add_generation_prompt adds nothing. A system message joins the first user turn.
MISTRAL_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if messages[0].role == 'system' %}{%- set system = messages[0].content %}"
    "{%- set messages = messages[1:] %}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') != (loop.index0 % 2 == 0) %}"
    "{{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{%- endif %}"
    "{%- if message.role == 'user' %}"
    "{%- if loop.first and system is defined %}{{- '[INST] ' + system + '\\n\\n' + message.content + ' [/INST]' }}"
    "{%- else %}{{- '[INST] ' + message.content + ' [/INST]' }}{%- endif %}"
    "{%- else %}{{- message.content + eos_token }}{%- endif %}"
    "{%- endfor %}"
)

_GEMMA_TURNS = (
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') != (loop.index0 % 2 == 0) %}"
    "{{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{%- endif %}"
    "{%- set role = 'model' if message.role == 'assistant' else message.role %}"
    "{%- set content = (prefix if loop.first else '') + message.content | trim %}"
    "{{- '<start_of_turn>' + role + '\\n' + content + '<end_of_turn>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<start_of_turn>model\\n' }}{%- endif %}"
)
GEMMA2_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if messages[0].role == 'system' %}{{- raise_exception('System role not supported') }}{%- endif %}"
    "{%- set prefix = '' %}" + _GEMMA_TURNS
)
GEMMA3_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if messages[0].role == 'system' %}{%- set prefix = messages[0].content | trim + '\\n\\n' %}"
    "{%- set messages = messages[1:] %}{%- else %}{%- set prefix = '' %}{%- endif %}" + _GEMMA_TURNS
)

PHI3_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message.role in ['system', 'user', 'assistant'] %}"
    "{{- '<|' + message.role + '|>\\n' + message.content + '<|end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|assistant|>\\n' }}{%- else %}{{- eos_token }}{%- endif %}"
)


# --------------------------------------------------------------------------- families
@dataclass(frozen=True)
class Family:
    name: str
    config_class: str               # transformers config class
    model_class: str                # transformers model class
    config: dict                    # the family's characteristic settings, miniature sizes
    template: str
    special_tokens: list[str]       # in id order, first
    bos: str | None
    eos: str                        # the tokenizer's eos_token
    pad: str
    stop_tokens: list[str]          # generation_config.json eos_token_id, as real checkpoints have
    end_of_turn: str                # the token that closes an assistant turn in the template
    system_role: bool = True        # False: the template refuses a system message (fold it into the user turn)
    tool_role: bool = True          # False: the template cannot render a tool message (send it as user)
    add_bos: bool = False           # the tokenizer puts bos in front of an encoded text (sentencepiece style)
    tied: bool = False
    moe: bool = False
    pad_vocab_to: int = 0           # embedding rows rounded up to a multiple (Qwen's vocab is padded)
    notes: str = ""


_SIZE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, max_position_embeddings=1024, initializer_range=0.02)

FAMILIES: dict[str, Family] = {f.name: f for f in [
    Family("qwen2", "Qwen2Config", "Qwen2ForCausalLM",
           dict(_SIZE, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, rms_norm_eps=1e-6),
           QWEN25_TEMPLATE, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], None, "<|im_end|>", "<|endoftext|>",
           ["<|im_end|>", "<|endoftext|>"], "<|im_end|>", tied=True, pad_vocab_to=128,
           notes="Qwen2.5 0.5B-3B: tied embeddings, qkv bias, vocab padded past the tokenizer, default system prompt"),
    Family("qwen3", "Qwen3Config", "Qwen3ForCausalLM",
           dict(_SIZE, head_dim=32, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                rms_norm_eps=1e-6),
           QWEN3_TEMPLATE, ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"], None,
           "<|im_end|>", "<|endoftext|>", ["<|im_end|>", "<|endoftext|>"], "<|im_end|>",
           notes="Qwen3: q/k RMSNorm, explicit head_dim, thinking template"),
    Family("llama", "LlamaConfig", "LlamaForCausalLM",
           dict(_SIZE, rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                        "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                        "original_max_position_embeddings": 256},
                rms_norm_eps=1e-5),
           LLAMA3_TEMPLATE, ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                             "<|eot_id|>", "<|eom_id|>", "<|finetune_right_pad_id|>"],
           "<|begin_of_text|>", "<|eot_id|>", "<|finetune_right_pad_id|>",
           ["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"], "<|eot_id|>", add_bos=True,
           notes="Llama 3.1: llama3 RoPE scaling, ipython tool role, bos in the template"),
    Family("mistral", "MistralConfig", "MistralForCausalLM",
           dict(_SIZE, head_dim=32, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                sliding_window=None, rms_norm_eps=1e-5),
           MISTRAL_TEMPLATE, ["<unk>", "<s>", "</s>", "[INST]", "[/INST]"], "<s>", "</s>", "<unk>", ["</s>"], "</s>",
           add_bos=True, tool_role=False, notes="Mistral Instruct: [INST] format, no generation prompt, user/assistant only"),
    Family("gemma2", "Gemma2Config", "Gemma2ForCausalLM",
           dict(_SIZE, head_dim=32, query_pre_attn_scalar=32, sliding_window=16,
                layer_types=["sliding_attention", "full_attention"], attn_logit_softcapping=50.0,
                final_logit_softcapping=30.0, hidden_activation="gelu_pytorch_tanh",
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, rms_norm_eps=1e-6),
           GEMMA2_TEMPLATE, ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"],
           "<bos>", "<eos>", "<pad>", ["<eos>", "<end_of_turn>"], "<end_of_turn>", add_bos=True, tied=True,
           system_role=False, tool_role=False,
           notes="Gemma 2: logit soft-capping, alternating sliding-window layers, scaled tied embeddings, no system role"),
    Family("gemma3", "Gemma3TextConfig", "Gemma3ForCausalLM",
           dict(_SIZE, head_dim=32, query_pre_attn_scalar=32, sliding_window=16,
                layer_types=["sliding_attention", "full_attention"], hidden_activation="gelu_pytorch_tanh",
                rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                 "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}},
                rms_norm_eps=1e-6),
           GEMMA3_TEMPLATE, ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"],
           "<bos>", "<eos>", "<pad>", ["<eos>", "<end_of_turn>"], "<end_of_turn>", add_bos=True, tied=True,
           tool_role=False, notes="Gemma 3 text: q/k norms, local and global RoPE bases, system folded into the first user turn"),
    Family("phi3", "Phi3Config", "Phi3ForCausalLM",
           dict(_SIZE, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, sliding_window=None,
                resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0, original_max_position_embeddings=1024,
                rms_norm_eps=1e-5),
           PHI3_TEMPLATE, ["<unk>", "<s>", "</s>", "<|endoftext|>", "<|assistant|>", "<|end|>", "<|user|>",
                           "<|system|>"], "<s>", "<|endoftext|>", "<|endoftext|>",
           ["<|endoftext|>", "<|assistant|>", "<|end|>"], "<|end|>", add_bos=True, tool_role=False,
           notes="Phi-3: fused qkv_proj and gate_up_proj, <|end|> ends a turn but eos is <|endoftext|>"),
    Family("qwen3_moe", "Qwen3MoeConfig", "Qwen3MoeForCausalLM",
           dict(_SIZE, head_dim=32, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                norm_topk_prob=True, decoder_sparse_step=1,
                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, rms_norm_eps=1e-6),
           QWEN3_TEMPLATE, ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"], None,
           "<|im_end|>", "<|endoftext|>", ["<|im_end|>", "<|endoftext|>"], "<|im_end|>", moe=True,
           notes="Qwen3-MoE: 4 experts, top-2 routing; transformers holds the experts fused"),
    Family("mixtral", "MixtralConfig", "MixtralForCausalLM",
           dict(_SIZE, head_dim=32, num_local_experts=4, num_experts_per_tok=2, sliding_window=None,
                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, rms_norm_eps=1e-5),
           MISTRAL_TEMPLATE, ["<unk>", "<s>", "</s>", "[INST]", "[/INST]"], "<s>", "</s>", "<unk>", ["</s>"], "</s>",
           add_bos=True, moe=True, tool_role=False, notes="Mixtral: 4 experts (block_sparse_moe), top-2 routing, Mistral's format"),
]}


# --------------------------------------------------------------------------- building
# Short English-ish conversations: the tokenizer's corpus and the warm start's data.
_NAMES = ["Ada", "Bo", "Cy", "Di", "Ed", "Flo", "Gus", "Hal", "Ivy", "Jo"]


def conversations(n: int, seed: int = 0) -> list[list[dict]]:
    """Two-turn conversations with a system message, a tool or user observation in the middle."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        name = rng.choice(_NAMES)
        out.append([
            {"role": "system", "content": "You are a careful assistant. Use the tool when it helps."},
            {"role": "user", "content": f"{name} has {a} apples and buys {b} more. How many now?"},
            {"role": "assistant", "content": f"<code>print({a} + {b})</code>"},
            {"role": rng.choice(["tool", "user"]), "content": f"<output>{a + b}</output>"},
            {"role": "assistant", "content": f"{name} has {a + b} apples. <answer>{a + b}</answer>"},
        ])
    return out


def build_tokenizer(family: Family, vocab_size: int = 512):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=family.special_tokens,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    corpus = [m["content"] for conv in conversations(300, seed=1) for m in conv]
    tok.train_from_iterator(corpus, trainer=trainer)
    if family.add_bos:   # as sentencepiece-style tokenizers do: encode(text) puts bos first
        bos_id = tok.token_to_id(family.bos)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{family.bos} $A", pair=f"{family.bos} $A {family.bos} $B", special_tokens=[(family.bos, bos_id)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=family.bos, eos_token=family.eos, pad_token=family.pad,
        unk_token="<unk>" if "<unk>" in family.special_tokens else None,
        chat_template=family.template, model_max_length=1024)


def build_model(family: Family, tokenizer, seed: int = 0):
    import transformers

    torch.manual_seed(seed)
    vocab = len(tokenizer)
    if family.pad_vocab_to:
        vocab = -(-vocab // family.pad_vocab_to) * family.pad_vocab_to
    ids = tokenizer.convert_tokens_to_ids
    config = getattr(transformers, family.config_class)(
        **family.config, vocab_size=vocab, tie_word_embeddings=family.tied,
        bos_token_id=ids(family.bos) if family.bos else None, eos_token_id=ids(family.eos),
        pad_token_id=ids(family.pad))
    config.architectures = [family.model_class]
    model = getattr(transformers, family.model_class)(config)
    if family.name == "qwen2":   # Qwen2 projections carry biases; make them matter
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("proj.bias"):
                    p.normal_(0, 0.02)
    return model


def reference_messages(family: Family, conv: list[dict]) -> list[dict]:
    """`conv` as the family's documentation says to send it: a system message the template
    refuses goes in front of the first user message (Gemma 2's advice), a tool result the
    template cannot render goes as a user message. The reference turnrl's assembly is
    checked against, written independently of it."""
    out = [dict(m) for m in conv]
    if out and out[0]["role"] == "system" and not family.system_role:
        system = out.pop(0)["content"]
        out[0]["content"] = system + "\n\n" + out[0]["content"]
    if not family.tool_role:
        out = [dict(m, role="user") if m["role"] == "tool" else m for m in out]
    return out


def _sft_rows(family: Family, tokenizer, convs: list[list[dict]]) -> list[tuple[list[int], list[int]]]:
    """Each conversation as the template renders it, tokenized, with a loss mask over the
    assistant contents and the end-of-turn token after each: what a chat SFT trains on."""
    rows = []
    for conv in convs:
        text = tokenizer.apply_chat_template(reference_messages(family, conv), tokenize=False)
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        spans, start = [], 0
        for message in conv:
            if message["role"] != "assistant":
                continue
            pos = text.index(message["content"], start)
            end = pos + len(message["content"])
            if text.startswith(family.end_of_turn, end):
                end += len(family.end_of_turn)
            spans.append((pos, end))
            start = end
        mask = [int(any(a <= s and e <= b for a, b in spans)) for s, e in enc["offset_mapping"]]
        rows.append((enc["input_ids"], mask))
    return rows


def build(family: str | Family, out_dir: str | Path, *, seed: int = 0, warmstart_steps: int = 150) -> Path:
    """Write the family's miniature to `out_dir` (an HF folder) and return it."""
    from transformers import GenerationConfig

    from turnrl.models.tiny import warm_start
    fam = FAMILIES[family] if isinstance(family, str) else family
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(fam)
    model = build_model(fam, tokenizer, seed)
    if warmstart_steps:
        rows = _sft_rows(fam, tokenizer, conversations(200, seed=seed))
        threads = torch.get_num_threads()
        torch.set_num_threads(1)   # a model this small gains nothing from two; with the cores shared, two spin
        try:
            warm_start(model, rows, warmstart_steps, batch_size=16, lr=3e-3, seed=seed,
                       desc=f"{fam.name} warm start")
        finally:
            torch.set_num_threads(threads)
    model.generation_config = GenerationConfig(
        bos_token_id=model.config.bos_token_id, pad_token_id=model.config.pad_token_id,
        eos_token_id=[tokenizer.convert_tokens_to_ids(t) for t in fam.stop_tokens])
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    (out / "miniature.json").write_text(json.dumps({"family": fam.name, "tied_embeddings": fam.tied,
                                                    "moe": fam.moe, "notes": fam.notes}, indent=1))
    return out
