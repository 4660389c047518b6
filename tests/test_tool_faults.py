"""Faults in users' tools and environments, each against real local servers on 127.0.0.1: an
HTTP tool server and MCP servers (streamable HTTP and stdio) killed and restarted mid-run, an MCP
endpoint that accepts connections and never answers, function tools that call sys.exit or never
return, and environments whose `step` returns garbage. Never a hang, never a silently dead tool,
never a lost batch. Each test prints what it measured (`pytest -s`): calls recovered, seconds to
recover, trajectories kept."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from transformers import AutoTokenizer

from conftest import free_port, measured
from turnrl import envs
from turnrl.envs.base import StepResult
from turnrl.envs.tools import close_toolboxes
from turnrl.rollout.chat import ChatFormat
from turnrl.rollout.multi_turn import ENV_ERROR, Budgets, Sample, replay, run_rollouts, tool_rates
from turnrl.training.health import HealthMonitor

EXAMPLE = {"prompt": "Compute 2 + 3.", "answer": "5"}


def call(name, **arguments) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def step(env, text):
    return asyncio.run(env.step(text))


def wait_listening(port: int, seconds: float = 30) -> None:
    deadline = time.time() + seconds
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    raise AssertionError(f"nothing listens on port {port} after {seconds} s")


@pytest.fixture(autouse=True)
def fresh_boxes():
    yield
    close_toolboxes()


@pytest.fixture(scope="module")
def fmt(tiny_model_dir):
    return ChatFormat(AutoTokenizer.from_pretrained(tiny_model_dir))


# --------------------------------------------------------------------------- HTTP tool server
class _Handler(BaseHTTPRequestHandler):
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
        data = json.dumps({"result": body.get("x", 0) * 2}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def http_server(port: int) -> ThreadingHTTPServer:
    server = ThreadingHTTPServer(("127.0.0.1", port), _Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_an_http_tool_server_stopped_and_restarted_mid_run(fmt):
    """Down: each call is a transport error after its retries (fast, no hang), counted in
    tools/double/error_frac, which fails the tool_errors health check naming the tool. Back up
    on the same port: the next call runs."""
    port = free_port()
    server = http_server(port)
    spec = {"name": "double", "url": f"http://127.0.0.1:{port}/double",
            "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}
    env = envs.make("tools", functions=[], http=[spec], retries=1, timeout_s=2)
    env.reset(EXAMPLE)
    assert step(env, call("double", x=4)).observation == ["8"]
    server.shutdown()
    server.server_close()
    start = time.perf_counter()
    down = replay(env, fmt, EXAMPLE, [call("double", x=1), call("double", x=2)])
    assert time.perf_counter() - start < 2
    assert all("could not be reached after 2 attempt(s)" in o for o in down.observations)
    rates = tool_rates([down])
    assert rates["tools/double/error_frac"] == 1.0
    flags, started, _ = HealthMonitor(_health()).check({"step": 3, **rates})
    assert [f.check for f in flags] == ["tool_errors"] and "double: 100% of its calls failed" in flags[0].message
    server = http_server(port)
    try:
        restarted = time.perf_counter()
        up = replay(env, fmt, EXAMPLE, [call("double", x=k) for k in range(3)])
        assert up.observations == ["0", "2", "4"]
        assert tool_rates([up])["tools/double/error_frac"] == 0.0
        measured("http tool restart", calls_recovered=f"{len(up.observations)}/3",
                 seconds_to_recover=time.perf_counter() - restarted)
    finally:
        server.shutdown()
        server.server_close()


def _health():
    from turnrl.config import HealthCfg
    return HealthCfg()


# --------------------------------------------------------------------------- MCP servers
MCP_SERVER = '''
import os, sys
from mcp.server.mcpserver import MCPServer

server = MCPServer("calc")

@server.tool()
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b

@server.tool()
def pid() -> int:
    """The server's process id."""
    return os.getpid()

if __name__ == "__main__":
    with open(sys.argv[1], "a") as f:
        f.write(f"{os.getpid()}\\n")
    if len(sys.argv) > 2:
        server.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
    else:
        server.run()
'''


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:          # a zombie is gone too
        return f.read().split(")")[-1].split()[0] != "Z"


def _pids(path) -> list[int]:
    return [int(line) for line in path.read_text().split()] if path.exists() else []


class HTTPMCPServer:
    """The MCP server above over streamable HTTP, in a process of its own on a fixed port."""

    def __init__(self, tmp_path, port: int):
        self.script, self.pid_file, self.port = tmp_path / "mcp_server.py", tmp_path / "http_pids", port
        self.script.write_text(MCP_SERVER)
        self.proc: subprocess.Popen | None = None

    def start(self) -> "HTTPMCPServer":
        self.proc = subprocess.Popen([sys.executable, str(self.script), str(self.pid_file), str(self.port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_listening(self.port)
        return self

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


def _many(envs_, text: str) -> list[StepResult]:
    async def all_steps():
        return await asyncio.gather(*(e.step(text) for e in envs_))
    return asyncio.run(all_steps())


def test_an_mcp_server_over_http_killed_and_restarted_is_reconnected(tmp_path):
    server = HTTPMCPServer(tmp_path, free_port()).start()
    try:
        spec = {"url": f"http://127.0.0.1:{server.port}/mcp", "connect_timeout_s": 20}
        trajectories = [envs.make("tools", functions=[], mcp=[spec], timeout_s=3, retries=2) for _ in range(8)]
        for env in trajectories:
            env.reset(EXAMPLE)
        first = _pids(server.pid_file)[0]
        assert [r.observation for r in _many(trajectories, call("pid"))] == [[str(first)]] * 8
        server.kill()
        start = time.perf_counter()
        down = _many(trajectories, call("add", a=1, b=2))
        assert time.perf_counter() - start < 3.5                # each bounded, all at once
        assert all(r.info["tool_transport"] + r.info["tool_timeouts"] == 1 for r in down), \
            [r.observation for r in down]
        server.start()
        restarted = time.perf_counter()
        deadline, up = time.time() + 15, []
        while time.time() < deadline:                           # a reconnect may wait out its backoff
            up = _many(trajectories, call("pid"))
            if all(r.info["tool_ok"] for r in up):
                break
            time.sleep(0.1)
        recovered = time.perf_counter() - restarted
        second = _pids(server.pid_file)[-1]
        assert second != first and [r.observation for r in up] == [[str(second)]] * 8   # the new server answers
        assert trajectories[0].box.reconnects >= 1
        measured("mcp over http restart", calls_recovered=f"{sum(r.info['tool_ok'] for r in up)}/8",
                 seconds_to_recover=recovered, reconnects=trajectories[0].box.reconnects)
    finally:
        close_toolboxes()
        server.stop()


def test_an_mcp_server_over_http_that_stops_answering_does_not_stall_the_calls(tmp_path):
    """SIGSTOP: the server's socket accepts, nothing answers. 8 calls at once end together within
    timeout_s; after SIGCONT the calls run again."""
    server = HTTPMCPServer(tmp_path, free_port()).start()
    try:
        spec = {"url": f"http://127.0.0.1:{server.port}/mcp", "connect_timeout_s": 20}
        trajectories = [envs.make("tools", functions=[], mcp=[spec], timeout_s=1, retries=1) for _ in range(8)]
        for env in trajectories:
            env.reset(EXAMPLE)
        assert all(r.info["tool_ok"] for r in _many(trajectories, call("add", a=1, b=1)))
        os.kill(server.proc.pid, signal.SIGSTOP)
        try:
            start = time.perf_counter()
            hung = _many(trajectories, call("add", a=1, b=2))
            took = time.perf_counter() - start
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        assert took < 2.5 and all(r.observation == ["Error: add timed out after 1 s"] for r in hung), took
        deadline, up = time.time() + 10, []
        while time.time() < deadline:
            up = _many(trajectories, call("add", a=2, b=2))
            if all(r.info["tool_ok"] for r in up):
                break
        assert [r.observation for r in up] == [["4"]] * 8
        measured("mcp over http stopped (SIGSTOP)", calls_at_once=8, seconds_for_all=took)
    finally:
        close_toolboxes()
        server.stop()


def test_an_mcp_stdio_server_that_dies_is_restarted_on_the_next_call(tmp_path):
    script, pid_file = tmp_path / "mcp_server.py", tmp_path / "stdio_pids"
    script.write_text(MCP_SERVER)
    env = envs.make("tools", functions=[], mcp=[{"command": [sys.executable, str(script), str(pid_file)],
                                                  "connect_timeout_s": 20}], timeout_s=20, retries=2)
    env.reset(EXAMPLE)
    first = _pids(pid_file)[0]
    assert step(env, call("pid")).observation == [str(first)]
    os.kill(first, signal.SIGKILL)
    deadline = time.time() + 10
    while _alive(first) and time.time() < deadline:
        time.sleep(0.05)
    start = time.perf_counter()
    r = step(env, call("pid") + call("add", a=20, b=22))       # the retry restarts the command
    recovered = time.perf_counter() - start
    second = _pids(pid_file)[-1]
    assert second != first and _alive(second)
    assert r.observation == [str(second), "42"], r.observation
    assert env.box.reconnects == 1
    measured("mcp over stdio killed", calls_recovered=f"{sum(not o.startswith('Error') for o in r.observation)}/2",
             seconds_to_recover=recovered)
    close_toolboxes()                                            # the restarted server stops with the box
    deadline = time.time() + 10
    while _alive(second) and time.time() < deadline:
        time.sleep(0.1)
    assert not _alive(second)


def test_an_mcp_endpoint_that_never_answers_fails_every_trajectory_at_once(fmt):
    """A socket that accepts and never answers: 16 trajectories end as env_error in about one
    connect_timeout_s, not 16 in a row."""
    import mcp.client.stdio  # noqa: F401 - imported once per process (seconds on a loaded machine): not timed
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    port = listener.getsockname()[1]
    try:
        make = lambda: envs.make("tools", functions=[], mcp=[{"url": f"http://127.0.0.1:{port}/mcp",  # noqa: E731
                                                               "connect_timeout_s": 1}])
        examples = [{"prompt": f"Compute {k} + 1.", "answer": str(k + 1)} for k in range(16)]
        start = time.perf_counter()
        trajs = run_rollouts(ScriptedEngine(fmt.tokenizer, "done"), examples, make, fmt,
                             Budgets(max_turns=2, max_tokens_per_turn=32, max_tokens_total=128))
        took = time.perf_counter() - start
    finally:
        listener.close()
    assert [t.finish for t in trajs] == [ENV_ERROR] * 16
    assert "could not connect to the MCP server" in trajs[-1].info["env_error"]
    assert took < 4, took
    measured("mcp endpoint that never answers", trajectories=16, connect_timeout_s=1, seconds=took)


# --------------------------------------------------------------------------- function tools
TOOLS = '''
import sys, threading, time

release = threading.Event()

def leave(code: int) -> str:
    """Exit the process.

    Args:
        code: The exit status.
    """
    sys.exit(code)

def interrupt() -> str:
    """Raise KeyboardInterrupt."""
    raise KeyboardInterrupt

async def leave_async() -> str:
    """Exit from a coroutine."""
    sys.exit(3)

def hang(x: int) -> int:
    """Never return (until the test releases it).

    Args:
        x: Anything.
    """
    release.wait(60)
    return x
'''


@pytest.fixture
def fault_tools(tmp_path, monkeypatch):
    (tmp_path / "fault_tools.py").write_text(TOOLS)
    monkeypatch.syspath_prepend(str(tmp_path))
    import fault_tools
    yield fault_tools
    fault_tools.release.set()        # the abandoned threads end with the test
    sys.modules.pop("fault_tools", None)


def test_a_function_tool_that_calls_sys_exit_is_an_error_observation(fault_tools):
    env = envs.make("tools", functions=["fault_tools:leave", "fault_tools:interrupt", "fault_tools:leave_async",
                                        "turnrl.envs.tools:calculator"], timeout_s=0.5, max_calls_per_turn=8)
    env.reset(EXAMPLE)
    start = time.perf_counter()
    r = step(env, call("leave", code=3) + call("interrupt") + call("leave_async") +
             call("calculator", expression="6 * 7"))
    assert time.perf_counter() - start < 0.5
    assert r.observation == ["Error: leave failed: called sys.exit(3); a tool must return or raise an exception",
                             "Error: interrupt failed: raised KeyboardInterrupt; a tool must return or raise an "
                             "exception",
                             "Error: leave_async failed: called sys.exit(3); a tool must return or raise an exception",
                             "42"]
    assert r.info["tool_raised"] == 3 and r.info["tool_by_name"]["leave"] == [1, 1]
    assert env.box.thread.is_alive()                                 # the box's loop is still there
    assert step(env, call("calculator", expression="6 * 7")).observation == ["42"]


def test_hung_sync_function_calls_are_abandoned_and_later_calls_still_run(fault_tools):
    """max_concurrent 2: four calls that never return each end at timeout_s, then 6 * 7 runs at
    once; past max_abandoned (= max_concurrent) still-running calls, the hung tool is not run."""
    env = envs.make("tools", functions=["fault_tools:hang", "turnrl.envs.tools:calculator"], timeout_s=0.3,
                    max_concurrent=2, max_calls_per_turn=4)
    env.reset(EXAMPLE)
    start = time.perf_counter()
    r = step(env, call("hang", x=1) + call("hang", x=2))
    assert r.observation == ["Error: hang timed out after 0.3 s"] * 2 and time.perf_counter() - start < 1
    start = time.perf_counter()
    assert step(env, call("calculator", expression="6 * 7")).observation == ["42"]
    calculator_s = time.perf_counter() - start
    assert calculator_s < 0.2
    refused = step(env, call("hang", x=3)).observation[0]
    assert refused.startswith("Error: hang failed: not run: 2 earlier calls of hang timed out and are still running")
    fault_tools.release.set()                                        # the hung calls return at last
    deadline = time.time() + 5
    while env.box.tools["hang"].abandoned and time.time() < deadline:
        time.sleep(0.02)
    fault_tools.release.clear()
    assert step(env, call("hang", x=4)).observation == ["Error: hang timed out after 0.3 s"]   # runs again
    fault_tools.release.set()
    measured("hung sync tool", calls_timed_out=3, calls_refused=1, seconds_of_6x7_after_them=calculator_s)


# --------------------------------------------------------------------------- garbage step results
class ScriptedEngine:
    """A batch engine that answers every turn with the same text (the loop around it is tested)."""

    def __init__(self, tokenizer, text: str):
        self.ids = tokenizer(text, add_special_tokens=False)["input_ids"]

    def generate(self, prompts, *, max_tokens, stop, temperature, top_p, seeds):
        return [Sample(list(self.ids), [-0.1] * len(self.ids), "stop") for _ in prompts]


BAD_STEPS = {
    "none": (None, "returned NoneType None"),
    "reward_none": (StepResult(None, None, True, {"outcome": 1.0}), "whose reward is None (NoneType), not a number"),
    "int_observation": (StepResult(7, 0.0, False, {}), "returned an observation of int"),
    "info_none": (StepResult(None, 1.0, True, None), "returned info = None (NoneType), not a dict"),
    "outcome_text": (StepResult(None, 1.0, True, {"outcome": "yes"}), "info['outcome'] is 'yes' (str), not a number"),
    "reserved": (StepResult(None, 1.0, True, {"outcome": 1.0, "answer": "5"}), "the reserved key(s) 'answer'"),
    "reserved_tokens": (StepResult(None, 1.0, True, {"outcome": 1.0, "response_tokens": 3}),
                        "the reserved key(s) 'response_tokens'"),
    "partial_credit_nan": (StepResult(None, 1.0, True, {"outcome": 1.0, "partial_credit": float("nan")}),
                           "info['partial_credit'] is nan, not a finite number"),
    "reason_none": (StepResult(None, 1.0, True, {"outcome": 1.0, "reason": None}),
                    "info['reason'] = None, not a string"),
    "info_int_keys": (StepResult(None, 1.0, True, {"outcome": 1.0, 3: "x"}),
                      "info with keys that are not strings ([3])"),
    "good": (StepResult(None, 1.0, True, {"outcome": 1.0, "reason": "answer"}), None),
}


class GarbageEnv:
    """An environment plugin whose step returns what the example's `bad` names."""
    system_prompt, stop, observation_role = "Answer.", (), "user"

    def reset(self, example):
        self.kind = example["bad"]
        return example["prompt"]

    def step(self, text):
        return BAD_STEPS[self.kind][0]


class AsyncGarbageEnv(GarbageEnv):
    async def step(self, text):
        return BAD_STEPS[self.kind][0]


@pytest.mark.parametrize("env_cls", [GarbageEnv, AsyncGarbageEnv])
def test_a_malformed_step_result_ends_only_its_trajectory(fmt, env_cls):
    examples = [{"prompt": f"Say {kind}.", "answer": "5", "bad": kind} for kind in BAD_STEPS]
    trajs = run_rollouts(ScriptedEngine(fmt.tokenizer, "five"), examples, env_cls, fmt,
                         Budgets(max_turns=2, max_tokens_per_turn=16, max_tokens_total=64), n=2)
    assert len(trajs) == 2 * len(BAD_STEPS)
    for t in trajs:
        expected = BAD_STEPS[t.example["bad"]][1]
        if expected is None:
            assert t.finish == "answer" and t.outcome == 1.0
            continue
        assert t.finish == ENV_ERROR and t.outcome == 0.0, t.example["bad"]
        message = t.info["env_error"]
        assert message.startswith(f"MalformedStep: {__name__}.{env_cls.__qualname__}.step "), message
        assert expected in message and "it must return StepResult(observation:" in message, message
    kept = sum(t.finish == "answer" for t in trajs)
    measured("garbage step results", trajectories=len(trajs), kept_good=f"{kept}/2",
             env_errors=sum(t.finish == ENV_ERROR for t in trajs))


# --------------------------------------------------------------------------- what reset returns, what a factory makes
class ResetReturns:
    """code_tool, its reset answering with what the example's `first` names."""
    FIRST = {"none": None, "dict": {"role": "user", "content": "hi"}, "int": 7}

    def __init__(self):
        from turnrl import envs
        self.env = envs.make("code_tool")
        self.system_prompt, self.stop, self.observation_role = self.env.system_prompt, self.env.stop, "tool"

    def reset(self, example):
        if example["first"] == "coroutine":
            async def later():
                return example["prompt"]
            return later()
        return self.FIRST.get(example["first"], example["prompt"])

    def step(self, text):
        return self.env.step(text)


@pytest.mark.parametrize("first, problem", [
    ("none", "reset returned NoneType None; it must return the first user message as a str"),
    ("dict", "reset returned dict {'role': 'user'"),
    ("int", "reset returned int 7"),
    ("coroutine", "reset is a coroutine function; reset must return the first message (a str) directly"),
    ("prompt", None),
])
def test_what_reset_returns_is_checked_naming_the_plugin(fmt, first, problem):
    """A first message that is not text ends the trajectory env_error naming module.Class and
    what reset must return (a None used to open an empty conversation, trained with its reward);
    the warm start's replay raises the same."""
    from turnrl.rollout.multi_turn import MalformedStep, replay
    example = {"prompt": "Compute 123 * 456.", "answer": "56088", "first": first}
    (t,) = run_rollouts(ScriptedEngine(fmt.tokenizer, "<answer>56088</answer>"), [example], ResetReturns, fmt,
                        Budgets(max_turns=2, max_tokens_per_turn=16, max_tokens_total=64), n=1)
    if problem is None:
        assert t.finish == "answer" and "env_error" not in t.info
        return
    assert t.finish == ENV_ERROR and t.outcome == 0.0 and t.response_ids == []
    assert t.info["env_error"].startswith(f"MalformedStep: {__name__}.ResetReturns: {problem}"), t.info["env_error"]
    with pytest.raises(MalformedStep, match=problem.split(";")[0][:30].replace("(", r"\(")):
        replay(ResetReturns(), fmt, example, ["<answer>56088</answer>"])


def test_a_factory_that_makes_no_environment_or_a_bad_role_is_said_so(fmt):
    class Shouting(ResetReturns):
        def __init__(self):
            super().__init__()
            self.observation_role = "assistant"
    example = {"prompt": "Compute 123 * 456.", "answer": "56088", "first": "prompt"}
    budgets = Budgets(max_turns=2, max_tokens_per_turn=16, max_tokens_total=64)
    (made_str,) = run_rollouts(ScriptedEngine(fmt.tokenizer, "x"), [example], lambda: "not an env", fmt, budgets, n=1)
    assert made_str.finish == ENV_ERROR and made_str.info["env_error"].startswith(
        "MalformedStep: the environment factory returned a str, which has no reset, step, system_prompt, stop, "
        "observation_role")
    (shouting,) = run_rollouts(ScriptedEngine(fmt.tokenizer, "x"), [example], Shouting, fmt, budgets, n=1)
    assert "observation_role is 'assistant'; it must be 'tool' or 'user'" in shouting.info["env_error"]


def test_one_stop_string_given_alone_is_one_stop_string(fmt):
    """`stop = "</answer>"` (a string, not a tuple): one stop string, not its ten characters."""
    from turnrl.rollout.multi_turn import stop_strings

    env = ResetReturns()
    env.stop = "</answer>"
    assert stop_strings(env, fmt) == ("</answer>",)


def test_the_warm_start_replay_refuses_a_malformed_step_as_rollouts_do(fmt):
    """replay (the warm start's and sft's demonstrations) checks each step's result as a rollout
    does: a NaN reward or a tuple is a MalformedStep naming the plugin, not a trained demonstration."""
    from turnrl.rollout.multi_turn import MalformedStep, replay
    example = {"prompt": "Say none.", "answer": "5", "bad": "reward_none"}
    with pytest.raises(MalformedStep, match=f"{__name__}.GarbageEnv.step returned a StepResult whose reward is None"):
        replay(GarbageEnv(), fmt, example, ["five"])
    example["bad"] = "good"
    assert replay(GarbageEnv(), fmt, example, ["five"]).outcome == 1.0
