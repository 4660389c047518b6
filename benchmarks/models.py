"""Benchmark models, built locally (no hub): the tiny model as `prepare_model` builds it, or a
larger one of any width and depth, both with a chat template that TRL's tool loop accepts.

Two kinds:

- `random`: freshly initialized weights. It almost never writes an end-of-turn token or a stop
  string, so every turn runs to the token limit in both frameworks: the same, fixed amount of
  generation per step, which makes tokens/s and scaling fits clean. Used for single-turn GRPO.
- `scripted`: the same network after a short supervised warm start on 3-turn code_tool
  demonstrations (`<code>` call, `<code>` check, `<answer>`), replayed through the real
  environment. It reliably takes three turns, so a multi-turn step does the same work in
  turnrl's loop and in TRL's tool-calling loop.

The chat template is ChatML, as turnrl's tiny model uses, plus the rendering of assistant tool
calls: a `python` call renders as `<code>...</code>`, exactly the text code_tool's protocol
uses, so TRL's tool loop and turnrl's loop see the same tokens. `RESPONSE_TEMPLATE` tells
transformers' `parse_response` (which TRL uses to find tool calls) how to read them back.
"""
from __future__ import annotations

import hashlib
import inspect
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

# ChatML; an assistant message's tool calls follow its content. `python` calls are the code
# tool's own text; any other tool renders as JSON (TRL checks that a template can render one).
TOOL_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\n' -}}"
    "{%- if message['content'] -%}{{- message['content'] -}}{%- endif -%}"
    "{%- for call in message.get('tool_calls') or [] -%}"
    "{%- set fn = call['function'] if call['function'] is defined else call -%}"
    "{%- if fn['name'] == 'python' -%}{{- '<code>' + (fn['arguments'].get('code') or '') + '</code>' -}}"
    "{%- else -%}{{- '<tool_call>' + (fn | tojson) + '</tool_call>' -}}{%- endif -%}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"
)

# transformers' response_template (>= 5.13): `<code>X</code>` is a call of the `python` tool
# with code X; the rest of the turn up to the end-of-turn token is the content.
RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "tool_calls": {"open": "<code>", "close": "</code>", "repeats": True, "content": "text",
                       "transform": {"type": "function",
                                     "function": {"name": "python", "arguments": {"code": "{content}"}}}},
        "content": {"close_pattern": r"<\|im_end\|>\s*", "content": "text"},
    },
}


@dataclass(frozen=True)
class ModelSpec:
    """A benchmark model. `hidden`/`layers`/`heads`/`kv_heads` as in `model.tiny` of params.yaml
    (head dim = hidden / heads; vLLM's CPU attention takes 32, 64, 128)."""
    hidden: int = 128
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    vocab: int = 512
    kind: str = "random"          # random | scripted
    script_steps: int = 150       # warm-start steps of a scripted model
    seed: int = 0

    def __post_init__(self):
        if self.kind not in ("random", "scripted"):
            raise ValueError(f"model kind must be 'random' or 'scripted', got {self.kind!r}")
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise ValueError(f"hidden {self.hidden}, heads {self.heads}, kv_heads {self.kv_heads}: hidden must be "
                             "a multiple of heads and heads a multiple of kv_heads")

    @property
    def name(self) -> str:
        tag = f"h{self.hidden}-l{self.layers}-{self.kind}"
        # the templates and the building code are part of the key: a change rebuilds the model
        recipe = json.dumps([asdict(self), TOOL_CHAT_TEMPLATE, RESPONSE_TEMPLATE, inspect.getsource(scripted_turns),
                             inspect.getsource(build)], sort_keys=True)
        digest = hashlib.sha1(recipe.encode()).hexdigest()[:8]
        return f"{tag}-{digest}"


def scripted_turns(row: dict) -> list[str]:
    """The 3-turn demonstration of a code_tool row: compute, check with the factors swapped,
    answer; a short sentence before each action makes turns of 20-30 tokens."""
    a, b = row["prompt"].removeprefix("Compute ").removesuffix(".").split(" * ")
    return [f"I will multiply {a} by {b} in Python.\n<code>print({a} * {b})</code>",
            f"Let me check it the other way round.\n<code>print({b} * {a})</code>",
            f"Both runs print {row['answer']}, so the product is {row['answer']}.\n<answer>{row['answer']}</answer>"]


def train_rows(count: int = 512, seed: int = 0) -> list[dict]:
    """The code_tool task's synthetic training rows, as the preprocess stage makes them."""
    from turnrl.data.synthetic import TASKS
    rows, _ = TASKS["code_tool"].splits(count, 64, seed)
    return rows


def ensure_model(spec: ModelSpec, cache_dir: str | Path) -> Path:
    """The model folder for `spec` under `cache_dir`, built on first use (a few seconds for a
    random model; a scripted one adds its warm start, ~30 s for the tiny size)."""
    out = Path(cache_dir) / spec.name
    if (out / "config.json").exists():
        return out
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    build(spec, tmp)
    tmp.rename(out)
    return out


def build(spec: ModelSpec, out: Path) -> None:
    import torch

    from turnrl.config import TinyModel
    from turnrl.envs.code_tool import CodeToolEnv
    from turnrl.rollout.chat import ChatFormat
    from turnrl.rollout.multi_turn import replay
    from turnrl.models.tiny import build_model, build_tokenizer, save, warm_start

    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    rows = train_rows(seed=spec.seed)
    env = CodeToolEnv()
    # The tokenizer learns from rendered demonstrations, as prepare_model's does.
    plain = build_tokenizer([""], 300)
    plain.chat_template = TOOL_CHAT_TEMPLATE
    demos = [replay(CodeToolEnv(), ChatFormat(plain), r, scripted_turns(r)) for r in rows[:200]]
    tokenizer = build_tokenizer([plain.decode(t.prompt_ids + t.response_ids) for t in demos], spec.vocab)
    tokenizer.chat_template = TOOL_CHAT_TEMPLATE
    tokenizer.response_template = RESPONSE_TEMPLATE
    shape = TinyModel(hidden_size=spec.hidden, num_layers=spec.layers, num_heads=spec.heads,
                      num_kv_heads=spec.kv_heads, vocab_size=spec.vocab)
    model = build_model(tokenizer, shape, spec.seed)
    if spec.kind == "scripted":
        fmt = ChatFormat(tokenizer)
        sequences = []
        for row in rows:
            t = replay(env, fmt, row, scripted_turns(row))
            # Every response token is trained, frames included, and the final end-of-turn
            # token: the model learns to close its turns itself (what TRL's loop needs).
            ids = t.prompt_ids + t.response_ids + [fmt.eos_id]
            sequences.append((ids, [0] * len(t.prompt_ids) + [1] * (len(ids) - len(t.prompt_ids))))
        warm_start(model, sequences, spec.script_steps, batch_size=16, lr=3e-3, seed=spec.seed,
                   desc=f"scripted warm start {spec.name}")
    save(model, tokenizer, out)
    (out / "bench_model.json").write_text(json.dumps(
        {**asdict(spec), "parameters": sum(p.numel() for p in model.parameters())}, indent=2))
