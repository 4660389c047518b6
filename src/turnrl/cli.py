"""`turnrl COMMAND ...`: the project's commands under one name.

    turnrl config [params.yaml] [-S k=v]   validate params, check their files, print the resolved config
    turnrl presets [NAME [--apply]]        list presets, print -S args, or write them to params.yaml
    turnrl evaluate PATH --out DIR ...     score any Hugging Face checkpoint on the configured benchmarks
    turnrl report A.json B.json --out DIR  compare two evaluations as Markdown with plots
    turnrl doctor [params.yaml] [-S k=v]   check the environment a run needs (versions, vLLM, DeepSpeed,
                                           Ray at cluster.address, GPUs, MLflow) and say what to fix
    turnrl serve-search [--port 8000] ...  serve the search environment's BM25 index over HTTP, for
                                           env.options.endpoint (rollout workers on many nodes share it)
    turnrl env [NAME] [--row N] [--step T]  an environment's resolved options and tool schemas, a row's
                                           first observation, and steps with the given texts

Every command reads params.yaml, or the file --params FILE or $TURNRL_PARAMS names (as the stages do).
"""
from __future__ import annotations

import importlib
import os
import sys

COMMANDS = {"config": "turnrl.config", "presets": "turnrl.presets",
            "evaluate": "turnrl.pipeline.evaluate", "report": "turnrl.pipeline.report", "doctor": "turnrl.models.doctor",
            "serve-search": "turnrl.pipeline.serve_search",
            "env": "turnrl.pipeline.env_cli"}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] in (["-h"], ["--help"]):
        print(__doc__.strip())
        return 0
    if not args or args[0] not in COMMANDS:
        print(__doc__.strip(), file=sys.stderr)
        if args:
            print(f"\nerror: unknown command {args[0]!r}; the commands: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    # vLLM logs to stdout by default: a command's stdout is its output (evaluate's JSON, config's YAML)
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    try:
        return importlib.import_module(COMMANDS[args[0]]).main(args[1:])
    except KeyboardInterrupt:   # Ctrl-C: one line, the shell's code for it, no traceback
        print(f"turnrl {args[0]}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
