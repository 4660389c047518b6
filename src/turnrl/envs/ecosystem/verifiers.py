"""`verifiers`: an environment of the verifiers library (0.4.0), run in its own virtualenv.

    env:
      name: verifiers
      options:
        environment: arith_vf              # a taskset id: a module exporting a vf.Taskset (and maybe a vf.Env)
        args: {size: 64}                   # the taskset's config fields
        env_args: {}                       # the env config's fields, e.g. {solver: {max_turns: 6}}
        path: [examples/verifiers_env]     # folders the environment's module is imported from
    data:
      train_set: synthetic                 # the environment's own tasks (by index; see below)

verifiers 0.4.0 pins mcp==2.0.0 while turnrl needs mcp>=2.3 (and it caps openai<3), so it cannot
share turnrl's environment: `./setup.sh` makes `.venv-verifiers` for it and the environment runs
there in a bridge process (`verifiers_bridge.py`, JSON lines over stdin/stdout), one per rollout
worker process, shared by its trajectories and stopped when the process exits.

Mapping: a row of `data.train_set: synthetic` is an index into the environment's taskset
(held-out rows even indices, training rows odd ones: the splits never share a task); `reset`
starts the library's episode on that task and returns its prompt; the task's system prompt is
the system message. Each `step` hands the policy's text to the env's `run()`; the user messages
it answers with are the observation, and the episode ends where the library's would (run()
returns, the agent's max_turns or rollout.max_turns if it is lower, a `@vf.stop`): a trace cut by
a limit is scored as it stands, as the library scores it. The last step's reward and `info["outcome"]` are
the trace's reward (the task's `@vf.reward` scores times their weights, summed); each reward's
own score is in `info` by name (logged as `env_<name>_mean`), `info["reason"]` is the library's
stop condition.
"""
from __future__ import annotations

import collections
import json
import os
import subprocess
import threading
import uuid
import weakref
from concurrent.futures import Future, TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from turnrl.data.synthetic import SyntheticTask, split_numbers
from turnrl.envs.base import EnvContext, EnvSpec, StepResult
from turnrl.envs.ecosystem.glue import OWN_INFO_KEYS
from turnrl.envs.helpers import Helpers
from turnrl.plugins import PluginError

BRIDGE = Path(__file__).with_name("verifiers_bridge.py")
VENV_PYTHON = Path(".venv-verifiers") / "bin" / "python"
PYTHON_ENV_VAR = "TURNRL_VERIFIERS_PYTHON"


class VerifiersOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    environment: str = Field(min_length=1, description=(
        "the verifiers taskset id: an importable module exporting a vf.Taskset subclass (and optionally a vf.Env "
        "subclass) through __all__"))
    args: dict[str, Any] = Field(default_factory=dict, description="the taskset's config fields")
    env_args: dict[str, Any] = Field(default_factory=dict, description="the env config's fields")
    path: list[str] = Field(default_factory=list, description="folders to import the environment's module from")
    python: str | None = Field(None, validate_default=True, description=(
        f"the bridge environment's python (default: ${PYTHON_ENV_VAR}, else .venv-verifiers/bin/python of this "
        "folder, a parent, or turnrl's checkout)"))
    timeout_s: float = Field(120.0, gt=0, description="how long to wait for each answer of the bridge")

    @field_validator("python", mode="after")
    @classmethod
    def _bridge_python(cls, python: str | None) -> str | None:
        # checked with the options (turnrl config, preprocess): a missing venv stops before any work
        try:
            find_python(python)
        except PluginError as exc:
            raise ValueError(str(exc)) from None
        return python


def _repo_root() -> Path:
    return Path(__file__).resolve().parents[4]   # src/turnrl/envs/ecosystem/verifiers.py


def find_python(python: str | None) -> str:
    """The bridge's interpreter; PluginError (one line) when there is none."""
    if python:
        if not Path(python).exists():
            raise PluginError("no such file; run ./setup.sh (it makes .venv-verifiers) or point env.options.python "
                              "at a python with verifiers==0.4.0")
        return python
    if os.environ.get(PYTHON_ENV_VAR):
        return find_python(os.environ[PYTHON_ENV_VAR])
    here = Path.cwd().resolve()
    for folder in (here, *here.parents, _repo_root()):
        if (folder / VENV_PYTHON).exists():
            return str(folder / VENV_PYTHON)
    raise PluginError("no .venv-verifiers/bin/python here, in a parent folder or in turnrl's checkout (verifiers "
                      "0.4.0 runs in its own environment); run ./setup.sh, or set env.options.python (or "
                      f"${PYTHON_ENV_VAR}) to a python with verifiers==0.4.0")


def _folder(path: str) -> str:
    p = Path(path)
    for base in (Path.cwd(), _repo_root()):
        if (base / p).is_dir():
            return str((base / p).resolve())
    raise PluginError(f"env.options.path: {path!r} is not a folder (relative paths are read from the working "
                      "directory or turnrl's checkout)")


class BridgeError(PluginError):
    """An error the bridge answered with (the library's, on one line)."""

    def __init__(self, error: str, op: str):
        super().__init__(f"verifiers bridge, {op}: {error}")
        self.error = error


class Bridge:
    """One bridge process: requests by id, answered by a reader thread (thread-safe)."""

    def __init__(self, python: str, spec: dict[str, Any], path: list[str], timeout_s: float):
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
        env["PYTHONPATH"] = os.pathsep.join([*path, os.getcwd()])
        self.timeout_s = timeout_s
        self.proc = subprocess.Popen([python, str(BRIDGE), json.dumps(spec)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        self.pending: dict[int, Future] = {}
        self.exited: PluginError | None = None
        self.lock = threading.Lock()
        self.next_id = 0
        self.stderr: collections.deque[str] = collections.deque(maxlen=40)
        threading.Thread(target=self._read, daemon=True, name="verifiers-bridge").start()
        threading.Thread(target=self._drain, daemon=True, name="verifiers-bridge-err").start()
        try:
            self.info = self.request("info")   # loads the environment: a bad one fails here, in one line
        except PluginError as exc:
            self.close()
            raise PluginError(f"env.options.environment = {spec['environment']!r}: "
                              f"{exc.error if isinstance(exc, BridgeError) else exc}") from None

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def _drain(self) -> None:
        for line in self.proc.stderr:
            self.stderr.append(line.rstrip())

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                answer = json.loads(line)
            except json.JSONDecodeError:
                continue
            with self.lock:
                future = self.pending.pop(answer.get("id"), None)
            if future is not None:
                future.set_result(answer)
        rc = self.proc.wait()
        last = next((line for line in reversed(self.stderr) if line.strip()), "")
        with self.lock:
            self.exited = PluginError(f"the verifiers bridge exited (exit code {rc}): {last}"[:400])
            futures, self.pending = list(self.pending.values()), {}
        for future in futures:
            future.set_exception(self.exited)

    def send(self, op: str, wait: bool = True, **fields: Any) -> Future | None:
        with self.lock:
            if self.exited is not None:   # no reader is left to answer
                raise self.exited
            self.next_id += 1
            rid = self.next_id
            future: Future | None = Future() if wait else None
            if future is not None:
                self.pending[rid] = future
            try:
                self.proc.stdin.write(json.dumps({"id": rid, "op": op, **fields}) + "\n")
                self.proc.stdin.flush()
            except (BrokenPipeError, OSError, ValueError) as exc:
                self.pending.pop(rid, None)
                raise PluginError(f"the verifiers bridge is gone ({exc}); exit code {self.proc.poll()}") from None
        return future

    def request(self, op: str, **fields: Any) -> dict[str, Any]:
        future = self.send(op, **fields)
        try:
            answer = future.result(timeout=self.timeout_s)
        except FutureTimeout:
            raise PluginError(f"the verifiers bridge did not answer {op!r} within env.options.timeout_s = "
                              f"{self.timeout_s:g}") from None
        if not answer.get("ok"):
            raise BridgeError(str(answer.get("error")), op)
        return answer

    def close(self) -> None:
        if self.alive:
            try:
                self.proc.stdin.close()   # the bridge stops at the end of its input
                self.proc.wait(timeout=5)
            except Exception:   # noqa: BLE001 - stopping anyway
                self.proc.kill()
                self.proc.wait()


_BRIDGES: Helpers[Bridge] = Helpers(retry_s=30.0, failures=(PluginError,))   # a failed start: not retried per trajectory


def bridge(options: VerifiersOptions) -> Bridge:
    """This process's bridge for these options (started on first use, restarted if it died)."""
    python = find_python(options.python)
    path = [_folder(p) for p in options.path]
    spec = {"environment": options.environment, "args": options.args, "env_args": options.env_args}
    key = json.dumps([python, path, spec], sort_keys=True, default=str)
    return _BRIDGES.get(key, lambda: Bridge(python, spec, path, options.timeout_s))


def close_bridges() -> None:
    _BRIDGES.close()


def _info_key(name: str) -> str:
    return f"reward_{name}" if name in OWN_INFO_KEYS else name


class VerifiersEnv:
    observation_role = "user"
    stop: tuple[str, ...] = ()

    def __init__(self, context: EnvContext | None = None, **options: Any):
        self.options = VerifiersOptions.model_validate(options)
        # rollout.max_turns caps the agent's own max_turns, as a trainer's limit does in the library:
        # the turn past it is refused, the trace stops with "max_turns" and is scored as it stands
        self.max_turns = (context or EnvContext()).max_turns
        self.system_prompt = ""
        self.bridge: Bridge | None = None
        self.episode: str | None = None

    def reset(self, example: dict) -> str:
        if "verifiers_index" not in example:
            raise PluginError("env.name = verifiers plays its environment's own tasks: set data.train_set and "
                              "data.heldout_set to synthetic (rows carry verifiers_index)")
        self.bridge = bridge(self.options)
        self.episode = uuid.uuid4().hex
        # the bridge forgets an episode turnrl abandons (a turn cut by its token limit, the token
        # budget spent) once this env is collected
        weakref.finalize(self, _forget, self.bridge, self.episode)
        answer = self.bridge.request("start", episode=self.episode, index=int(example["verifiers_index"]),
                                     max_turns=self.max_turns)
        self.system_prompt = answer.get("system_prompt") or ""
        return "\n\n".join(answer["messages"])

    def step(self, text: str) -> StepResult:
        if self.bridge is None:
            raise PluginError("step() before reset()")
        answer = self.bridge.request("step", episode=self.episode, text=text)
        if not answer["done"]:
            messages = answer["messages"]
            return StepResult(messages[0] if len(messages) == 1 else messages, 0.0, False, {})
        reward = float(answer["reward"])
        info: dict[str, Any] = {_info_key(name): float(r["score"]) for name, r in answer["rewards"].items()}
        info.update(outcome=reward, reason=str(answer.get("stop_condition") or "done"))
        self.episode = None
        return StepResult(None, reward, True, info)


def _forget(b: Bridge, episode: str) -> None:
    if b.alive:
        try:
            b.send("close", wait=False, episode=episode)
        except PluginError:
            pass


def task_rows(count: int, *, seed: int, split: str, exclude: set) -> list[dict]:
    """Row i of a split is the taskset's task 2 * i (held-out) or 2 * i + 1 (training), so the
    splits never share one; the environment's own prompt and answer are read at reset."""
    return [{"id": f"verifiers-{split}-{index}", "prompt": f"verifiers task {index}", "answer": "", "answers": [],
             "subject": None, "level": None, "source": "verifiers", "verifiers_index": index}
            for index in split_numbers(count, split=split, exclude=exclude)]


TASK = SyntheticTask(name="verifiers", rows=task_rows, key=lambda r: r["verifiers_index"])
ENV = EnvSpec(factory=VerifiersEnv, options=VerifiersOptions, task=TASK, name="verifiers")
