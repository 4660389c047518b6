"""`turnrl serve-search`: the search environment's BM25 index over HTTP, one index for many
rollout workers (as Search-R1 and RoSTE run their retrievers).

    turnrl serve-search                        # params.yaml's search corpus, top_k, max_passage_chars
    turnrl serve-search --port 8000 --host 0.0.0.0 -S env.options.top_k=3
    turnrl serve-search --corpus passages.jsonl --top-k 3 --max-passage-chars 300

The corpus, top-k and passage length are the search environment's: from params
(`env.options` when `env.name` is `search`, its defaults otherwise), the corpus being
`env.options.corpus` or the one `preprocess` wrote (`data/processed/corpus.parquet`); flags
override them. Point the environment at it with `env.options.endpoint: http://HOST:PORT`.

    GET  /health   {"ok": true, "passages": N, "digest": ..., "top_k": k, "max_passage_chars": c}
    POST /search   {"query": "...", "k": 3 (optional)}  ->
                   {"passages": [{id, title, text, score}], "result": "<result>...</result>"}

`result` is the observation the environment would show (`format_results`), so the service is
also a ready-made HTTP tool for the `tools` environment (`env.options.http: [{name: search,
url: http://HOST:PORT/search, parameters: {...query...}}]`). Requests are served on threads; the
index is shared (bm25s retrieval under a lock).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from turnrl.config import add_params_argument
from turnrl.envs.search import build_index
from turnrl.envs.search_server import SearchService


def settings(cfg, data_dir: str | Path = "data/processed", given: dict | None = None) -> dict:
    """The search environment's corpus, top_k and max_passage_chars under these params (`cfg`
    None: its defaults), with `given` (-S env.options.KEY=VALUE) over them."""
    from turnrl import envs
    from turnrl.envs.search import CORPUS_FILE
    spec = envs.resolve("search")
    own = dict(cfg.env.options) if cfg is not None and cfg.env.name == "search" else {}
    options = envs.check_options(spec, {**own, **(given or {})})
    corpus = options["corpus"] or str(Path(data_dir) / CORPUS_FILE)
    return {"corpus": corpus, "top_k": options["top_k"], "max_passage_chars": options["max_passage_chars"]}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="turnrl serve-search", description=__doc__.split("\n\n")[0])
    add_params_argument(p)
    p.add_argument("-S", "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a param, e.g. -S env.options.top_k=3 (repeatable)")
    p.add_argument("--data", default="data/processed", help="the preprocess stage's output (its corpus.parquet)")
    p.add_argument("--corpus", help="a passages file or data set name instead of params' corpus")
    p.add_argument("--top-k", type=int, help="passages per search by default (params: env.options.top_k)")
    p.add_argument("--max-passage-chars", type=int, help="passage length in `result` (params: max_passage_chars)")
    p.add_argument("--host", default="127.0.0.1", help="0.0.0.0 to serve other machines")
    p.add_argument("--port", type=int, default=8000, help="0: any free port (printed)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from turnrl.config import ConfigError, load_config, params_file
    from turnrl.pipeline.env_cli import EnvCliError, env_options
    from turnrl.plugins import PluginError
    # -S env.options.KEY=VALUE are the search environment's options, whatever env.name params has
    ours = [o for o in args.overrides if o.strip().lstrip("+").startswith("env.options.")]
    rest = [o for o in args.overrides if o not in ours]
    try:
        params = params_file(args, None)
        if params != "params.yaml" and not Path(params).is_file():   # named (--params, $TURNRL_PARAMS): must be there
            raise ConfigError(f"the params file {params}: no such file")
        cfg = load_config(params, rest) if Path(params).is_file() or rest else None
        chosen = settings(cfg, args.data, env_options(ours))
    except (ConfigError, PluginError, EnvCliError) as exc:
        print(f"turnrl serve-search: {exc}", file=sys.stderr)
        return 2
    corpus = args.corpus or chosen["corpus"]
    top_k = args.top_k if args.top_k is not None else chosen["top_k"]
    max_chars = args.max_passage_chars if args.max_passage_chars is not None else chosen["max_passage_chars"]
    if top_k < 1 or max_chars < 1:
        print("turnrl serve-search: --top-k and --max-passage-chars must be at least 1", file=sys.stderr)
        return 2
    try:
        index = build_index(corpus)
    except (FileNotFoundError, ValueError) as exc:
        print(f"turnrl serve-search: the corpus {corpus!r}: {exc}. Run `dvc repro preprocess` with "
              "env.name=search, or pass --corpus FILE", file=sys.stderr)
        return 2
    try:
        service = SearchService(index, top_k=top_k, max_passage_chars=max_chars, host=args.host, port=args.port)
    except (OSError, OverflowError) as exc:   # the port in use or out of range, an unknown host
        print(f"turnrl serve-search: cannot serve at {args.host}:{args.port} ({exc}); pick another --port (0: any "
              "free one) or --host", file=sys.stderr)
        return 2
    print(f"serving {len(index)} passages of {corpus} (top_k {top_k}, max_passage_chars {max_chars}) at "
          f"{service.url}  (env.options.endpoint: {service.url})", flush=True)
    try:
        service.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        service.server_close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
