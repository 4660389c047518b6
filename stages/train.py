"""DVC stage `train`: multi-turn RL on Ray (DeepSpeed policy, vLLM rollouts).

Resumable: checkpoints go to `train.checkpoint_dir` (outside DVC's outs, so DVC keeps them
across reruns); a rerun after a crash continues from the newest one that fits these params
(see turnrl.training.checkpoint) and continues its MLflow run.
"""
import json
import sys
import time
from pathlib import Path

from turnrl.pipeline.stage import run_stage, write_json

DATA, START, FINAL = Path("data/processed"), Path("models/sft"), Path("models/final")
_checkpoints = {}   # the store and the checkpoint to resume from, found once per process


def checkpoints(cfg):
    """(store, resume or None) for this config: decided before the MLflow run opens."""
    if not _checkpoints:
        from turnrl.training.folders import model_dir
        from turnrl.training.checkpoint import CheckpointStore, run_fingerprint, shaping_params
        high = cfg.levels.high_model_path   # a second model for the high level, from its own folder
        key = run_fingerprint(cfg, [Path(model_dir(START)), DATA / "train.parquet", *([Path(high)] if high else [])])
        store = CheckpointStore(cfg.train.checkpoint_dir, key, keep=cfg.train.keep_checkpoints,
                                params=shaping_params(cfg))
        _checkpoints.update(store=store, resume=store.resumable(cfg.train.steps))
    return _checkpoints["store"], _checkpoints["resume"]


def resume_run_id(cfg):
    resume = checkpoints(cfg)[1]
    return resume.mlflow_run_id if resume else None


def main(cfg):
    import shutil

    import mlflow

    from turnrl.tracking import artifacts, model_logging, runs, traces
    from turnrl.pipeline import plots
    from turnrl.training.folders import model_dir
    from turnrl.pipeline.preprocess import load_split
    from turnrl.training.cluster import ActorFailure
    from turnrl.training.health import UnhealthyTraining
    from turnrl.training.loop import EnvironmentFailure, sample_table, train
    from transformers import AutoTokenizer

    start = time.perf_counter()
    run = runs.current_run()
    source = model_dir(START)
    tokenizer = AutoTokenizer.from_pretrained(source)
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731
    artifacts.log_datasets(run, {"train": (DATA / "train.parquet", "training")})
    overhead = {"s": 0.0}   # this callback's own time, logged with the next step (MLflow only)
    done = []   # every step's metrics so far (a resumed run's earlier ones first): what a failure keeps

    def on_step(step, metrics, trajs):
        done.append(metrics)
        t0 = time.perf_counter()
        runs.log_metrics({**{k: v for k, v in metrics.items() if k != "step"}, "tracking_s": overhead["s"]},
                                step)
        if step == 1 or step % cfg.train.samples_logged_every == 0 or step == cfg.train.steps:
            artifacts.log_table(run, lambda: sample_table(trajs, decode), f"samples/step_{step:05d}.json")
        if traces.traced_step(step, cfg.tracking.traces.every, cfg.train.steps):
            traces.log_traces(run, traces.rollout_traces(trajs, step, cfg.rollout.n, cfg.tracking.traces.per_step,
                                                         env=cfg.env.name, algorithm=cfg.algorithm.name))
        overhead["s"] = time.perf_counter() - t0

    store, resume = checkpoints(cfg)
    if resume is not None:
        mlflow.set_tag("turnrl.resumed_from_step", resume.step)
        try:   # the crashed attempt's failure tag: this run goes on (and is tagged again if it fails)
            mlflow.MlflowClient().delete_tag(run.run_id, "turnrl.failed")
        except Exception:   # noqa: BLE001 - no such tag (the attempt was killed before tagging)
            pass
        # steps the crashed run had not sent before it died (metrics are sent in the background)
        runs.backfill_steps(run, resume.state["history"])
        done.extend(resume.state["history"])
    shutil.rmtree(FINAL, ignore_errors=True)
    where = {}   # ranks, engines, nodes: filled once the actors are up
    try:
        history = train(cfg, source, str(DATA), load_split(DATA, "train"), str(FINAL), on_step=on_step,
                        checkpoints=store, resume=resume, mlflow_run_id=run.run_id, info=where,
                        heldout_rows=load_split(DATA, "heldout") if cfg.train.eval_every else None)
    except BaseException as exc:   # whatever ends it, the steps done land: curves, metrics/train.json, MLflow
        keep_failed(run, done, exc, summarize_training(done, where, resume, start))
        if isinstance(exc, ActorFailure):   # e.g. a reward function that failed (reward.on_error: fail)
            print(f"turnrl train: {str(exc).rstrip('.')}. Checkpoints in {Path(cfg.train.checkpoint_dir).resolve()} "
                  "are kept; a rerun resumes from the last", file=sys.stderr)
            raise SystemExit(1) from None
        if isinstance(exc, (UnhealthyTraining, EnvironmentFailure)):   # their message says checkpoints are kept
            print(f"turnrl train: {exc}", file=sys.stderr)
            raise SystemExit(1) from None
        raise   # run_stage says what it was, in one line
    summary = summarize_training(history, where, resume, start)
    health_summary = summary["health"]

    plots.write_csv(history, Path("plots/train.csv"))
    plots.render_png(history, Path("plots/train_curves.png"),
                     title=f"{cfg.algorithm.name} on {cfg.env.name}, {cfg.train.steps} steps")
    write_json("metrics/train.json", summary)
    # MLflow: after the local results, none of which depends on it
    run.recorder.now("tags", "turnrl.health", lambda: mlflow.set_tag(
        "turnrl.health", json.dumps(health_summary["flags"])[:5000] if health_summary["flags"] else "ok"))
    artifacts.log_dict(run, where, "actors.json")
    runs.log_metrics({f"summary/{k}": v for k, v in summary.items()})
    runs.log_parent(run, metrics={"train/wall_s": summary["wall_s"], "train/step_s_mean": summary["step_s_mean"],
                                  "train/reward_last5": summary["reward_last5"],
                                  "train/accuracy_last5": summary["accuracy_last5"]})
    artifacts.log_artifacts(run, "plots/train_curves.png", "plots")
    model_logging.log_policy(run, FINAL)


def summarize_training(history, where, resume, start):
    """metrics/train.json's numbers, from the steps in `history` (none, for a run that failed
    before its first step)."""
    from turnrl.training import health
    last = history[-5:]

    def mean(key, rows=history):   # over the steps that have the metric (a resumed run's older ones may not)
        values = [h[key] for h in rows if key in h]
        return sum(values) / len(values) if values else None
    return {
        "steps": len(history),
        "resumed_from_step": resume.step if resume else 0,
        "trainer_ranks": where.get("trainer_ranks"),   # unset when the actors never came up
        "rollout_engines": where.get("rollout_engines"),
        "nodes": where.get("nodes"),
        "reward_first": history[0]["reward_mean"] if history else None,
        "reward_last5": mean("reward_mean", last),
        "accuracy_last5": mean("accuracy", last),
        "logp_gap_max": max((h["logp_gap_max"] for h in history if "logp_gap_max" in h), default=None),
        "step_s_mean": mean("step_s"),
        "rollout_s_mean": mean("rollout_s"),
        "train_s_mean": mean("train_s"),
        "sync_s_mean": mean("sync_s"),
        "engine_idle_frac_mean": mean("engine_idle_frac"),
        "trainer_idle_frac_mean": mean("trainer_idle_frac"),
        "gen_tokens_per_s_mean": mean("gen_tokens_per_s"),
        "wall_s": time.perf_counter() - start,
        "health": health.summarize_health(history),   # the checks that failed, from which step, for how many steps
    }


def keep_failed(run, done, exc, summary):
    """A failed run's steps, kept: plots/train.csv, metrics/train.json marked failed (why, how
    many steps), and the MLflow run's tags and summary (its step metrics were logged as they
    came). A failure here is a warning: the run's own failure is what gets reported."""
    import mlflow

    from turnrl.pipeline import plots
    from turnrl.tracking import runs
    reason = " ".join(str(exc).split())[:2000] or type(exc).__name__
    try:
        plots.write_csv(done, Path("plots/train.csv"))
        write_json("metrics/train.json", {"failed": True, "reason": reason, **summary})
        flags = json.dumps(summary["health"]["flags"])[:5000]
        run.recorder.now("tags", "turnrl.failed", lambda: mlflow.set_tags(
            {"turnrl.health": flags, "turnrl.failed": f"{type(exc).__name__}: {reason}"[:5000]}))
        runs.log_metrics({f"summary/{k}": v for k, v in summary.items()
                          if isinstance(v, (int, float)) and not isinstance(v, bool)})
    except Exception as err:   # noqa: BLE001 - e.g. a full disk: say so, and report the run's own failure
        print(f"turnrl train: the steps done could not all be kept ({type(err).__name__}: {err})", file=sys.stderr)


if __name__ == "__main__":
    run_stage("train", main, resume_run=resume_run_id)
