"""The training loop, on a Ray cluster: one readable loop for every algorithm.

    for step in steps:
        trajectories = rollout engines: multi-turn rollouts, each for its share of the prompts
        advantages   = pure function of rewards, groups and token masks (turnrl.algos)
        metrics      = trainer ranks: policy-gradient update (DeepSpeed, each on its share)
        weights      = trainer -> every engine (named tensors, no engine restart)
        checkpoint   = every train.checkpoint_every steps and at the end (see checkpoint.py)

With `train.overlap_rollout` the engines roll out step s+1 while the trainer updates on step s
(Ray runs an actor's calls in the order they were made, so the weights pushed after update s
load once that rollout is done): each batch is one update old, and the update takes its
importance ratio to the engine's sampling logprobs.

The algorithm (`algorithm.name`, turnrl.algos.registry) is an advantage function of the batch;
its optional `prepare` hook scores the batch first (MLMT's KL terms), and one with a critic
(PPO) gets the critic's values and returns its targets. Every algorithm then runs the same
clipped policy-gradient update.

Hierarchical environments (turns whose `role` is "high", like math_refine's feedback):
`levels.train` / `levels.alternate` leave a level untrained at a step, and with
`levels.high_model: separate` a second model (its own trainer ranks, and an engine in every
rollout actor) plays the high-level turns. The advantages are computed once; each model trains
on its level's turns (`level_mask`), a level frozen this step is not called at all (an all-zero
loss mask would still move Adam's moments), and each pushes to its own engines. The second
model is saved to `out_dir/high_level` and checkpointed as `high_level`.

An environment that raises ends its trajectory (finish env_error); more than
`env.max_error_fraction` of a step's trajectories stops the run with `EnvironmentFailure`.

A run given a checkpoint to resume from loads it first and continues at the next step.
"""
from __future__ import annotations

import logging
import random
import time
from pathlib import Path
from typing import Callable, Sequence

import torch
from tqdm.auto import tqdm

from turnrl.algos import contiguous_group_ids, first_obs_position, per_turn_mean_std
from turnrl.algos.registry import AdvantageInputs, Algorithm, Scorer
from turnrl.algos.registry import resolve as resolve_algorithm
from turnrl.config import AlgorithmCfg, Config, ConfigError, LevelsCfg, TrainCfg
from turnrl.gateway.samples import episode_view, training_rows
from turnrl.training.folders import high_level_folder
from turnrl.rewards import endpoint
from turnrl.rewards.judge import check_rows as check_judge_rows
from turnrl.rewards.shaping import cut_by_budget
from turnrl.rewards.teacher import (check_server_tokenizer as check_teacher_server,
                                   check_tokenizer as check_teacher_tokenizer, teacher_metrics)
from turnrl.rollout.multi_turn import ENV_ERROR, Trajectory, tool_rates
from turnrl.training import served_models
from turnrl.training.checkpoint import CheckpointStore, DamagedCheckpoint, Resume, write_state
from turnrl.training.health import HealthMonitor, UnhealthyTraining
from turnrl.training.rollouts import Rollouts, make_rollouts
from turnrl.training.cluster import (ActorFailure, RolloutGroup, TrainerGroup, Workers, check_cluster, start_ray,
                                     start_workers, two_models)

log = logging.getLogger(__name__)


class EnvironmentFailure(RuntimeError):
    """More than env.max_error_fraction of a step's trajectories ended with their environment
    raising; `history` holds the metrics of the steps run so far."""

    def __init__(self, message: str, history: list[dict] | None = None):
        super().__init__(message)
        self.history = history or []


# --------------------------------------------------------------------------- batches
def collate(trajs: Sequence[Trajectory], pad_id: int) -> dict[str, torch.Tensor]:
    """Trajectories -> right-padded, token-aligned tensors, all [B, L] with L = longest
    prompt + response: input_ids, attention_mask, loss_mask (1 on policy tokens only),
    engine_logprobs (0 elsewhere), turn_ids (-1 outside the response), high (True on the tokens
    of high-level turns and the observations after them); from asynchronous rollouts also
    versions (the policy version that sampled each token's turn, -1 outside the response); with
    reward.teacher teacher_logprobs [B, L], and with its top_k teacher_top_ids and
    teacher_top_logprobs [B, L, k] (0 where the policy did not sample)."""
    width = max(len(t.prompt_ids) + len(t.response_ids) for t in trajs)
    B = len(trajs)
    out = {
        "input_ids": torch.full((B, width), pad_id, dtype=torch.long),
        "attention_mask": torch.zeros((B, width), dtype=torch.long),
        "loss_mask": torch.zeros((B, width)),
        "engine_logprobs": torch.zeros((B, width)),
        "turn_ids": torch.full((B, width), -1, dtype=torch.long),
        "high": torch.zeros((B, width), dtype=torch.bool),
    }
    if any(t.teacher_logprobs for t in trajs):   # reward.teacher's (on-policy distillation)
        out["teacher_logprobs"] = torch.zeros((B, width))
    top_k = max((len(top) for t in trajs for top in t.teacher_top_ids), default=0)
    if top_k:   # reward.teacher.top_k: [B, L, k], entry t the teacher's top tokens at token t's position
        out["teacher_top_ids"] = torch.zeros((B, width, top_k), dtype=torch.long)
        out["teacher_top_logprobs"] = torch.zeros((B, width, top_k))
    stamped = any(t.turn_versions for t in trajs)   # asynchronous rollouts: the version of each turn
    if stamped:
        out["versions"] = torch.full((B, width), -1, dtype=torch.long)
    for row, t in enumerate(trajs):
        p, r = len(t.prompt_ids), len(t.response_ids)
        if stamped and t.turn_versions:
            out["versions"][row, p:p + r] = torch.tensor(t.turn_versions)[torch.tensor(t.turn_ids)]
        out["input_ids"][row, :p + r] = torch.tensor(t.prompt_ids + t.response_ids)
        out["attention_mask"][row, :p + r] = 1
        out["loss_mask"][row, p:p + r] = torch.tensor(t.loss_mask, dtype=torch.float)
        out["engine_logprobs"][row, p:p + r] = torch.tensor(t.engine_logprobs)
        if t.teacher_logprobs:
            out["teacher_logprobs"][row, p:p + r] = torch.tensor(t.teacher_logprobs)
        if top_k and t.teacher_top_ids:   # k each where the policy sampled, none elsewhere
            out["teacher_top_ids"][row, p:p + r] = torch.tensor([ids or [0] * top_k for ids in t.teacher_top_ids])
            out["teacher_top_logprobs"][row, p:p + r] = torch.tensor(
                [lps or [0.0] * top_k for lps in t.teacher_top_logprobs])
        out["turn_ids"][row, p:p + r] = torch.tensor(t.turn_ids)
        out["high"][row, p:p + r] = torch.tensor([t.levels[k] == "high" for k in t.turn_ids], dtype=torch.bool)
    return out


def advantage_inputs(trajs: Sequence[Trajectory], batch: dict[str, torch.Tensor], group_size: int,
                     extras: dict | None = None, state: dict | None = None) -> AdvantageInputs:
    """What an algorithm's advantage function reads, from the trajectories and their batch
    (`state`: the run's memory across steps, kept by the caller)."""
    turns = max((len(t.turn_rewards) for t in trajs), default=0)
    turn_rewards = torch.zeros(len(trajs), turns)
    for row, t in enumerate(trajs):
        turn_rewards[row, :len(t.turn_rewards)] = torch.tensor(t.turn_rewards)
    mask = batch["loss_mask"]
    in_response = batch["turn_ids"] >= 0
    return AdvantageInputs(
        rewards=torch.tensor([t.reward for t in trajs]), turn_rewards=turn_rewards, mask=mask,
        turn_ids=batch["turn_ids"], high=batch["high"], group_ids=contiguous_group_ids(len(trajs), group_size),
        first_obs_pos=first_obs_position(in_response & (mask == 0)), values=batch.get("values"),
        extras=extras or {}, logprobs=batch["engine_logprobs"] * mask, teacher_logprobs=batch.get("teacher_logprobs"),
        roles=tuple(role_key(t.example) for t in trajs), state=state if state is not None else {})


def role_key(example: dict) -> str:
    """"<game>/<role>" of a game seat's row (turnrl.games), "" for every other row."""
    return f"{example.get('game', '')}/{example['role']}" if example.get("role") else ""


def episode_advantages(algorithm_cfg: AlgorithmCfg, group_size: int, trajs: Sequence[Trajectory],
                       rows: Sequence[Trajectory], batch: dict[str, torch.Tensor], extras: dict | None = None,
                       algorithm: Algorithm | None = None, state: dict | None = None):
    """`advantages_for` the episodes, on the rows the trainer trains ([B, L] like `batch`).
    Where no episode has several samples (every built-in environment) rows are the episodes and
    this is `advantages_for` itself. Otherwise (an agent program that edited its context) each
    episode is one trajectory to the algorithm, its samples' responses end to end
    (`episode_view`): group normalisation counts each episode once, turn-level credit sees the
    episode's calls in order, and each row gets the advantages of its own tokens. A critic's
    values go into that layout and its returns come back from it."""
    if not any(t.samples for t in trajs):
        return advantages_for(algorithm_cfg, group_size, trajs, batch, extras, algorithm, state)
    views, placement = episode_view(trajs)
    view_batch = collate(views, pad_id=0)
    spans = [(r, e, len(row.prompt_ids), len(views[e].prompt_ids) + offset, len(row.response_ids))
             for r, (row, (e, offset)) in enumerate(zip(rows, placement))]
    if "values" in batch:
        view_batch["values"] = torch.zeros_like(view_batch["loss_mask"])
        for r, e, start, view_start, length in spans:
            view_batch["values"][e, view_start:view_start + length] = batch["values"][r, start:start + length]
    out = advantages_for(algorithm_cfg, group_size, views, view_batch, extras, algorithm, state)

    def to_rows(view_tensor: torch.Tensor) -> torch.Tensor:
        row_tensor = torch.zeros_like(batch["loss_mask"], dtype=view_tensor.dtype)
        for r, e, start, view_start, length in spans:
            row_tensor[r, start:start + length] = view_tensor[e, view_start:view_start + length]
        return row_tensor
    return tuple(to_rows(x) for x in out) if isinstance(out, tuple) else to_rows(out)


def advantages_for(algorithm_cfg: AlgorithmCfg, group_size: int, trajs: Sequence[Trajectory],
                   batch: dict[str, torch.Tensor], extras: dict | None = None, algorithm: Algorithm | None = None,
                   state: dict | None = None):
    """The advantages [B, L] of `algorithm_cfg.name` (with a critic: (advantages, returns)) for
    the trajectories and their batch (groups of `group_size`, rollout.n); `extras` from the
    algorithm's prepare hook."""
    algorithm = algorithm or resolve_algorithm(algorithm_cfg.name)
    return algorithm.advantages(advantage_inputs(trajs, batch, group_size, extras, state), algorithm_cfg)


# --------------------------------------------------------------------------- levels
def trained_level(levels: LevelsCfg, step: int) -> str:
    """Which level training step `step` (from 1) updates: "both", "high" or "low"
    (`levels.train`, and `alternate: [h, l]`: h steps high, then l steps low)."""
    if levels.train != "both" or not levels.alternate:
        return levels.train
    high_steps, low_steps = levels.alternate
    return "high" if (step - 1) % (high_steps + low_steps) < high_steps else "low"


def level_mask(high: torch.Tensor, level: str) -> torch.Tensor:
    """1.0 on the tokens `level` trains ("both": all, "high": high-level turns', "low": the
    others'), else 0.0; the shape of `high` [B, L]."""
    if level == "both":
        return torch.ones_like(high, dtype=torch.float)
    return high.float() if level == "high" else 1.0 - high.float()


def env_errors(trajs: Sequence[Trajectory]) -> tuple[float, str]:
    """(share of trajectories their environment's exception ended, the first such error, with
    the row it was on)."""
    failed = [t for t in trajs if t.finish == ENV_ERROR]
    if not failed:
        return 0.0, ""
    first = failed[0]
    return len(failed) / max(1, len(trajs)), f"{first.info.get('env_error', '')} (row {first.example.get('id')!r})"


def rollout_metrics(trajs: Sequence[Trajectory], n: int) -> dict[str, float]:
    """Reward, accuracy, turns, lengths, tool use and finish reasons of a rollout batch. (The judges'
    call metrics are the rollout source's: it knows every group judged, dropped ones too.)"""
    count = len(trajs)
    rewards = [t.reward for t in trajs]
    episodes = [t for t in trajs if t.samples or "samples" in t.info]   # an agent program's episodes
    groups = [rewards[i:i + n] for i in range(0, count, n)]
    out = {
        "reward_mean": sum(rewards) / count,
        "accuracy": sum(t.outcome > 0 for t in trajs) / count,
        "turns_mean": sum(t.num_turns for t in trajs) / count,
        "response_tokens_mean": sum(policy_tokens(t) for t in trajs) / count,
        "tool_calls_mean": sum(len(t.observations) for t in trajs) / count,
        "groups_all_same_frac": sum(len(set(g)) == 1 for g in groups) / max(1, len(groups)),
        **tool_rates(trajs),   # the held-out evaluation's tool_call_rate / tool_success_rate
    }
    prompts = sum(t.prefill_tokens + t.cached_tokens for t in trajs)
    if prompts:   # vLLM's prefix cache: the share of the turns' prompt tokens it served, and what was prefilled
        out["prefix_cache_hit_rate"] = sum(t.cached_tokens for t in trajs) / prompts
        out["prefill_tokens_mean"] = sum(t.prefill_tokens for t in trajs) / count
    if episodes:   # gateway episodes: how their calls merged into samples
        out["samples_per_episode"] = sum(len(t.samples) for t in episodes) / len(episodes)
        out["calls_per_episode"] = sum(t.num_turns for t in episodes) / len(episodes)
        with_calls = [t for t in episodes if t.num_turns > 1]
        out["merged_frac"] = sum(t.info["merged_frac"] for t in with_calls) / max(1, len(with_calls))
    # The reward's per-turn parts (a turn a trajectory never reached counts as 0) and the
    # environment's numeric reward components (tool_ok, answer_in_results, f1, improvement, ...).
    for k in range(max((len(t.turn_rewards) for t in trajs), default=0)):
        out[f"turn{k + 1}_reward_mean"] = sum(t.turn_rewards[k] for t in trajs if len(t.turn_rewards) > k) / count
    # Policy tokens per turn, over the trajectories that reached it: which turn grows.
    for k in range(max((t.num_turns for t in trajs), default=0)):
        lengths = [sum(m for s in t.samples or [t] for m, turn in zip(s.loss_mask, s.turn_ids) if turn == k)
                   for t in trajs if t.num_turns > k]
        out[f"turn{k + 1}_tokens_mean"] = sum(lengths) / len(lengths)
    numeric = {key for t in trajs for key, v in t.info.items()
               if isinstance(v, (int, float)) and key not in ("outcome", "reward")}
    for key in sorted(numeric):
        values = [float(t.info[key]) for t in trajs if isinstance(t.info.get(key), (int, float))]
        out[f"env_{key}_mean"] = sum(values) / len(values)
    for reason in ("answer", "no_action", "max_turns", "token_budget", "truncated", ENV_ERROR):
        out[f"finish_{reason}_frac"] = sum(t.finish == reason for t in trajs) / count
    for name in sorted({name for t in trajs for name in t.rewards}):   # reward functions, by name
        out[f"reward_{name}_mean"] = sum(t.rewards.get(name, 0.0) for t in trajs) / count
    out.update(teacher_metrics(trajs))   # reward.teacher of another tokenizer: how exact its mapping was
    return out


def policy_tokens(t: Trajectory) -> int:
    """Tokens the policy sampled in a trajectory (in all the samples of an agent's episode)."""
    return sum(s.policy_tokens() for s in t.samples) if t.samples else t.policy_tokens()


def advantage_metrics(advantages: torch.Tensor, mask: torch.Tensor, turn_ids: torch.Tensor) -> dict[str, float]:
    """Mean |A| over trained tokens, and the mean and std of A per policy turn (all [B, L])."""
    turns = int(turn_ids.max()) + 1 if turn_ids.numel() else 0
    out = {"advantage_abs_mean": float((advantages.abs() * mask).sum() / mask.sum().clamp(min=1))}
    mean, std, count = per_turn_mean_std(advantages, mask, turn_ids, max(turns, 1))
    for k in range(turns):
        if count[k] > 0:
            out[f"advantage_turn{k + 1}_mean"] = float(mean[k])
            out[f"advantage_turn{k + 1}_std"] = float(std[k])
    return out


def sample_table(trajs: Sequence[Trajectory], decode: Callable[[list[int]], str], limit: int = 8) -> dict[str, list]:
    """A few trajectories as columns for an MLflow table."""
    picked = list(trajs[:limit])
    return {
        "prompt": [t.shown_prompt for t in picked],
        "answer": [str(t.example.get("answer", "")) for t in picked],
        "trajectory": [decode(t.response_ids) for t in picked],
        "turns": [t.num_turns for t in picked],
        "turn_rewards": [str(t.turn_rewards) for t in picked],
        "reward": [t.reward for t in picked],
        "finish": [t.finish for t in picked],
    }


class PromptSampler:
    """Seeded shuffled passes over the training rows. `position` (prompts handed out so far)
    is the whole state, so a resumed run continues with the same prompts."""

    def __init__(self, rows: list[dict], seed: int, position: int = 0):
        self.rows, self.seed, self.position = rows, seed, position
        self._epoch, self._perm = -1, []

    def _order(self, epoch: int) -> list[int]:
        order = list(range(len(self.rows)))
        random.Random(f"{self.seed}:{epoch}").shuffle(order)
        return order

    def next(self, count: int) -> list[dict]:
        batch = []
        for _ in range(count):
            epoch, index = divmod(self.position, len(self.rows))
            if epoch != self._epoch:
                self._epoch, self._perm = epoch, self._order(epoch)
            # a copy per draw: a row drawn twice in a step is two prompts, two groups, never one
            # (groups are told apart by their example, e.g. a judge's scope: group)
            batch.append(dict(self.rows[self._perm[index]]))
            self.position += 1
        return batch


def without_unused_teacher(cfg: Config) -> Config:
    """`cfg` without a reward.teacher its algorithm does not learn from (left in params.yaml
    while comparing with grpo): said once, then neither served nor asked (it was called for every
    trajectory, and a failing one stopped a run that never used it)."""
    if not cfg.reward.teacher.enabled or resolve_algorithm(cfg.algorithm.name).teacher:
        return cfg
    log.warning("reward.teacher is set, and algorithm.name = %s learns from no teacher: it is not served nor "
                "asked in this run (algorithm.name: opd distills from it)", cfg.algorithm.name)
    unset = type(cfg.reward.teacher)()
    return cfg.model_copy(update={"reward": cfg.reward.model_copy(update={"teacher": unset})})


# --------------------------------------------------------------------------- the loop
def train(cfg: Config, model_dir: str, data_dir: str, train_rows: list[dict], out_dir: str,
          on_step: Callable[[int, dict, list[Trajectory]], None] | None = None,
          checkpoints: CheckpointStore | None = None, resume: Resume | None = None,
          mlflow_run_id: str | None = None, info: dict | None = None,
          heldout_rows: list[dict] | None = None) -> list[dict]:
    """Run RL steps up to `train.steps` from the model in `model_dir` (or from `resume`, a
    checkpoint in `checkpoints`); save the final HF folder to `out_dir`. With `checkpoints`,
    a checkpoint is written every `train.checkpoint_every` steps and at the end (a run that
    does not resume first removes the old ones). Returns one metrics dict per step, from
    step 1 (a resumed run's earlier steps come from the checkpoint). `info`, if given, gets
    where the actors ran (ranks, engines, nodes). `heldout_rows`: what `train.eval_every` scores."""
    check_cluster(cfg)
    cfg = without_unused_teacher(cfg)
    check_judge_rows(cfg.reward.judges, train_rows, "the training rows")   # before any work
    mismatch = check_teacher_tokenizer(cfg.reward.teacher, model_dir)
    if mismatch:
        raise ConfigError(mismatch)
    _check_api_keys(cfg)
    # Actors run elsewhere (other nodes, other working directories): absolute local paths.
    model_dir, data_dir, out_dir = (str(Path(p).resolve()) if Path(p).exists() or p == out_dir else p
                                    for p in (model_dir, data_dir, out_dir))
    high_dir = str(Path(high_level_folder(cfg.levels.high_model_path, model_dir)).resolve()) if two_models(cfg) else None
    start_ray(cfg)
    t0 = time.perf_counter()
    served = served_models.launch(cfg)   # judges and a teacher turnrl serves start beside the workers
    cfg = served.cfg                     # ... their addresses in params
    workers = None
    try:
        workers = start_workers(cfg, model_dir, data_dir, high_dir)
        served.wait_ready()
        mismatch, unchecked = check_teacher_server(cfg.reward.teacher, model_dir)   # a teacher at base_url too
        if unchecked:
            log.warning(unchecked)
        if mismatch:
            raise ConfigError(mismatch)
    except BaseException:   # e.g. a served model that never answered: nothing left running
        if workers is not None:
            workers.shutdown()
        served.stop()
        raise
    log.info("workers ready in %.1fs", time.perf_counter() - t0)
    if info is not None:
        info.update(trainer_ranks=cfg.cluster.trainer_ranks, rollout_engines=cfg.cluster.rollout_engines,
                    nodes=workers.nodes, placement=cfg.cluster.placement, actors=workers.locations)
    try:
        return _train(cfg, workers, model_dir, train_rows, out_dir, on_step, checkpoints, resume, mlflow_run_id,
                      high_dir, heldout_rows or [])
    finally:
        workers.shutdown()
        served.stop()


def _train(cfg: Config, workers: Workers, model_dir: str, train_rows: list[dict], out_dir: str,
           on_step, checkpoints: CheckpointStore | None, resume: Resume | None, mlflow_run_id: str | None,
           high_dir: str | None = None, heldout_rows: list[dict] = ()) -> list[dict]:
    sampler = PromptSampler(train_rows, cfg.seed)
    algorithm = resolve_algorithm(cfg.algorithm.name)
    monitor = HealthMonitor(cfg.train.health, reward_signal=not algorithm.teacher)
    first, history = _begin(workers, sampler, monitor, checkpoints, resume)
    eos_id = _end_of_turn_id(cfg, model_dir) if algorithm.prepare is not None else None
    rollouts = make_rollouts(cfg, workers.rollout, sampler, version=_pushes_so_far(history))
    try:
        return _steps(cfg, workers, rollouts, algorithm, eos_id, first, history, monitor, sampler, on_step,
                      checkpoints, mlflow_run_id, heldout_rows, model_dir, out_dir, high_dir)
    finally:
        rollouts.close()


def _steps(cfg: Config, workers: Workers, rollouts: Rollouts, algorithm: Algorithm, eos_id: int | None, first: int,
           history: list[dict], monitor: HealthMonitor, sampler: PromptSampler, on_step,
           checkpoints: CheckpointStore | None, mlflow_run_id: str | None, heldout_rows: Sequence[dict],
           model_dir: str, out_dir: str, high_dir: str | None) -> list[dict]:
    """The loop itself: from step `first` to train.steps."""
    t0 = time.perf_counter()
    algorithm_state: dict = {}   # the advantage function's memory across this run's steps (AdvantageInputs.state)
    wall_before = history[-1].get("wall_s", 0.0) if history else 0.0
    bar = tqdm(range(first, cfg.train.steps + 1), desc="train", unit="step")
    for step in bar:
        t_start = time.perf_counter()
        trajs, engine_busy, source_metrics = rollouts.next_batch(step)
        if workers.offload_engines:       # colocated on GPUs: give the device to the trainer
            workers.rollout.call("sleep")
        t_rollout = time.perf_counter()
        _check_environment(cfg, trajs, step, history, bar)   # before the update: never train on broken rollouts

        version = int(source_metrics.get("policy_version", 0))
        batch, stats, trainer_busy, pushes, t_adv = update_on(cfg, workers, algorithm, trajs, step, eos_id, version,
                                                              algorithm_state)
        t_train = time.perf_counter()
        if workers.offload_engines:
            workers.rollout.call("wake_up")
        rollouts.push(pushes)
        t_sync = time.perf_counter()

        metrics = {**rollout_metrics(trajs, cfg.rollout.n), **stats,
                   **advantage_metrics(batch["advantages"], batch["loss_mask"], batch["turn_ids"]),
                   "trained_tokens": float(batch["loss_mask"].sum()),   # policy tokens the update used
                   **source_metrics, "updates_pushed": float(_pushes_so_far(history) + bool(pushes)),
                   **step_timings(t_start, t_rollout, t_adv, t_train, t_sync, engine_busy, trainer_busy,
                                  engines=len(workers.rollout.handles),
                                  generated=sum(policy_tokens(t) for t in trajs)),
                   **dispatch_metrics(cfg, workers.rollout), "step": step}
        if _eval_due(cfg.train, step, heldout_rows):   # after the push: the engines hold this update's weights
            metrics.update(heldout_metrics(workers.rollout, heldout_rows[:cfg.train.eval_examples], step))
            # its groups are not the step's batch; a group re-sent off a failed engine is counted
            after = dispatch_metrics(cfg, workers.rollout)
            if after:
                metrics["dispatch_moved"] += after["dispatch_moved"]
        metrics["wall_s"] = wall_before + time.perf_counter() - t0   # training's own time, across resumes
        failing = _record(monitor, metrics, history, bar, on_step, trajs)
        stop = bool(failing) and cfg.train.on_unhealthy == "stop"
        if checkpoints is not None and _checkpoint_due(cfg, step, stop, failing):
            # Rollouts in flight are not part of the checkpoint: a resumed run samples those prompts again.
            save_checkpoint(workers, checkpoints, step, {"position": sampler.position - rollouts.unused_prompts(step),
                                                         "history": history, "mlflow_run_id": mlflow_run_id})
        if stop:
            bar.close()
            raise UnhealthyTraining(
                f"training stopped at step {step} (train.on_unhealthy: stop): "
                + "; ".join(f"{f.check}: {f.message}" for f in failing)
                + ". Checkpoints are kept: rerun with -S train.on_unhealthy=warn to go on from the last one, or "
                "change what made it unhealthy (e.g. train.lr, algorithm.kl_coef) to start afresh", history)
    bar.close()
    rollouts.close()
    workers.policy.call("save", out_dir, model_dir)
    if workers.high is not None:
        workers.high.call("save", str(Path(out_dir) / HIGH_LEVEL), high_dir)
    return history


def _check_api_keys(cfg: Config) -> None:
    """Before any work: every judge's and the teacher's api_key_env is set here (the actors of a
    local cluster inherit this environment), else the one line that says which."""
    servers = [(f"reward.judges[{k}] ({j.name})", j) for k, j in enumerate(cfg.reward.judges)]
    if cfg.reward.teacher.enabled:
        servers.append(("reward.teacher", cfg.reward.teacher))
    for key, server in servers:
        try:
            endpoint.Session.for_server(server, key)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None


def _pushes_so_far(history: list[dict]) -> int:
    """Updates pushed to the engines before this run's first step (a resumed run's)."""
    return int(history[-1].get("updates_pushed", len(history))) if history else 0


def _begin(workers: Workers, sampler: PromptSampler, monitor: HealthMonitor, checkpoints: CheckpointStore | None,
           resume: Resume | None) -> tuple[int, list[dict]]:
    """(the first step to run, the metrics of the steps already done): a resumed run's (its
    checkpoint loaded, its weights pushed, the sampler and health checks where they were), else
    (1, []), the old checkpoints of another training removed."""
    if resume is None:
        if checkpoints is not None:
            checkpoints.discard_all()
        return 1, []
    log.info("resuming from step %d (%s)", resume.step, resume.path)
    try:
        load_checkpoint(workers, resume.path)
    except ActorFailure as exc:   # every rerun would fail the same way: say which folder to delete
        raise DamagedCheckpoint(f"the checkpoint {resume.path} could not be loaded ({exc}); if it is damaged (a "
                                "file cut short or edited), delete that folder and rerun: the run resumes from the "
                                "checkpoint before it") from None
    for sync in _syncs(workers):
        sync.push()
    sampler.position = resume.state["position"]
    history = list(resume.state["history"])
    monitor.replay(history)
    return resume.step + 1, history


def _end_of_turn_id(cfg: Config, model_dir: str) -> int:
    """The token that closes an assistant turn (Gemma's <end_of_turn>, not its eos): an
    algorithm's prepare hook (MLMT's conversation without the feedback) closes a message with it."""
    from transformers import AutoTokenizer

    from turnrl.rollout.chat import ChatFormat
    return ChatFormat(AutoTokenizer.from_pretrained(model_dir), cfg.model.template_type).end_of_turn_id


def _check_environment(cfg: Config, trajs: Sequence[Trajectory], step: int, history: list[dict], bar) -> None:
    """Stop with EnvironmentFailure when more than env.max_error_fraction of the trajectories
    ended in an error (their environment raised, or reward.teacher gave no logprobs)."""
    error_frac, first_error = env_errors(trajs)
    if error_frac > cfg.env.max_error_fraction:
        bar.close()
        raise EnvironmentFailure(
            f"step {step}: {error_frac:.0%} of the trajectories ended in an error of the environment {cfg.env.name} "
            f"(or of reward.teacher) (env.max_error_fraction {cfg.env.max_error_fraction}); the first: {first_error}. "
            "Fix what it names (the environment's reset or step, the teacher's server), or raise "
            "env.max_error_fraction; checkpoints are kept", history)


def update_on(cfg: Config, workers: Workers, algorithm: Algorithm, trajs: Sequence[Trajectory], step: int,
              eos_id: int | None, version: int = 0, algorithm_state: dict | None = None
              ) -> tuple[dict[str, torch.Tensor], dict[str, float], list[float], list, float]:
    """Learn from one rollout batch: collate it, let the algorithm score it (its prepare hook),
    compute the advantages (and a critic's values and returns), update the policy (each level's
    model on its turns) and the critic. Returns (batch, stats, each trainer rank's busy seconds,
    the weight syncs to push, the time the advantages were ready). `version`: the policy
    version the update starts from (asynchronous rollouts: their turns' versions are beside it)."""
    rows, episode_of = training_rows(trajs)     # an agent program's episode: its samples
    batch = collate(rows, pad_id=0)    # any pad id: padding is outside the attention and loss masks
    if "versions" in batch:
        batch["trainer_version"] = torch.full_like(batch["versions"], version)
    extras, algo_stats, scored = {}, {}, {"low": {}, "high": {}}
    if algorithm.prepare is not None and any(t.samples for t in trajs):
        raise ValueError(f"algorithm.name = {cfg.algorithm.name}: its prepare hook scores one trajectory per episode "
                         "(MLMT's two levels), and this batch has agent episodes (env.name: agent); use an "
                         "algorithm without one (grpo, rloo, mt_grpo, ppo, ...)")
    if algorithm.prepare is not None:   # inputs that need the models, on every policy token
        keep = _keeping(batch, scored)   # the batch's scores, so the update does not compute them again
        scorer = Scorer(
            logprobs=keep(workers.policy.logprobs, "low", "old_logprobs"),
            reference_logprobs=keep(workers.policy.reference_logprobs, "low", "ref_logprobs"),
            high=(keep(workers.high.logprobs, "high", "old_logprobs"),
                  keep(workers.high.reference_logprobs, "high", "ref_logprobs")) if workers.high is not None
            else None, eos_id=eos_id)
        extras, algo_stats = algorithm.prepare(trajs, batch, scorer, cfg.algorithm)
    batch["loss_mask"] *= level_mask(batch["high"], trained_level(cfg.levels, step))   # e.g. a frozen level
    if cfg.train.mask_truncated:   # a cut-off answer is not trained on as a wrong one
        mask_cut_rows(batch["loss_mask"], [trajs[e].finish for e in episode_of])
        algo_stats["truncated_masked"] = float(sum(cut_by_budget([t.finish for t in trajs])))
    if algorithm.critic:   # PPO: the critic's values first; it is fitted on the returns below
        batch["values"] = workers.critic.values(batch)
    advantages = episode_advantages(cfg.algorithm, cfg.rollout.n, trajs, rows, batch, extras, algorithm,
                                    algorithm_state)
    if algorithm.critic:   # (advantages, the critic's targets)
        batch["advantages"], batch["returns"] = advantages
    else:
        batch["advantages"] = advantages
    t_adv = time.perf_counter()
    # PPO: while the critic warms up the policy is scored, not updated (nothing to push).
    update = not algorithm.critic or step > cfg.algorithm.critic_warmup
    stats, trainer_busy, pushes = train_levels(cfg.levels, workers, batch, step, scored, update)
    critic_stats = workers.critic.train(batch, step)[0] if algorithm.critic else {}
    return batch, {**stats, **critic_stats, **algo_stats}, trainer_busy, pushes, t_adv


def mask_cut_rows(loss_mask: torch.Tensor, finishes: Sequence[str]) -> None:
    """Zero the loss mask [rows, T] of the rows whose trajectory a token budget cut (in place)."""
    loss_mask[torch.tensor(cut_by_budget(finishes), dtype=torch.bool)] = 0


def step_timings(t_start: float, t_rollout: float, t_adv: float, t_train: float, t_sync: float,
                 engine_busy: list[float], trainer_busy: list[float], engines: int, generated: int) -> dict[str, float]:
    """Seconds per phase of a step, and the share of the step each role's actors waited (for
    the other role, or the slowest of their own)."""
    step_s = t_sync - t_start
    return {"rollout_s": t_rollout - t_start, "advantage_s": t_adv - t_rollout, "train_s": t_train - t_adv,
            "sync_s": t_sync - t_train, "step_s": step_s,
            # (async: the engines also work while the trainer trains, so their busy time can reach the step's)
            "engine_idle_frac": max(0.0, 1 - sum(engine_busy) / engines / step_s),
            "trainer_idle_frac": max(0.0, 1 - sum(trainer_busy) / len(trainer_busy) / step_s),
            # over the engines' own busy time: with overlap_rollout the wait for them (rollout_s) is not it
            "gen_tokens_per_s": generated / max(1e-9, max(engine_busy)),
            # each engine's: seconds rolling out this step's batch, and the rest of the step
            **{f"engine/{e}/{what}": value for e, busy in enumerate(engine_busy)
               for what, value in (("busy_s", busy), ("idle_s", max(0.0, step_s - busy)))}}


def dispatch_metrics(cfg: Config, rollout: RolloutGroup) -> dict[str, float]:
    """Synchronous steps: the groups each engine rolled out (`engine/<i>/groups`) and the groups
    re-sent off an engine that failed (`dispatch_moved`, rollout.dispatch: least_loaded)."""
    taken = rollout.take_dispatch_metrics()
    return taken if cfg.train.mode == "sync" else {}


def _record(monitor: HealthMonitor, metrics: dict, history: list[dict], bar, on_step, trajs) -> list:
    """Run the health checks on a step's metrics (log what started or stopped failing), add
    the step to `history`, show it and hand it to `on_step`. Returns the failing checks."""
    step = metrics["step"]
    failing, started, recovered = monitor.check(metrics)
    for flag in started:
        log.warning("step %d: unhealthy training (%s): %s", step, flag.check, flag.message)
    for check in recovered:
        log.info("step %d: %s no longer failing", step, check)
    history.append(metrics)
    # shown with the next step's count, not as a refresh of its own: a line per step in a flow's log
    bar.set_postfix(reward=f"{metrics['reward_mean']:.2f}", gap=f"{metrics['logp_gap_max']:.1e}", refresh=False)
    if on_step is not None:
        on_step(step, metrics, trajs)
    return failing


def _eval_due(train: TrainCfg, step: int, heldout_rows: Sequence[dict]) -> bool:
    return bool(train.eval_every and heldout_rows) and (step % train.eval_every == 0 or step == train.steps)


def heldout_metrics(rollout: RolloutGroup, rows: list[dict], step: int) -> dict[str, float]:
    """Held-out accuracy (share of outcomes > 0) and mean reward of one sample per row under
    the engines' current weights, and the seconds it took. Seeded apart from the training
    rollouts (which reseed their engines every step), so it changes no training sample."""
    start = time.perf_counter()
    trajs, _ = rollout.rollout(rows, 1, step + EVAL_SEED_OFFSET)
    return {"heldout_accuracy": sum(t.outcome > 0 for t in trajs) / len(trajs),
            "heldout_reward_mean": sum(t.reward for t in trajs) / len(trajs),
            "eval_s": time.perf_counter() - start}


EVAL_SEED_OFFSET = 1_000_003   # the held-out rollouts' generator streams, apart from every training step's


def _checkpoint_due(cfg: Config, step: int, stop: bool, failing: list) -> bool:
    """Every train.checkpoint_every steps, at the end, and on an unhealthy stop (but not after
    a NaN update, which is not worth keeping: the stop then leaves the last good checkpoint)."""
    every = cfg.train.checkpoint_every
    return (step == cfg.train.steps or bool(every and step % every == 0)
            or (stop and not any(f.check == "non_finite" for f in failing)))


HIGH_LEVEL = "high_level"   # the feedback model's folder in the final model, and its checkpoint entry


def _keeping(batch: dict[str, torch.Tensor], scored: dict[str, dict]) -> Callable:
    """keep(score, level, key): `score` (batch -> token logprobs) that also files its result
    for `batch` itself (not for other batches it scores) under scored[level][key]."""
    def keep(score: Callable, level: str, key: str) -> Callable:
        def scoring(b: dict[str, torch.Tensor]) -> torch.Tensor:
            out = score(b)
            if b is batch:
                scored[level][key] = out
            return out
        return scoring
    return keep


def train_levels(levels: LevelsCfg, workers: Workers, batch: dict[str, torch.Tensor], step: int,
                 scored: dict[str, dict] | None = None, update: bool = True) -> tuple[dict[str, float], list[float], list]:
    """The policy update of a step: (stats, each trainer rank's busy seconds, the weight syncs
    to push). One model: `workers.policy` on the whole batch. Two (`levels.high_model:
    separate`): each model trained at this step (`trained_level`) on its level's turns, the
    high-level model's stats under "high_"; `logp_gap_max` is the larger of the two.
    `scored[level]`: the batch's old / reference logprobs under that level's model, if already
    computed."""
    scored = scored or {}
    if workers.high is None:
        stats, busy = workers.policy.train({**batch, **scored.get("low", {})}, step, update)
        return stats, busy, [workers.sync] if update else []
    level = trained_level(levels, step)
    stats, busy, pushes = {}, [], []
    for name, group, sync, prefix in (("low", workers.policy, workers.sync, ""),
                                      ("high", workers.high, workers.high_sync, "high_")):
        if level not in ("both", name):
            continue   # frozen this step: not called, its optimizer state stays as it is
        part = {**batch, **scored.get(name, {}), "loss_mask": batch["loss_mask"] * level_mask(batch["high"], name)}
        part_stats, part_busy = group.train(part, step)
        stats.update({prefix + k: v for k, v in part_stats.items()})
        busy += part_busy
        pushes.append(sync)
    stats["logp_gap_max"] = max(v for k, v in stats.items() if k.endswith("logp_gap_max"))
    return stats, busy, pushes


def save_checkpoint(workers: Workers, store: CheckpointStore, step: int, state: dict) -> None:
    """Every trainer rank writes its DeepSpeed shard and RNG states into one folder, then the
    driver adds state.json and the store renames the folder into place. The folder must be
    on storage every node shares (train.checkpoint_dir)."""
    with store.writing(step) as folder:
        for role, group in _trainer_roles(workers):
            group.call("save_checkpoint", str(folder / role))
        write_state(folder, {"step": step, "fingerprint": store.fingerprint,
                             **({"params": store.params} if store.params is not None else {}), **state})


def load_checkpoint(workers: Workers, folder: Path) -> None:
    for role, group in _trainer_roles(workers):
        group.call("load_checkpoint", str(folder / role))


def _trainer_roles(workers: Workers) -> list[tuple[str, TrainerGroup]]:
    return [("policy", workers.policy)] + ([("critic", workers.critic)] if workers.critic is not None else []) + (
        [(HIGH_LEVEL, workers.high)] if workers.high is not None else [])


def _syncs(workers: Workers) -> list:
    return [workers.sync] + ([workers.high_sync] if workers.high_sync is not None else [])
