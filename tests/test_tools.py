"""The `tools` environment: parsers, tools from functions, HTTP endpoints and MCP servers, error
observations, concurrency and timeouts, and token-exact trajectories through a chat template
that renders tools."""
import asyncio
import json
import os
import re
import sys
import textwrap
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from turnrl import envs
from turnrl.envs.tools import (ToolCall, calculator, close_toolboxes, make_tools_env, parse_hermes,
                               parse_llama3, parse_mistral, resolve_parser)
from turnrl.plugins import PluginError

EXAMPLE = {"prompt": "Compute 12 * 13.", "answer": "156"}


def call(name, **arguments) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def step(env, text):
    return asyncio.run(env.step(text))


@pytest.fixture(autouse=True)
def fresh_boxes():
    yield
    close_toolboxes()


# --------------------------------------------------------------------------- parsers
def test_hermes_reads_well_formed_calls_in_order_with_the_text_around_them():
    text = ('Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "12 * 13"}}\n</tool_call>'
            '\n<tool_call>{"name": "lookup", "arguments": "{\\"key\\": \\"a\\"}"}</tool_call><|im_end|>')
    turn = parse_hermes(text)
    assert turn.items == [ToolCall("calculator", {"expression": "12 * 13"}), ToolCall("lookup", {"key": "a"})]
    assert turn.content == "Let me compute.\n\n<|im_end|>" and not turn.is_answer
    assert parse_hermes("<answer>156</answer><|im_end|>").is_answer


@pytest.mark.parametrize("text, why", [
    ('<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}</tool_call>', "not valid JSON"),
    ('<tool_call>{"arguments": {}}</tool_call>', 'no "name"'),
    ('<tool_call>["calculator"]</tool_call>', "must be a JSON object"),
    ('<tool_call>{"name": "calculator", "arguments": [1]}</tool_call>', "must be a JSON object, not list"),
    ('<tool_call>{"name": "calculator", "arguments": {"expression": "1"}}', "not closed"),
])
def test_hermes_turns_a_malformed_call_into_a_reason(text, why):
    turn = parse_hermes(text)
    assert turn.calls == [] and len(turn.errors) == 1 and why in turn.errors[0] and not turn.is_answer


def test_llama3_and_mistral_formats():
    llama = parse_llama3('<|python_tag|>{"name": "calculator", "parameters": {"expression": "2*3"}}; '
                         '{"name": "calculator", "parameters": {"expression": "4"}}<|eom_id|>')
    assert llama.calls == [ToolCall("calculator", {"expression": "2*3"}), ToolCall("calculator", {"expression": "4"})]
    assert parse_llama3("The answer is 6.<|eot_id|>").is_answer
    assert "not valid JSON" in parse_llama3('{"name": "calculator", "parameters": {').errors[0]
    v3 = parse_mistral('[TOOL_CALLS] [{"name": "calculator", "arguments": {"expression": "5"}}]</s>')
    v11 = parse_mistral('[TOOL_CALLS]calculator[ARGS]{"expression": "5"}[TOOL_CALLS]calculator[ARGS]{"x"}')
    assert v3.calls == [ToolCall("calculator", {"expression": "5"})]
    assert v11.calls == [ToolCall("calculator", {"expression": "5"})] and len(v11.errors) == 1
    assert parse_mistral("6").is_answer


def test_llama3_prose_after_the_calls_is_content_not_an_error():
    turn = parse_llama3('{"name": "calculator", "parameters": {"expression": "6*7"}} I will wait for the result.')
    assert turn.calls == [ToolCall("calculator", {"expression": "6*7"})] and turn.errors == []
    assert turn.content == "I will wait for the result."
    assert len(parse_llama3('{"name": "calculator", "parameters": {"expression": "1"}}; {"name": ').errors) == 1


def test_mistral_calls_that_carry_their_id_or_no_args_token():
    """Mistral Small 3.2 / Magistral / Devstral templates write the call's id between the name and
    the arguments; the shortest v11 form writes the arguments straight after the name."""
    turn = parse_mistral('Let me compute.[TOOL_CALLS]calculator[CALL_ID]Kx7Qp2mZ9[ARGS]{"expression": "6*7"}'
                         '[TOOL_CALLS]calculator[CALL_ID]a1b2c3d4e[ARGS]{"expression": "2"}</s>')
    assert turn.calls == [ToolCall("calculator", {"expression": "6*7"}, "Kx7Qp2mZ9"),
                          ToolCall("calculator", {"expression": "2"}, "a1b2c3d4e")]
    assert turn.content == "Let me compute." and turn.errors == []
    bare = parse_mistral('[TOOL_CALLS]calculator{"expression": "5"}')
    assert bare.calls == [ToolCall("calculator", {"expression": "5"})]
    broken = parse_mistral('[TOOL_CALLS]calculator[CALL_ID]Kx7Qp2mZ9[ARGS]{"expression": ')
    assert broken.calls == [] and "arguments of calculator are not valid JSON" in broken.errors[0]


def test_a_parser_of_ones_own_by_import_path(tmp_path, monkeypatch):
    (tmp_path / "my_parser.py").write_text(textwrap.dedent("""
        import re
        def parse(text):
            return [{"name": m.group(1), "arguments": {"expression": m.group(2)}}
                    for m in re.finditer(r"CALL (\\w+)\\((.*?)\\)", text)]
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    turn = resolve_parser("my_parser:parse")("CALL calculator(2 * 21) CALL nope")
    assert turn.calls == [ToolCall("calculator", {"expression": "2 * 21"})]
    with pytest.raises(PluginError, match="must be one of hermes"):
        resolve_parser("hermes3")
    env = make_tools_env(parser="my_parser:parse")
    env.reset(EXAMPLE)
    assert step(env, "CALL calculator(12 * 13)").observation == ["156"]


# --------------------------------------------------------------------------- the environment
def test_every_botched_call_is_an_error_observation_counted_by_kind_and_the_rest_run():
    """Malformed JSON, an unknown tool, a missing argument, a wrong type, a tool that raises and a
    good call in one turn: six tool messages in the order written, one counter each."""
    env = envs.make("tools", max_calls_per_turn=8)
    env.reset(EXAMPLE)
    text = "".join([call("calculator", expression="12 * 13"), "<tool_call>{oops}</tool_call>", call("calc", x=1),
                    call("calculator"), call("calculator", expression=12), call("calculator", expression="1/0")])
    r = step(env, text)
    assert not r.done and len(r.observation) == 6 and r.reward == pytest.approx(1 / 6)
    good, malformed, unknown, missing, wrong_type, raised = r.observation
    assert good == "156"
    assert malformed.startswith("Error: the tool call is not valid JSON")
    assert unknown == "Error: unknown tool 'calc'; the tools are: calculator."
    assert missing == "Error: bad arguments for calculator: 'expression' is a required property"
    assert wrong_type == "Error: bad arguments for calculator: expression: 12 is not of type 'string'"
    assert raised == "Error: calculator raised ZeroDivisionError: division by zero"
    assert {k: r.info[k] for k in ("tool_calls", "tool_errors", "tool_malformed", "tool_unknown", "tool_bad_arguments",
                                   "tool_raised", "tool_timeouts", "tool_transport")} == \
        {"tool_calls": 6, "tool_errors": 5, "tool_malformed": 1, "tool_unknown": 1, "tool_bad_arguments": 2,
         "tool_raised": 1, "tool_timeouts": 0, "tool_transport": 0}
    assert r.info["tool_ok"] is False
    # the answer turn: graded by math-verify, the counts carried to the end
    end = step(env, "So it is \\boxed{156}.<|im_end|>")
    assert end.done and end.info["outcome"] == 1.0 and end.info["reason"] == "answer" and end.info["tool_calls"] == 6
    env.reset(EXAMPLE)
    assert step(env, "<answer>157</answer>").info["outcome"] == 0.0 and env.counts["calls"] == 0


def test_calls_beyond_the_turn_limit_are_not_run():
    env = envs.make("tools", max_calls_per_turn=2)
    env.reset(EXAMPLE)
    r = step(env, call("calculator", expression="1+1") * 3)
    assert r.observation == ["2", "2", "Error: not run: at most 2 tool calls per turn"] and r.info["tool_malformed"] == 1


def test_a_function_tool_by_import_path_gets_its_schema_from_hints_and_docstring(tmp_path, monkeypatch):
    (tmp_path / "my_tools.py").write_text(textwrap.dedent('''
        import asyncio

        def lookup(key: str, limit: int = 2) -> list:
            """Look a key up in the table.

            Args:
                key: The key to look up.
                limit: How many values to return at most.
            """
            return {"a": [1, 2, 3], "b": [4]}[key][:limit]

        async def shout(text: str) -> str:
            """Say it louder.

            Args:
                text: What to say.
            """
            await asyncio.sleep(0.01)
            return text.upper() * 200

        def untyped(key):
            return key
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    env = envs.make("tools", functions=["my_tools:lookup", "my_tools:shout"], max_result_chars=40)
    assert env.tools == [
        {"type": "function", "function": {"name": "lookup", "description": "Look a key up in the table.", "parameters": {
            "type": "object", "properties": {"key": {"type": "string", "description": "The key to look up."},
                                             "limit": {"type": "integer",
                                                       "description": "How many values to return at most."}},
            "required": ["key"]}}},
        {"type": "function", "function": {"name": "shout", "description": "Say it louder.", "parameters": {
            "type": "object", "properties": {"text": {"type": "string", "description": "What to say."}},
            "required": ["text"]}}}]
    env.reset(EXAMPLE)
    r = step(env, call("lookup", key="a") + call("lookup", key="a", limit=3) + call("shout", text="hi") +
             call("lookup", key="zz"))
    assert r.observation[:2] == ["[1, 2]", "[1, 2, 3]"]            # JSON of a non-string result
    assert r.observation[2] == "HI" * 18 + "H..."                   # cut to max_result_chars (40)
    assert r.observation[3] == "Error: lookup raised KeyError: 'zz'"
    with pytest.raises(PluginError, match="no tool schema from .untyped. .* no docstring"):
        envs.check_options(envs.resolve("tools"), {"functions": ["my_tools:untyped"]})


def test_function_tools_take_json_arguments_the_model_can_send(tmp_path, monkeypatch):
    """Arguments the model cannot send (an Enum, a pydantic model, *args, **kwargs) are refused
    when params are checked; an argument the function does not take is the model's mistake
    (bad_arguments), 3.0 for an int is 3, None for an Optional[Literal] is allowed, and a sync
    wrapper around an async function is awaited."""
    (tmp_path / "my_json_tools.py").write_text(textwrap.dedent('''
        import asyncio, enum, functools
        from typing import Literal, Optional
        from pydantic import BaseModel

        class Color(enum.Enum):
            RED = "red"

        class Point(BaseModel):
            x: int

        def paint(color: Color) -> str:
            """Paint.

            Args:
                color: The color.
            """
            return color.value

        def place(point: Point) -> int:
            """Place.

            Args:
                point: Where.
            """
            return point.x

        def anything(*values: int) -> int:
            """Sum.

            Args:
                values: Numbers.
            """
            return sum(values)

        def count(n: int, mode: Optional[Literal["up", "down"]] = None) -> str:
            """Count.

            Args:
                n: How far.
                mode: Which way, or none.
            """
            return f"{type(n).__name__} {list(range(n))} {mode}"

        async def _later(text):
            await asyncio.sleep(0)
            return text.upper()

        def wrapped(text: str) -> str:
            """Shout, later.

            Args:
                text: What to say.
            """
            return _later(text)
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = envs.resolve("tools")
    for name, said in (("paint", "'color' is a Color, which the model cannot send as JSON; take Literal[...]"),
                       ("place", "'point' is a Point, which the model cannot send as JSON; take dict"),
                       ("anything", "anything takes *values; a tool's arguments are named one by one")):
        with pytest.raises(PluginError, match=re.escape(said)):
            envs.check_options(spec, {"functions": [f"my_json_tools:{name}"]})
    with pytest.raises(PluginError, match="a tool named 'count' comes from 'my_json_tools:count' already"):
        envs.check_options(spec, {"functions": ["my_json_tools:count", "my_json_tools:count"]})
    env = envs.make("tools", functions=["my_json_tools:count", "my_json_tools:wrapped"])
    env.reset(EXAMPLE)
    r = step(env, call("count", n=3.0) + call("count", n=2, mode=None) + call("count", n=1, extra=True) +
             call("wrapped", text="hi"))
    assert r.observation[:2] == ["int [0, 1, 2] None", "int [0, 1] None"]
    assert r.observation[2].startswith("Error: bad arguments for count: Additional properties are not allowed")
    assert r.observation[3] == "HI"
    assert r.info["tool_bad_arguments"] == 1 and r.info.get("tool_raised", 0) == 0


def test_calculator():
    assert calculator("347 * 8215") == "2850605" and calculator("(12 + 30) / 4") == "10.5"
    assert calculator("7 / 7") == "1" and calculator("-2 ** 3") == "-8"
    for bad in ("__import__('os')", "2 ** 100000", "x + 1"):
        with pytest.raises(ValueError):
            calculator(bad)


# --------------------------------------------------------------------------- HTTP tools
class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: "ToolServer"

    def do_POST(self):   # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
        self.server.hits[self.path] = self.server.hits.get(self.path, 0) + 1
        status, payload = self.server.routes[self.path](body, self.server.hits[self.path])
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


class ToolServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128      # the listen backlog: 5 by default, which delays the 6th connection by 1 s

    def handle_error(self, request, client_address):
        pass                      # a client that timed out and left (BrokenPipe): expected here

    def __init__(self, routes):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.routes, self.hits = routes, {}
        threading.Thread(target=self.serve_forever, daemon=True).start()

    def url(self, path):
        return f"http://127.0.0.1:{self.server_address[1]}{path}"

    def close(self):
        self.shutdown()
        self.server_close()


def _sleepy(seconds):
    def route(body, hit):
        time.sleep(seconds)
        return 200, {"result": body.get("x", 0) * 2}
    return route


X_SCHEMA = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}


@pytest.fixture
def tool_server():
    server = ToolServer({
        "/double": _sleepy(0.0),
        "/slow": _sleepy(5.0),
        "/wait": _sleepy(0.3),
        "/flaky": lambda body, hit: (503, {"error": "busy"}) if hit <= 2 else (200, {"result": "third time"}),
        "/refuse": lambda body, hit: (200, {"error": "no such record"}),
        "/missing": lambda body, hit: (404, {"error": "not here"}),
    })
    yield server
    server.close()


def http_env(server, *paths, **options):
    return envs.make("tools", functions=[], http=[{"name": p.strip("/"), "url": server.url(p), "parameters": X_SCHEMA}
                                                  for p in paths], **options)


def test_an_http_tool_that_times_out_is_an_error_observation_and_does_not_hold_the_turn(tool_server):
    # the timeout leaves /double room on a loaded machine (at 0.4 s it timed out too, once, in the full suite)
    env = http_env(tool_server, "/double", "/slow", timeout_s=1.5)
    env.reset(EXAMPLE)
    start = time.perf_counter()
    r = step(env, call("slow", x=1) + call("double", x=21))
    assert time.perf_counter() - start < 4.0                # bounded by the timeout, not the server's 5 s
    assert r.observation == ["Error: slow timed out after 1.5 s", "42"]
    assert r.info["tool_timeouts"] == 1 and r.info["tool_errors"] == 1 and r.info["tool_ok"] is False


def test_http_transport_errors_are_retried_and_tool_errors_are_not(tool_server):
    env = http_env(tool_server, "/flaky", "/refuse", "/missing", retries=2)
    env.reset(EXAMPLE)
    r = step(env, call("flaky", x=1) + call("refuse", x=1) + call("missing", x=1))
    assert r.observation == ["third time", "Error: refuse failed: no such record", "Error: missing failed: HTTP 404: not here"]
    assert tool_server.hits == {"/flaky": 3, "/refuse": 1, "/missing": 1}
    close_toolboxes()
    tool_server.hits.clear()
    env = http_env(tool_server, "/flaky", retries=1)
    env.reset(EXAMPLE)
    r = step(env, call("flaky", x=1))
    assert r.observation == ["Error: flaky could not be reached after 2 attempt(s) (HTTP 503)"] and \
        r.info["tool_transport"] == 1
    # nothing listening at all: connection refused, retried, then a transport error
    dead = ToolServer({})
    url = dead.url("/gone")
    dead.close()
    env = envs.make("tools", functions=[], http=[{"name": "gone", "url": url}], retries=1)
    env.reset(EXAMPLE)
    assert "could not be reached after 2 attempt(s) (ConnectError" in step(env, call("gone")).observation[0]


def test_calls_of_all_trajectories_are_in_flight_at_once_up_to_max_concurrent(tool_server):
    """16 environments (trajectories), one 0.3 s call each, awaited together as the rollout
    loop awaits pending steps: about 0.3 s with room for all, four rounds with 4 slots."""
    for slots, low, high in ((16, 0.29, 1.0), (4, 1.19, 2.5)):
        close_toolboxes()
        made = [http_env(tool_server, "/wait", max_concurrent=slots) for _ in range(16)]
        for env in made:
            env.reset(EXAMPLE)

        async def all_steps():
            return await asyncio.gather(*(env.step(call("wait", x=k)) for k, env in enumerate(made)))
        start = time.perf_counter()
        results = asyncio.run(all_steps())
        took = time.perf_counter() - start
        assert [r.observation for r in results] == [[str(2 * k)] for k in range(16)]
        assert low < took < high, (slots, took)
        assert made[0].box is made[-1].box and made[0].box.peak_in_flight == slots


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
def divide(a: float, b: float) -> float:
    """Divide a by b."""
    return a / b

if __name__ == "__main__":
    with open(sys.argv[1], "w") as f:
        f.write(str(os.getpid()))
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


def _mcp_checks(env):
    assert [t["function"]["name"] for t in env.tools] == ["add", "divide"]
    assert env.tools[0]["function"]["parameters"]["required"] == ["a", "b"]
    env.reset(EXAMPLE)
    r = step(env, call("add", a=2, b=3) + call("divide", a=1, b=0) + call("add", a="x", b=1))
    assert r.observation[0] == "5"
    assert r.observation[1].startswith("Error: divide failed:") and r.info["tool_raised"] == 1
    assert r.observation[2] == "Error: bad arguments for add: a: 'x' is not of type 'integer'"


def test_an_mcp_server_over_stdio_started_and_stopped_with_the_tools(tmp_path):
    script, pid_file = tmp_path / "calc_server.py", tmp_path / "pid"
    script.write_text(MCP_SERVER)
    env = envs.make("tools", functions=[], mcp=[{"command": [sys.executable, str(script), str(pid_file)]}])
    _mcp_checks(env)
    pid = int(pid_file.read_text())
    assert _alive(pid)
    close_toolboxes()                          # what happens at the end of the process (atexit)
    deadline = time.time() + 10
    while _alive(pid) and time.time() < deadline:
        time.sleep(0.1)
    assert not _alive(pid)


def test_an_mcp_server_over_http(tmp_path):
    import socket
    import subprocess
    script, pid_file = tmp_path / "calc_server.py", tmp_path / "pid"
    script.write_text(MCP_SERVER)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, str(script), str(pid_file), str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 30
        while time.time() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                time.sleep(0.2)
        env = envs.make("tools", functions=[], mcp=[{"url": f"http://127.0.0.1:{port}/mcp", "tools": ["add", "divide"]}])
        _mcp_checks(env)
    finally:
        close_toolboxes()
        proc.terminate()
        proc.wait(timeout=10)
    with pytest.raises(PluginError, match="could not connect to the MCP server"):
        envs.make("tools", functions=[], mcp=[{"url": f"http://127.0.0.1:{port}/mcp", "connect_timeout_s": 3}])


# --------------------------------------------------------------------------- token in, token out
# Qwen 2.5's way with tools, cut down: the schemas in the system message; consecutive tool
# messages grouped into one user message of <tool_response> blocks.
QWEN_LIKE = (
    "{%- if tools -%}<|im_start|>system\n{{ messages[0]['content'] }}\n\n# Tools\n<tools>"
    "{%- for tool in tools -%}\n{{ tool | tojson }}{%- endfor -%}\n</tools><|im_end|>\n{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message.role == 'system' and tools -%}"
    "{%- elif message.role == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}{{ '<|im_start|>user' }}{%- endif -%}"
    "{{ '\n<tool_response>\n' + message.content + '\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}{{ '<|im_end|>\n' }}{%- endif -%}"
    "{%- else -%}{{ '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}"
)


@pytest.mark.parametrize("template", ["tiny", "qwen_like"])
def test_masks_are_exact_across_tool_turns_with_a_template_that_renders_tools(tiny_model_dir, template):
    """Two calls in turn 1 (two tool messages), one in turn 2, then the answer: the trajectory is
    exactly the sampled ids and the template's rendering of the same conversation, tools
    included; only the sampled ids are trained on."""
    from transformers import AutoTokenizer

    from conftest import ScriptedEngine
    from turnrl.rollout.chat import ChatFormat, renders_tools
    from turnrl.rollout.multi_turn import Budgets, run_rollouts
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    if template == "qwen_like":
        tok.chat_template = QWEN_LIKE
    fmt = ChatFormat(tok)
    assert renders_tools(tok)
    turns = [call("calculator", expression="12 * 13") + "\n" + call("calculator", expression="156 - 1") + "<|im_end|>",
             "Check: " + call("calculator", expression="13 * 12") + "<|im_end|>",
             "<answer>156</answer><|im_end|>"]
    engine = ScriptedEngine(tok, turns)
    [t] = run_rollouts(engine, [EXAMPLE], lambda: envs.make("tools"), fmt, Budgets(4, 256, 2000))
    assert t.finish == "answer" and t.outcome == 1.0 and t.turn_rewards == [1.0, 1.0, 1.0]
    assert t.observations == ["156\n155", "156"] and t.info["tool_calls"] == 3
    env = envs.make("tools")
    messages = [{"role": "system", "content": env.system_prompt}, {"role": "user", "content": EXAMPLE["prompt"]},
                {"role": "assistant", "content": turns[0].removesuffix("<|im_end|>")},
                {"role": "tool", "content": "156"}, {"role": "tool", "content": "155"},
                {"role": "assistant", "content": turns[1].removesuffix("<|im_end|>")},
                {"role": "tool", "content": "156"},
                {"role": "assistant", "content": turns[2].removesuffix("<|im_end|>")}]
    rendered = tok.apply_chat_template(messages, tools=env.tools, tokenize=False)
    assert tok.decode(t.prompt_ids + t.response_ids, skip_special_tokens=False) == rendered.rstrip("\n")
    assert '"name": "calculator"' in tok.decode(t.prompt_ids)          # the schema is in the prompt
    sampled = [tok(x, add_special_tokens=False)["input_ids"] for x in turns]
    policy = [i for i, m in zip(t.response_ids, t.loss_mask) if m]
    assert policy == sampled[0] + sampled[1] + sampled[2]              # token in, token out
    obs = [fmt.observation_ids(["156", "155"], "tool", after_eos=True), fmt.observation_ids(["156"], "tool",
                                                                                           after_eos=True)]
    assert t.response_ids == sampled[0] + obs[0] + sampled[1] + obs[1] + sampled[2]
    assert t.loss_mask == [1] * len(sampled[0]) + [0] * len(obs[0]) + [1] * len(sampled[1]) + [0] * len(obs[1]) + \
        [1] * len(sampled[2])
    if template == "qwen_like":     # both results in one user message, as the template groups them
        assert tok.decode(obs[0]) == ("\n<|im_start|>user\n<tool_response>\n156\n</tool_response>\n<tool_response>\n155\n"
                                      "</tool_response><|im_end|>\n<|im_start|>assistant\n")


def test_a_template_without_tools_gets_them_in_the_system_prompt():
    from turnrl.rollout.chat import ChatFormat, renders_tools
    from turnrl.models.tiny import build_tokenizer
    tok = build_tokenizer(["abc"], 300)
    tok.chat_template = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
                         "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
    assert not renders_tools(tok)
    env = envs.make("tools")
    text = ChatFormat(tok).prompt_text(env.system_prompt, "q", env.tools)
    assert text.startswith("<|im_start|>system\n" + env.system_prompt + "\n\n# Tools\n<tools>\n{\"type\": \"function\"")
    assert ChatFormat(tok, "base").prompt_text("S", "q", env.tools).startswith("S\n\n# Tools\n<tools>")


def test_the_warm_start_demonstrations_replay_through_the_environment(tiny_model_dir):
    """The tiny model's demonstrations: a good one calls the calculator with the factors and
    copies its result (outcome 1, one tool call); a bad one guesses."""
    import random

    from transformers import AutoTokenizer

    from turnrl.rollout.chat import ChatFormat
    from turnrl.rollout.multi_turn import replay
    spec = envs.resolve("tools")
    rows, _ = spec.task.splits(20, 5, seed=0)
    fmt = ChatFormat(AutoTokenizer.from_pretrained(tiny_model_dir))
    rng = random.Random(0)
    for row in rows[:5]:
        good = replay(envs.make("tools"), fmt, row, spec.task.demonstrate(row, rng, True).turns)
        bad = replay(envs.make("tools"), fmt, row, spec.task.demonstrate(row, rng, False).turns)
        assert good.outcome == 1.0 and good.observations == [row["answer"]] and good.info["tool_ok"] is True
        assert bad.num_turns == 1 and "tool_ok" not in bad.info
