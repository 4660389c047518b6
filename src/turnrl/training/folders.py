"""Where a model is: the Hugging Face folder behind a stage's model out, and the high level's
starting folder. Read by the pipeline and the trainer alike (so it lives on the trainer's floor, below both
the pipeline and turnrl.models)."""
from __future__ import annotations

import json
from pathlib import Path


def model_dir(folder: str | Path) -> str:
    """The HF folder behind a stage's model out: the folder itself, or the checkpoint it points to."""
    folder = Path(folder)
    pointer = folder / "turnrl_model.json"
    if pointer.exists():
        info = json.loads(pointer.read_text())
        if info.get("kind") == "checkpoint":
            return info["path"]
    if not (folder / "config.json").exists():
        raise FileNotFoundError(f"{folder} holds no model; run `dvc repro prepare_model` first")
    return str(folder)


def high_level_folder(chosen: str, policy_dir: str | Path) -> str:
    """The high-level model's starting folder with `levels.high_model: separate`:
    `chosen` (params' `levels.high_model_path`), or the policy's own starting folder when empty. Raises ValueError
    if its tokenizer is not the policy's (the two models continue each other's token ids in
    one conversation)."""
    from transformers import AutoTokenizer
    folder = model_dir(chosen) if chosen else str(policy_dir)
    if chosen:
        policy, high = AutoTokenizer.from_pretrained(str(policy_dir)), AutoTokenizer.from_pretrained(folder)
        if policy.get_vocab() != high.get_vocab() or policy.chat_template != high.chat_template:
            raise ValueError(
                f"levels.high_model_path = {chosen!r}: its tokenizer (vocabulary or chat template) is not the "
                f"policy's ({policy_dir}); both models write into one token sequence, so they need the same "
                "tokenizer. Use a model of the same family, or leave high_model_path empty (the policy's start)")
    return folder
