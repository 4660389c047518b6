"""The verifiers bridge: a verifiers 0.4.0 environment served over JSON lines on stdin/stdout.

verifiers 0.4.0 cannot be installed beside turnrl (it pins mcp==2.0.0, turnrl needs mcp>=2.3),
so it lives in its own virtualenv (`.venv-verifiers`, made by setup.sh) and this script runs
under that environment's python, by file path. It imports nothing of turnrl.

    python verifiers_bridge.py '{"environment": "my_taskset", "args": {...}, "env_args": {...}}'

`environment` is a taskset id as the library resolves it (an importable module exporting a
`vf.Taskset` subclass, and optionally a `vf.Env` subclass, through `__all__`); `args` are the
taskset's config fields, `env_args` the env config's (e.g. `{"solver": {"max_turns": 6}}`).
The environment is built with the library's own `vf.load_environment(vf.resolve_env_config(...))`.

The policy is turnrl's: where the library's harness would call a model, the bridge hands the
conversation to turnrl and waits for its text. The library's control flow is kept: the env's
`run(task, agents)` drives the episode (a plain taskset's `SingleAgentEnv` takes one reply; a
multi-turn env answers each reply with `await interaction.turn(message)`); before each policy
turn the agent's `max_turns` and the task's `@vf.stop` Trace predicates are checked as the
library's session does (`RolloutLimits.reached`, then each stop); when `run` returns, the
task's `score(trace)` records its weighted `@vf.reward`s and the env's `finalize` runs.

Requests, one JSON object a line, each with an `id` echoed in its answer:
    {"op": "info"}                                   -> {size, env, agents}
    {"op": "rows", "indices": [...]}                 -> {rows: [{index, id, prompt, answer}]}
    {"op": "start", "episode": k, "index": i,        -> {system_prompt, messages, done, ...}
     "max_turns": m}                                  (optional: caps the agent's max_turns)
    {"op": "step", "episode": k, "text": "..."}      -> {messages, done, ...}
    {"op": "close", "episode": k}                    -> {}
A final answer (done) carries reward (the trace's weighted total), rewards ({name: {score,
weight}}), stop_condition. Errors answer {"ok": false, "error": "<one line>"}.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import traceback
from typing import Any

# run by file path, Python puts this file's folder first on sys.path: turnrl.envs.ecosystem, whose
# verifiers.py would shadow the library
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

POLICY_TIMEOUT_S = 3600.0   # an episode waiting this long for turnrl's next turn is dropped


def _one_line(exc: BaseException) -> str:
    errors = getattr(exc, "errors", None)
    if callable(errors) and type(exc).__name__ == "ValidationError":   # pydantic's: each field and why
        with contextlib.suppress(Exception):
            parts = [f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in errors()[:3]]
            return f"ValidationError: {'; '.join(parts)}"[:500]
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:500]


class Bridge:
    def __init__(self, spec: dict[str, Any]):
        import verifiers.v1 as vf
        from verifiers.v1.utils.loaders import load_environment, resolve_env_config
        self.vf = vf
        raw = dict(spec.get("env_args") or {})
        raw["taskset"] = {**dict(spec.get("args") or {}), "id": spec["environment"]}
        self.env = load_environment(resolve_env_config(raw))
        self.tasks: list | None = None
        self.episodes: dict[Any, Episode] = {}
        from verifiers.v1.configs.agent import agent_config_fields
        self.agents = agent_config_fields(self.env.config)

    def task(self, index: int):
        if self.tasks is None:
            if not self.env.taskset.bounded:
                raise ValueError("the taskset is infinite; turnrl needs a bounded one")
            self.tasks = list(self.env.taskset)
        if not 0 <= index < len(self.tasks):
            raise IndexError(f"task {index} is out of range: the taskset has {len(self.tasks)} tasks "
                             "(lower data.train_examples / heldout_examples, or grow the taskset through env.options.args)")
        return self.tasks[index]

    async def handle(self, request: dict[str, Any]) -> dict[str, Any]:
        op = request.get("op")
        if op == "info":
            self.task(0)
            return {"size": len(self.tasks), "env": type(self.env).__name__, "agents": list(self.agents)}
        if op == "rows":
            rows = []
            for i in request["indices"]:
                data = self.task(int(i)).data
                rows.append({"index": int(i), "id": data.id, "prompt": data.prompt_text,
                             "answer": str(getattr(data, "answer", "") or "")})
            return {"rows": rows}
        if op == "start":
            task = self.task(int(request["index"]))
            episode = Episode(self, task, request.get("max_turns"))
            self.episodes[request["episode"]] = episode
            return {**await episode.next_event(), "system_prompt": task.data.system_prompt or ""}
        if op == "step":
            episode = self.episodes.get(request["episode"])
            if episode is None:
                raise KeyError(f"no episode {request['episode']!r} (never started, or already over)")
            await episode.replies.put(str(request["text"]))
            try:
                answer = await episode.next_event()
            except Exception:
                self.episodes.pop(request["episode"], None)   # a failed episode is over
                raise
            if answer.get("done"):
                self.episodes.pop(request["episode"], None)
            return answer
        if op == "close":
            episode = self.episodes.pop(request.get("episode"), None)
            if episode is not None:
                episode.runner.cancel()
            return {}
        raise ValueError(f"unknown op {op!r}")


class Episode:
    """One episode: the env's `run` as a task of the bridge's loop, paused at each policy turn."""

    def __init__(self, bridge: Bridge, task, max_turns: int | None = None):
        self.bridge, self.task, self.max_turns = bridge, task, max_turns
        self.events: asyncio.Queue = asyncio.Queue()
        self.replies: asyncio.Queue = asyncio.Queue()
        self.trace = None
        self.scored_task = task    # the task the policy's interaction plays (its score is the reward)
        self.runner = asyncio.get_running_loop().create_task(self._run())

    async def next_event(self) -> dict[str, Any]:
        kind, payload = await self.events.get()
        if kind == "error":
            raise RuntimeError(payload)
        return payload

    async def _run(self) -> None:
        try:
            agents = BridgeAgents(self)
            await self.bridge.env.setup(agents)
            await self.bridge.env.run(self.task, agents)
            if self.trace is None:
                raise RuntimeError("the env's run() never opened an interaction with the policy")
            await self.events.put(("done", await self._finish()))
        except asyncio.CancelledError:
            raise
        except Exception as exc:   # noqa: BLE001 - reported to turnrl as this episode's error
            traceback.print_exc(file=sys.stderr)
            await self.events.put(("error", _one_line(exc)))

    async def _finish(self) -> dict[str, Any]:
        vf, trace = self.bridge.vf, self.trace
        if trace.stop_condition is None:
            trace.stop("user_closed")
        await self.scored_task.score(trace)
        episode = vf.Episode(task=trace.task, traces=[trace], ok=True)
        await self.bridge.env.finalize(self.task, episode)
        rewards = {name: {"score": r.score, "weight": r.weight} for name, r in trace.rewards.items() if r is not None}
        return {"done": True, "messages": [], "reward": trace.reward, "rewards": rewards,
                "metrics": {k: v for k, v in trace.metrics.items() if v is not None},
                "stop_condition": trace.stop_condition, "turns": trace.num_turns}


class BridgeAgents:
    """The env's agents: the one seat turnrl's policy plays (the env config's first agent)."""

    def __init__(self, episode: Episode):
        self._episode = episode
        self._names = list(episode.bridge.agents)

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        if name not in self._names:
            raise AttributeError(f"no agent {name!r}; this env declares {self._names}")
        if name != self._names[0]:
            raise RuntimeError(f"agent {name!r} needs a model of its own; turnrl's policy plays only "
                               f"{self._names[0]!r} (the env config's first agent)")
        return BridgeAgent(self._episode, name, self._episode.bridge.agents[name])


class BridgeAgent:
    def __init__(self, episode: Episode, name: str, config):
        self.episode, self.name, self.config = episode, name, config
        self.trainable = True

    @contextlib.asynccontextmanager
    async def interaction(self, task):
        yield Interaction(self.episode, task, self.config)

    async def run(self, task):
        """A plain taskset's single-agent run: the prompt opens, the policy replies once (no tools)."""
        async with self.interaction(task) as interaction:
            await interaction.turn()
        return self.episode.trace


class Interaction:
    """`Interaction.turn` with turnrl's policy behind it (the library's own semantics:
    a prompted task's bare first turn, the user turn sent, limits and @stop before each reply)."""

    def __init__(self, episode: Episode, task, config):
        from verifiers.v1.session import RolloutLimits, hook_boundary
        from verifiers.v1.trace import AgentInfo, TraceTask, Trace
        if episode.trace is not None:
            raise RuntimeError("the env opened a second interaction with the policy; the bridge plays one per episode")
        self.episode, self.task, self.over, self.started = episode, task, False, False
        episode.scored_task = task
        self.trace = episode.trace = Trace(task=TraceTask(type=type(task).__name__, data=task.data, key=task.key,
                                                          hash=task.hash), agent=AgentInfo(config=config))
        # the trainer's turn limit caps the agent's, as a harness's limits do (the lower one wins)
        caps = [m for m in (config.max_turns, episode.max_turns) if m is not None]
        self.limits = RolloutLimits(max_turns=min(caps) if caps else None)
        stops = [(hook_boundary(fn, allow_trace=True), fn) for fn in task.hooks("stop")]
        self.stops = [fn for kind, fn in stops if kind is Trace]
        others = [fn.__name__ for kind, fn in stops if kind is not Trace]
        if others:
            raise RuntimeError(f"@vf.stop on a Request or Response ({', '.join(others)}) is not supported by the "
                               "bridge (there is no model call object); write them over the Trace")
        data = task.data
        if data.system_prompt:
            self._add(self.episode.bridge.vf.SystemMessage(content=data.system_prompt))

    def _add(self, message, sampled: bool = False) -> None:
        from verifiers.v1.graph import MessageNode
        parent = len(self.trace.nodes) - 1 if self.trace.nodes else None
        self.trace.nodes.append(MessageNode(parent=parent, message=message, sampled=sampled))

    async def _refused(self) -> str | None:
        from verifiers.v1.session import call_hook
        from verifiers.v1.trace import Trace
        if (limit := self.limits.reached(self.trace)) is not None:
            return limit
        for stop in self.stops:
            result = await call_hook(stop, {Trace: self.trace})
            if not isinstance(result, bool):
                raise TypeError(f"@stop {stop.__name__} must return bool, got {type(result).__name__}")
            if result:
                return stop.__name__
        return None

    async def turn(self, message=None):
        from verifiers.v1.agent import Segment
        vf = self.episode.bridge.vf
        if self.over:
            raise RuntimeError("the exchange is over (the run ended); read interaction.trace")
        prompted = not self.started and self.task.data.prompt is not None
        if message is None and not prompted:
            raise ValueError("nothing to run a turn on: this exchange takes its next user message")
        if message is not None and prompted:
            raise ValueError("the task's prompt opens this exchange: take its first reply with a bare turn()")
        if prompted:
            prompt = self.task.data.prompt
            new = [vf.UserMessage(content=prompt)] if isinstance(prompt, str) else list(prompt)
        elif isinstance(message, str):
            new = [vf.UserMessage(content=message)]
        else:
            new = [__import__('verifiers.v1.dialects', fromlist=['parse_message']).parse_message(m) if isinstance(m, dict) else m for m in message]
        self.started = True
        # the library commits a turn's messages with its reply: a refused turn leaves them out of the trace
        stopped = await self._refused()
        if stopped is not None:
            self.trace.stop(stopped)
            self.over = True
            return Segment(messages=[], terminated=True)
        texts = [vf.types.content_text(m.content) for m in new]
        roles = [getattr(m, "role", "user") for m in new]
        await self.episode.events.put(("turn", {"done": False, "messages": texts, "roles": roles}))
        text = await asyncio.wait_for(self.episode.replies.get(), POLICY_TIMEOUT_S)
        reply = vf.AssistantMessage(content=text)
        for m in new:
            self._add(m)
        self._add(reply, sampled=True)
        return Segment(messages=[reply])

    async def close(self):
        return self.trace


async def serve(spec: dict[str, Any]) -> None:
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)                  # the library's prints go to stderr, never into the protocol
    sys.stdout = sys.stderr
    loop = asyncio.get_running_loop()
    try:
        bridge: Bridge | None = Bridge(spec)
        problem = None
    except Exception as exc:   # noqa: BLE001 - every request then answers this one line
        traceback.print_exc(file=sys.stderr)
        bridge, problem = None, f"verifiers cannot load it: {_one_line(exc)}"

    async def answer(request: dict[str, Any]) -> None:
        rid = request.get("id")
        try:
            if bridge is None:
                raise RuntimeError(problem)
            result = {"id": rid, "ok": True, **await bridge.handle(request)}
        except Exception as exc:   # noqa: BLE001
            result = {"id": rid, "ok": False, "error": problem if bridge is None else _one_line(exc)}
        out.write(json.dumps(result, default=float) + "\n")

    pending = set()
    while True:
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if not line:
            break
        try:
            request = json.loads(line)
        except json.JSONDecodeError as exc:
            out.write(json.dumps({"id": None, "ok": False, "error": f"bad request line: {exc}"}) + "\n")
            continue
        job = loop.create_task(answer(request))
        pending.add(job)
        job.add_done_callback(pending.discard)


if __name__ == "__main__":
    asyncio.run(serve(json.loads(sys.argv[1])))
