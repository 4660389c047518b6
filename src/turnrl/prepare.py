"""`prepare_model`: build and warm-start the embedded model, or resolve a given checkpoint."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

from turnrl import envs
from turnrl.config import Config
from turnrl.data.synthetic import product_demonstration
from turnrl.rollout.chat import ChatFormat
from turnrl.rollout.loop import replay
from turnrl.tiny import build_model, build_tokenizer, save, seeded_rng, warm_start


def env_factory(cfg: Config) -> Callable[[], envs.Env]:
    options = cfg.env.code_tool
    return lambda: envs.make(cfg.env.name, timeout_s=options.timeout_s, memory_mb=options.memory_mb,
                             max_output_chars=options.max_output_chars)


def demonstrations(rows: list[dict], count: int, tool_fraction: float, seed: int,
                   name: str) -> list[tuple[dict, list[str]]]:
    rng = seeded_rng(seed, name)
    picked = [rows[rng.randrange(len(rows))] for _ in range(count)]
    return [(row, product_demonstration(row, rng, tool_fraction)) for row in picked]


def build_tiny(cfg: Config, train_rows: list[dict], out_dir: Path,
               log_metrics: Callable[[int, dict], None] | None = None) -> dict:
    """Tokenizer + tiny Qwen2 + supervised warm start; returns a summary for metrics.

    The warm start has two phases. `skill_steps` on demonstrations that all use the tool
    teach the skill (copy the factors into <code>, the output into <answer>); `prior_steps`
    on a mixture where only `tool_fraction` of the demonstrations use the tool set how often
    the policy reaches for it (the others answer at once with a guess; only that choice is
    trained, not the guessed digits). RL then starts from a policy that sometimes succeeds
    and often fails, and must find out that the tool pays.
    """
    spec = cfg.model.warmstart
    make_env = env_factory(cfg)
    env = make_env()
    skill = demonstrations(train_rows, spec.demonstrations, 1.0, cfg.seed, "skill")
    prior = demonstrations(train_rows, spec.demonstrations // 2, spec.tool_fraction, cfg.seed, "prior")
    # The tokenizer learns from the conversations as the model will see them (a tool demo's
    # output is the product, which `print(a * b)` prints).
    text = ChatFormat(build_tokenizer([""], 300), cfg.model.template_type)
    corpus = [text.prompt_text(env.system_prompt, row["prompt"]) + turns[0]
              + text.observation_text(f"<output>{row['answer']}</output>", env.observation_role) + turns[-1]
              for row, turns in skill[:2000]]
    tokenizer = build_tokenizer(corpus, cfg.model.tiny.vocab_size)
    fmt = ChatFormat(tokenizer, cfg.model.template_type)

    # Replay each scripted demonstration through the real environment (the tool really runs)
    # so the warm start sees exactly the token layout rollouts produce.
    def sequences(demos):
        with ThreadPoolExecutor(max_workers=cfg.env.code_tool.sandbox_workers) as pool:
            replays = list(pool.map(lambda d: replay(make_env(), fmt, d[0], d[1]), demos))
        # A guess teaches only the choice to answer at once, not the made-up number.
        return [(t.prompt_ids + t.response_ids,
                 [0] * len(t.prompt_ids) + (t.loss_mask if t.observations else _first_action_mask(t, fmt)))
                for t in replays]

    model = build_model(tokenizer, cfg.model.tiny, cfg.seed)
    skill_losses = warm_start(model, sequences(skill), spec.skill_steps, spec.batch_size, spec.lr, cfg.seed,
                              desc="warm start: skill", log=log_metrics)
    prior_losses = warm_start(model, sequences(prior), spec.prior_steps, spec.batch_size, spec.lr / 3, cfg.seed,
                              desc="warm start: prior",
                              log=log_metrics and (lambda step, m: log_metrics(spec.skill_steps + step, m)))
    save(model, tokenizer, out_dir)
    summary = {
        "parameters": sum(p.numel() for p in model.parameters()),
        "vocab_size": len(tokenizer),
        "demonstrations": len(skill) + len(prior),
        "prior_tool_share": sum(len(t) > 1 for _, t in prior) / max(1, len(prior)),
        "skill_final_loss": skill_losses[-1] if skill_losses else None,
        "prior_final_loss": prior_losses[-1] if prior_losses else None,
    }
    (out_dir / "turnrl_model.json").write_text(json.dumps({"kind": "tiny", **summary}, indent=2))
    return summary


def _first_action_mask(t, fmt: ChatFormat) -> list[int]:
    """Loss mask covering only the opening tag of the first turn (`<code>` or `<answer>`):
    the prior phase teaches which action to take first and leaves the skill alone."""
    opening = t.turn_texts[0][:t.turn_texts[0].index(">") + 1]
    count = next(k for k in range(1, len(t.response_ids) + 1)
                 if fmt.tokenizer.decode(t.response_ids[:k]).startswith(opening))
    return [1] * count + [0] * (len(t.loss_mask) - count)


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
