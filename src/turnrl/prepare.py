"""`prepare_model`: build and warm-start the embedded model, or resolve a given checkpoint."""
from __future__ import annotations

import json
import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

from turnrl import envs
from turnrl.config import Config
from turnrl.data.synthetic import product_demonstration
from turnrl.rollout.chat import ChatFormat
from turnrl.rollout.loop import replay
from turnrl.tiny import build_model, build_tokenizer, save, seeded_rng, warm_start

log = logging.getLogger(__name__)


def env_factory(cfg: Config) -> Callable[[], envs.Env]:
    options = cfg.env.code_tool
    return lambda: envs.make(cfg.env.name, timeout_s=options.timeout_s, memory_mb=options.memory_mb,
                             max_output_chars=options.max_output_chars)


def demonstrations(cfg: Config, rows: list[dict]) -> list[tuple[dict, list[str]]]:
    rng = seeded_rng(cfg.seed, "demonstrations")
    count = cfg.model.warmstart.demonstrations
    picked = [rows[rng.randrange(len(rows))] for _ in range(count)]
    return [(row, product_demonstration(row, rng, cfg.model.warmstart.tool_fraction)) for row in picked]


def build_tiny(cfg: Config, train_rows: list[dict], out_dir: Path,
               log_metrics: Callable[[int, dict], None] | None = None) -> dict:
    """Tokenizer + tiny Qwen2 + supervised warm start; returns a summary for metrics."""
    make_env = env_factory(cfg)
    env = make_env()
    demos = demonstrations(cfg, train_rows)
    # The tokenizer learns from the conversations as the model will see them (a tool demo's
    # output is the product, which `print(a * b)` prints).
    text = ChatFormat(build_tokenizer([""], 300), cfg.model.template_type)
    corpus = [text.prompt_text(env.system_prompt, row["prompt"]) + turns[0]
              + text.observation_text(f"<output>{row['answer']}</output>", env.observation_role) + turns[-1]
              for row, turns in demos[:2000]]
    tokenizer = build_tokenizer(corpus, cfg.model.tiny.vocab_size)
    fmt = ChatFormat(tokenizer, cfg.model.template_type)

    # Replay each scripted demonstration through the real environment (the tool really runs)
    # so the warm start sees exactly the token layout rollouts produce.
    with ThreadPoolExecutor(max_workers=cfg.env.code_tool.sandbox_workers) as pool:
        replays = list(pool.map(lambda d: replay(make_env(), fmt, d[0], d[1]), demos))
    sequences = [(t.prompt_ids + t.response_ids, [0] * len(t.prompt_ids) + t.loss_mask) for t in replays]

    model = build_model(tokenizer, cfg.model.tiny, cfg.seed)
    losses = warm_start(model, sequences, cfg.model.warmstart, cfg.seed, log=log_metrics)
    save(model, tokenizer, out_dir)
    summary = {
        "parameters": sum(p.numel() for p in model.parameters()),
        "vocab_size": len(tokenizer),
        "demonstrations": len(demos),
        "demonstration_tool_share": sum(len(t) > 1 for _, t in demos) / max(1, len(demos)),
        "warmstart_final_loss": losses[-1] if losses else None,
    }
    (out_dir / "turnrl_model.json").write_text(json.dumps({"kind": "tiny", **summary}, indent=2))
    return summary


def resolve_checkpoint(path: str, out_dir: Path) -> dict:
    """A real checkpoint is used where it is: `models/initial/turnrl_model.json` points to it."""
    local = Path(path).expanduser()
    if local.exists():
        if not (local / "config.json").exists():
            raise FileNotFoundError(f"model.path={path}: {local} has no config.json; point it at a Hugging Face model folder")
        target = str(local.resolve())
    else:
        try:
            from huggingface_hub import snapshot_download
            target = snapshot_download(path)
        except Exception as exc:  # offline, unknown id, no access
            raise FileNotFoundError(
                f"model.path={path}: not a local folder, and the hub could not provide it ({exc}). "
                "Use a local Hugging Face folder, a reachable hub id, or 'tiny' for the embedded model") from None
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "turnrl_model.json").write_text(json.dumps({"kind": "checkpoint", "path": target}, indent=2))
    return {"path": target}


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
