"""turnrl's side of the benchmark.

- `run_loop`: the product path, `turnrl.training.loop.train` on a local Ray cluster of our own
  (`turnrl.training.cluster.start_workers`: one trainer rank, a DeepSpeed engine, and one
  rollout engine, colocated in one placement-group bundle; after every update the weights go
  through Ray's object store in buckets). Per step: the loop's own timers (rollout,
  advantages, train, sync) and the wall time between steps.
- `run_parts`: the same work with the same two worker classes in one process, no Ray, each
  part timed on its own: generation, environment steps, token assembly, old and reference
  logprobs, the update, weight gather and load (named tensors handed over in memory). What
  the Ray loop spends beyond these parts is framework overhead (Ray calls, moving batches and
  weights between processes, idle).
"""
from __future__ import annotations

import os
import shutil
import time
from typing import Any


def tree_cpu_seconds(pid: int | None = None) -> float:
    """CPU seconds (user + system, with reaped children such as sandbox runs) used so far by a
    process and all its live descendants. Less sensitive than wall time to other work on the
    machine: it counts the work a framework does, not the time it waits for a core."""
    import psutil
    root = psutil.Process(pid or os.getpid())
    total = 0.0
    for proc in [root, *root.children(recursive=True)]:
        try:
            t = proc.cpu_times()
            total += t.user + t.system + t.children_user + t.children_system
        except psutil.Error:
            pass
    return total


def tree_niceness(pid: int | None = None) -> list[int]:
    """The niceness values found in a process tree (to check both frameworks ran at one priority)."""
    import psutil
    root = psutil.Process(pid or os.getpid())
    values = set()
    for proc in [root, *root.children(recursive=True)]:
        try:
            values.add(proc.nice())
        except psutil.Error:
            pass
    return sorted(values)


def config(case: dict[str, Any]):
    """The turnrl Config of a benchmark case (same keys the harness gives TRL)."""
    from turnrl.config import parse_config
    return parse_config({
        "seed": case["seed"],
        "model": {"path": case["model_dir"]},
        "env": {"name": "code_tool", **({"workers": case["env_workers"]} if case.get("env_workers") else {})},
        "algorithm": {"name": "grpo", "kl_coef": case["beta"], "clip_low": 0.2, "clip_high": 0.28,
                      "loss_agg": "token-mean"},
        "rollout": {"engine": case["engine"], "n": case["group"], "max_turns": case["turns"],
                    "max_tokens_per_turn": case["max_tokens"],
                    "max_tokens_total": max(case["max_total"], case["max_tokens"])},
        "train": {"steps": case["warmup"] + case["steps"], "prompts_per_step": case["prompts"], "lr": case["lr"],
                  "overlap_rollout": case.get("overlap", False)},
        # the loop gives each role (they take turns) this many threads: the same as TRL's process
        # (with overlap both roles work at once and share them: one thread each from two)
        "cluster": {"num_cpus": case["threads"]},
    }, source="benchmark case")


def run_loop(case: dict[str, Any]) -> dict[str, Any]:
    import ray

    from benchmarks.models import train_rows
    from turnrl.training.loop import train

    cfg = config(case)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    # A cluster of our own (never join another one on this shared machine), in a short temp dir.
    temp_dir = f"/tmp/rb{os.getpid()}"
    ray.init(address="local", num_cpus=cfg.cluster.num_cpus, include_dashboard=False, _temp_dir=temp_dir,
             log_to_driver=False)
    steps: list[dict] = []
    niceness: set[int] = set()
    marks = [time.perf_counter()]
    cpu = [tree_cpu_seconds()]

    def on_step(step: int, metrics: dict, trajs) -> None:
        marks.append(time.perf_counter())
        cpu.append(tree_cpu_seconds())
        step_s = marks[-1] - marks[-2] if step > 1 else metrics["step_s"]
        # seconds the actors spent inside their work calls (timed in the actors themselves)
        engine_busy = (1 - metrics["engine_idle_frac"]) * metrics["step_s"]
        trainer_busy = (1 - metrics["trainer_idle_frac"]) * metrics["step_s"]
        # the step's wall time in neither role's work call: Ray calls, moving batches and
        # weights, the driver's glue, idle. Only when the roles take turns: with overlap their
        # work calls run at once and the difference means nothing.
        outside = {} if case.get("overlap") else {"outside_work_s": step_s - engine_busy - trainer_busy}
        steps.append({
            "step": step,
            "step_s": step_s,
            "engine_busy_s": engine_busy, "trainer_busy_s": trainer_busy, **outside,
            "cpu_s": cpu[-1] - cpu[-2],    # CPU seconds of this process and Ray's (all its descendants)
            "loop_step_s": metrics["step_s"],
            "rollout_s": metrics["rollout_s"], "advantage_s": metrics["advantage_s"],
            "train_s": metrics["train_s"], "sync_s": metrics["sync_s"],
            "gen_tokens": float(sum(t.policy_tokens() for t in trajs)),
            "trained_tokens": metrics["trained_tokens"],
            "batch_tokens": float(sum(len(t.prompt_ids) + len(t.response_ids) for t in trajs)),
            "turns_mean": metrics["turns_mean"], "tool_calls_mean": metrics["tool_calls_mean"],
            "reward_mean": metrics["reward_mean"], "logp_gap_max": metrics["logp_gap_max"],
        })
        niceness.update(tree_niceness())

    try:
        started = time.perf_counter()
        train(cfg, case["model_dir"], case["work_dir"], train_rows(seed=case["seed"]),
              os.path.join(case["work_dir"], "turnrl_out"), on_step=on_step)
        total = time.perf_counter() - started
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)
    return {"framework": "turnrl", "steps": steps, "train_wall_s": total, "niceness": sorted(niceness)}


def run_parts(case: dict[str, Any]) -> dict[str, Any]:
    import copy
    import socket

    import torch

    from turnrl.algos import policy_loss
    from benchmarks.models import train_rows
    from turnrl.training.loop import PromptSampler, advantages_for, collate
    from turnrl.training.rollout_worker import RolloutWorker
    from turnrl.training.workers import PolicyWorker, RolloutParams, TrainerParams, token_logprobs

    cfg = config(case)
    torch.set_flush_denormal(True)
    timers: dict[str, float] = {}

    def add(name: str, seconds: float) -> None:
        timers[name] = timers.get(name, 0.0) + seconds

    # The rollout engine first: in-process vLLM sets up torch.distributed (world of one), which
    # DeepSpeed then reuses.
    rollout = RolloutWorker(case["model_dir"], RolloutParams.of(cfg), case["work_dir"])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    policy = PolicyWorker(case["model_dir"], TrainerParams.of(cfg), master_port=port)

    def timed(call):
        def timed_call(*a, **k):
            start = time.perf_counter()
            try:
                return call(*a, **k)
            finally:
                add("generate", time.perf_counter() - start)
        return timed_call

    engine = rollout.engine
    if hasattr(engine, "stepper"):     # the loop steps vLLM itself: generation is the steps' time
        make_stepper = engine.stepper

        def timed_stepper(**options):
            stepper = make_stepper(**options)
            stepper.step = timed(stepper.step)
            return stepper
        engine.stepper = timed_stepper
    else:
        engine.generate = timed(engine.generate)

    make_env = rollout.make_env
    env_spans: list[tuple[float, float]] = []   # environment steps run in a thread pool: keep spans

    def timed_env():
        start = time.perf_counter()
        env = make_env()
        step = env.step

        def timed_step(text):
            t0 = time.perf_counter()
            try:
                return step(text)
            finally:
                env_spans.append((t0, time.perf_counter()))
        env.step = timed_step
        env_spans.append((start, time.perf_counter()))
        return env
    rollout.make_env = timed_env

    # The same update in plain PyTorch (no DeepSpeed, no metrics), on a copy of the policy: what
    # the update costs without the engine around it.
    plain = copy.deepcopy(policy.engine.module).train()
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=cfg.train.lr, weight_decay=0.0, betas=(0.9, 0.99))

    def plain_update(batch) -> float:
        start = time.perf_counter()
        logp = token_logprobs(plain(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits,
                              batch["input_ids"])
        loss, _ = policy_loss(logp, logp.detach(), batch["advantages"], batch["loss_mask"], clip_low=0.2,
                              clip_high=0.28, dual_clip=None, agg="token-mean")
        loss.backward()
        torch.nn.utils.clip_grad_norm_(plain.parameters(), cfg.train.grad_clip)
        plain_opt.step()
        plain_opt.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    sampler = PromptSampler(train_rows(seed=case["seed"]), cfg.seed)
    on_policy = cfg.algorithm.epochs == 1 and cfg.algorithm.mini_batches == 1
    steps = []
    for step in range(1, case["warmup"] + case["steps"] + 1):
        timers.clear()
        env_spans.clear()
        cpu0 = tree_cpu_seconds()
        t0 = time.perf_counter()
        trajs = rollout.rollout(sampler.next(cfg.train.prompts_per_step), cfg.rollout.n)
        t1 = time.perf_counter()
        batch = collate(trajs, 0)
        batch["advantages"] = advantages_for(cfg.algorithm, cfg.rollout.n, trajs, batch)
        t2 = time.perf_counter()
        if not on_policy:   # train() scores the old policy first (one epoch of one mini-batch: it does not)
            policy.logprobs(batch)
        t3 = time.perf_counter()
        with torch.no_grad():
            token_logprobs(policy.reference(input_ids=batch["input_ids"],
                                            attention_mask=batch["attention_mask"]).logits, batch["input_ids"])
        t4 = time.perf_counter()
        policy.train(batch)          # (old logprobs +) reference logprobs + the update
        t5 = time.perf_counter()
        weights = policy.named_weights()
        t6 = time.perf_counter()
        rollout.load_weights(weights)
        t7 = time.perf_counter()
        cpu1 = tree_cpu_seconds()
        plain_s = plain_update(batch)
        old_s, ref_s = t3 - t2, t4 - t3
        env_wall = covered(env_spans)
        steps.append({
            "step": step,
            "generate_s": timers.get("generate", 0.0),
            "env_s": env_wall,                                   # wall time with any env step running
            "env_calls_s": sum(b - a for a, b in env_spans),     # summed over the pool's threads
            "assembly_s": (t1 - t0) - timers.get("generate", 0.0) - env_wall,
            "advantage_s": t2 - t1,
            "old_logprobs_s": old_s,
            "ref_logprobs_s": ref_s,
            "update_s": max(0.0, (t5 - t4) - old_s - ref_s),   # what train() spends beyond its two forwards
            "weights_gather_s": t6 - t5,
            "weights_load_s": t7 - t6,
            "plain_torch_update_s": plain_s,
            # the step as the loop runs it (train() holds its own old + reference forward)
            "step_s": (t1 - t0) + (t2 - t1) + (t5 - t4) + (t7 - t5),
            "cpu_s": cpu1 - cpu0,   # includes the extra forwards timed above (reference; old if not on-policy)
            "gen_tokens": float(sum(t.policy_tokens() for t in trajs)),
            "batch_tokens": float(batch["attention_mask"].sum()),
            "padded_tokens": float(batch["attention_mask"].numel()),
            "turns_mean": sum(t.num_turns for t in trajs) / len(trajs),
        })
    return {"framework": "turnrl_parts", "steps": steps}


def covered(spans: list[tuple[float, float]]) -> float:
    """Length of the union of time intervals (seconds during which at least one ran)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def run_rollout_sweep(case: dict[str, Any]) -> dict[str, Any]:
    """Rollout tokens/s of the multi-turn loop for each (group size, max turns) in the case,
    one engine, in-process (no trainer)."""
    from benchmarks.models import train_rows
    from turnrl.rollout.multi_turn import Budgets, run_rollouts
    from turnrl.training.rollout_worker import RolloutWorker
    from turnrl.training.workers import RolloutParams

    cfg = config({**case, "turns": max(case["turns_list"]), "group": max(case["groups"])})
    worker = RolloutWorker(case["model_dir"], RolloutParams.of(cfg), case["work_dir"])
    rows = train_rows(seed=case["seed"])
    r = cfg.rollout
    points = []
    offset = 0
    for turns in case["turns_list"]:
        for n in case["groups"]:
            budgets = Budgets(turns, r.max_tokens_per_turn, r.max_tokens_total)
            times, tokens, done_turns = [], [], []
            for rep in range(case["warmup"] + case["steps"]):
                examples = rows[offset:offset + case["prompts"]]
                offset = (offset + case["prompts"]) % (len(rows) - case["prompts"])
                start = time.perf_counter()
                trajs = run_rollouts(worker.engine, examples, worker.make_env, worker.fmt, budgets, n=n,
                                     temperature=r.temperature, top_p=r.top_p, env_workers=cfg.env.workers)
                if rep >= case["warmup"]:
                    times.append(time.perf_counter() - start)
                    tokens.append(sum(t.policy_tokens() for t in trajs))
                    done_turns.append(sum(t.num_turns for t in trajs) / len(trajs))
            points.append({"engine": case["engine"], "group": n, "max_turns": turns, "prompts": case["prompts"],
                           "rollout_s": sorted(times)[len(times) // 2],
                           "tokens_per_s": sum(tokens) / sum(times),
                           "gen_tokens": sum(tokens) / len(tokens),
                           "turns_mean": sum(done_turns) / len(done_turns)})
    return {"framework": "turnrl_rollout", "points": points}
