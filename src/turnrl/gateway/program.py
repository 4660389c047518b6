"""`env.name: agent`: the user's agent program is the environment.

    env:
      name: agent
      options:
        program: my_agents.solver:run        # a Python function, sync or async ...
        # command: node agents/solver.js      # ... or a command line in any language
        timeout_s: 120                       # per episode
        max_concurrent: 128                  # programs running at once per rollout engine

For each episode turnrl calls the program with the task row and a gateway URL plus a key that
identifies the episode. The program talks to the policy only through that URL with an ordinary
OpenAI client and imports nothing from turnrl:

    def run(task: dict, base_url: str, api_key: str) -> float | dict | None
        client = openai.OpenAI(base_url=base_url, api_key=api_key)
        ...                                   # any calls, tools, context edits, sub-agents
        return reward                         # or {"reward": r, "components": {...}}

A command gets the same as environment variables, OPENAI_BASE_URL, OPENAI_API_KEY and
TURNRL_TASK (the row as JSON; also on its standard input), and ends the episode by printing its
reward (a number, or a JSON object as above) as the last line of its standard output. Either may
instead post it: `POST {base_url}/turnrl/reward` with `{"reward": r, "components": {...},
"call_rewards": {completion_id: r}}` and the key as bearer token (then return None / print
nothing). See docs/agents.md.
"""
from __future__ import annotations

import inspect
import json
import math
import numbers
import os
import shlex
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import Annotated, Any, Callable, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from turnrl.plugins import PluginError, is_import_path, load_object


class AgentOptions(BaseModel):
    """`env.options` of `env.name: agent`."""
    model_config = ConfigDict(extra="forbid")
    program: str = Field("", description=(
        "the agent as a Python function by import path (module:function; sync or async), called as "
        "fn(task, base_url=..., api_key=...); or leave empty and set `command`"))
    command: str | list[str] = Field("", description=(
        "the agent as a command line (any language): OPENAI_BASE_URL, OPENAI_API_KEY and TURNRL_TASK in its "
        "environment, the task row as JSON on its standard input, its reward printed as the last line"))
    timeout_s: Annotated[float, Field(gt=0)] = Field(300.0, description=(
        "seconds an episode may take; past them it ends as an environment error and its calls are refused"))
    max_concurrent: Annotated[int, Field(gt=0)] = Field(128, description=(
        "programs running at once, per rollout engine: their calls batch on the engine together, so fewer than a "
        "step's episodes (prompts_per_step x n) leave the engine's batch smaller than the built-in loop's"))
    parser: str = Field("hermes", description=(
        "how tool calls are read from the model's text (hermes, llama3, mistral, or module:function), "
        "as in the `tools` environment"))
    sampling: Literal["policy", "request"] = Field("policy", description=(
        "policy: every call samples with rollout.temperature / top_p (eval.* when evaluating), whatever the "
        "program asks, so training stays on-policy; request: the program's temperature and top_p are used"))
    model_name: str = Field("turnrl-policy", description="the model id /v1/models lists (any id is accepted)")
    host: str = Field("127.0.0.1", description=(
        "where the gateway listens: loopback by default; 0.0.0.0 for programs on other machines"))
    port: Annotated[int, Field(ge=0, le=65535)] = Field(0, description="0: a free port")
    demonstration: str = Field("", description=(
        "for model.path: tiny: module:function(task, rng, good) -> the assistant messages a (good or poor) agent "
        "sends for this row; the gateway replays them to the real program for the warm start"))
    rows: str = Field("", description=(
        "for data.train_set: synthetic: module:function(count, *, seed, split, exclude) -> rows with at least "
        "prompt and answer"))
    env: dict[str, str] = Field(default_factory=dict, description="extra environment variables for a command")

    @model_validator(mode="after")
    def _one_program(self) -> "AgentOptions":
        if bool(self.program) == bool(self.command):
            raise ValueError("set exactly one of program (module:function) and command (a command line)")
        if self.program and not is_import_path(self.program):
            hint = "; a command line (node agent.js) is env.options.command" if " " in self.program.strip() else ""
            raise ValueError(f"program = {self.program!r}: an import path is 'package.module:function'{hint}")
        return self


class ProgramError(RuntimeError):
    """The program failed (raised, exited non-zero, timed out, gave no reward): an environment error."""


@dataclass(frozen=True)
class AgentProgram:
    """What `env.name: agent` makes per episode: the program to run and how (its options)."""
    options: AgentOptions

    # the Env attributes the rollout machinery reads before it knows the kind
    system_prompt = ""
    stop: tuple = ()
    observation_role = "tool"

    def function(self) -> Callable[..., Any]:
        fn = load_object(self.options.program, "env.options.program")
        if not callable(fn):
            raise PluginError(f"env.options.program = {self.options.program!r}: {fn!r} is not callable")
        return fn

    def run(self, example: dict, base_url: str, api_key: str) -> Any:
        """Run the program for one episode; what it returned (None: it posted or gave nothing).
        Raises ProgramError for a failure, TimeoutError past timeout_s."""
        if self.options.program:
            return self._call(example, base_url, api_key)
        return self._command(example, base_url, api_key)

    def _call(self, example: dict, base_url: str, api_key: str) -> Any:
        fn = self.function()
        started = time.monotonic()
        result = fn(dict(example), base_url=base_url, api_key=api_key)
        took = time.monotonic() - started
        if took > self.options.timeout_s:   # a sync function cannot be stopped: returning late is its timeout
            raise TimeoutError(f"the program returned after {took:.1f} s, past env.options.timeout_s = "
                               f"{self.options.timeout_s:g} s")
        if inspect.isawaitable(result):   # an async function, an object with `async def __call__`, a wrapper
            import asyncio

            async def bounded():
                try:
                    return await asyncio.wait_for(result, self.options.timeout_s - took)
                except asyncio.TimeoutError:
                    raise TimeoutError(f"the program did not return within env.options.timeout_s = "
                                       f"{self.options.timeout_s:g} s") from None
            return asyncio.run(bounded())
        return result

    def _command(self, example: dict, base_url: str, api_key: str) -> Any:
        argv = self.options.command if isinstance(self.options.command, list) else shlex.split(self.options.command)
        task = json.dumps(example, default=str)
        # the row in TURNRL_TASK too, where it fits: the environment of a process is bounded (Linux: 128 KiB a
        # variable); stdin always has it
        in_env = {"TURNRL_TASK": task} if len(task.encode()) <= TASK_ENV_LIMIT else {}
        env = {**os.environ, **tracking_env(), **self.options.env, "OPENAI_BASE_URL": base_url,
               "OPENAI_API_KEY": api_key, **in_env}
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    env=env, text=True, start_new_session=True)
        except OSError as exc:
            raise ProgramError(f"command {argv[0]!r} (env.options.command) could not start: {exc}") from None
        try:
            out, err = _finished(proc, task, self.options.timeout_s)
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"the command did not end within env.options.timeout_s = {self.options.timeout_s:g} s")
        if proc.returncode != 0:
            tail = " | ".join(err.strip().splitlines()[-3:])[-400:]
            raise ProgramError(f"the command exited with code {proc.returncode}" + (f": {tail}" if tail else ""))
        lines = [line for line in out.strip().splitlines() if line.strip()]
        if not lines:
            return None
        try:
            return json.loads(lines[-1])
        except json.JSONDecodeError:
            return None if lines[-1].strip().lower() in ("", "null", "none") else _not_json(lines[-1])


def _not_json(line: str) -> Any:
    raise ProgramError(f"the command's last line {line[:120]!r} is not a reward (a number or a JSON object "
                       "{\"reward\": ...}); print the reward last, or post it to /turnrl/reward and print nothing")


TASK_ENV_LIMIT = 100_000   # bytes of a row put in TURNRL_TASK (larger: stdin only)


def _finished(proc: subprocess.Popen, task: str, timeout_s: float) -> tuple[str, str]:
    """The command's stdout and stderr once it has exited (TimeoutExpired past `timeout_s`). Its
    process group is killed then, whatever is left of it: a child it left running, holding its
    stdout, would otherwise keep the episode open until the timeout."""
    output: list[tuple[str, str]] = []
    reader = threading.Thread(target=lambda: output.append(proc.communicate(task)), daemon=True)
    reader.start()
    try:
        proc.wait(timeout=timeout_s)
        expired = False
    except subprocess.TimeoutExpired:
        expired = True
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):   # nothing left of the group (or not ours to kill)
        if expired:
            proc.kill()
    reader.join(timeout=10)
    if expired:
        raise subprocess.TimeoutExpired(proc.args, timeout_s)
    return output[0] if output else ("", "")


def tracking_env() -> dict[str, str]:
    """For a program's process: the run's MLflow experiment (MLFLOW_EXPERIMENT_ID) unless the
    environment names one, so traces the program records itself (MLflow's autologging of its
    OpenAI client) land where turnrl can join them into its trace of the episode. The store,
    MLFLOW_TRACKING_URI, is inherited: the stage sets it (mlflow.set_tracking_uri does)."""
    run_experiment = os.environ.get("TURNRL_MLFLOW_EXPERIMENT_ID")
    if not run_experiment or os.environ.get("MLFLOW_EXPERIMENT_ID") or os.environ.get("MLFLOW_EXPERIMENT_NAME"):
        return {}
    return {"MLFLOW_EXPERIMENT_ID": run_experiment}


def plain(value: Any) -> Any:
    """A program's result with its array scalars (numpy's, torch's 0-d tensors) as Python numbers,
    in a dict too; anything else as it is (checked where the reward is read)."""
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    shape = getattr(value, "shape", None)
    if shape is not None and tuple(shape) == () and callable(getattr(value, "item", None)):
        return value.item()
    return value


def finite(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ProgramError(f"{what} is {value!r}, not a finite number")
    return float(value)


def make_program(**options: Any) -> AgentProgram:
    return AgentProgram(AgentOptions(**options))
