"""Smoke runs for the ecosystem family pages' "A recipe that learns on the CPU" sections (issue 53,
part 5): a family with no measured learning run gets one short `dvc exp run` here, from a
checkpoint of the default pipeline (`models/initial` of `env.name: code_tool`, the tiny model
warm-started on its arithmetic task), with `env.stop` set to that checkpoint's `</answer>`.

    python benchmarks/ecosystem_recipes.py --checkpoint /path/to/models/initial --seeds 0

Each run is `benchmarks/learning.py`'s run_one in a scratch copy of the committed project
(copy_project; `-S seed=S -S eval.benchmarks=[]` added), the checkpoint copied into it as
`ckpt`. One seed is a smoke result, not a learning claim (that needs 3 seeds). Results go to
benchmarks/results/ecosystem_recipes.json (a rerun skips finished runs).
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.learning import Row, copy_project, run_one  # noqa: E402

STOP = "++env.stop=['</answer>']"
ROWS = {
    # examples/openenv_guess: a number from 1 to 16, "Higher." / "Lower." / "Correct!", 4 guesses
    "openenv_guess": Row("openenv_guess", "openenv", "grpo", sets=[
        "env.name=openenv",
        "++env.options.command=\"uvicorn 'examples.openenv_guess.server:app' --port {port}\"",
        "++env.options.step_timeout_s=60", STOP, "model.path=ckpt", "rollout.max_turns=4",
        "data.heldout_examples=64", "train.lr=0.0002", "train.steps=10"]),
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", type=Path, required=True, help="a models/initial of the default pipeline")
    p.add_argument("--rows", nargs="+", choices=list(ROWS), default=list(ROWS))
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--work-dir", type=Path, default=Path("/tmp/eco_scratch"))
    p.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results" / "ecosystem_recipes.json")
    args = p.parse_args(argv)
    results = json.loads(args.results.read_text()) if args.results.exists() else []
    for seed in args.seeds:
        for name in args.rows:
            if any(r["row"] == name and r["seed"] == seed and "failed" not in r for r in results):
                continue
            project = args.work_dir / name
            if not (project / "dvc.yaml").exists():
                project.mkdir(parents=True, exist_ok=True)
                copy_project(project)
            if not (project / "ckpt" / "config.json").exists():
                shutil.copytree(args.checkpoint, project / "ckpt")
            print(f"ecosystem_recipes: {name}, seed {seed}", flush=True)
            result = run_one(project, ROWS[name], seed, [])
            result["command"] = result.get("command", "").replace(str(project), "<scratch>")
            result["checkpoint"] = "models/initial of the default pipeline (env.name: code_tool, tiny model)"
            results = [r for r in results if not (r["row"] == name and r["seed"] == seed)] + [result]
            args.results.parent.mkdir(parents=True, exist_ok=True)
            args.results.write_text(json.dumps(results, indent=1) + "\n")
            print(json.dumps({k: result.get(k) for k in ("row", "seed", "baseline", "trained", "gain_pts",
                                                          "baseline_greedy", "trained_greedy", "wall_s", "failed")}),
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
