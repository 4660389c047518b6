"""Rolling out agent programs (`env.name: agent`) through the gateway: the `EpisodeRunner` of
the agent environment, in synchronous and asynchronous training, evaluation and the warm start.

    for each episode (n per task row, at most env.options.max_concurrent at once):
        open an episode on the gateway (a key, its budgets)
        run the program: fn(task, base_url=, api_key=) in the program host (a process of its own,
        turnrl.gateway.host), or the command
        end the episode (the program returned, failed or timed out: later calls get 410)
        its reward: returned, or posted to /turnrl/reward; its calls -> samples -> a Trajectory

A program that raises, exits non-zero, times out or gives no reward ends its episode as an
environment error (finish `env_error`, the reason in `info["env_error"]`, one log line), counted
against env.max_error_fraction; the other episodes go on. The episode's reward reaches all its
samples (`turnrl.gateway.samples`).
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Callable, Mapping, Sequence

from turnrl.envs.base import RESERVED_INFO_KEYS
from turnrl.envs.tools.parsers import resolve_parser
from turnrl.gateway.host import ProgramHost
from turnrl.gateway.program import AgentProgram, ProgramError, finite, plain
from turnrl.gateway.render import Renderer
from turnrl.gateway.samples import episode_trajectory
from turnrl.gateway.server import EngineLoop, Episode, Gateway, Limits
from turnrl.rollout.chat import ChatFormat
from turnrl.rollout.multi_turn import ENV_ERROR, Budgets, Sample, Trajectory, error_text

log = logging.getLogger(__name__)


class ScriptedEngine:
    """An engine that answers each call with the demonstration's next assistant turn (the
    request's `script` option): the warm start replays a demonstration through the real program.
    A turn that does not end the message itself gets the end-of-turn token, as a model's would."""

    def __init__(self, fmt: ChatFormat):
        self.fmt = fmt

    def generate(self, prompts, *, max_tokens, stop, temperature, top_p, seeds, script=None) -> list[Sample]:
        ids = self.fmt.encode(script or "")
        if self.fmt.end_of_turn_id is not None and not self.fmt.ends_turn(ids):
            ids.append(self.fmt.end_of_turn_id)
        return [Sample(list(ids), [0.0] * len(ids), "stop") for _ in prompts]

    def stepper(self, **_):
        return _ScriptStepper(self)


class _ScriptStepper:
    def __init__(self, engine: ScriptedEngine):
        self.engine, self.queue = engine, []

    def add(self, key, prompt, max_tokens, seed, options=None) -> None:
        self.queue.append((key, (options or {}).get("script", "")))

    def step(self):
        batch, self.queue = self.queue, []
        return [(key, self.engine.generate([None], max_tokens=[0], stop=(), temperature=0, top_p=1, seeds=[None],
                                           script=script)[0]) for key, script in batch]

    def busy(self) -> bool:
        return bool(self.queue)

    def abort(self) -> None:
        self.queue = []


def outcome_of(value: Any, episode: Episode) -> tuple[float, dict]:
    """(reward, named components) from what the program returned, else what it posted."""
    value = plain(value)   # numpy's and torch's scalars as numbers
    components = dict(episode.components)
    if isinstance(value, dict):
        unknown = sorted(set(value) - {"reward", "components", "call_rewards"})
        if unknown:
            raise ProgramError(f"the program returned a dict with unknown key(s) {unknown}; return a number or "
                               "{'reward': r, 'components': {...}, 'call_rewards': {completion_id: r}}")
        for key in ("components", "call_rewards"):
            if not isinstance(value.get(key) or {}, dict):
                raise ProgramError(f"the program returned {key} = {value[key]!r:.60}; it must be a dict of names to "
                                   "numbers")
        for name, v in (value.get("components") or {}).items():
            components[str(name)] = finite(v, f"components[{name!r}]")
        known = {c.completion_id for c in episode.calls}
        for cid, v in (value.get("call_rewards") or {}).items():
            if str(cid) not in known:
                raise ProgramError(f"call_rewards names {cid!r}, which this episode did not answer; use the `id` of a "
                                   "chat completion it returned")
            episode.call_rewards[str(cid)] = finite(v, f"call_rewards[{cid!r}]")
        value = value.get("reward")
    if value is None:
        if episode.reward is None:
            raise ProgramError("the program gave no reward: return it (a number; a command prints it as its last "
                               "line of stdout) or post it to <base_url>/turnrl/reward before returning")
        return episode.reward, components
    return finite(value, "the reward the program returned"), components


_TAKEN_INFO_KEYS = {*RESERVED_INFO_KEYS, "outcome", "reason", "env_error", "partial_credit", "episode_s", "calls",
                    "samples", "merged_frac", "gateway_calls"}


class AgentRunner:
    """The agent environment's `EpisodeRunner`. One gateway and engine loop per engine, started
    on first use and kept for the runner's life (the rollout actor's)."""

    def __init__(self):
        self.gateways: dict[int, tuple[EngineLoop, Gateway]] = {}
        self.version = 0
        self._slots: threading.Semaphore | None = None
        self._host: ProgramHost | None = None
        self._lock = threading.Lock()

    # ---------------------------------------------------------------- plumbing
    def gateway(self, engine: Any, fmt: ChatFormat, program: AgentProgram, version: int = 0) -> tuple[EngineLoop, Gateway]:
        engine = engine["low"] if isinstance(engine, Mapping) else engine
        if id(engine) not in self.gateways:
            o = program.options
            loop = EngineLoop(engine, version=version)
            gateway = Gateway(loop, Renderer(fmt, resolve_parser(o.parser)), host=o.host, port=o.port,
                              model_name=o.model_name)
            self.gateways[id(engine)] = (loop, gateway)
            if self._slots is None:
                self._slots = threading.Semaphore(o.max_concurrent)
        return self.gateways[id(engine)]

    @staticmethod
    def limits(program: AgentProgram, budgets: Budgets, temperature: float, top_p: float) -> Limits:
        return Limits(temperature=temperature, top_p=top_p, max_calls=budgets.max_turns,
                      max_tokens_per_call=budgets.max_tokens_per_turn, max_tokens_total=budgets.max_tokens_total,
                      context=budgets.max_context, request_sampling=program.options.sampling == "request",
                      stop=tuple(s for s in program.stop if s))

    def episode(self, gateway: Gateway, program: AgentProgram, example: dict, limits: Limits, fmt: ChatFormat,
                script: Sequence[str] | None = None) -> Trajectory:
        """Run one episode of the program to its end; its Trajectory (samples inside)."""
        with self._slots:
            ep = gateway.open(example, limits, script)
            result: dict[str, Any] = {}
            started = time.time()
            running = self._start(program, example, gateway.base_url, ep.key)
            try:
                result["value"] = running.result(timeout=program.options.timeout_s + 5.0)
            except BaseException as exc:   # noqa: BLE001 - the user's program
                # (a TimeoutError the program or its command raised is its own; only a wait that ran out is this)
                result["error"] = exc if running.done() or not isinstance(exc, FutureTimeout) else TimeoutError(
                    f"the program did not return within env.options.timeout_s = {program.options.timeout_s:g} s")
            gateway.close(ep, "the program failed" if "error" in result else "the program returned")
        try:
            return self._trajectory(ep, result, fmt, started)
        finally:
            gateway.forget(ep)

    def _start(self, program: AgentProgram, example: dict, base_url: str, key: str) -> Future:
        """The episode's program started: a function in the program host (a process of its own,
        `turnrl.gateway.host`), a command as a child process waited on by a thread here."""
        if program.options.program:
            with self._lock:
                if self._host is None or self._host.options != program.options:
                    if self._host is not None:
                        self._host.close()
                    self._host = ProgramHost(program.options)
                host = self._host
            return host.submit(example, base_url, key)
        future: Future = Future()

        def target():
            try:
                future.set_result(program.run(example, base_url, key))
            except BaseException as exc:   # noqa: BLE001 - the user's command
                future.set_exception(exc)
        threading.Thread(target=target, name="turnrl-agent-command", daemon=True).start()
        return future

    def _trajectory(self, ep: Episode, result: dict, fmt: ChatFormat, started: float) -> Trajectory:
        fallback = fmt.prompt_ids("", str(ep.example.get("prompt", "")))
        error = result.get("error")
        info: dict[str, Any] = {"episode_s": time.time() - started}
        outcome, finish = 0.0, "answer"
        if error is None:
            try:
                outcome, components = outcome_of(result.get("value"), ep)
                # a component named like a key turnrl sets (or a reward function's argument) is prefixed
                info.update({(f"component_{k}" if k in _TAKEN_INFO_KEYS else k): v for k, v in components.items()})
            except ProgramError as exc:
                error = exc
        for call in ep.calls:
            call.reward = ep.call_rewards.get(call.completion_id, 0.0)
        if error is not None:
            finish = ENV_ERROR
            info.update(reason=ENV_ERROR, env_error=getattr(error, "reason", None) or error_text(error))
            log.warning("agent episode of %r: %s", ep.example.get("id", str(ep.example.get("prompt", ""))[:40]),
                        info["env_error"])
            outcome = 0.0
        elif ep.calls and ep.calls[-1].finish == "length":
            finish = "truncated"
        elif not ep.calls:
            finish = "no_action"
        return episode_trajectory(ep.example, ep.calls, outcome=outcome, finish=finish, info=info, prompt_ids=fallback)

    # ---------------------------------------------------------------- EpisodeRunner
    def run(self, engine, examples: Sequence[dict], make_env: Callable[[], AgentProgram], fmt: ChatFormat,
            budgets: Budgets, *, n: int = 1, temperature: float = 1.0, top_p: float = 1.0, progress: bool = False,
            desc: str = "rollout", on_group_done: Callable[[list[Trajectory]], None] | None = None,
            on_trajectory_done: Callable[[Trajectory], None] | None = None, **_: Any) -> list[Trajectory]:
        """n episodes per example, in order (episode i of example i // n). The seed, rejoin and
        observation-lag options of the step loop do not apply: programs run on their own clocks.
        `on_trajectory_done(episode)` is called as each episode ends, `on_group_done(group)` as
        each example's n have ended (on the thread that ran the last of them); an episode that
        raised is reported by neither, and its group not at all."""
        program = make_env()
        _, gateway = self.gateway(engine, fmt, program, self.version)
        limits = self.limits(program, budgets, temperature, top_p)
        jobs = [example for example in examples for _ in range(n)]
        left, lock = [n] * len(examples), threading.Lock()
        from tqdm.auto import tqdm
        with ThreadPoolExecutor(max_workers=max(1, program.options.max_concurrent)) as pool, \
                tqdm(total=len(jobs), desc=desc, unit="episode", disable=not progress, leave=False) as bar:
            futures = [pool.submit(self.episode, gateway, program, example, limits, fmt) for example in jobs]

            def ended(k: int, future) -> None:
                if on_trajectory_done is not None and future.exception() is None:
                    on_trajectory_done(future.result())
                with lock:
                    left[k // n] -= 1
                    done = not left[k // n]
                group = futures[k // n * n:(k // n + 1) * n]
                if done and on_group_done is not None and all(f.exception() is None for f in group):
                    on_group_done([f.result() for f in group])
            for k, future in enumerate(futures):
                future.add_done_callback(lambda f, k=k: ended(k, f))
            out = []
            for future in futures:
                out.append(future.result())
                bar.update()
        return out

    def stream(self, engine, make_env, fmt, budgets, *, n: int, max_groups: int, temperature: float, top_p: float,
               version: int = 0, **_: Any) -> "AgentStream":
        program = make_env()
        loop, gateway = self.gateway(engine, fmt, program, version)
        loop.version = version
        return AgentStream(self, loop, gateway, program, fmt, self.limits(program, budgets, temperature, top_p),
                           n=n, max_groups=max_groups)

    def replay(self, make_env, fmt: ChatFormat, example: dict, turns: Sequence[Any]) -> Trajectory:
        """A demonstration through the real program: each call is answered with the next turn."""
        program = make_env()
        key = ("script", id(fmt))
        if key not in self.gateways:
            loop = EngineLoop(ScriptedEngine(fmt))
            self.gateways[key] = (loop, Gateway(loop, Renderer(fmt, resolve_parser(program.options.parser)),
                                                model_name=program.options.model_name))
            if self._slots is None:
                self._slots = threading.Semaphore(program.options.max_concurrent)
        gateway = self.gateways[key][1]
        limits = Limits(max_calls=len(turns), max_tokens_per_call=1 << 20)
        t = self.episode(gateway, program, example, limits, fmt, script=[str(turn) for turn in turns])
        if t.finish == ENV_ERROR:
            raise ProgramError(t.info.get("env_error", "the program failed"))
        return t

    def load_weights(self, version: int, apply: Callable[[], None], weights=None) -> None:
        """New weights for the engine, loaded by its loop between two engine steps (`weights`,
        the same weights again, is not kept)."""
        self.version = version
        loops = [loop for key, (loop, _) in self.gateways.items() if not isinstance(key, tuple)]
        if not loops:
            apply()
            return
        done = threading.Event()

        def run():
            try:
                apply()
            finally:
                done.set()
        loops[0].load_weights(version, run)
        while not done.wait(timeout=1.0):
            if loops[0].error is not None:
                raise RuntimeError(f"the gateway's engine loop stopped: {loops[0].error!r}") from loops[0].error

    def close(self) -> None:
        for loop, gateway in self.gateways.values():
            gateway.shutdown()
            loop.stop()
        self.gateways.clear()
        if self._host is not None:
            self._host.close()
            self._host = None


class AgentStream:
    """Asynchronous training's continuous rollouts (the interface of `turnrl.rollout.stream.Stream`)
    for agent programs: groups of n episodes start while fewer than `max_groups` are in flight and
    are handed out as soon as all n ended; weights load between two engine steps, each call
    stamped with the version it was sampled under."""

    def __init__(self, runner: AgentRunner, loop: EngineLoop, gateway: Gateway, program: AgentProgram,
                 fmt: ChatFormat, limits: Limits, *, n: int, max_groups: int):
        self.runner, self.loop, self.gateway, self.program = runner, loop, gateway, program
        self.fmt, self.limits, self.n, self.max_groups = fmt, limits, n, max_groups
        self._inbox: deque = deque()                     # (example, n, tag): tag None for training groups
        self._finished: deque = deque()
        self._tagged: dict[int, list[list[Trajectory]]] = {}
        self._in_flight: dict[int, int | None] = {}      # group -> tag
        self._next_group = self._next_tag = 0
        self._cond = threading.Condition()
        self._stopped = False
        self.error: BaseException | None = None
        self.pool = ThreadPoolExecutor(max_workers=max(1, program.options.max_concurrent))

    @property
    def busy_s(self) -> float:
        return self.loop.busy_s

    @property
    def version(self) -> int:
        return self.loop.version

    def feed(self, examples: list[dict]) -> None:
        with self._cond:
            self._inbox.extend((example, self.n, None) for example in examples)
            self._cond.notify_all()

    def roll_out(self, examples: list[dict], n: int, timeout_s: float = 3600.0) -> list[Trajectory]:
        with self._cond:
            self._next_tag += 1
            tag = self._next_tag
            self._tagged[tag] = []
            self._inbox.extendleft((example, n, tag) for example in reversed(examples))
            self._cond.notify_all()
            done = self._cond.wait_for(lambda: len(self._tagged[tag]) == len(examples), timeout=timeout_s)
            groups = self._tagged.pop(tag)
        if not done:
            raise TimeoutError(f"{len(examples) - len(groups)} of {len(examples)} examples not rolled out in {timeout_s}s")
        order = {id(example): k for k, example in enumerate(examples)}
        return [t for group in sorted(groups, key=lambda g: order[id(g[0].example)]) for t in group]

    def take_groups(self, max_groups: int, timeout_s: float) -> list[list[Trajectory]]:
        with self._cond:
            self._cond.wait_for(lambda: self._finished or self._stopped, timeout=timeout_s)
            if self.loop.error is not None:
                raise RuntimeError(f"the gateway's engine stopped: {self.loop.error!r}") from self.loop.error
            out = []
            while self._finished and len(out) < max_groups:
                out.append(self._finished.popleft())
            return out

    def load_weights(self, version: int, apply: Callable[[], None], weights=None) -> None:
        self.loop.load_weights(version, apply)

    def counts(self) -> dict[str, int]:
        with self._cond:
            return {"inbox": sum(tag is None for *_, tag in self._inbox),
                    "in_flight": sum(tag is None for tag in self._in_flight.values()), "finished": len(self._finished)}

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()

    def run(self) -> None:
        """The admitting thread: start queued groups while there is room, until stopped."""
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._stopped or (self._inbox and (
                    self._inbox[0][2] is not None or self._training_in_flight() < self.max_groups)), timeout=0.5)
                if self._stopped:
                    break
                if not self._inbox or (self._inbox[0][2] is None and self._training_in_flight() >= self.max_groups):
                    continue
                example, n, tag = self._inbox.popleft()
                group = self._next_group
                self._next_group += 1
                self._in_flight[group] = tag
            self.pool.submit(self._group, group, example, n, tag)
        self.pool.shutdown(wait=False, cancel_futures=True)

    def _training_in_flight(self) -> int:
        return sum(tag is None for tag in self._in_flight.values())

    def _group(self, group: int, example: dict, n: int, tag: int | None) -> None:
        with ThreadPoolExecutor(max_workers=n) as pool:
            trajs = list(pool.map(lambda _: self.runner.episode(self.gateway, self.program, example, self.limits,
                                                                self.fmt), range(n)))
        with self._cond:
            self._in_flight.pop(group, None)
            (self._finished if tag is None else self._tagged[tag]).append(trajs)
            self._cond.notify_all()
