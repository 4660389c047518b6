"""What a judge adds to a synchronous step, by how its calls are started: each trajectory scored as
it ends (turnrl's default) against each group scored as its last member ends (what a scorer
that needs whole groups gets, and turnrl's default before).

In one process, without Ray or training: the rollout actor's own parts (RolloutWorker: the vLLM
engine, the code_tool environments, the reward functions) roll out a step's batch of the
embedded default (16 prompts x 8) again and again under the same weights, each round three
times with the same prompts and generator seed, so the same trajectories (vLLM's CPU sampler
draws from torch's seeded generator):

- `outcome`: the programmatic reward only (no judge);
- `group` and `trajectory`: the judge only (benchmarks/noisy_judge.py, as benchmarks/judge.py
  serves it: log-normal latency, median 0.5 s, 2% HTTP 503, 1% no score), started as each group
  ends or as each trajectory ends.

The arms take turns within each round (their order rotates), so a slower minute of the shared
machine falls on all three. Per arm: the seconds until the last trajectory ended (`gen_s`), the
seconds the step then waited for its scores (`wait_s`: what a judge adds in sync), and their sum
(`rollout_s`, the step's rollout phase).

    python benchmarks/judge.py --rows sync --seeds 0      # once: the scratch project and its models
    python benchmarks/judge_tail.py                       # -> benchmarks/results/judge-tail.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "src"))

from benchmarks.judge import serve_judge  # noqa: E402
from benchmarks.noisy_judge import TEMPLATE  # noqa: E402

ARMS = ("outcome", "group", "trajectory")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--project", type=Path, default=Path("/tmp/turnrl_judge_bench"),
                        help="a project whose pipeline has run (its params.yaml, data and models)")
    parser.add_argument("--model", default="models/initial", help="the policy, under --project")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--port", type=int, default=8741)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--results", type=Path, default=ROOT / "benchmarks/results/judge-tail.json")
    args = parser.parse_args(argv)

    import torch

    from turnrl.config.loading import load_config
    from turnrl.data.files import read_parquet
    from turnrl.rewards.functions import from_config
    from turnrl.rollout.scored import scored_as_they_finish
    from turnrl.training.rollout_worker import RolloutWorker
    from turnrl.training.workers import RolloutParams

    # the judge of benchmarks/judge.py's judge_sets, as YAML (JSON) values
    judge_entry = {"name": "judge", "base_url": f"http://127.0.0.1:{args.port}/v1", "model": "noisy-judge",
                   "range": [0, 10], "max_concurrency": 32, "timeout_s": 30, "retries": 3, "template": TEMPLATE}
    cfg = load_config(args.project / "params.yaml", [f"seed={args.seed}", "reward.outcome_weight=0",
                                                     f"reward.judges={json.dumps([judge_entry])}",
                                                     "reward.on_error=zero"])
    rows = read_parquet(args.project / "data/processed/train.parquet")
    judge = serve_judge(args.port, args.seed)
    try:
        worker = RolloutWorker(str(args.project / args.model), RolloutParams.of(cfg),
                               str(args.project / "data/processed"))
        judged = worker.reward_functions
        plain = from_config(cfg.reward, cfg.rollout, judges=False)
        r, n, per_step = cfg.rollout, cfg.rollout.n, cfg.train.prompts_per_step

        def one(arm: str, examples: list[dict], generator_seed: int) -> dict:
            torch.manual_seed(generator_seed)
            judged.new_step()   # nothing read from another arm's verdicts on the same trajectories
            fns = plain if arm == "outcome" else judged
            start, ended = time.perf_counter(), {}

            def roll_out(**hook):
                out = worker.runner.run(worker.engine, examples, worker.make_env, worker.fmt, worker.budgets(), n=n,
                                        temperature=r.temperature, top_p=r.top_p, env_workers=cfg.env.workers,
                                        observation_lag=r.observation_lag, rejoin=r.rejoin, **hook)
                ended["t"] = time.perf_counter()
                return out
            trajs = scored_as_they_finish(roll_out, lambda batch: fns.score(batch, worker.decode),
                                          "group" if arm == "group" else "trajectory")
            done = time.perf_counter()
            calls = sum(1 for t in trajs for v in t.info.get("judge_judge", []) if not v.get("cached"))
            return {"arm": arm, "gen_s": ended["t"] - start, "wait_s": done - ended["t"], "rollout_s": done - start,
                    "judge_calls": calls, "response_tokens": sum(len(t.response_ids) for t in trajs) / len(trajs)}

        one("outcome", rows[:per_step], 0)   # warm-up: the engine's first batch, the judge's connections
        one("trajectory", rows[:per_step], 0)
        records = []
        for k in range(args.rounds):
            examples = [rows[(k * per_step + j) % len(rows)] for j in range(per_step)]
            for arm in ARMS[k % 3:] + ARMS[:k % 3]:
                rec = {"round": k, **one(arm, examples, 1000 + k)}
                records.append(rec)
                print(json.dumps({key: round(v, 3) if isinstance(v, float) else v for key, v in rec.items()}),
                      flush=True)
    finally:
        judge.terminate()
    summary = {}
    for arm in ARMS:
        mine = [rec for rec in records if rec["arm"] == arm]
        summary[arm] = {key: round(statistics.mean(rec[key] for rec in mine), 3)
                        for key in ("gen_s", "wait_s", "rollout_s", "judge_calls", "response_tokens")}
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    out = {"commit": commit, "model": args.model, "rounds": args.rounds, "seed": args.seed,
           "summary": summary, "records": records}
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
