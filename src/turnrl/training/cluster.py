"""The training run's actors on a Ray cluster: where they go, and how they are driven.

    cluster.address  ''           a local Ray with cluster.num_cpus CPUs
                     HOST:PORT    join that cluster (`ray start --head`, `ray start --address`)
    one placement group (cluster.strategy over nodes), its bundles by cluster.placement:
      colocated      bundle i: trainer rank i (+ critic rank i) and rollout engine i share its
                     devices and take turns (the loop runs the phases one after the other)
      separate       a bundle per actor: dedicated devices per role
    trainer ranks    one DeepSpeed process group per model (gloo on CPU, NCCL on GPUs),
                     rendezvous at rank 0's node
    rollout engines  rollout.dispatch: static, each rolls out a contiguous share of a step's
                     prompts, its generator seeded from (seed, step, engine); least_loaded,
                     chunks of groups go to whichever engine is free first, each seeded from
                     (seed, step, its first group), and a failed engine's chunks to the others
                     (RolloutGroup)
    weights          after every update, from the trainer to every engine (`WeightSync`)
    high model       levels.high_model: separate: the high level's model (math_refine's feedback)
                     is a second DeepSpeed group ("high" ranks, as many as the policy's) and a
                     second engine inside every rollout actor; each model's weights go to its own
                     engines
    plugins          the project's own modules that params name (env.name, reward.functions, ...)
                     ship with the job (Ray's py_modules), so every actor imports the same code

Every call on the actors goes through `wait_all`: an actor that dies or raises stops the run
with an `ActorFailure` naming its role and the cause (the one exception: a rollout engine under
rollout.dispatch: least_loaded, whose work the other engines take over while any is left).
"""
from __future__ import annotations

import functools
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, Sequence

from turnrl.config import Config, ConfigError
from turnrl.config.sections import weight_sync_mode
from turnrl.training.batching import combine_rank_stats
from turnrl.training.checkpoint import step_seed
from turnrl.training.workers import TrainerParams

log = logging.getLogger(__name__)


class ActorFailure(RuntimeError):
    """A Ray actor of the run died or raised; the message names its role and the cause."""


# --------------------------------------------------------------------------- checks and plan
def two_models(cfg: Config) -> bool:
    """A second trained model plays the high-level turns (`levels.high_model: separate`)."""
    return cfg.levels.high_model == "separate"


def needs_critic(cfg: Config) -> bool:
    from turnrl.algos.registry import resolve
    return resolve(cfg.algorithm.name).critic


def plugin_modules(cfg: Config) -> list[str]:
    """The project's own packages behind the import paths of params, for Ray's py_modules."""
    from turnrl.plugins import is_import_path, local_packages
    named = [cfg.env.name, cfg.algorithm.name, cfg.algorithm.policy_loss, *cfg.reward.functions,
             *(b.grader for b in cfg.eval.benchmarks),
             *_strings(cfg.env.options)]   # import paths inside the options too (the tools env's functions)
    return local_packages([p for p in named if is_import_path(p)])


def _strings(value) -> list[str]:
    """The strings in an options value that look like import paths (package.module:name)."""
    import re
    if isinstance(value, str):
        return [value] if re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*", value) else []
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    if isinstance(value, (list, tuple)):
        return [s for v in value for s in _strings(v)]
    return []


def check_cluster(cfg: Config) -> None:
    """Params that cannot work together, found before any actor starts."""
    c, alg = cfg.cluster, cfg.algorithm
    rows = cfg.train.prompts_per_step * cfg.rollout.n
    if rows // alg.mini_batches < c.trainer_ranks:
        raise ConfigError(
            f"cluster.trainer_ranks = {c.trainer_ranks}: each mini-batch has only {rows // alg.mini_batches} rows "
            f"(train.prompts_per_step x rollout.n / algorithm.mini_batches) and every rank needs at least one; "
            "raise train.prompts_per_step or lower algorithm.mini_batches or cluster.trainer_ranks")
    if weight_sync_mode(cfg) == "nccl":
        if cfg.rollout.engine != "vllm" or c.engine_gpus <= 0 or c.trainer_gpus <= 0:
            raise ConfigError("cluster.weight_sync = nccl needs rollout.engine: vllm and GPUs for both roles "
                              "(cluster.trainer_gpus, cluster.engine_gpus > 0); use object_store on CPUs")
        if two_models(cfg):
            raise ConfigError("cluster.weight_sync = nccl sends one model's weights; with levels.high_model: "
                              "separate use cluster.weight_sync: object_store")
        if c.placement == "colocated":
            raise ConfigError("cluster.weight_sync = nccl cannot pair a trainer rank and an engine on one GPU "
                              "(NCCL refuses two ranks on one device): use placement: separate, or object_store")
    if cfg.train.overlap_rollout and c.placement == "colocated" and c.engine_gpus > 0:
        raise ConfigError("train.overlap_rollout: the engines generate while the trainer trains, so they cannot share "
                          "its GPUs (colocated engines sleep during the update); use cluster.placement: separate, "
                          "or overlap_rollout: false")


@dataclass(frozen=True)
class Slot:
    """One actor's place: its role, index within the role, bundle and resources."""
    role: str      # policy | critic | high (the high-level model's trainer) | engine
    index: int
    bundle: int
    cpus: float
    gpus: float

    @property
    def name(self) -> str:
        return f"rollout engine {self.index}" if self.role == "engine" else f"{self.role} rank {self.index}"


def plan_placement(cfg: Config) -> tuple[list[dict[str, float]], list[Slot]]:
    """The placement group's bundles and every actor's slot in them (see the module doc).
    Colocated: a bundle's CPUs are its actors' sum, its GPUs the largest request, shared
    evenly (Ray hands the actors of a bundle fractions of the same device)."""
    c = cfg.cluster
    actors = [("policy", r, c.trainer_cpus, c.trainer_gpus) for r in range(c.trainer_ranks)]
    if needs_critic(cfg):
        actors += [("critic", r, c.trainer_cpus, c.trainer_gpus) for r in range(c.trainer_ranks)]
    if two_models(cfg):
        actors += [("high", r, c.trainer_cpus, c.trainer_gpus) for r in range(c.trainer_ranks)]
    actors += [("engine", e, c.engine_cpus, c.engine_gpus) for e in range(c.rollout_engines)]
    if c.placement == "separate":
        slots = [Slot(role, i, k, cpus, gpus) for k, (role, i, cpus, gpus) in enumerate(actors)]
        return [_bundle(s.cpus, s.gpus) for s in slots], slots
    bundles, slots = [], []
    for b in range(max(c.trainer_ranks, c.rollout_engines)):
        members = [a for a in actors if a[1] == b]
        gpus = max(a[3] for a in members)
        bundles.append(_bundle(sum(a[2] for a in members), gpus))
        slots += [Slot(role, i, b, cpus, gpus / len(members)) for role, i, cpus, _ in members]
    return bundles, slots


def _bundle(cpus: float, gpus: float) -> dict[str, float]:
    return {"CPU": cpus, **({"GPU": gpus} if gpus else {})}


def threads_per_actor(cfg: Config, slot: Slot) -> int:
    c = cfg.cluster
    if c.threads_per_actor:
        return c.threads_per_actor
    if not c.address:   # one machine: the actors busy at once are the ranks, or the engines (both with overlap or async)
        both = cfg.train.overlap_rollout or cfg.train.mode == "async"
        busy = c.trainer_ranks + c.rollout_engines if both else max(c.trainer_ranks, c.rollout_engines)
        return max(1, c.num_cpus // busy)
    return max(1, round(slot.cpus))


# --------------------------------------------------------------------------- Ray
def start_ray(cfg: Config) -> None:
    import ray
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if ray.is_initialized():
        return
    modules = plugin_modules(cfg)   # the project's plugins, for actors in other processes and on other nodes
    # ray.init sets a SIGTERM handler that exits mid-cleanup (SystemExit(15), then SIGABRT); a handler
    # the program set first (a stage's: one line, the MLflow run closed) is put back after it
    before = signal.getsignal(signal.SIGTERM) if threading.current_thread() is threading.main_thread() else None
    _init_ray(cfg, modules)
    if callable(before):
        signal.signal(signal.SIGTERM, before)


def _init_ray(cfg: Config, modules: list[str]) -> None:
    import ray
    if cfg.cluster.address:
        import turnrl
        try:   # py_modules: this checkout's turnrl goes with the job to every node's workers
            ray.init(address=cfg.cluster.address, log_to_driver=True,
                     runtime_env={"py_modules": [str(Path(turnrl.__file__).parent), *modules]})
        except Exception as exc:
            raise ConnectionError(
                f"cluster.address = {cfg.cluster.address!r}: no Ray cluster reachable ({type(exc).__name__}: {exc}). "
                "Start one with `ray start --head --port PORT` (and `ray start --address HOST:PORT` on the other "
                "nodes), or leave cluster.address empty for a local Ray; `turnrl doctor` checks it") from None
    else:
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        ray.init(num_cpus=cfg.cluster.num_cpus, include_dashboard=False, log_to_driver=True,
                 runtime_env={"py_modules": modules} if modules else None)


def wait_all(calls: Sequence[tuple[str, Any]], silent_s: float | None = None) -> tuple[list, list[float]]:
    """Results of `calls` ((role, object ref) pairs) in order, and the seconds until each was
    done. The first failure raises ActorFailure at once, without waiting for the others
    (they may be stuck in a collective with the actor that died). `silent_s`: when no call has
    answered for that long, ActorFailure naming the ones still out (a hung actor), not a hang."""
    import ray
    start = last = time.perf_counter()
    pending = {ref: i for i, (_, ref) in enumerate(calls)}
    results: list = [None] * len(calls)
    seconds = [0.0] * len(calls)
    while pending:
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=silent_s)
        if not ready:
            out = ", ".join(calls[i][0] for i in sorted(pending.values()))
            raise ActorFailure(f"{out}: no answer in {time.perf_counter() - last:.0f} s (rollout.engine_timeout_s "
                               f"= {silent_s:g}); a hung engine, or raise the limit if its work is that long")
        last = time.perf_counter()
        for ref in ready:
            i = pending.pop(ref)
            seconds[i] = time.perf_counter() - start
            try:
                results[i] = ray.get(ref)
            except ray.exceptions.RayError as exc:
                raise ActorFailure(f"{calls[i][0]} failed: {_cause(exc)}") from exc
    return results, seconds


def _cause(exc: Exception) -> str:
    import ray
    if isinstance(exc, ray.exceptions.RayTaskError) and exc.cause is not None:
        return f"{type(exc.cause).__name__}: {exc.cause}"
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:600]}"


# --------------------------------------------------------------------------- groups
@dataclass
class ActorGroup:
    """Actors of one role, called together (every rank of a DeepSpeed group must be)."""
    names: list[str]
    handles: list

    def call(self, method: str, *args, **kwargs) -> tuple[list, list[float]]:
        return wait_all([(name, getattr(h, method).remote(*args, **kwargs)) for name, h in zip(self.names, self.handles)])

    def results(self, method: str, *args, **kwargs) -> list:
        return self.call(method, *args, **kwargs)[0]


class TrainerGroup(ActorGroup):
    """The ranks of one DeepSpeed group (policy or critic). Each gets the whole batch (one
    object-store copy) and trains on its share."""

    def train(self, batch: dict, step: int, update: bool = True) -> tuple[dict[str, float], list[float]]:
        """(stats combined over the ranks, each rank's seconds in its update). `update=False`:
        the same forward and stats, no optimizer step (PPO's policy while the critic warms up)."""
        import ray
        timed = self.results("timed_train", ray.put(batch), step, update)
        return combine_rank_stats([stats for stats, _ in timed]), [seconds for _, seconds in timed]

    def values(self, batch: dict):
        import ray
        return self.results("values", ray.put(batch))[0]

    def logprobs(self, batch: dict):
        """Token logprobs [B, L] under the policy's current weights (no grad)."""
        import ray
        return self.results("logprobs", ray.put(batch))[0]

    def reference_logprobs(self, batch: dict):
        """Token logprobs [B, L] under the frozen reference (the starting weights)."""
        import ray
        return self.results("reference_logprobs", ray.put(batch))[0]


class RolloutGroup(ActorGroup):
    """The rollout engines. `dispatch` (rollout.dispatch) says how a synchronous step's groups
    reach them:

        static        each engine rolls out a contiguous share of the step's examples (whole
                      groups of n) in one call, seeded from (seed, step, engine); an engine that
                      fails stops the run (ActorFailure)
        least_loaded  the groups go in chunks of consecutive groups, CHUNKS_PER_ENGINE per engine
                      on average, one chunk in flight per engine: the engine that finishes first
                      gets the next chunk (turnrl.rollout.dispatch), so an engine whose chunk held
                      the long episodes no longer holds up a share of its own. Each chunk is
                      seeded from (seed, step, its first group's index), not from the engine, so
                      which engine rolled it out changes no token. An engine that dies or raises
                      leaves the dispatch: its chunks go to the others (counted once in
                      dispatch_moved) and the step completes; with none left, ActorFailure
                      naming every engine's cause. A later step skips it; `rejoin` brings a
                      restarted one back. With one engine: a single call, as static.

    `engine_timeout_s` (rollout.engine_timeout_s): an engine with work outstanding that finishes
    nothing for that long is hung. least_loaded treats it as failed (it is killed, its chunks go
    to the others); static stops the run with ActorFailure naming it. Never a silent hang.

    A whole episode (every turn) is rolled out inside one worker, so its turns stick to the
    engine that holds its prefix without any help from the dispatch."""

    CHUNKS_PER_ENGINE = 4   # finer: better balance, smaller batches per engine call

    def __init__(self, names: list[str], handles: list, seed: int, dispatch: str = "static",
                 engine_timeout_s: float | None = None):
        super().__init__(names, handles)
        if dispatch not in ("static", "least_loaded"):
            raise ValueError(f"rollout dispatch {dispatch!r}: static or least_loaded")
        self.seed, self.dispatch, self.engine_timeout_s = seed, dispatch, engine_timeout_s
        self.dead: dict[int, str] = {}            # engine index -> why it left the dispatch
        self.in_flight: list[_Dispatched] = []    # least_loaded rollouts not collected yet
        self._groups = [0] * len(handles)         # groups each engine rolled out, since take_dispatch_metrics
        self._moved = 0
        self._shares: dict[Any, int] = {}         # static: groups in each call in flight

    def rollout(self, examples: list[dict], n: int, step: int) -> tuple[list, list[float]]:
        """`n` trajectories per example (whole groups of n on one engine), in the examples'
        order (trajectory i of example i // n), and each engine's busy seconds for them."""
        return self.collect(self.submit(examples, n, step))

    def submit(self, examples: list[dict], n: int, step: int):
        """`rollout` started, not waited for: give the result to `collect`."""
        live = [e for e in range(len(self.handles)) if e not in self.dead]
        if self.dispatch == "least_loaded" and len(self.handles) > 1:
            dispatched = _Dispatched(self, live, examples, n, step)
            self.in_flight.append(dispatched)
            return dispatched
        count = len(self.handles)
        shares = [examples[e * len(examples) // count:(e + 1) * len(examples) // count] for e in range(count)]
        calls = [(name, h.timed_rollout.remote(share, n, generator_seed=step_seed(self.seed, step, e)))
                 for e, (name, h, share) in enumerate(zip(self.names, self.handles, shares)) if share]
        self._shares.update({ref: len(share) for (_, ref), share in zip(calls, [s for s in shares if s])})
        return calls

    def collect(self, calls) -> tuple[list, list[float]]:
        """(the trajectories in the examples' order, each engine's busy seconds: one entry per
        engine, 0 for one that rolled out nothing)."""
        busy = [0.0] * len(self.handles)
        if isinstance(calls, _Dispatched):
            trajs, busy, groups, moved = calls.wait()
            self.in_flight = [d for d in self.in_flight if d is not calls]
            self._groups = [a + b for a, b in zip(self._groups, groups)]
            self._moved += moved
            return trajs, busy
        results = wait_all(calls, self.engine_timeout_s)[0]
        for (name, ref), (_, seconds) in zip(calls, results):
            e = self.names.index(name)
            busy[e] += seconds
            self._groups[e] += self._shares.pop(ref, 0)
        return [t for trajs, _ in results for t in trajs], busy

    def flush(self) -> None:
        """Before anything else is queued on the engines (a weight push): every chunk of the
        rollouts in flight is sent now (to the least-loaded engines, by queued groups), so it
        runs before that call and under the weights it was started with."""
        for dispatched in self.in_flight:
            dispatched.flush()

    def live(self) -> tuple[list[str], list]:
        """The names and handles of the engines still in the dispatch."""
        keep = [e for e in range(len(self.handles)) if e not in self.dead]
        return [self.names[e] for e in keep], [self.handles[e] for e in keep]

    def rejoin(self, index: int, handle=None) -> None:
        """Engine `index` (restarted: its new `handle`) takes part in the dispatch again. It
        must hold the current weights first (a weight push to it)."""
        if handle is not None:
            self.handles[index] = handle
        self.dead.pop(index, None)

    def take_dispatch_metrics(self) -> dict[str, float]:
        """Groups per engine (`engine/<i>/groups`) and `dispatch_moved` (groups re-sent off an
        engine that failed) since the last call; counters restart."""
        metrics = {f"engine/{e}/groups": float(g) for e, g in enumerate(self._groups)}
        metrics["dispatch_moved"] = float(self._moved)
        self._groups, self._moved = [0] * len(self.handles), 0
        return metrics


class _Dispatched:
    """One least-loaded rollout in flight (RolloutGroup.submit): a thread of the driver sends
    each chunk to the engine the Dispatcher picks (one chunk in flight per engine until
    `flush`) and takes the results as they come (ray.wait), so it goes on while the driver
    waits on something else (the update, with train.overlap_rollout)."""

    def __init__(self, group: RolloutGroup, live: list[int], examples: list[dict], n: int, step: int):
        import threading
        from collections import deque

        from turnrl.rollout.dispatch import Dispatcher
        self.group, self.n = group, n
        engines = len(live) or 1
        size = max(1, -(-len(examples) // (engines * group.CHUNKS_PER_ENGINE)))
        self.chunks = [(start, examples[start:start + size]) for start in range(0, len(examples), size)]
        self.results: list = [None] * len(self.chunks)
        self.busy = [0.0] * len(group.handles)
        self.groups = [0] * len(group.handles)
        self.todo = deque(range(len(self.chunks)))
        self.running: dict[Any, tuple[int, int]] = {}     # ref -> (chunk, engine)
        self.progress: dict[int, float] = {}               # engine -> when it last finished a chunk or got one idle
        self.dispatcher = Dispatcher(live, capacity=1)
        self.step = step
        self.error: BaseException | None = None
        self.lock = threading.Lock()
        self.finished = threading.Event()
        if not live:
            self.error = self._none_left()
            self.finished.set()
            return
        self.thread = threading.Thread(target=self._run, name=f"turnrl-dispatch-{step}", daemon=True)
        self.thread.start()

    def _none_left(self) -> ActorFailure:
        why = "; ".join(f"{self.group.names[e]}: {cause}" for e, cause in sorted(self.group.dead.items()))
        return ActorFailure(f"every rollout engine failed ({why})")

    def _send(self) -> None:
        """Each queued chunk to the engine the dispatcher picks, while one has room (lock held)."""
        while self.todo:
            chunk = self.todo[0]
            start, examples = self.chunks[chunk]
            engine = self.dispatcher.assign(chunk, work=len(examples))
            if engine is None:
                return
            self.todo.popleft()
            if not any(e == engine for _, e in self.running.values()):
                self.progress[engine] = time.perf_counter()
            seed = step_seed(self.group.seed, self.step, f"group {start}")
            ref = self.group.handles[engine].timed_rollout.remote(examples, self.n, generator_seed=seed)
            self.running[ref] = (chunk, engine)

    def _take(self, ref) -> None:
        """A chunk's result, or its engine's failure: that engine leaves, its chunks go back."""
        import ray
        chunk, engine = self.running.pop(ref)
        try:
            trajs, seconds = ray.get(ref)
        except ray.exceptions.RayError as exc:
            self._leave(engine, _cause(exc))
            return
        self.progress[engine] = time.perf_counter()
        self.dispatcher.done(chunk)
        self.results[chunk] = trajs
        self.busy[engine] += seconds
        self.groups[engine] += len(self.chunks[chunk][1])

    def _leave(self, engine: int, cause: str) -> None:
        """`engine` failed or hung: it leaves the dispatch and its chunks go back to the queue."""
        self.group.dead[engine] = cause
        log.warning("%s failed, its rollouts go to the other engines: %s", self.group.names[engine], cause)
        back = self.dispatcher.remove(engine)
        self.running = {r: ce for r, ce in self.running.items() if ce[1] != engine}
        self.todo.extendleft(sorted(back, reverse=True))
        if not self.dispatcher.live:
            raise self._none_left()

    def _hung(self) -> list[int]:
        """Engines with chunks out that finished nothing for engine_timeout_s."""
        limit, now = self.group.engine_timeout_s, time.perf_counter()
        busy = {e for _, e in self.running.values()}
        return [] if limit is None else [e for e in sorted(busy) if now - self.progress[e] > limit]

    def _run(self) -> None:
        import ray
        try:
            while True:
                with self.lock:
                    self._send()
                    if not self.running and not self.todo:
                        return
                    refs = list(self.running)
                ready, _ = ray.wait(refs, num_returns=1, timeout=1.0)
                with self.lock:
                    for ref in ready:
                        if ref in self.running:   # (not dropped with an engine that failed meanwhile)
                            self._take(ref)
                    for engine in self._hung():
                        ray.kill(self.group.handles[engine], no_restart=True)   # its stuck work holds CPU/GPU
                        self._leave(engine, f"no answer in {self.group.engine_timeout_s:g} s (rollout.engine_timeout_s)")
        except BaseException as exc:   # handed to the caller of wait()
            self.error = exc
        finally:
            self.finished.set()

    def flush(self) -> None:
        with self.lock:
            self.dispatcher.capacity = None
            if self.dispatcher.live:
                self._send()

    def wait(self) -> tuple[list, list[float], list[int], int]:
        """(trajectories in the examples' order, busy seconds and groups per engine, groups moved)."""
        self.finished.wait()
        if self.error is not None:
            raise self.error
        return [t for part in self.results for t in part], self.busy, self.groups, int(self.dispatcher.moved_work)


# --------------------------------------------------------------------------- weights
class WeightSync(Protocol):
    """After an update: every engine gets the trainer's weights. With wait=False the engines'
    part may still be running on return (it queues behind an engine's rollout in flight): the
    calls to wait for are returned."""
    def push(self, wait: bool = True) -> list[tuple[str, Any]]: ...


@dataclass
class ObjectStoreSync:
    """Rank 0's weights as buckets of named CPU tensors in Ray's object store (shared memory
    on its node, transferred once to each other node), streamed into every engine still in the
    dispatch (one that failed under rollout.dispatch: least_loaded is skipped)."""
    policy: TrainerGroup
    engines: RolloutGroup
    bucket_mb: int
    level: str = "low"   # which engine of each rollout actor: the policy's, or the high-level model's (high)

    def push(self, wait: bool = True) -> list[tuple[str, Any]]:
        buckets = self.policy.results("weight_buckets", self.bucket_mb)[0]
        self.engines.flush()   # the rollouts in flight (overlap_rollout) run before the load, on the older weights
        calls = [(name, h.load_weight_buckets.remote(buckets, self.level)) for name, h in zip(*self.engines.live())]
        if wait:
            wait_all(calls)
            return []
        return calls


@dataclass
class NcclSync:
    """GPUs in separate placement: vLLM's NCCL weight transfer. Trainer rank 0 and every
    engine form one NCCL group; rank 0 broadcasts each parameter (gathered under ZeRO-3 by
    all ranks) and the engines load it in place. Not run on this project's CPU-only CI."""
    policy: TrainerGroup
    engines: RolloutGroup
    address: tuple[str, int]

    def __post_init__(self) -> None:
        host, port = self.address
        self.policy.call("init_weight_transfer", host, port, 1 + len(self.engines.handles), self.engines.handles)

    def push(self, wait: bool = True) -> list[tuple[str, Any]]:
        self.engines.flush()
        self.policy.call("send_weights")   # the engines take part in the broadcast: done on return
        return []


# --------------------------------------------------------------------------- start
@dataclass
class Workers:
    policy: TrainerGroup
    rollout: RolloutGroup
    critic: TrainerGroup | None = None     # algorithms with a critic (PPO)
    high: TrainerGroup | None = None       # levels.high_model: separate, the high-level model's ranks
    sync: WeightSync | None = None
    high_sync: WeightSync | None = None
    offload_engines: bool = False          # colocated on GPUs: engines sleep while the trainer trains
    locations: dict[str, dict] = field(default_factory=dict)
    placement_group: Any = None

    @property
    def nodes(self) -> int:
        return len({loc["node_id"] for loc in self.locations.values()})

    def shutdown(self) -> None:
        """Remove the placement group: its actors end with it."""
        if self.placement_group is not None:
            import ray
            ray.util.remove_placement_group(self.placement_group)
            self.placement_group = None


def start_workers(cfg: Config, model_dir: str, data_dir: str, high_model_dir: str | None = None) -> Workers:
    """Place and start every actor, join the trainer ranks into their DeepSpeed groups, and
    set up the weight sync. Logs where each actor runs. `high_model_dir`: the high-level model's
    starting folder with `levels.high_model: separate`."""
    import ray
    bundles, slots = plan_placement(cfg)
    pg = _placement_group(cfg, bundles)
    try:
        return _start(cfg, model_dir, data_dir, pg, slots, high_model_dir)
    except BaseException:
        ray.util.remove_placement_group(pg)   # and with it every actor started so far
        raise


def start_trainer_ranks(cfg: Config, model_dir: str, params: TrainerParams, **worker_options) -> tuple[TrainerGroup, Any]:
    """The policy's trainer ranks alone, no engines (the sft stage), each in a bundle of its own
    (cluster.trainer_ranks, trainer_cpus, trainer_gpus): (the group, its placement group, whose
    removal ends them). `worker_options`: PolicyWorker's keyword arguments."""
    import ray
    from turnrl.training.workers import PolicyWorker
    c = cfg.cluster
    slots = [Slot("policy", r, r, c.trainer_cpus, c.trainer_gpus) for r in range(c.trainer_ranks)]
    pg = _placement_group(cfg, [_bundle(s.cpus, s.gpus) for s in slots])
    try:
        host, port = _rendezvous(pg, slots[0])
        env = {} if c.trainer_gpus else {"DS_ACCELERATOR": "cpu"}
        handles = [ray.remote(PolicyWorker).options(**_actor_options(cfg, pg, s, env)).remote(
            model_dir, params, rank=s.index, world_size=len(slots), master_addr=host, master_port=port,
            **worker_options) for s in slots]
        group = TrainerGroup([s.name for s in slots], handles)
        wait_all([(name, h.where.remote()) for name, h in zip(group.names, group.handles)])
        return group, pg
    except BaseException:
        ray.util.remove_placement_group(pg)
        raise


def _placement_group(cfg: Config, bundles: list[dict[str, float]]):
    """A placement group of `bundles`, ready; ActorFailure saying what to lower if it cannot be placed."""
    import ray
    c = cfg.cluster
    pg = ray.util.placement_group(bundles, strategy=c.strategy)
    try:
        ray.get(pg.ready(), timeout=c.ready_timeout_s)
    except ray.exceptions.GetTimeoutError:
        ray.util.remove_placement_group(pg)
        raise ActorFailure(
            f"the cluster cannot place the run's actors within {c.ready_timeout_s:.0f}s: bundles {bundles} "
            f"({c.strategy}), available {ray.available_resources()}. Lower cluster.trainer_cpus / engine_cpus / "
            "*_gpus, raise cluster.num_cpus, or add nodes") from None
    return pg


def _strategy(pg, slot: Slot):
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    return PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=slot.bundle)


def _actor_options(cfg: Config, pg, slot: Slot, env: dict[str, str]) -> dict:
    """Ray options of the actor in `slot`: its resources, bundle, threads and environment (with
    the run's MLflow store and experiment, for what actors start: an agent program's traces)."""
    threads = str(threads_per_actor(cfg, slot))
    tracking_env = {k: os.environ[k] for k in ("MLFLOW_TRACKING_URI", "TURNRL_MLFLOW_EXPERIMENT_ID") if os.environ.get(k)}
    return {"num_cpus": slot.cpus, "num_gpus": slot.gpus, "scheduling_strategy": _strategy(pg, slot),
            "runtime_env": {"env_vars": {"OMP_NUM_THREADS": threads, "TOKENIZERS_PARALLELISM": "false",
                                         "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE"),
                                         **tracking_env, **env}}}


def _rendezvous(pg, slot: Slot) -> tuple[str, int]:
    """A free address on the node of `slot`'s bundle (a DeepSpeed group's or NCCL's rendezvous)."""
    import ray
    return ray.get(ray.remote(num_cpus=0)(_free_port_here).options(scheduling_strategy=_strategy(pg, slot)).remote())


def _start(cfg: Config, model_dir: str, data_dir: str, pg, slots: list[Slot], high_model_dir: str | None) -> Workers:
    import ray

    from turnrl.rollout.engines import cpu_env_defaults
    from turnrl.training.rollout_worker import RolloutWorker
    from turnrl.training.workers import CriticWorker, PolicyWorker, RolloutParams
    c = cfg.cluster
    options = functools.partial(_actor_options, cfg, pg)
    rendezvous = functools.partial(_rendezvous, pg)

    trainer_env = {} if c.trainer_gpus else {"DS_ACCELERATOR": "cpu"}
    trainer_params = TrainerParams.of(cfg)   # each role gets the params it reads, validated once here
    groups = {}
    for role, cls, folder in (("policy", PolicyWorker, model_dir), ("critic", CriticWorker, model_dir),
                              ("high", PolicyWorker, high_model_dir)):
        members = [s for s in slots if s.role == role]
        if not members:
            continue
        host, port = rendezvous(members[0])
        handles = [ray.remote(cls).options(**options(s, trainer_env)).remote(
            folder, trainer_params, rank=s.index, world_size=len(members), master_addr=host, master_port=port)
            for s in members]
        groups[role] = TrainerGroup([s.name for s in members], handles)

    sync_mode = weight_sync_mode(cfg)
    engine_options: dict[str, Any] = {}
    offload = c.placement == "colocated" and c.engine_gpus > 0 and cfg.rollout.engine == "vllm"
    if c.engine_gpus > 0 and cfg.rollout.engine == "vllm":
        engine_options["gpu_memory_utilization"] = c.engine_gpu_memory
        engine_options["enable_sleep_mode"] = offload
    if sync_mode == "nccl":
        engine_options["weight_transfer_config"] = {"backend": "nccl"}
    engine_env = cpu_env_defaults(cfg.rollout.kv_cache_gib)
    engine_slots = [s for s in slots if s.role == "engine"]
    asynchronous = cfg.train.mode == "async"
    if asynchronous and cfg.rollout.engine == "vllm":
        # weights are reloaded between two engine steps while requests run: no step may be in flight
        # then. The prefix cache stays on (a turn reuses its episode's earlier turns): every push drops
        # each cached block and recomputes the running requests' keys and values under the new weights
        # (engines.forget_older_kv), so no block of older weights is ever reused. Clearing rather than
        # salting by policy version: a block the older weights computed is of no use to a request
        # sampled with the new ones, so keeping it would only take room
        engine_options.update(async_scheduling=False)
    engines = RolloutGroup([s.name for s in engine_slots], [
        # async: feed, take_groups and weight loads reach the actor while its stream generates
        ray.remote(RolloutWorker).options(**options(s, engine_env), max_concurrency=4 if asynchronous else 1).remote(
            model_dir, RolloutParams.of(cfg), data_dir, engine_options, high_model_dir if "high" in groups else None)
        for s in engine_slots], seed=cfg.seed, dispatch=cfg.rollout.dispatch,
        engine_timeout_s=cfg.rollout.engine_timeout_s)

    everyone = [*groups.values(), engines]
    names = [name for g in everyone for name in g.names]
    places = wait_all([(name, h.where.remote()) for g in everyone for name, h in zip(g.names, g.handles)])[0]
    workers = Workers(groups["policy"], engines, groups.get("critic"), groups.get("high"), offload_engines=offload,
                      locations=dict(zip(names, places)), placement_group=pg)
    for name, loc in workers.locations.items():
        log.info("%s: node %s (%s), pid %s%s, turnrl from %s", name, loc["node"], loc["node_id"][:8], loc["pid"],
                 f", GPUs {loc['gpus']}" if loc["gpus"] else "", loc["turnrl"])
    log.info("%d trainer ranks (ZeRO-%d, %s), %d rollout engines, %s placement on %d node(s), weights by %s",
             c.trainer_ranks, cfg.train.zero_stage, "NCCL" if c.trainer_gpus else "gloo", c.rollout_engines,
             c.placement, workers.nodes, sync_mode)
    if sync_mode == "nccl":
        workers.sync = NcclSync(workers.policy, engines, rendezvous(next(s for s in slots if s.role == "policy")))
    else:
        workers.sync = ObjectStoreSync(workers.policy, engines, c.bucket_mb)
        if workers.high is not None:
            workers.high_sync = ObjectStoreSync(workers.high, engines, c.bucket_mb, level="high")
    return workers


def _free_port_here() -> tuple[str, int]:
    """(this node's IP, a free port on it): where a process group can meet."""
    import ray
    return ray.util.get_node_ip_address(), rendezvous_port()


def rendezvous_port() -> int:
    """A free TCP port between Ray's worker ports (10002-19999) and the kernel's ephemeral range.
    Rank 0 binds it seconds after it is chosen; a port from the ephemeral range (what binding
    port 0 gives) can be handed to another process's connection meanwhile. Seen in CI with two
    runs on one machine: EADDRINUSE in DeepSpeed's init."""
    import random
    import socket
    pick = random.SystemRandom()   # not the global generator: runs seeded alike would pick alike
    try:
        ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768
    for _ in range(200):
        port = pick.randint(20000, ephemeral_low - 1) if ephemeral_low > 20000 else 0
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise RuntimeError(f"no free TCP port in 20000-{ephemeral_low - 1} for the trainer ranks to meet on")
