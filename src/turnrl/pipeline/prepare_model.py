"""`prepare_model`: build and warm-start the embedded model, or resolve a given checkpoint."""
from __future__ import annotations

import json
import tempfile
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

from turnrl import envs
from turnrl.config import Config, ConfigError
from turnrl.data import synthetic
from turnrl.errors import one_line
from turnrl.rollout.chat import ChatFormat
from turnrl.rollout.episodes import EpisodeRunner, StepRunner, runner_for
from turnrl.rollout.multi_turn import Trajectory
from turnrl.models.tiny import build_model, build_tokenizer, save, seeded_rng, warm_start


class WarmStartError(ConfigError):
    """The environment, or its demonstration function, failed during the tiny model's warm
    start: bad input (exit 2), said in one line naming the plugin, the row and the exception."""


def _failure(env_name: str, row: dict, what: str, exc: BaseException) -> WarmStartError:
    return WarmStartError(
        f"env.name = {env_name!r}: the warm start (model.path: tiny) {what} on row {row.get('id')!r} and it "
        f"raised {one_line(exc)}; fix the environment or its "
        "demonstration (docs/plugins.md, \"The warm start\"), or set model.path to a checkpoint")


def demonstrable(task: synthetic.SyntheticTask | None, env_name: str) -> synthetic.SyntheticTask:
    """The environment's task if it gives demonstrations; else, before any work, a WarmStartError
    (a game, an environment without a task: only a checkpoint can play it)."""
    env_name = env_name or getattr(task, "name", "")
    if problem := synthetic.demonstration_problem(task, env_name):
        raise WarmStartError(f"env.name = {env_name!r}: model.path: tiny: {problem}")
    return task


def demonstration_rows(cfg: Config, task: synthetic.SyntheticTask) -> tuple[list[dict], list[dict], str]:
    """(training rows to demonstrate, held-out rows, where they came from). The environment's
    synthetic split when it has one and data.train_set is `synthetic` (or its demonstration
    only knows its own rows); else data.train_set's training rows, those with a reference
    answer where the demonstration takes any row (reasoning-gym, a jsonl with answers).
    Never a held-out row: the training split of preprocess excludes them."""
    data_rows = task.rows is None or (task.any_row and cfg.data.train_set != "synthetic")
    if not data_rows:
        train, heldout = task.splits(cfg.data.train_examples, cfg.data.heldout_examples, cfg.seed)
        return train, heldout, "synthetic"
    from turnrl.pipeline.preprocess import training_splits
    train, heldout, _, _ = training_splits(cfg)
    if task.rows is not None:   # a built-in's demonstration writes the reference answer
        train = [r for r in train if str(r.get("answer") or "").strip()]
        if not train:
            raise WarmStartError(f"data.train_set = {cfg.data.train_set!r}: model.path: tiny is warm-started on "
                                 "demonstrations of its training rows and none has a reference answer; give the "
                                 "rows an answer field (data.fields) or set model.path to a checkpoint")
    return train, heldout, str(cfg.data.train_set)


def demonstrations(task: synthetic.SyntheticTask, rows: list[dict], count: int, good_fraction: float,
                   seed: int, name: str, env_name: str = "") -> list[tuple[dict, synthetic.Demonstration, bool]]:
    """(row, demonstration, good) triples; a share `good_fraction` of them good."""
    demonstrable(task, env_name or task.name)
    rng = seeded_rng(seed, name)
    out = []
    for _ in range(count):
        row, good = rows[rng.randrange(len(rows))], rng.random() < good_fraction
        try:
            demo = task.demonstrate(row, rng, good)
        except Exception as exc:   # the plugin's demonstration function
            raise _failure(env_name or task.name, row, f"asked for a {'good' if good else 'bad'} demonstration",
                           exc) from exc
        out.append((row, demo, good))
    return out


def replay_demonstration(make_env: Callable[[], envs.Env], fmt: ChatFormat, row: dict,
                         demo: synthetic.Demonstration, env_name: str, runner: EpisodeRunner | None = None) -> Trajectory:
    """One demonstration replayed through the environment (by its runner: the step loop's
    `replay`, or the agent gateway answering the real program); its exception a WarmStartError."""
    try:
        return (runner or StepRunner()).replay(make_env, fmt, row, demo.turns)
    except Exception as exc:
        frames = [f.name for f in traceback.extract_tb(exc.__traceback__)]
        last = len(frames) - 1 - frames[::-1].index("replay") if "replay" in frames else 0
        after = frames[last + 1:]
        called = after[0] if after and after[0] in ("reset", "step") else "the environment"
        what = f"replayed a demonstration through {called if called == 'the environment' else called + '()'}"
        raise _failure(env_name, row, what, exc) from exc


def build_tiny(cfg: Config, out_dir: Path, log_metrics: Callable[[int, dict], None] | None = None) -> dict:
    """Tokenizer + tiny Qwen2 + supervised warm start on the environment's demonstrations (of
    its synthetic task, or of data.train_set's rows); returns a summary for metrics.

    The warm start has two phases. `skill_steps` on whole demonstrations teach the skill
    (call the tool and copy its output, search and copy, write useful feedback, work the
    columns and answer; and, where the task needs it, the habit too: approve and keep the
    attempt, ramble until interrupted). `prior_steps` on a mixture where only `good_fraction`
    use the environment well set how often the policy does the right thing: the good ones train
    whole, the others only their choice point (guess instead of the tool, approve instead of
    working the columns, ramble instead of answering). RL then starts from a policy that sometimes succeeds and often fails, and must
    find out what pays.

    The demonstrations come from the environment's task (its EnvSpec), by its demonstration
    function: of its synthetic training split (the same rows, and the same seed, as the
    preprocess stage's), or of data.train_set's training rows when the environment has no
    synthetic rows or its demonstration takes any row with an answer (math_answer, intervention)
    and data.train_set names a data set (`demonstration_rows`); never of the held-out split. An
    environment with data files (a search corpus) gets them written for these rows first.
    """
    with tempfile.TemporaryDirectory(prefix="turnrl-warmstart-") as data_dir:
        return _build_tiny(cfg, out_dir, Path(data_dir), log_metrics)


def demonstration_setup(cfg: Config, data_dir: Path | str):
    """What the warm start and `sft.data: demonstrations` share: (the environment's demonstrable
    task, its train rows, held-out rows, where they came from, `replays(fmt, demos)`). The
    environment's data files are written to `data_dir` first; `replays` runs each scripted
    demonstration through the real environment (the tool really runs, the index really answers,
    the game really plays), on env.workers threads, so the samples have exactly the layout
    rollouts produce."""
    env = envs.resolve(cfg.env.name)
    task: synthetic.SyntheticTask = demonstrable(env.task_for(cfg.env.checked_options()), cfg.env.name)
    train_rows, heldout_rows, source = demonstration_rows(cfg, task)
    if env.prepare_data is not None:
        env.prepare_data(heldout_rows + train_rows, Path(data_dir), **cfg.env.checked_options())
    make_env = cfg.env.factory(max_turns=cfg.rollout.max_turns, seed=cfg.seed, data_dir=data_dir)
    runner = runner_for(env)

    def replays(fmt: ChatFormat, demos) -> list[Trajectory]:
        with ThreadPoolExecutor(max_workers=cfg.env.workers) as pool:
            return list(pool.map(lambda d: replay_demonstration(make_env, fmt, d[0], d[1], cfg.env.name, runner),
                                 demos))
    return task, train_rows, heldout_rows, source, replays


def _build_tiny(cfg: Config, out_dir: Path, data_dir: Path, log_metrics) -> dict:
    spec = cfg.model.warmstart
    task, train_rows, heldout_rows, source, replays = demonstration_setup(cfg, data_dir)
    skill = demonstrations(task, train_rows, spec.demonstrations, task.skill_good_fraction, cfg.seed, "skill",
                           cfg.env.name)
    prior = demonstrations(task, train_rows, spec.demonstrations // 2, spec.good_fraction, cfg.seed, "prior",
                           cfg.env.name)

    # The tokenizer learns from the conversations as the model will see them.
    chat_format = cfg.model.tiny.chat_format
    bytes_only = ChatFormat(build_tokenizer([""], 300, chat_format), cfg.model.template_type)
    sample = skill[:1000] + prior[:500]
    corpus_text = [bytes_only.tokenizer.decode(s.prompt_ids + s.response_ids)
                   for t in replays(bytes_only, sample) for s in t.samples or [t]]
    tokenizer = build_tokenizer(corpus_text, cfg.model.tiny.vocab_size, chat_format)
    fmt = ChatFormat(tokenizer, cfg.model.template_type)

    def sequences(demos, phase: str):
        # an agent program's episode may be several samples (it edited its context): each is a sequence
        return [(s.prompt_ids + s.response_ids, [0] * len(s.prompt_ids) + warm_start_mask(s, d, good, phase, fmt))
                for t, (_, d, good) in zip(replays(fmt, demos), demos) for s in t.samples or [t]]

    model = build_model(tokenizer, cfg.model.tiny, cfg.seed)
    skill_losses = warm_start(model, sequences(skill, "skill"), spec.skill_steps, spec.batch_size, spec.lr, cfg.seed,
                              desc="warm start: skill", log=log_metrics)
    prior_losses = warm_start(model, sequences(prior, "prior"), spec.prior_steps, spec.batch_size, spec.lr, cfg.seed,
                              desc="warm start: prior",
                              log=log_metrics and (lambda step, m: log_metrics(spec.skill_steps + step, m)))
    save(model, tokenizer, out_dir)
    summary = {
        "parameters": sum(p.numel() for p in model.parameters()),
        "vocab_size": len(tokenizer),
        "env": cfg.env.name,
        "demonstrations": len(skill) + len(prior),
        "prior_good_share": sum(good for _, _, good in prior) / max(1, len(prior)),
        "skill_final_loss": skill_losses[-1] if skill_losses else None,
        "prior_final_loss": prior_losses[-1] if prior_losses else None,
    }
    if source != "synthetic":   # (the default's summary stays as it was)
        summary["demonstrated_rows"] = source
    (out_dir / "turnrl_model.json").write_text(json.dumps({"kind": "tiny", **summary}, indent=2))
    return summary


def warm_start_mask(t: Trajectory, demo: synthetic.Demonstration, good: bool, phase: str,
                    fmt: ChatFormat) -> list[int]:
    """The loss mask of a replayed demonstration's response in a warm-start phase. Skill: every
    policy token. Prior: a good demonstration whole (it also anchors the skill: training only
    choice tokens let 40 steps wreck math_refine's arithmetic), a bad one only its choice, not
    the made-up content after it."""
    return _trained_mask(t, demo.choice if phase == "prior" and not good else None, fmt)


def _trained_mask(t: Trajectory, choice: tuple[int, str] | None, fmt: ChatFormat) -> list[int]:
    """The loss mask of a demonstration's response: every policy token, or with a `choice`
    (turn, prefix) only the first tokens of that turn covering the prefix: the prior phase
    teaches which action to take and not the made-up content after it."""
    if choice is None:
        return list(t.loss_mask)
    turn, prefix = choice
    positions = [i for i, (m, k) in enumerate(zip(t.loss_mask, t.turn_ids)) if m and k == turn]
    ids = [t.response_ids[i] for i in positions]
    count = next(n for n in range(1, len(ids) + 1) if fmt.tokenizer.decode(ids[:n]).startswith(prefix))
    keep = set(positions[:count])
    return [1 if i in keep else 0 for i in range(len(t.response_ids))]


def resolve_checkpoint(path: str, out_dir: Path) -> dict:
    """A real checkpoint is used where it is: `models/initial/turnrl_model.json` points to it."""
    from turnrl.config.checks import initial_model_problem
    problem = initial_model_problem(path, out_dir)
    if problem:   # (turnrl config and every stage's checks say so before any work)
        raise ConfigError(problem)
    local = Path(path).expanduser()
    if not local.exists() and (local.is_absolute() or path.startswith((".", "~"))):
        raise FileNotFoundError(
            f"model.path={path}: no such folder. Point model.path at a Hugging Face model folder "
            "(config.json, weights, tokenizer), a hub id (org/name), or 'tiny' for the embedded model; "
            "e.g. dvc exp run -S model.path=tiny")
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
