"""Step-time breakdown of the training loop by trainer ranks and rollout engines.

    python benchmarks/scaling.py --setups 1x1 2x1 1x2 2x2 --steps 6 [-S key=value ...]

Run from a project whose `data/processed` and `models/initial` exist (after `dvc repro
prepare_model`). Each setup (RANKSxENGINES) trains `--steps` steps on a fresh local Ray with
params.yaml plus the overrides; the first step (engine warm-up) is left out of the means.
Prints a Markdown table: seconds per step in rollout, train and sync, the rest of the step
(advantages, collation, the driver), and the share of the step each role's actors wait.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

COLUMNS = ["step_s", "rollout_s", "train_s", "sync_s", "other_s", "engine_idle_frac", "trainer_idle_frac",
           "gen_tokens_per_s", "logp_gap_max"]


def run_setup(params: str, overrides: list[str], ranks: int, engines: int, steps: int) -> dict[str, float]:
    import ray

    from turnrl.config import load_config
    from turnrl.training.folders import model_dir
    from turnrl.pipeline.preprocess import load_split
    from turnrl.training.loop import train
    cfg = load_config(params, [*overrides, f"cluster.trainer_ranks={ranks}", f"cluster.rollout_engines={engines}",
                               f"train.steps={steps}"])
    out = Path(f"/tmp/turnrl_scaling_{os.getpid()}")
    start = time.perf_counter()
    try:
        history = train(cfg, model_dir(Path("models/initial")), "data/processed",
                        load_split(Path("data/processed"), "train"), str(out))
    finally:
        ray.shutdown()
    measured = history[1:] or history
    row = {key: sum(h[key] for h in measured) / len(measured) for key in COLUMNS if key != "other_s"}
    row["other_s"] = row["step_s"] - row["rollout_s"] - row["train_s"] - row["sync_s"]
    row["logp_gap_max"] = max(h["logp_gap_max"] for h in history)
    row["wall_s"] = time.perf_counter() - start
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--setups", nargs="+", default=["1x1", "2x1", "1x2", "2x2"], help="RANKSxENGINES")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("-S", "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    rows = []
    for setup in args.setups:
        ranks, engines = (int(x) for x in setup.split("x"))
        load_before = os.getloadavg()[0]
        row = run_setup(args.params, args.overrides, ranks, engines, args.steps)
        row["load"] = (load_before + os.getloadavg()[0]) / 2
        rows.append((setup, row))
        print(f"{setup}: {row}", file=sys.stderr, flush=True)
    print("| ranks x engines | step s | rollout s | train s | sync s | other s | engines idle | trainer idle "
          "| gen tok/s | max logp gap | load avg |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for setup, r in rows:
        print(f"| {setup} | {r['step_s']:.2f} | {r['rollout_s']:.2f} | {r['train_s']:.2f} | {r['sync_s']:.2f} "
              f"| {r['other_s']:.2f} | {r['engine_idle_frac']:.0%} | {r['trainer_idle_frac']:.0%} "
              f"| {r['gen_tokens_per_s']:.0f} | {r['logp_gap_max']:.1e} | {r['load']:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
