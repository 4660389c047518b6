"""One evaluation for `baseline_eval`, `eval` and `turnrl evaluate` (this module's `main`): the
same engine, decoding and grading, so numbers compare across runs and models.

Blocks of the metrics (`metrics/baseline.json`, `metrics/eval.json`):

- `task`: the training environment's held-out set (its first `eval.limit` problems when
  set), always through the environment's own multi-turn protocol (`env.name`: tool turns, interventions, refinement). With
  `eval.greedy` a greedy pass is reported beside the sampled one (`accuracy_greedy`): a warm
  start can be greedy-perfect and sample-poor, or the reverse.
- one block per benchmark of `eval.benchmarks` (registered: math500, aime24, aime25, amc23,
  gsm8k_test; or a file of one's own), asked as `eval.protocol` says: `single` = one plain
  answer (the `math_answer` environment, `eval.max_tokens` tokens) graded by the benchmark's
  grader (math-verify on the last `\\boxed{}` / `<answer>` by default, against any of the row's
  answers), `multi` = through the training environment like the task, graded by it. Sets with
  subjects and levels (MATH-500: 7 and 5) add `by_subject` and `by_level`. A registered
  benchmark nobody could provide says `available: false` and why.

Every block has `accuracy` (mean@k over `eval.samples` = k samples per problem), `pass_at_k`
(the unbiased estimator), `n` (problems), `correct`, `mean_response_tokens` (policy tokens
per trajectory), `tokens_per_correct` (all policy tokens / correct trajectories, MuTIS's
efficiency measure), `mean_turns`, for tool environments `tool_call_rate` (trajectories that
called the tool) and `tool_success_rate` (whose last call ran: MT-GRPO's tool success), and
how it was decoded: `protocol`, `env`, `temperature`,
`top_p`, `samples_per_problem`, `seed`.

Decoding: `eval.temperature` (0 = greedy), `eval.top_p`, `eval.samples`; every trajectory and
turn samples with a seed derived from `seed`, so the same checkpoint evaluated twice on a fresh
engine gives the same numbers.

Per-problem generations go to `out_dir/<block>.parquet`, one row per trajectory: problem id,
prompt, reference answer, full trajectory text (policy turns and observations), extracted
answer, correct, the grading reason (why right or wrong: the environment's or grader's own,
`info["grade"]`, else `scored <outcome> by <env>`), tokens, turns, decoding, `extra` (the
row's own fields beyond the schema, as JSON), and the conversation as `messages` and `tools`
(OpenAI format, JSON text): the correct rows of a file are data for the `sft` stage
(`sft.data`, which reads JSON text columns as lists), rejection-sampling fine-tuning.

Any Hugging Face checkpoint folder, evaluated exactly as `baseline_eval` and `eval` do:

    turnrl evaluate PATH --out DIR [--params params.yaml] [--data data/processed] [-S key=value ...] [--mlflow]

(or `python -m turnrl.pipeline.evaluate ...`). PATH is a Hugging Face model folder (config.json,
weights, tokenizer), e.g. a published model fetched with `hf download
Qwen/Qwen2.5-Math-1.5B --local-dir ckpt/qwen-math`, or a pipeline model out (models/final; with
`levels.high_model: separate` its high_level/ folder plays the high-level turns). The params are
`--params` with the overrides of `-S` (same syntax as `dvc exp run -S`): the held-out task from
the pipeline's preprocessed data (run `dvc repro preprocess` first), and every benchmark read
from its source now (its `path`, $TURNRL_DATA_DIR or the hub), so a benchmark given with `-S` is
the one scored, whatever was preprocessed. It writes `DIR/metrics.json` (the shape of
metrics/eval.json), `DIR/<block>.parquet` (the per-problem generations) and `DIR/run.json` (the
checkpoint and the resolved params); `--mlflow` also records the run, under the params'
`tracking` settings.

    turnrl evaluate ckpt/qwen-math --out eval/qwen-math \\
        -S model.dtype=bfloat16 -S eval.temperature=0 -S eval.max_tokens=3000 \\
        -S "eval.benchmarks=[math500,aime24,amc23]"
    turnrl evaluate models/final --out eval/olympiad \\
        -S "eval.benchmarks=[{name: olympiad, path: olympiad.jsonl, fields: {prompt: question, answer: final_answer}}]"

Compare two evaluations with `turnrl report A/metrics.json B/metrics.json --out DIR`.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
from collections import defaultdict
from pathlib import Path
from typing import Callable, Sequence

from turnrl import envs
from turnrl.config import BenchmarkCfg, Config, add_params_argument, params_file
from turnrl.data import sources
from turnrl.rollout.chat import ChatFormat
from turnrl.rollout.episodes import StepRunner, runner_for
from turnrl.rollout.multi_turn import ENV_ERROR, Budgets, Trajectory, tool_rates

log = logging.getLogger(__name__)

#: Why a trajectory that ended without a graded answer is wrong (by `Trajectory.finish`).
NO_ANSWER = {
    "truncated": "no answer: the response hit the token limit before its answer was complete",
    "token_budget": "no answer: the trajectory's token budget ran out",
    "max_turns": "no answer within the turn limit",
    "no_action": "no answer found",
    ENV_ERROR: "the environment raised",
}


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


def metric_means(trajs: Sequence[Trajectory], keys: Sequence[str]) -> dict[str, float]:
    """The mean of each of an environment's `eval_metrics` (numeric `info` keys, e.g. a game's
    win / draw / loss) over the trajectories that report it."""
    out = {}
    for key in keys:
        values = [float(t.info[key]) for t in trajs if isinstance(t.info.get(key), (int, float))]
        if values:
            out[key] = sum(values) / len(values)
    return out


def summarize_generations(trajs: Sequence[Trajectory], k: int = 1, metrics: Sequence[str] = ()) -> dict:
    """Accuracy (mean@k), pass@k and token efficiency of trajectories grouped k per problem
    (trajectory i belongs to problem i // k, as `run_rollouts` orders them), and the means of
    the environment's `metrics` (`EnvSpec.eval_metrics`)."""
    n = len(trajs) // k if k else 0
    correct = [t for t in trajs if t.outcome > 0]
    tokens = sum(t.policy_tokens() for t in trajs)
    out = {
        "accuracy": len(correct) / len(trajs) if trajs else 0.0,
        "n": n,
        "correct": len(correct),
        f"pass_at_{k}": (sum(pass_at_k(k, sum(t.outcome > 0 for t in trajs[i:i + k]), k)
                             for i in range(0, len(trajs), k)) / n) if n else 0.0,
        "mean_response_tokens": tokens / len(trajs) if trajs else 0.0,
        "tokens_per_correct": tokens / len(correct) if correct else None,
        "mean_turns": sum(t.num_turns for t in trajs) / len(trajs) if trajs else 0.0,
        "env_errors": sum(t.finish == ENV_ERROR for t in trajs),
    }
    out.update(tool_rates(trajs))
    out.update(metric_means(trajs, metrics))
    if any("partial_credit" in t.info for t in trajs):   # reasoning-gym: the mean score beside accuracy
        out["partial_credit_mean"] = sum(float(t.info.get("partial_credit", t.outcome)) for t in trajs) / len(trajs)
    for name in sorted({name for t in trajs for name in t.rewards}):   # reward functions, by name
        out[f"reward_{name}_mean"] = sum(t.rewards.get(name, 0.0) for t in trajs) / len(trajs)
    return out


def breakdown(trajs: Sequence[Trajectory], key: str, k: int = 1, metrics: Sequence[str] = ()) -> dict:
    """Accuracy (mean@k), problem count and the environment's `metrics` per value of
    `example[key]` (subject, level; a game's "<role> vs <opponent>")."""
    groups: dict[str, list[Trajectory]] = defaultdict(list)
    for t in trajs:
        groups[str(t.example.get(key))].append(t)
    return {g: {"accuracy": sum(t.outcome > 0 for t in v) / len(v), "n": len(v) // k, **metric_means(v, metrics)}
            for g, v in sorted(groups.items())}


def grading_reason(t: Trajectory, env: str | None = None) -> str:
    """Why the trajectory was judged right or wrong, in words, from whoever judged it: the
    environment's (or its grader's) `info["grade"]`, search's exact match; else, for an
    environment that gives no reason, `scored <outcome> by <env>` with its answer."""
    info = t.info
    if info.get("grade"):                       # math_answer, intervention, math_refine, plugins: their verdict
        return str(info["grade"])
    if "exact_match" in info:                   # search: exact match against the gold answers
        verdict = "exact match" if info["exact_match"] else "no exact match"
        gold = t.example.get("answers") or t.example.get("answer")
        return f"{verdict}: predicted {info.get('prediction')!r}, gold {gold!r}"
    if t.finish == ENV_ERROR:
        return f"the environment raised: {info.get('env_error', '')}"
    extracted = info.get("extracted")
    if env == "code_tool" and extracted is not None and t.finish == "answer":
        # code_tool grades its <answer> with math-verify but reports no verdict: the same grading gives it
        from turnrl.rewards.math import grade_any
        return grade_any(f"<answer>{extracted}</answer>", t.example).reason
    if extracted is None and t.finish in NO_ANSWER:
        return NO_ANSWER[t.finish]
    said = f": answer {extracted!r}" if extracted is not None else ""
    return f"scored {t.outcome:g} by {env or 'the environment'}{said} (finish {t.finish})"


def extra_fields(example: dict) -> str:
    """A row's fields beyond the schema's, as JSON (the generations' `extra` column)."""
    return json.dumps({k: v for k, v in example.items() if k not in sources.SCHEMA_FIELDS}, default=str)


def _answers(example: dict) -> list:
    answers = example.get("answers")
    return list(answers) if isinstance(answers, (list, tuple)) and len(answers) else [example.get("answer")]


def records(trajs: Sequence[Trajectory], decode: Callable, decoding: str, benchmark: str, k: int = 1,
            env: str | None = None) -> list[dict]:
    return [{
        "benchmark": benchmark, "id": str(t.example.get("id")), "sample": i % k,
        "prompt": t.shown_prompt, "answer": str(t.example.get("answer")),   # what the model saw first
        # every answer the grader accepts (a list answer, NQ's aliases), as JSON
        "answers": json.dumps(_answers(t.example), default=str),
        "subject": t.example.get("subject"), "level": t.example.get("level"),
        "trajectory": decode(t.response_ids),
        # as text: an environment may extract a number on one row and a string on the next
        "extracted": None if t.info.get("extracted") is None else str(t.info["extracted"]),
        "correct": t.outcome > 0, "reason": grading_reason(t, env), "reward": float(t.info.get("partial_credit", t.outcome)), "finish": t.finish,
        "turns": t.num_turns, "tokens": t.policy_tokens(), "decoding": decoding, "extra": extra_fields(t.example),
        # the conversation (OpenAI messages, JSON): the correct ones of a checkpoint's are sft.data
        "messages": json.dumps(t.messages), "tools": json.dumps(t.tools),
    } for i, t in enumerate(trajs)]


class _Run:
    """The pieces every block shares: engine, chat format, config, output folder."""

    keep: dict | None = None   # block name -> its (sampled-decoding) trajectories, when given

    def __init__(self, cfg: Config, engine, tokenizer, data_dir: Path, out_dir: Path):
        from turnrl.rewards.functions import from_config as reward_functions
        self.cfg, self.engine, self.out_dir = cfg, engine, out_dir
        self.fmt = ChatFormat(tokenizer, cfg.model.template_type)
        self.decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=False)
        self.plain = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
        solver = engine["low"] if isinstance(engine, dict) else engine   # {"low", "high"}: two models
        self.context = getattr(solver, "max_model_len", 1 << 30)
        self.train_env = cfg.env.factory(max_turns=cfg.rollout.max_turns, seed=cfg.seed, data_dir=data_dir)
        spec = envs.resolve(cfg.env.name)
        self.runner = runner_for(spec)   # its episodes: the step loop, the agent gateway, a game's tables
        self.metrics = tuple(spec.eval_metrics)   # info keys the task block reports (a game's win / draw / loss)
        self.reward_functions = reward_functions(cfg.reward, cfg.rollout, judges=False)

    def protocol(self, name: str, grader: str = "math") -> tuple[Callable[[], envs.Env], Budgets, dict]:
        """(environment factory, budgets, the block's protocol fields) for `single` or `multi`."""
        r, e = self.cfg.rollout, self.cfg.eval
        if name == "single":
            return (lambda: envs.make("math_answer", grader=grader), Budgets(1, e.max_tokens, e.max_tokens, self.context),
                    {"protocol": "single", "env": "math_answer", "grader": grader, "max_turns": 1,
                     "max_tokens": e.max_tokens})
        return (self.train_env, Budgets(r.max_turns, r.max_tokens_per_turn, r.max_tokens_total, self.context,
                                        self.cfg.env.step_timeout_s),
                {"protocol": "multi", "env": self.cfg.env.name, "max_turns": r.max_turns,
                 "max_tokens": r.max_tokens_total})

    def block(self, name: str, problems: list[dict], protocol: str, grader: str = "math") -> dict:
        """Evaluate `problems` with the configured decoding; write `<name>.parquet`; the block."""
        e = self.cfg.eval
        make_env, budgets, fields = self.protocol(protocol, grader)
        k = e.samples
        roll = self.runner.run if protocol == "multi" else StepRunner().run
        trajs = roll(self.engine, problems, make_env, self.fmt, budgets, n=k, temperature=e.temperature,
                     top_p=e.top_p, seed=self.cfg.seed, env_workers=self.cfg.env.workers,
                     observation_lag=self.cfg.rollout.observation_lag, rejoin=self.cfg.rollout.rejoin,
                     progress=True, desc=f"eval {name}")
        if name == "task":   # the training reward's parts, on the held-out set
            self.reward_functions.score(trajs, self.plain)
        decoding = "greedy" if e.temperature == 0 else f"temperature={e.temperature},top_p={e.top_p}"
        metrics = self.metrics if protocol == "multi" else ()
        block = {**summarize_generations(trajs, k, metrics), **fields, "temperature": e.temperature, "top_p": e.top_p,
                 "samples_per_problem": k, "seed": self.cfg.seed}
        rows = records(trajs, self.decode, decoding, name, k, fields["env"])
        if name == "task" and e.greedy and e.temperature > 0:
            greedy = roll(self.engine, problems, make_env, self.fmt, budgets, temperature=0.0,
                          seed=self.cfg.seed, env_workers=self.cfg.env.workers, progress=True,
                          observation_lag=self.cfg.rollout.observation_lag, rejoin=self.cfg.rollout.rejoin,
                          desc=f"eval {name} (greedy)")
            g = summarize_generations(greedy, metrics=metrics)
            block.update({"accuracy_greedy": g["accuracy"], "mean_response_tokens_greedy": g["mean_response_tokens"],
                          "tokens_per_correct_greedy": g["tokens_per_correct"],
                          **{f"{key}_greedy": g[key] for key in metrics if key in g}})
            rows += records(greedy, self.decode, "greedy", name, env=fields["env"])
        for key in ("subject", "level"):   # MATH-500's 7 subjects and 5 levels; sets without them skip it
            values = [p.get(key) for p in problems]
            if values and None not in values and len(set(values)) > 1:
                block[f"by_{key}"] = breakdown(trajs, key, k, metrics)
        sources.write_parquet(rows, self.out_dir / f"{name}.parquet")
        if self.keep is not None:   # the trajectories themselves, for traces (log_to_mlflow)
            self.keep[name] = trajs
        self.check_errors(name, trajs)
        return block

    def check_errors(self, name: str, trajs: Sequence[Trajectory]) -> None:
        """A block whose environment (or grader) raised: a warning naming the first error, or,
        above env.max_error_fraction as in training, EnvironmentFailure (its generations are written)."""
        failed = [t for t in trajs if t.finish == ENV_ERROR]
        if not failed:
            return
        limit = self.cfg.env.max_error_fraction
        said = (f"eval {name}: {len(failed)} of {len(trajs)} trajectories ended env_error (their environment or "
                f"grader raised; they score 0); the first, row {failed[0].example.get('id')!r}: "
                f"{failed[0].info.get('env_error', '?')}")
        if len(failed) / len(trajs) > limit:
            from turnrl.training.loop import EnvironmentFailure
            raise EnvironmentFailure(f"{said}; more than env.max_error_fraction = {limit}: fix it (the generations "
                                     f"are in {self.out_dir / (name + '.parquet')})")
        log.warning("%s", said)


Benchmarks = Callable[[BenchmarkCfg], tuple[list[dict] | None, str]]   # spec -> (rows, or None and why not)


def processed_benchmarks(cfg: Config, data_dir: Path) -> Benchmarks:
    """Benchmarks as the preprocess stage wrote them to `data_dir` (the DVC stages' way); a
    benchmark missing there, or preprocessed from another spec, is a FileNotFoundError saying
    to rerun preprocess."""
    from turnrl.pipeline.preprocess import BENCHMARK_DIR, benchmark_record, load_split, manifest
    found = manifest(Path(data_dir))
    for bench in cfg.eval.benchmarks:
        entry = found.get("benchmarks", {}).get(bench.name)
        if entry is None or entry.get("spec") != benchmark_record(bench):
            why = "is not there" if entry is None else "was preprocessed from another spec"
            raise FileNotFoundError(f"{data_dir}: benchmark {bench.name} (eval.benchmarks) {why}; run "
                                    "`dvc repro preprocess` with these eval.benchmarks")

    def read(bench: BenchmarkCfg) -> tuple[list[dict] | None, str]:
        entry = found["benchmarks"][bench.name]
        if not entry.get("available"):
            return None, str(entry.get("reason"))
        return load_split(Path(data_dir) / BENCHMARK_DIR, bench.name), ""
    return read


def source_benchmarks(cfg: Config) -> Benchmarks:
    """Benchmarks read from their files (or data dir, or hub) now, whatever was preprocessed:
    what `turnrl evaluate` uses, so a path given on its command line is the one scored."""
    from turnrl.pipeline.preprocess import load_benchmark

    def read(bench: BenchmarkCfg) -> tuple[list[dict] | None, str]:
        rows, info = load_benchmark(cfg, bench)
        return rows, str(info.get("reason", ""))
    return read


def check_data(cfg: Config, data_dir: Path) -> dict:
    """The preprocess manifest of `data_dir`; FileNotFoundError saying what to run when there
    is none."""
    from turnrl.pipeline.preprocess import manifest
    if not (Path(data_dir) / "manifest.json").exists():
        raise FileNotFoundError(f"{data_dir} holds no preprocessed data (no manifest.json); "
                                "run `dvc repro preprocess` first")
    return manifest(Path(data_dir))


def evaluate(cfg: Config, engine, tokenizer, data_dir: Path, out_dir: Path,
             benchmarks: Benchmarks | None = None, keep: dict | None = None) -> dict:
    """Evaluate the task and every benchmark of `eval.benchmarks` on `engine` (or {"low": policy,
    "high": the high-level model}, see `load_levels`); write the per-problem generations to
    `out_dir/<block>.parquet`; return the metrics (block -> dict). `data_dir` is the preprocess
    stage's output (data/processed: the held-out split, the environment's data files);
    `benchmarks` reads each benchmark (default: as preprocessed there); `keep`, if given, gets
    each block's trajectories by block name (for traces)."""
    from turnrl.pipeline.preprocess import load_split

    data_dir, out_dir = Path(data_dir), Path(out_dir)
    check_data(cfg, data_dir)
    read = benchmarks or processed_benchmarks(cfg, data_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in out_dir.glob("*.parquet"):   # generations of blocks no longer configured
        stale.unlink()
    run = _Run(cfg, engine, tokenizer, data_dir, out_dir)
    run.keep = keep

    heldout = load_split(data_dir, "heldout")
    metrics: dict = {"task": run.block("task", heldout[:cfg.eval.limit] if cfg.eval.limit else heldout, "multi")}
    for bench in cfg.eval.benchmarks:
        problems, reason = read(bench)
        if problems is None:
            log.warning("%s not evaluated: %s", bench.name, reason)
            metrics[bench.name] = {"available": False, "reason": reason, "accuracy": None, "n": 0,
                                   "mean_response_tokens": None, "protocol": cfg.eval.protocol}
            continue
        if cfg.eval.protocol == "multi" and bench.grader != "math":
            log.warning("%s: grader %s applies to eval.protocol: single; with multi the environment (%s) grades",
                        bench.name, bench.grader, cfg.env.name)
        if cfg.eval.limit:
            problems = problems[:cfg.eval.limit]
        if not problems:   # every row dropped (data.bad_rows: drop), or an empty file: no accuracy to report
            reason = f"{bench.name} has no problems to evaluate (every row dropped, or none in its file)"
            log.warning("%s not evaluated: %s", bench.name, reason)
            metrics[bench.name] = {"available": False, "reason": reason, "accuracy": None, "n": 0,
                                   "mean_response_tokens": None, "protocol": cfg.eval.protocol}
            continue
        metrics[bench.name] = {"available": True, **run.block(bench.name, problems, cfg.eval.protocol, bench.grader)}
    return metrics


def flat_metrics(metrics: dict) -> dict[str, float]:
    """`block.key` (and `block.by_subject.X.accuracy`) -> number, for MLflow."""
    out: dict[str, float] = {}
    for bench, block in metrics.items():
        for key, value in block.items():
            if isinstance(value, bool):
                continue
            if isinstance(value, (int, float)):
                out[f"{bench}.{key}"] = value
            elif isinstance(value, dict):
                for group, stats in value.items():
                    if isinstance(stats, dict) and isinstance(stats.get("accuracy"), (int, float)):
                        out[f"{bench}.{key}.{group}.accuracy"] = stats["accuracy"]
    return out


#: Block keys that describe how a block was evaluated: MLflow params, not metrics.
SETTINGS = ("temperature", "top_p", "samples_per_problem", "seed", "max_turns", "max_tokens", "protocol", "env",
            "grader", "available", "reason")


def log_to_mlflow(metrics: dict, out_dir: Path, metrics_name: str, trajectories: dict | None = None,
                  stage: str | None = None) -> None:
    """Log an evaluation to the active MLflow run: the metrics as a dict artifact and as
    numbers in sections (`eval/<block>/accuracy`, ...), the settings each block was evaluated
    with as params (`eval/<block>/temperature`, ...), each generations parquet as a table
    (`generations/<block>.json`) and, given the `trajectories` by block (`evaluate(keep=)`), a
    sample of each block as traces with their correctness as feedback (`tracking.traces.
    per_benchmark`; `stage`: baseline or final, a tag of the traces)."""
    import mlflow
    import pandas as pd

    from turnrl.tracking import traces as tracing
    from turnrl.tracking.artifacts import log_dict, log_table
    from turnrl.tracking.runs import current_run, log_metrics, param_value
    run = current_run()
    settings = {f"eval/{block}/{key}": value for block, values in metrics.items() if isinstance(values, dict)
                for key, value in values.items() if key in SETTINGS}
    numbers = {f"eval/{k.replace('.', '/', 1)}": v for k, v in flat_metrics(metrics).items()
               if k.split(".", 1)[1] not in SETTINGS}
    if run is None:   # outside a stage run (a bare active run)
        mlflow.log_dict(metrics, metrics_name)
        mlflow.log_params({k: param_value(v) for k, v in settings.items()})
        log_metrics(numbers)
        for table in sorted(Path(out_dir).glob("*.parquet")):
            mlflow.log_table(pd.read_parquet(table), f"generations/{table.stem}.json")
        return
    log_dict(run, metrics, metrics_name)
    run.recorder.submit("params", "evaluation settings", lambda c: c.log_batch(
        run.run_id, params=[mlflow.entities.Param(k, param_value(v)) for k, v in settings.items()]))
    log_metrics(numbers)
    for table in sorted(Path(out_dir).glob("*.parquet")):
        log_table(run, pd.read_parquet(table), f"generations/{table.stem}.json")
    per_block = run.cfg.tracking.traces.per_benchmark
    for block, trajs in (trajectories or {}).items():
        tracing.log_traces(run, tracing.evaluation_traces(trajs, block, stage or "evaluation", per_block,
                                                           reason=lambda t: grading_reason(t, run.cfg.env.name),
                                                           env=run.cfg.env.name))


def load_engine(cfg: Config, model_folder: str | Path):
    """The rollout engine (in this process) and tokenizer for a model folder: a stage's model
    out (models/initial, models/final) or any Hugging Face checkpoint folder."""
    from transformers import AutoTokenizer

    from turnrl.training.folders import model_dir
    from turnrl.rollout.engines import context_length, make_engine
    path = model_dir(model_folder)
    engine = make_engine(cfg.rollout.engine, path, dtype=cfg.model.dtype, seed=cfg.seed,
                         kv_cache_gib=cfg.rollout.kv_cache_gib, max_model_len=context_length(path),
                         prefix_caching=cfg.rollout.prefix_caching, kv_block_size=cfg.rollout.kv_block_size)
    return engine, AutoTokenizer.from_pretrained(path)


def load_levels(cfg: Config, model_folder: str | Path, high_folder: str | Path | None = None):
    """(engine, tokenizer) for `model_folder`, like `load_engine`; with `levels.high_model:
    separate`, (engines {"low": policy, "high": high-level model}, tokenizer), the high-level
    model from `high_folder`, or when None from its starting folder (`levels.high_model_path`,
    empty: the policy's)."""
    from turnrl.training.folders import high_level_folder, model_dir
    engine, tokenizer = load_engine(cfg, model_folder)
    if cfg.levels.high_model != "separate":
        return engine, tokenizer
    high = high_level_folder(cfg.levels.high_model_path, model_dir(model_folder)) if high_folder is None else high_folder
    return {"low": engine, "high": load_engine(cfg, high)[0]}, tokenizer


# --------------------------------------------------------------------------- `turnrl evaluate`
BAD_INPUT_EXIT = 2


def _points_elsewhere(model: Path) -> bool:
    """Whether `model` is prepare_model's pointer to a checkpoint (turnrl_model.json of kind
    checkpoint) rather than a model folder of its own."""
    try:
        return json.loads((model / "turnrl_model.json").read_text()).get("kind") == "checkpoint"
    except (OSError, ValueError, AttributeError):
        return False


def check_inputs(cfg: Config, model: Path, data_dir: Path) -> None:
    """Fail early, saying what to do, when the checkpoint or the preprocessed data is missing."""
    if not model.is_dir():
        raise FileNotFoundError(f"{model}: not a folder. Pass a Hugging Face checkpoint folder (config.json, "
                                "weights, tokenizer); for a hub id download it first: "
                                f"hf download <id> --local-dir {model}")
    if not (model / "config.json").exists() and not (model / "turnrl_model.json").exists():
        raise FileNotFoundError(f"{model}: no config.json, so not a Hugging Face checkpoint folder")
    if not _points_elsewhere(model):   # (a pointer to a checkpoint is read where it points)
        try:
            model_type = json.loads((model / "config.json").read_text()).get("model_type")
        except (ValueError, AttributeError):
            model_type = None
        if not model_type:
            raise FileNotFoundError(f"{model}/config.json: no model_type, so not a Hugging Face model's config; pass "
                                    "the folder save_pretrained wrote")
        weights = ("*.safetensors", "*.bin", "*.safetensors.index.json")
        if not any(next(model.glob(pattern), None) for pattern in weights):
            raise FileNotFoundError(f"{model}: no weights (*.safetensors or *.bin); pass the folder save_pretrained "
                                    "wrote (a LoRA adapter folder: merge it first, as the train stage's models/final "
                                    "is)")
    manifest = check_data(cfg, data_dir)
    made_for = (manifest.get("env") or {}).get("name")
    if made_for and made_for != cfg.env.name:
        raise FileNotFoundError(f"{data_dir} was made for env.name = {made_for}, not {cfg.env.name}: its held-out "
                                "rows are that environment's; run `dvc repro preprocess` with env.name = "
                                f"{cfg.env.name} (or pass --data a folder made for it)")


def evaluate_checkpoint(cfg: Config, model: str | Path, out: str | Path,
                        data_dir: str | Path = "data/processed") -> dict:
    """Evaluate checkpoint folder `model`; write `out/metrics.json`, `out/run.json` and the
    generations; return the metrics."""
    from turnrl.pipeline.stage import write_json
    model, out, data_dir = Path(model), Path(out), Path(data_dir)
    check_inputs(cfg, model, data_dir)
    high = model / "high_level"   # levels.high_model: separate: the trained high-level model saved beside the policy
    engine, tokenizer = load_levels(cfg, model, high if high.is_dir() else None)
    metrics = evaluate(cfg, engine, tokenizer, data_dir, out, benchmarks=source_benchmarks(cfg))
    write_json(out / "metrics.json", metrics)
    write_json(out / "run.json", {"checkpoint": str(model.resolve()), "data": str(data_dir.resolve()),
                                  "config": cfg.model_dump()})
    return metrics


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="turnrl evaluate",
                                description="Evaluate a Hugging Face checkpoint folder on the pipeline's benchmarks.")
    p.add_argument("model", type=Path, help="a Hugging Face checkpoint folder")
    p.add_argument("--out", type=Path, required=True, help="folder for metrics.json and the generations")
    add_params_argument(p)
    p.add_argument("--data", type=Path, default=Path("data/processed"),
                   help="the preprocess stage's output (default: data/processed)")
    p.add_argument("-S", "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a param, e.g. -S eval.temperature=0 (repeatable)")
    p.add_argument("--mlflow", action="store_true", help="record the evaluation as an MLflow run")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """`turnrl evaluate PATH --out DIR ...`: exit 0, or 2 with a one-line error on bad input."""
    from turnrl.config import ConfigError, load_config
    from turnrl.data.sources import DataSourceError
    from turnrl.config import checks
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = load_config(params_file(args, None), args.overrides)
        checks.before_evaluate(cfg)   # benchmark files, their fields, MCP commands: before evaluating anything
        check_inputs(cfg, args.model, args.data)
        if args.out.exists() and not args.out.is_dir():
            raise FileNotFoundError(f"--out {args.out}: a file, not a folder; name a folder for the metrics and "
                                    "generations")
    except (ConfigError, FileNotFoundError, DataSourceError) as exc:
        print(f"turnrl evaluate: {exc}", file=sys.stderr)
        return BAD_INPUT_EXIT
    if args.mlflow:
        from turnrl.tracking.runs import stage_run
        with stage_run("evaluate_checkpoint", cfg):
            import mlflow
            mlflow.set_tag("turnrl.checkpoint", str(args.model.resolve()))
            metrics = evaluate_checkpoint(cfg, args.model, args.out, args.data)
            log_to_mlflow(metrics, args.out, "metrics.json")
    else:
        metrics = evaluate_checkpoint(cfg, args.model, args.out, args.data)
    summary = {b: {k: v[k] for k in ("accuracy", "n") if k in v} for b, v in metrics.items()}
    print(json.dumps(summary, indent=2))
    print(f"wrote {args.out / 'metrics.json'} and the generations in {args.out}/", file=sys.stderr)   # stdout: the JSON
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
