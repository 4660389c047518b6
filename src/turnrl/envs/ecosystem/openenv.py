"""`openenv`: an OpenEnv environment (openenv-core) run unchanged as a turnrl environment.

    env:
      name: openenv
      options: {url: "http://127.0.0.1:8000"}                            # a running server, or
      # options: {command: "uvicorn my_env.server:app --port {port}"}     # one this worker starts, or
      # options: {env_class: "my_env.env:MyEnvironment"}                  # the class, in process

Exactly one of `url`, `command` or `env_class`:
- `url`: a server made by openenv-core's `create_app`, reached with the library's own
  `GenericEnvClient` (one WebSocket session per trajectory: the server must allow as many
  concurrent sessions as a worker runs trajectories, `max_concurrent_envs`).
- `command`: a shell command that starts such a server on `{port}` (a free port the adapter
  picks). Each process that rolls out (the rollout worker) starts it once, on first use, in the
  project folder, waits until `GET /health` answers, restarts it if it has died, and stops it
  when the process exits.
- `env_class`: an `openenv.core.env_server.Environment` subclass, one instance per trajectory.

The mapping: `reset(example)` resets with `seed` = the row's `game_seed` (and `reset_kwargs`);
the policy's text becomes the Action through `action` (a field name: `{field: text}`; a
`module:function`: `function(text)` returns the Action or its dict; unset: the Action's only
string field, from the server's `/schema` or the class); the Observation becomes text through
`observation` (a `module:function` of the observation's fields; unset: the only string field,
else one `name: value` line per field). Each step's reward is the server's (None is 0.0), `done`
ends the episode, `info["outcome"]` is the episode's return and numeric observation fields are
`info` (in process also the numeric `metadata`, which the wire protocol drops). An action the
environment rejects is an observation saying so (reward 0, `info["invalid_action"]`), the
episode goes on, as with the library's client.

A server that is down, answers an error or garbage, closes the session, or takes longer than
`step_timeout_s` ends that trajectory as an environment error (counted against
`env.max_error_fraction`); the next episode connects afresh, so a restarted server is picked
up. The client's coroutines run on one event loop thread per process, which `step` awaits from
the rollout's loop (every trajectory's step in flight at once).
"""
from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import os
import shlex
import signal
import socket
import subprocess
import tempfile
import threading
import time
import weakref
from typing import Any, Callable

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from turnrl.data.synthetic import SyntheticTask
from turnrl.envs.base import EnvSpec, StepResult
from turnrl.envs.ecosystem.glue import import_library, is_number, numeric_info
from turnrl.envs.ecosystem.gym_text import episode_rows
from turnrl.envs.helpers import Helpers
from turnrl.errors import one_line
from turnrl.plugins import PluginError, is_import_path, load_object, project_root

SYSTEM_PROMPT = "You are acting in an environment. Read its messages and reply with your action."
_WHERE, _WHAT = "env.name = openenv", "openenv-core"   # the import guard's message
_NOT_INFO = ("env_error", "reward", "done", "metadata")   # an observation's fields that are not info


class OpenEnvError(RuntimeError):
    """The server (or in-process environment) failed one episode: a turnrl environment error."""


class OpenEnvOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    url: str | None = Field(None, description="a running OpenEnv server: http(s):// or ws(s)://host:port")
    command: str | None = Field(None, description=(
        "a shell command starting an OpenEnv server on {port}, e.g. 'uvicorn my_env.server:app --port {port}'"))
    env_class: str | None = Field(None, description="module:Class of an openenv Environment, run in process")
    action: str | None = Field(None, description=(
        "how text becomes the Action: a field name, or module:function (text -> Action or dict); "
        "unset: the Action's only string field"))
    observation: str | None = Field(None, description=(
        "module:function (the observation's fields as a dict -> text); unset: its only string field, "
        "else 'name: value' lines"))
    reset_kwargs: dict[str, Any] = Field(default_factory=dict, description="extra keyword arguments of reset")
    system_prompt: str = SYSTEM_PROMPT
    connect_timeout_s: float = Field(10.0, gt=0, description="connecting to the server, fetching /schema")
    step_timeout_s: float = Field(60.0, gt=0, description="the server's answer to one reset or step")
    startup_timeout_s: float = Field(120.0, gt=0, description="command: until the server answers GET /health")

    @field_validator("url")
    @classmethod
    def _url(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("http://", "https://", "ws://", "wss://")):
            raise ValueError("an OpenEnv server's address, e.g. http://127.0.0.1:8000")
        return value.rstrip("/") if value else value

    @field_validator("command")
    @classmethod
    def _command(cls, value: str | None) -> str | None:
        if value is not None and "{port}" not in value:
            raise ValueError("the command must contain {port} (the port the adapter picks), e.g. "
                             "'uvicorn my_env.server:app --port {port}'")
        return value

    @field_validator("env_class", "observation")
    @classmethod
    def _import_path(cls, value: str | None) -> str | None:
        if value is not None and not is_import_path(value):
            raise ValueError("an import path module:attribute, e.g. my_env.env:MyEnvironment")
        return value

    @model_validator(mode="after")
    def _one_source(self) -> "OpenEnvOptions":
        given = [k for k in ("url", "command", "env_class") if getattr(self, k)]
        if len(given) != 1:
            raise ValueError("set exactly one of env.options.url (a running server), env.options.command (a "
                             "server this worker starts) or env.options.env_class (in process); got "
                             + (", ".join(given) or "none"))
        return self


# --------------------------------------------------------------------------- the library
def _library(what: str):
    if what == "client":
        return import_library("openenv.core.generic_client", where=_WHERE, what=_WHAT).GenericEnvClient
    return import_library("openenv.core.env_server", where=_WHERE, what=_WHAT)


class _Loop:
    """One asyncio loop on a daemon thread per process: the client's WebSocket connections live
    on it across rollouts (reset is synchronous, before the rollout's own loop exists)."""
    _lock = threading.Lock()
    _current: "_Loop | None" = None

    def __init__(self):
        self.pid = os.getpid()
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="turnrl-openenv", daemon=True).start()

    @classmethod
    def get(cls) -> asyncio.AbstractEventLoop:
        with cls._lock:
            if cls._current is None or cls._current.pid != os.getpid():   # a forked child needs its own
                cls._current = cls()
            return cls._current.loop


def _http(url: str) -> str:
    return "http" + url[2:] if url.startswith("ws") else url


def _get_json(url: str, path: str, timeout: float) -> Any:
    import httpx
    try:
        response = httpx.get(_http(url) + path, timeout=timeout)
    except httpx.HTTPError as exc:
        raise OpenEnvError(f"the OpenEnv server at {url} is unreachable ({type(exc).__name__}: {exc})") from None
    if response.status_code != 200:
        raise OpenEnvError(f"the OpenEnv server at {url} answered {response.status_code} to GET {path}: "
                           f"{' '.join(response.text.split())[:200]}")
    try:
        return response.json()
    except ValueError:
        raise OpenEnvError(f"the OpenEnv server at {url} answered GET {path} with something not JSON: "
                           f"{' '.join(response.text.split())[:200]!r}") from None


# --------------------------------------------------------------------------- `command`: a server per process
class _Server:
    """A server this process started from `command`, on a free port (a shared helper: started
    again once it died, its failed start remembered a while)."""

    def __init__(self, command: str, timeout_s: float):
        self.command, self.timeout_s = command, timeout_s
        self.proc: subprocess.Popen | None = None
        self.url, self.log = "", ""
        self.start()

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        fd, self.log = tempfile.mkstemp(prefix="turnrl-openenv-", suffix=".log")
        # Its own process group (stopped whole by close()). A Ray worker is killed, not exited, so
        # no atexit runs: a detached watcher stops the group once this process is gone.
        self.proc = subprocess.Popen(["/bin/sh", "-c", self.command.replace("{port}", str(port))], cwd=project_root(),
                                     stdout=fd, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True)
        _watch(self.proc.pid, self.log)
        os.close(fd)
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                failure = OpenEnvError(f"env.options.command exited with code {self.proc.returncode} before its "
                                       f"server answered GET /health: {self.tail()}")
                break
            try:
                _get_json(self.url, "/health", 1.0)
                return
            except OpenEnvError:
                time.sleep(0.2)
        else:
            failure = OpenEnvError(f"env.options.command: no answer to GET {self.url}/health within "
                                   f"env.options.startup_timeout_s = {self.timeout_s} s: {self.tail()}")
        self.close()
        raise failure

    def tail(self) -> str:
        try:
            with open(self.log, errors="replace") as f:
                lines = [line.strip() for line in f.read().splitlines() if line.strip()]
        except OSError:
            lines = []
        return " | ".join(lines[-3:])[-400:] or "(no output)"

    def close(self) -> None:
        """Stop the server's whole process group and remove its log."""
        if self.proc is not None and self.proc.poll() is None:
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(self.proc.pid, sig)
                    self.proc.wait(5.0)
                    break
                except subprocess.TimeoutExpired:
                    continue
                except ProcessLookupError:
                    break
        if self.log:
            with contextlib.suppress(OSError):
                os.unlink(self.log)


def _watch(group: int, log: str) -> None:
    """Stop process group `group` (a server's) and remove its `log` within seconds of this
    process's end (or of the server's), however it ends: a Ray worker is killed with SIGKILL, and
    Ray may kill its direct children too, so the watcher is detached (its shell exits at once;
    the loop lives on under init)."""
    loop = (f"while kill -0 {os.getpid()} && kill -0 {group}; do sleep 1; done; "
            f"kill -TERM -{group}; sleep 5; kill -KILL -{group}; rm -f {shlex.quote(log)}")
    subprocess.run(["/bin/sh", "-c", f"({loop}) >/dev/null 2>&1 &"], stdin=subprocess.DEVNULL,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, check=False)


_SERVERS: Helpers[_Server] = Helpers(retry_s=10.0, failures=(OpenEnvError,))   # command -> its server here


def server_url(command: str, timeout_s: float) -> str:
    """The address of this process's server for `command`, started (or restarted) if needed."""
    return _SERVERS.get(command, lambda: _Server(command, timeout_s)).url


def stop_servers() -> None:
    """Stop every server this process started (at exit too; tests call it)."""
    _SERVERS.close()


# --------------------------------------------------------------------------- text <-> Action, Observation
def _text_field(schema: dict, action: str | None, where: str) -> str:
    """The Action field the policy's text goes to: `action` if it is one, else the only string field."""
    props = {k: v for k, v in (schema.get("properties") or {}).items() if k != "metadata"}
    kinds = ", ".join(f"{k} ({v.get('type', 'any')})" for k, v in props.items()) or "none"
    if action is not None:
        if action not in props:
            raise PluginError(f"env.options.action = {action!r}: {where}'s Action has no such field; "
                              f"its fields: {kinds}")
        return action
    strings = [k for k, v in props.items() if v.get("type") == "string"]
    if len(strings) != 1:
        raise PluginError(f"env.options.action: {where}'s Action has no single string field (its fields: {kinds}); "
                          "name the field the text goes to (action: FIELD) or a module:function (text -> Action)")
    return strings[0]


def default_render(observation: dict[str, Any]) -> str:
    """The observation's only string field, else one `name: value` line per field."""
    strings = [v for v in observation.values() if isinstance(v, str)]
    if len(strings) == 1:
        return strings[0]
    return "\n".join(f"{k}: {v if isinstance(v, str) else json.dumps(v, default=str)}" for k, v in observation.items())


class _Episode:
    """What both ways of reaching an environment share: reset arguments, rendering, the result."""
    observation_role = "user"
    stop: tuple[str, ...] = ()

    def __init__(self, options: OpenEnvOptions):
        self.o = options
        self.system_prompt = options.system_prompt
        self.action_fn: Callable | None = None
        if options.action is not None and is_import_path(options.action):
            self.action_fn = load_object(options.action, "env.options.action")
        self.render: Callable[[dict], str] = (load_object(options.observation, "env.options.observation")
                                             if options.observation else default_render)
        self.total = 0.0   # the episode's return so far
        self.where = ""

    def reset_args(self, example: dict) -> dict[str, Any]:
        kwargs = dict(self.o.reset_kwargs)
        if example.get("game_seed") is not None:
            kwargs.setdefault("seed", int(example["game_seed"]))
        return kwargs

    def parse(self, observation: Any, reward: Any, done: Any) -> tuple[dict, float, bool]:
        """(observation fields, reward with None as 0.0, done); garbage is an OpenEnvError."""
        if not isinstance(observation, dict):
            raise OpenEnvError(f"{self.where} answered an observation that is not an object: {observation!r}"[:300])
        if not (reward is None or isinstance(reward, bool) or is_number(reward)):
            raise OpenEnvError(f"{self.where} answered a reward that is not a finite number: {reward!r}"[:300])
        if not isinstance(done, bool):
            raise OpenEnvError(f"{self.where} answered done = {done!r}, not a bool"[:300])
        return observation, 0.0 if reward is None else float(reward), done

    def text(self, observation: dict) -> str:
        text = self.render(observation)
        if not isinstance(text, str):
            raise PluginError(f"env.options.observation = {self.o.observation!r} returned {type(text).__name__}, "
                              "not text")
        return text

    def result(self, observation: dict, reward: float, done: bool, *extra: dict) -> StepResult:
        self.total += reward
        info = numeric_info(observation, *extra, skip=_NOT_INFO)   # logged per step as env_<key>_mean
        if done:
            info.update(outcome=self.total, reason="done")
        return StepResult(self.text(observation), reward, done, info)

    def invalid(self, message: str) -> StepResult:
        """An action the environment rejected: said to the policy, the episode goes on."""
        return StepResult(f"Invalid action: {message}", 0.0, False, {"invalid_action": 1.0})


# --------------------------------------------------------------------------- a server (url or command)
_BACKGROUND: set = set()   # disconnects in flight (a task needs a reference until it is done)


def _close_soon(box: list) -> None:
    """Disconnect the box's client on the adapter's loop without waiting (finalizers, failures)."""
    client, box[0] = box[0], None
    current = _Loop._current
    if client is None or current is None or current.loop.is_closed():
        return
    try:
        future = asyncio.run_coroutine_threadsafe(client.disconnect(), current.loop)
        _BACKGROUND.add(future)
        future.add_done_callback(_BACKGROUND.discard)
    except RuntimeError:   # the loop is shutting down with the process
        pass


class RemoteOpenEnv(_Episode):
    """One WebSocket session (the library's GenericEnvClient) per episode."""
    _schemas: dict[str, dict] = {}   # url -> the server's /schema, fetched once per process

    def __init__(self, options: OpenEnvOptions):
        super().__init__(options)
        self.client_cls = _library("client")
        self.box: list = [None]   # the session's client; closed when done, failed, or this env is collected
        weakref.finalize(self, _close_soon, self.box)
        self.field: str | None = None

    def reset(self, example: dict) -> str:
        o = self.o
        url = o.url or server_url(o.command, o.startup_timeout_s)
        self.where = f"the OpenEnv server at {url}"
        if o.action is not None and self.action_fn is None:
            self.field = o.action   # a field named: the server validates the action itself
        elif self.action_fn is None:
            if url not in self._schemas:
                self._schemas[url] = _get_json(url, "/schema", o.connect_timeout_s)
            self.field = _text_field(self._schemas[url].get("action") or {}, None, self.where)
        future = asyncio.run_coroutine_threadsafe(self._reset(url, self.reset_args(example)), _Loop.get())
        try:
            answer = future.result(timeout=o.connect_timeout_s + o.step_timeout_s + 5)
        except TimeoutError:
            future.cancel()
            raise OpenEnvError(f"{self.where} did not answer the reset in time") from None
        observation, _, _ = self.parse(answer.observation, answer.reward, answer.done)
        self.total = 0.0
        return self.text(observation)

    async def _reset(self, url: str, kwargs: dict):
        _close_soon(self.box)
        client = self.client_cls(base_url=url, connect_timeout_s=self.o.connect_timeout_s,
                                 message_timeout_s=self.o.step_timeout_s)
        self.box[0] = client
        try:
            await client.connect()
            return await client.reset(**kwargs)
        except Exception as exc:   # noqa: BLE001 - one line saying what the server did
            _close_soon(self.box)
            raise self.failure("reset", exc) from None

    def action(self, text: str) -> Any:
        if self.action_fn is None:
            return {self.field: text}
        action = self.action_fn(text)
        if isinstance(action, BaseModel):
            return action.model_dump()
        if not isinstance(action, dict):
            raise PluginError(f"env.options.action = {self.o.action!r} returned {type(action).__name__}, not an "
                              "Action or a dict")
        return action

    async def step(self, text: str) -> StepResult:
        payload = self.action(text)
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self._step(payload), _Loop.get()))

    async def _step(self, payload: dict) -> StepResult:
        client = self.box[0]
        if client is None:
            raise OpenEnvError(f"{self.where or 'openenv'}: step without a live session (reset first)")
        try:
            answer = await client.step(payload)
        except Exception as exc:   # noqa: BLE001
            if isinstance(exc, RuntimeError) and "(code: VALIDATION_ERROR)" in str(exc):
                return self.invalid(str(exc).removeprefix("Server error: "))
            _close_soon(self.box)
            raise self.failure("step", exc) from None
        try:
            result = self.result(*self.parse(answer.observation, answer.reward, answer.done))
        except Exception:
            _close_soon(self.box)
            raise
        if result.done:
            _close_soon(self.box)
        return result

    def failure(self, what: str, exc: Exception) -> OpenEnvError:
        """`exc` from the client as one line saying what the server did."""
        name = type(exc).__name__
        if isinstance(exc, TimeoutError):
            why = f"did not answer the {what} within env.options.step_timeout_s = {self.o.step_timeout_s} s"
        elif name.startswith("ConnectionClosed"):
            why = f"closed the session during the {what} (stopped or restarted?): {exc}"
        elif isinstance(exc, ConnectionError):
            why = f"could not be reached: {exc}"
        elif isinstance(exc, (ValueError, AttributeError, TypeError, KeyError)):
            why = f"answered the {what} with something that is not OpenEnv's protocol ({name}: {exc})"
        else:
            why = f"failed the {what}: {one_line(exc)}"
        return OpenEnvError(" ".join(f"{self.where} {why}".split())[:500])


# --------------------------------------------------------------------------- in process (env_class)
def _action_class(env_cls: type) -> type | None:
    """The Action class an Environment subclass declares (Environment[MyAction, ...])."""
    from typing import get_args
    action_base = _library("server").Action
    for klass in env_cls.__mro__:
        for base in getattr(klass, "__orig_bases__", ()):
            args = get_args(base)
            if args and isinstance(args[0], type) and issubclass(args[0], action_base):
                return args[0]
    return None


def _accepted(fn: Callable, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments `fn` takes (all of them if it has **kwargs), as the server passes them."""
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in params}


class LocalOpenEnv(_Episode):
    """A fresh instance of the Environment class per episode, called in this process."""

    def __init__(self, options: OpenEnvOptions):
        super().__init__(options)
        server = _library("server")
        self.env_cls = load_object(options.env_class, "env.options.env_class")
        if not (isinstance(self.env_cls, type) and issubclass(self.env_cls, server.Environment)):
            raise PluginError(f"env.options.env_class = {options.env_class!r} is not a subclass of "
                              "openenv.core.env_server.Environment")
        self.serialize = server.serialize_observation
        self.where = f"env.options.env_class {options.env_class}"
        self.action_cls = _action_class(self.env_cls)
        self.field: str | None = None
        if self.action_fn is None:
            if self.action_cls is None:
                raise PluginError(f"env.options.action: cannot tell {options.env_class}'s Action class (declare "
                                  "Environment[MyAction, ...]); name a module:function (text -> Action)")
            self.field = _text_field(self.action_cls.model_json_schema(), options.action, self.where)
        self.env = None

    def reset(self, example: dict) -> str:
        if self.env is not None:
            self.env.close()
        self.env = self.env_cls()
        observation = self.env.reset(**_accepted(self.env.reset, self.reset_args(example)))
        data = self.serialize(observation)
        fields, _, _ = self.parse(data.get("observation"), data.get("reward"), data.get("done"))
        self.total = 0.0
        return self.text(fields)

    def step(self, text: str) -> StepResult:
        try:
            action = self.action_fn(text) if self.action_fn is not None else {self.field: text}
            if isinstance(action, dict):
                if self.action_cls is None:
                    raise PluginError(f"env.options.action = {self.o.action!r} returned a dict, and "
                                      f"{self.o.env_class}'s Action class is unknown: return the Action")
                action = self.action_cls.model_validate(action)
        except ValidationError as exc:
            first = exc.errors()[0]
            return self.invalid(f"{'.'.join(map(str, first['loc']))}: {first['msg']}")
        observation = self.env.step(action)
        data = self.serialize(observation)
        metadata = getattr(observation, "metadata", None) or {}
        result = self.result(*self.parse(data.get("observation"), data.get("reward"), data.get("done")), metadata)
        if result.done:
            self.env.close()
        return result


def make_env(**options: Any) -> _Episode:
    """The environment `env.options` describe: in process (env_class) or a server's session."""
    o = OpenEnvOptions(**options)
    return LocalOpenEnv(o) if o.env_class else RemoteOpenEnv(o)


def _rows(count: int, *, seed: int, split: str, exclude: set) -> list[dict]:
    """Seeded episodes (the game seeds gym_text uses: held-out and training never share one)."""
    return [{**r, "source": "openenv"} for r in episode_rows(count, seed=seed, split=split, exclude=exclude)]


TASK = SyntheticTask(name="openenv", rows=_rows, key=lambda r: r["game_seed"])
ENV = EnvSpec(factory=make_env, options=OpenEnvOptions, task=TASK, name="openenv")
