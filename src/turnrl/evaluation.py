"""One evaluation for `baseline_eval` and `eval`: the same engine, decoding and grading.

Benchmarks:
- `task`: the training environment's held-out set through the environment's own multi-turn
  protocol (tool turns for code_tool). Sampled at `eval.temperature` (`accuracy`) and, with
  `eval.greedy`, greedily (`accuracy_greedy`): a warm start can be greedy-perfect and
  sample-poor, or the reverse, so both are reported.
- `math500`: one plain answer per problem (`math_answer` protocol), graded with math-verify,
  with `by_subject` and `by_level` breakdowns. If the preprocess stage could not find it, the
  block says `available: false` and why.

Per-problem generations are written as parquet next to the metrics.
"""
from __future__ import annotations

import logging
from collections import defaultdict
from pathlib import Path
from typing import Sequence

from turnrl import envs
from turnrl.config import Config
from turnrl.data import sources
from turnrl.rollout.chat import ChatFormat
from turnrl.rollout.loop import Budgets, Trajectory, run_rollouts

log = logging.getLogger(__name__)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct: 1 - C(n-c, k) / C(n, k)
    (the estimator of Chen et al., 2021), computed as a stable product."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples, got {n}")
    if n - c < k:
        return 1.0
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def summarize(trajs: Sequence[Trajectory]) -> dict:
    n = len(trajs)
    correct = [t for t in trajs if t.outcome > 0]
    tokens = sum(t.policy_tokens() for t in trajs)
    return {
        "accuracy": len(correct) / n if n else 0.0,
        "n": n,
        "correct": len(correct),
        "mean_response_tokens": tokens / n if n else 0.0,
        "tokens_per_correct": tokens / len(correct) if correct else None,
        "mean_turns": sum(t.num_turns for t in trajs) / n if n else 0.0,
    }


def breakdown(trajs: Sequence[Trajectory], key: str) -> dict:
    groups: dict[str, list[Trajectory]] = defaultdict(list)
    for t in trajs:
        groups[str(t.example.get(key))].append(t)
    return {k: {"accuracy": sum(t.outcome > 0 for t in v) / len(v), "n": len(v)} for k, v in sorted(groups.items())}


def records(trajs: Sequence[Trajectory], decode, decoding: str) -> list[dict]:
    return [{
        "id": t.example.get("id"), "prompt": t.example.get("prompt"), "answer": str(t.example.get("answer")),
        "trajectory": decode(t.response_ids), "extracted": t.info.get("extracted"),
        "correct": t.outcome > 0, "reward": t.outcome, "finish": t.finish, "turns": t.num_turns,
        "tokens": t.policy_tokens(), "decoding": decoding,
    } for t in trajs]


def evaluate(cfg: Config, engine, tokenizer, data_dir: Path, out_dir: Path) -> dict:
    """Run every configured benchmark; write generations to `out_dir`; return the metrics."""
    from turnrl.prepare import env_factory
    from turnrl.preprocess import load_split, manifest

    out_dir.mkdir(parents=True, exist_ok=True)
    fmt = ChatFormat(tokenizer, cfg.model.template_type)
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731
    r = cfg.rollout
    context = getattr(engine, "max_model_len", 1 << 30)
    metrics: dict = {}

    heldout = load_split(data_dir, "heldout")
    task_budgets = Budgets(r.max_turns, r.max_tokens_per_turn, r.max_tokens_total, context)
    k = cfg.eval.samples
    sampled = run_rollouts(engine, heldout, env_factory(cfg), fmt, task_budgets, n=k, temperature=cfg.eval.temperature,
                           top_p=r.top_p, seed=cfg.seed, env_workers=cfg.env.code_tool.sandbox_workers,
                           progress=True, desc="eval task (sampled)")
    # accuracy is mean@k over all samples; n counts problems
    task = {**summarize(sampled), "n": len(heldout), "samples_per_problem": k,
            f"pass_at_{k}": sum(pass_at_k(k, sum(t.outcome > 0 for t in sampled[i:i + k]), k)
                            for i in range(0, len(sampled), k)) / len(heldout),
            "protocol": f"{cfg.env.name} (multi-turn, max_turns={r.max_turns})",
            "temperature": cfg.eval.temperature}
    rows = records(sampled, decode, f"temperature={cfg.eval.temperature}")
    if cfg.eval.greedy:
        greedy = run_rollouts(engine, heldout, env_factory(cfg), fmt, task_budgets, temperature=0.0,
                              env_workers=cfg.env.code_tool.sandbox_workers, progress=True, desc="eval task (greedy)")
        g = summarize(greedy)
        task.update({"accuracy_greedy": g["accuracy"], "mean_response_tokens_greedy": g["mean_response_tokens"]})
        rows += records(greedy, decode, "greedy")
    metrics["task"] = task
    sources.write_parquet(rows, out_dir / "task.parquet")

    info = manifest(data_dir).get("math500") if cfg.eval.math500 else None
    if info is not None:
        if not info.get("available"):
            log.warning("math500 not evaluated: %s", info.get("reason"))
            metrics["math500"] = {"available": False, "reason": info.get("reason"), "accuracy": None, "n": 0,
                                  "mean_response_tokens": None}
        else:
            problems = load_split(data_dir, "math500")
            if cfg.eval.math500_limit:
                problems = problems[:cfg.eval.math500_limit]
            budgets = Budgets(1, cfg.eval.math500_max_tokens, cfg.eval.math500_max_tokens, context)
            trajs = run_rollouts(engine, problems, lambda: envs.make("math_answer"), fmt, budgets,
                                 temperature=cfg.eval.temperature, top_p=r.top_p, seed=cfg.seed,
                                 progress=True, desc="eval math500")
            metrics["math500"] = {**summarize(trajs), "available": True, "protocol": "single answer",
                                  "temperature": cfg.eval.temperature,
                                  "by_subject": breakdown(trajs, "subject"), "by_level": breakdown(trajs, "level")}
            sources.write_parquet(records(trajs, decode, f"temperature={cfg.eval.temperature}"),
                                  out_dir / "math500.parquet")
    return metrics


def load_engine(cfg: Config, model_folder: Path):
    """The rollout engine (in this process) and tokenizer for a stage's model folder."""
    from transformers import AutoTokenizer

    from turnrl.prepare import model_dir
    from turnrl.rollout.engines import context_length, make_engine
    path = model_dir(model_folder)
    engine = make_engine(cfg.rollout.engine, path, dtype=cfg.model.dtype, seed=cfg.seed,
                         kv_cache_gib=cfg.rollout.kv_cache_gib, max_model_len=context_length(path))
    return engine, AutoTokenizer.from_pretrained(path)
