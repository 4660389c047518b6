"""What the gateway costs a rollout: one batch of the agent task (16 prompts x 8 episodes, the
embedded default's batch) rolled out through the gateway (examples/agents/calculator_agent.py,
the `openai` SDK, in the program host) and through its built-in twin (the `tools` environment with
the agent's two functions: benchmarks/agent_task.py), alternately, on one vLLM engine and model.

    python benchmarks/agent_overhead.py                      # the untrained tiny model, 5 rounds
    python benchmarks/agent_overhead.py --model /tmp/turnrl_agent_bench/gateway/models/initial

Reports the median seconds per batch of each path (after one warm-up batch each: the program
host's start and the engine's first compile), their ratio, and the engine's steps per batch; writes
benchmarks/agent_overhead.json. benchmarks/agent.py measures whole training steps; this isolates
the rollout, where the two paths differ, from the update, where they do not.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

FUNCTIONS = ["examples.agents.calculator_agent:calculator", "examples.agents.calculator_agent:count_digits"]


def tiny_model(folder: Path) -> Path:
    """An untrained tiny model as the tests build it (the same for both paths)."""
    from turnrl.config import Config
    from turnrl.data.synthetic import product_rows
    from turnrl.models.tiny import build_model, build_tokenizer, save
    rows = product_rows(200, seed=0, split="train", exclude=set())
    tokenizer = build_tokenizer([r["prompt"] + f"<answer>{r['answer']}</answer>" for r in rows], 512)
    save(build_model(tokenizer, Config().model.tiny, seed=0), tokenizer, folder)
    return folder


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="a model folder (default: an untrained tiny model)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/agent_overhead.json")
    args = parser.parse_args(argv)

    from transformers import AutoTokenizer

    from benchmarks.agent_task import ENV
    from turnrl.data.synthetic import product_rows
    from turnrl.gateway.program import make_program
    from turnrl.gateway.runner import AgentRunner
    from turnrl.rollout import engines
    from turnrl.rollout.chat import ChatFormat
    from turnrl.rollout.episodes import StepRunner
    from turnrl.rollout.multi_turn import Budgets

    model = args.model or tiny_model(Path(tempfile.mkdtemp(prefix="turnrl_overhead_")))
    fmt = ChatFormat(AutoTokenizer.from_pretrained(model))
    engine = engines.VLLMEngine(str(model), max_model_len=1024)
    rows = product_rows(args.prompts, seed=0, split="train", exclude=set())
    budgets = Budgets(max_turns=3, max_tokens_per_turn=48, max_tokens_total=160, max_context=1024)   # the preset's
    steps = {"n": 0}
    step = engines.VLLMStepper.step

    def counted(self):   # the engine steps a batch took (instrumentation only)
        steps["n"] += 1
        return step(self)
    engines.VLLMStepper.step = counted

    agent = AgentRunner()
    paths = {
        "gateway": lambda: agent.run(engine, rows, lambda: make_program(program="examples.agents.calculator_agent:run",
                                                                       timeout_s=120), fmt, budgets, n=args.n),
        "builtin": lambda: StepRunner().run(engine, rows, lambda: ENV.factory(**ENV.options(functions=FUNCTIONS)
                                                                             .model_dump()), fmt, budgets, n=args.n),
    }
    seconds: dict[str, list[float]] = {name: [] for name in paths}
    engine_steps: dict[str, list[int]] = {name: [] for name in paths}
    for round_ in range(args.rounds + 1):
        for name, roll_out in paths.items():
            steps["n"] = 0
            start = time.perf_counter()
            trajs = roll_out()
            took = time.perf_counter() - start
            assert len(trajs) == args.prompts * args.n
            if round_:   # round 0 warms up: the program host's start, the engine's first compile
                seconds[name].append(round(took, 3))
                engine_steps[name].append(steps["n"])
            print(f"round {round_} {name}: {took:.2f} s, {steps['n']} engine steps", flush=True)
    agent.close()
    median = {name: statistics.median(values) for name, values in seconds.items()}
    result = {"model": str(args.model or "untrained tiny"), "episodes_per_batch": args.prompts * args.n,
              "rounds": args.rounds, "seconds": seconds, "engine_steps": engine_steps, "median_s": median,
              "ratio_gateway_builtin": round(median["gateway"] / median["builtin"], 3)}
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"gateway {median['gateway']:.2f} s, builtin {median['builtin']:.2f} s per batch of "
          f"{args.prompts * args.n}: {result['ratio_gateway_builtin']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
