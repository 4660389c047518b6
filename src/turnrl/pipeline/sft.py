"""`sft`: supervised fine-tuning of prepare_model's model before RL, or its pass-through.

The samples are what RL trains on, token for token: a conversation file's rows rendered by
`turnrl.gateway.conversations` (the chat template, tools, assistant tokens only), or the
environment's demonstrations replayed through it (`sft.data: demonstrations`, the scripted
turns the tiny model's warm start uses). Training runs on the train stage's trainer ranks
(`turnrl.training.sft`).
"""
from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Callable

from turnrl.config import Config
from turnrl.rollout.chat import ChatFormat
from turnrl.rollout.multi_turn import Trajectory


def pass_through(initial: Path, out: Path) -> dict:
    """models/initial as models/sft: its pointer to a checkpoint, or a copy of its folder."""
    shutil.rmtree(out, ignore_errors=True)
    pointer = initial / "turnrl_model.json"
    if pointer.exists() and json.loads(pointer.read_text()).get("kind") == "checkpoint":
        out.mkdir(parents=True)
        shutil.copy2(pointer, out / pointer.name)
    else:
        shutil.copytree(initial, out)
    return {"skipped": True, "reason": "sft.data: none"}


def conversation_split(cfg: Config, fmt: ChatFormat) -> tuple[list[Trajectory], list[Trajectory], dict]:
    """(training samples, held-out samples, counts) of sft.data's conversations; the held-out
    share is split by conversation, so no conversation is in both."""
    from turnrl.data.conversations import load_conversations
    from turnrl.data.sources import DataSourceError
    from turnrl.gateway.conversations import conversation_samples
    from turnrl.training.sft import split_heldout
    spec = cfg.sft
    conversations = load_conversations(spec.data, spec.messages_field, spec.tools_field)
    train, heldout = split_heldout(conversations, spec.heldout_fraction, cfg.seed, keep=cfg.cluster.trainer_ranks)
    counts = {"conversations": len(conversations), "heldout_conversations": len(heldout), "truncated": 0, "dropped": 0}

    def samples(part):
        out = []
        for conversation in part:
            rendered = conversation_samples(conversation, fmt, spec.max_length)
            counts["truncated"] += rendered.truncated
            counts["dropped"] += rendered.dropped
            out += rendered.samples
        return out
    train_samples, heldout_samples = samples(train), samples(heldout)
    if not train_samples:
        raise DataSourceError(f"sft.data = {spec.data!r}: no sample fits in sft.max_length = {spec.max_length} "
                         f"({counts['dropped']} dropped: their prompt alone fills it); raise sft.max_length")
    return train_samples, heldout_samples, counts


def demonstration_split(cfg: Config, fmt: ChatFormat) -> tuple[list[Trajectory], list[Trajectory], dict]:
    """(training samples, held-out samples, counts): sft.demonstrations of the environment's
    good demonstrations, replayed through it (an agent program's episode: its samples)."""
    from turnrl.data.sources import DataSourceError
    from turnrl.gateway.conversations import fit
    from turnrl.pipeline.prepare_model import demonstration_setup, demonstrations
    from turnrl.training.sft import split_heldout
    with tempfile.TemporaryDirectory(prefix="turnrl-sft-") as data_dir:
        task, rows, _, _, replays = demonstration_setup(cfg, data_dir)
        replayed = replays(fmt, demonstrations(task, rows, cfg.sft.demonstrations, 1.0, cfg.seed, "sft", cfg.env.name))
    train, heldout = split_heldout(replayed, cfg.sft.heldout_fraction, cfg.seed, keep=cfg.cluster.trainer_ranks)
    counts = {"conversations": len(replayed), "heldout_conversations": len(heldout), "truncated": 0, "dropped": 0}

    def samples(part):   # at sft.max_length, as a conversation file's are: cut at the right, or dropped
        out = []
        for sample in (s for t in part for s in (t.samples or [t])):
            full = len(sample.prompt_ids) + len(sample.response_ids)
            kept = fit(sample, cfg.sft.max_length)
            counts["dropped"] += kept is None
            counts["truncated"] += kept is not None and len(kept.prompt_ids) + len(kept.response_ids) < full
            out += [kept] if kept is not None else []
        return out
    train_samples, heldout_samples = samples(train), samples(heldout)
    if not train_samples:
        raise DataSourceError(f"sft.data = demonstrations: no demonstration fits in sft.max_length = "
                              f"{cfg.sft.max_length} ({counts['dropped']} dropped: their prompt alone fills it); raise "
                              "sft.max_length")
    return train_samples, heldout_samples, counts


def run_sft(cfg: Config, model_dir: str, out: Path, on_step: Callable[[int, dict], None] | None = None) -> dict:
    """Fine-tune the model in `model_dir` on sft.data into `out`; returns metrics/sft.json's summary."""
    from transformers import AutoTokenizer

    from turnrl.training.sft import fine_tune
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    fmt = ChatFormat(tokenizer, cfg.model.template_type)
    split = demonstration_split if cfg.sft.data == "demonstrations" else conversation_split
    train, heldout, counts = split(cfg, fmt)
    shutil.rmtree(out, ignore_errors=True)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    history = fine_tune(cfg, model_dir, train, heldout, str(out), pad_id, on_step)
    (out / "turnrl_model.json").write_text(json.dumps({"kind": "sft", "from": model_dir, "data": cfg.sft.data},
                                                      indent=2))
    heldout_losses = [h["heldout_loss"] for h in history if "heldout_loss" in h]
    history = [h for h in history if h["step"] > 0]
    return {
        "skipped": False,
        "data": cfg.sft.data,
        **counts,
        "samples": len(train),
        "heldout_samples": len(heldout),
        "assistant_tokens": sum(sum(s.loss_mask) for s in train),
        "steps": len(history),
        "loss_first": history[0]["loss"],
        "loss_last": history[-1]["loss"],
        "heldout_loss_start": heldout_losses[0] if heldout_losses else None,
        "heldout_loss_last": heldout_losses[-1] if heldout_losses else None,
        "tokens_per_s_mean": sum(h["tokens_per_s"] for h in history) / len(history),
    }
