"""`tools`: function calling in the model's own format, with tools from Python functions, HTTP
endpoints and MCP servers.

The tools' JSON schemas go into the prompt through the tokenizer's chat template
(`apply_chat_template(..., tools=...)`, the environment's `tools` attribute), so the policy sees
them as its model family was trained to: Qwen's `<tools>` block, Llama 3.1's JSON, ... A policy
turn is parsed by the family's parser (`parser`):

    hermes   <tool_call>{"name": ..., "arguments": {...}}</tool_call>, any number per turn
             (Qwen 2.5 / 3, Hermes, the embedded tiny model)
    llama3   the turn is a JSON object {"name": ..., "parameters": {...}} (after an optional
             <|python_tag|>), several separated by ";" (Llama 3.1 / 3.2 JSON tool calling)
    mistral  [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...] or [TOOL_CALLS]name[ARGS]{...}
    module:function   your own: text -> ParsedTurn (or a list of {"name", "arguments"} dicts)

A turn with calls: every call runs (a turn's calls concurrently), and each result comes back as
its own tool message (observation = a list of messages). A turn without a call is the final
answer, graded by `grader` (math-verify on the last <answer> or \\boxed{} by default; `exact`,
or `module:function`), outcome 1.0 or 0.0. Turn reward of a tool turn: the share of its calls
that ran (MT-GRPO's "the call worked").

Nothing a policy writes crashes the rollout: a malformed call (bad JSON, no name, an unclosed
tag), an unknown tool, arguments the tool's schema rejects, a tool that raises, times out or
cannot be reached all come back as an error observation (`Error: ...`) and the trajectory goes
on. Counts per trajectory in `info` (logged every step as `env_<key>_mean`): `tool_calls`,
`tool_errors` and by kind `tool_malformed`, `tool_unknown`, `tool_bad_arguments`,
`tool_raised`, `tool_timeouts`, `tool_transport`; `tool_ok` (every call of the last tool turn
ran: tool_call_rate / tool_success_rate).

Where tools come from (`env.options`):

    functions: [my_pkg.tools:lookup]     Python functions (sync or async), the schema from their
                                         type hints and docstring (transformers' get_json_schema)
    http: [{name, url, description, parameters}]      POST url with the arguments as JSON; the
                                         reply's "result" (or "error"), else its JSON or text
    mcp: [{command: [python, server.py]}, {url: http://host:8000/mcp}]   MCP servers (stdio or
                                         streamable HTTP): every tool they list, or `tools: [...]`

Every call in a process goes through one `ToolBox` per tool configuration, on an event loop of
its own: all trajectories' calls are in flight at once up to `max_concurrent`, each bounded by
`timeout_s` (retries included), retried up to `retries` times on transport errors (connection
refused or reset, HTTP 502/503/504) with a short backoff. A synchronous function runs in a
thread of the box (a timed-out one is abandoned, not killed).
"""
from __future__ import annotations

import ast
import asyncio
import atexit
import concurrent.futures
import functools
import inspect
import json
import math
import operator
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Annotated, Any, Callable, Sequence

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from turnrl.data import synthetic
from turnrl.envs.base import EnvSpec, StepResult
from turnrl.plugins import PluginError, is_import_path, load_object

SYSTEM_PROMPT = ("Solve the problem. You can call the tools; their results come back as tool messages. "
                 "Give the final answer as <answer>...</answer>.")

ERROR_KINDS = ("malformed", "unknown", "bad_arguments", "raised", "timeouts", "transport")


# --------------------------------------------------------------------------- parsing
@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict


@dataclass
class ParsedTurn:
    """A policy turn: its calls in the order written, each a `ToolCall` or, for a botched one,
    a string saying why it is not a call (it gets an error message); and the text around them."""
    items: list[ToolCall | str] = field(default_factory=list)
    content: str = ""

    @property
    def calls(self) -> list[ToolCall]:
        return [c for c in self.items if isinstance(c, ToolCall)]

    @property
    def errors(self) -> list[str]:
        return [c for c in self.items if not isinstance(c, ToolCall)]

    @property
    def is_answer(self) -> bool:
        return not self.items


def _as_call(obj: Any, arguments_key: str = "arguments") -> ToolCall | str:
    """A call from a parsed JSON value, or why it is not one."""
    if not isinstance(obj, dict):
        return f"a tool call must be a JSON object with \"name\" and \"{arguments_key}\", not {type(obj).__name__}"
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return "the tool call has no \"name\""
    args = obj.get(arguments_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):       # OpenAI-style: the arguments as a JSON string
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as exc:
            return f"the arguments of {name} are not valid JSON ({exc.msg})"
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return f"the arguments of {name} must be a JSON object, not {type(args).__name__}"
    return ToolCall(name.strip(), args)


def _loads(body: str) -> tuple[Any, str | None]:
    try:
        return json.loads(body), None
    except json.JSONDecodeError as exc:
        return None, f"the tool call is not valid JSON ({exc.msg} at character {exc.pos})"


_HERMES = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)
_HERMES_HINT = 'Write <tool_call>{"name": ..., "arguments": {...}}</tool_call>.'


def parse_hermes(text: str) -> ParsedTurn:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number of them."""
    turn = ParsedTurn()
    rest, last = [], 0
    for m in _HERMES.finditer(text):
        rest.append(text[last:m.start()])
        last = m.end()
        if not m.group(2):
            turn.items.append(f"the tool call is not closed with </tool_call>. {_HERMES_HINT}")
            continue
        value, problem = _loads(m.group(1).strip())
        call = _as_call(value) if problem is None else f"{problem}. {_HERMES_HINT}"
        turn.items.append(call)
    rest.append(text[last:])
    turn.content = "".join(rest).strip()
    return turn


_LLAMA_END = re.compile(r"(<\|eot_id\|>|<\|eom_id\|>|<\|end_of_text\|>)\s*$")


def parse_llama3(text: str) -> ParsedTurn:
    """Llama 3.1 / 3.2 JSON tool calling: the turn is `{"name": ..., "parameters": {...}}`
    (optionally after <|python_tag|>), several separated by ";". Other text is an answer."""
    body = _LLAMA_END.sub("", text).strip()
    tagged = body.startswith("<|python_tag|>")
    body = body.removeprefix("<|python_tag|>").strip()
    if not tagged and not body.startswith("{"):
        return ParsedTurn(content=text.strip())
    turn = ParsedTurn()
    decoder = json.JSONDecoder()
    pos = 0
    while pos < len(body):
        try:
            value, end = decoder.raw_decode(body, pos)
        except json.JSONDecodeError as exc:
            turn.items.append(f"the tool call is not valid JSON ({exc.msg} at character {exc.pos}). "
                              'Write {"name": ..., "parameters": {...}}.')
            break
        call = _as_call(value, "parameters")
        turn.items.append(call)
        pos = end
        while pos < len(body) and body[pos] in " \n\t;":
            pos += 1
    return turn


_MISTRAL_ARGS = re.compile(r"\[TOOL_CALLS\]\s*([A-Za-z0-9_.\-]+)\s*\[ARGS\]", re.DOTALL)


def parse_mistral(text: str) -> ParsedTurn:
    """Mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (v3) or, from v11 on,
    `[TOOL_CALLS]name[ARGS]{...}` once per call."""
    if "[TOOL_CALLS]" not in text:
        return ParsedTurn(content=text.strip())
    turn = ParsedTurn(content=text[:text.index("[TOOL_CALLS]")].strip())
    decoder = json.JSONDecoder()
    named = list(_MISTRAL_ARGS.finditer(text))
    if named:
        for m in named:
            try:
                value, _ = decoder.raw_decode(text, m.end())
            except json.JSONDecodeError as exc:
                turn.items.append(f"the arguments of {m.group(1)} are not valid JSON ({exc.msg})")
                continue
            call = _as_call({"name": m.group(1), "arguments": value})
            turn.items.append(call)
        return turn
    start = text.index("[TOOL_CALLS]") + len("[TOOL_CALLS]")
    try:
        value, _ = decoder.raw_decode(text[start:].lstrip())
    except json.JSONDecodeError as exc:
        turn.items.append(f"the tool calls are not valid JSON ({exc.msg}). "
                          'Write [TOOL_CALLS][{"name": ..., "arguments": {...}}].')
        return turn
    for item in value if isinstance(value, list) else [value]:
        call = _as_call(item)
        turn.items.append(call)
    return turn


PARSERS: dict[str, Callable[[str], ParsedTurn]] = {"hermes": parse_hermes, "qwen": parse_hermes,
                                                   "llama3": parse_llama3, "mistral": parse_mistral}


def resolve_parser(name: str, key: str = "env.options.parser") -> Callable[[str], ParsedTurn]:
    """A built-in parser by name (hermes, qwen, llama3, mistral) or your own by import path:
    `fn(text) -> ParsedTurn`, or a list of {"name", "arguments"} dicts (then every other text
    of the turn is its content)."""
    if name in PARSERS:
        return PARSERS[name]
    if not is_import_path(name):
        raise PluginError(f"{key} = {name!r}: must be one of {', '.join(PARSERS)} or an import path "
                          "module:function (text -> ParsedTurn)")
    fn = load_object(name, key)
    if not callable(fn):
        raise PluginError(f"{key} = {name!r}: {fn!r} is not callable; it must be parse(text) -> ParsedTurn")

    def parse(text: str) -> ParsedTurn:
        out = fn(text)
        if isinstance(out, ParsedTurn):
            return out
        turn = ParsedTurn(content=text.strip())
        for item in out or []:
            turn.items.append(item if isinstance(item, ToolCall) else _as_call(item))
        return turn
    return parse


# --------------------------------------------------------------------------- tools
class ToolError(Exception):
    """The tool ran and failed (it raised, or the server reported an error)."""


class TransportError(Exception):
    """The tool could not be reached (retried)."""


def _validation_schema(schema: Any) -> Any:
    """A JSON schema jsonschema can check: transformers marks Optional arguments
    `"nullable": true` (OpenAPI's spelling), JSON Schema says `"type": [t, "null"]`."""
    if isinstance(schema, dict):
        out = {k: _validation_schema(v) for k, v in schema.items() if k != "nullable"}
        if schema.get("nullable") and "type" in out:
            kinds = out["type"] if isinstance(out["type"], list) else [out["type"]]
            out["type"] = [*kinds, "null"] if "null" not in kinds else kinds
        return out
    if isinstance(schema, list):
        return [_validation_schema(v) for v in schema]
    return schema


class Tool:
    """A named tool: its schema (what the chat template renders) and `run(arguments)`."""
    kind = "tool"

    def __init__(self, name: str, description: str, parameters: dict | None):
        self.name, self.description = name, description or ""
        self.parameters = parameters or {"type": "object", "properties": {}}
        import jsonschema
        schema = _validation_schema(self.parameters)
        cls = jsonschema.validators.validator_for(schema)
        self._validator = cls(schema)

    @property
    def schema(self) -> dict:
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}

    def check(self, arguments: dict) -> str | None:
        """Why `arguments` do not fit the schema (the first problem), or None."""
        errors = sorted(self._validator.iter_errors(arguments), key=lambda e: list(e.path))
        if not errors:
            return None
        e = errors[0]
        where = ".".join(str(p) for p in e.path)
        return f"{where}: {e.message}" if where else e.message

    async def run(self, arguments: dict, box: "ToolBox") -> Any:
        raise NotImplementedError


class FunctionTool(Tool):
    """A Python function (sync: run in the box's threads; async: awaited on its loop)."""
    kind = "function"

    def __init__(self, fn: Callable, key: str):
        from transformers.utils import get_json_schema
        try:
            schema = get_json_schema(fn)["function"]
        except Exception as exc:   # noqa: BLE001 - TypeHintParsingException, DocstringParsingException
            raise PluginError(
                f"{key}: no tool schema from {getattr(fn, '__qualname__', fn)!r} ({exc}). Give every argument a "
                "type hint and a line in the docstring's Args: section (Google style), and the function a "
                "one-line description") from None
        super().__init__(schema["name"], schema.get("description", ""), schema.get("parameters"))
        self.fn = fn
        self.is_async = inspect.iscoroutinefunction(fn)

    async def run(self, arguments: dict, box: "ToolBox") -> Any:
        if self.is_async:
            return await self.fn(**arguments)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(box.threads, functools.partial(self.fn, **arguments))


class HTTPTool(Tool):
    """POST `url` with the arguments as a JSON object. The reply: a JSON object's "result" (or
    its "error", which fails the call), else the JSON or the text. HTTP 502/503/504 and
    connection errors are transport errors (retried); other non-2xx statuses fail the call."""
    kind = "http"

    def __init__(self, spec: "HTTPToolSpec"):
        super().__init__(spec.name, spec.description, spec.parameters)
        self.url, self.headers = spec.url, dict(spec.headers)

    async def run(self, arguments: dict, box: "ToolBox") -> Any:
        import httpx
        try:
            response = await box.http().post(self.url, json=arguments, headers=self.headers)
        except httpx.TimeoutException as exc:
            raise TimeoutError(str(exc)) from exc
        except httpx.TransportError as exc:
            raise TransportError(f"{type(exc).__name__}: {exc}") from exc
        if response.status_code in (502, 503, 504):
            raise TransportError(f"HTTP {response.status_code}")
        try:
            body = response.json()
        except ValueError:
            body = response.text
        if response.status_code >= 400:
            detail = body.get("error", body) if isinstance(body, dict) else body
            raise ToolError(f"HTTP {response.status_code}: {str(detail)[:300]}")
        if isinstance(body, dict) and "error" in body and "result" not in body:
            raise ToolError(str(body["error"]))
        if isinstance(body, dict) and "result" in body:
            return body["result"]
        return body


class MCPTool(Tool):
    """A tool an MCP server lists; called through the box's session with that server."""
    kind = "mcp"

    def __init__(self, server: "_MCPServer", name: str, description: str, parameters: dict | None):
        super().__init__(name, description, parameters)
        self.server = server

    async def run(self, arguments: dict, box: "ToolBox") -> Any:
        import anyio
        try:
            result = await self.server.client.call_tool(self.name, arguments)
        except (anyio.ClosedResourceError, anyio.BrokenResourceError, ConnectionError) as exc:
            raise TransportError(f"{type(exc).__name__}: {exc}") from exc
        texts = [getattr(c, "text", None) for c in result.content]
        text = "\n".join(t for t in texts if t is not None)
        if result.is_error:
            raise ToolError(text or "the MCP server reported an error")
        if text:
            return text
        return result.structured_content if result.structured_content is not None else ""


class _MCPServer:
    """One MCP session, opened and held by a task on the box's loop until the box closes."""

    def __init__(self, spec: "MCPServerSpec", key: str):
        self.spec, self.key, self.client = spec, key, None
        self.closing: asyncio.Event | None = None
        self.task: asyncio.Task | None = None

    def target(self):
        from mcp import StdioServerParameters
        if self.spec.url:
            return self.spec.url
        from mcp.client.stdio import get_default_environment
        command, *args = self.spec.command
        return StdioServerParameters(command=command, args=args, env={**get_default_environment(), **self.spec.env},
                                     cwd=self.spec.cwd or None)

    async def open(self) -> list[MCPTool]:
        from mcp import Client
        self.closing = asyncio.Event()
        ready: asyncio.Future = asyncio.get_running_loop().create_future()

        async def hold() -> None:
            try:
                # no read timeout of the session's own: each call is bounded by timeout_s, the
                # handshake and listing by connect_timeout_s (below)
                async with Client(self.target()) as client:
                    self.client = client
                    listed = await client.list_tools()
                    tools = [MCPTool(self, t.name, t.description or "", dict(t.input_schema or {}))
                             for t in listed.tools if not self.spec.tools or t.name in self.spec.tools]
                    ready.set_result(tools)
                    await self.closing.wait()
            except BaseException as exc:   # noqa: BLE001 - reported through `ready`, or on close
                if not ready.done():
                    ready.set_exception(exc)
                elif not isinstance(exc, asyncio.CancelledError):
                    raise
        self.task = asyncio.create_task(hold())
        try:
            tools = await asyncio.wait_for(asyncio.shield(ready), self.spec.connect_timeout_s)
        except Exception as exc:
            self.task.cancel()
            where = self.spec.url or " ".join(self.spec.command)
            raise PluginError(f"{self.key}: could not connect to the MCP server {where!r} "
                              f"({type(exc).__name__}: {exc})") from None
        missing = sorted(set(self.spec.tools) - {t.name for t in tools})
        if missing:
            raise PluginError(f"{self.key}: the MCP server has no tool {', '.join(missing)}")
        return tools

    async def close(self) -> None:
        if self.closing is not None:
            self.closing.set()
        if self.task is not None:
            try:
                await asyncio.wait_for(self.task, 10)
            except BaseException:   # noqa: BLE001 - closing: nothing left to do about it
                self.task.cancel()


@dataclass
class CallOutcome:
    ok: bool
    text: str                   # what goes back to the policy (a result, or "Error: ...")
    error: str | None = None    # one of ERROR_KINDS when not ok
    seconds: float = 0.0
    attempts: int = 1


def _result_text(value: Any, limit: int) -> str:
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= limit else text[:max(0, limit - 3)] + "..."


class ToolBox:
    """The tools of one configuration in this process, and the event loop their calls run on.

    `call(name, arguments)` from any thread or event loop (`acall` awaits it); every call is
    checked against the tool's schema, waits for one of `max_concurrent` slots, and is bounded
    by `timeout_s` with up to `retries` retries on transport errors."""

    def __init__(self, functions: Sequence[str] = (), http: Sequence["HTTPToolSpec"] = (),
                 mcp: Sequence["MCPServerSpec"] = (), *, timeout_s: float = 10.0, max_concurrent: int = 64,
                 retries: int = 2, max_result_chars: int = 1000, key: str = "env.options"):
        self.timeout_s, self.retries, self.max_result_chars = timeout_s, retries, max_result_chars
        self.max_concurrent = max_concurrent
        self.threads = concurrent.futures.ThreadPoolExecutor(max_workers=max_concurrent,
                                                             thread_name_prefix="turnrl-tool")
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="turnrl-tools", daemon=True)
        self.thread.start()
        self._http = None
        self._servers: list[_MCPServer] = []
        self.in_flight = self.peak_in_flight = 0
        self.closed = False
        try:
            self.slots = self._run(self._make_semaphore())
            tools: list[tuple[str, Tool]] = []
            for i, path in enumerate(functions):
                where = f"{key}.functions[{i}] = {path!r}"
                fn = load_object(path, f"{key}.functions[{i}]")
                if not callable(fn):
                    raise PluginError(f"{where}: {fn!r} is not a function")
                tools.append((where, FunctionTool(fn, where)))
            for i, spec in enumerate(http):
                tools.append((f"{key}.http[{i}]", HTTPTool(spec)))
            for i, spec in enumerate(mcp):
                server = _MCPServer(spec, f"{key}.mcp[{i}]")
                self._servers.append(server)
                tools += [(f"{key}.mcp[{i}]", t) for t in self._run(server.open(), spec.connect_timeout_s + 5)]
            self.tools: dict[str, Tool] = {}
            origin: dict[str, str] = {}
            for where, tool in tools:
                if tool.name in self.tools:
                    raise PluginError(f"{where}: a tool named {tool.name!r} comes from {origin[tool.name]} already; "
                                      "tool names must be unique")
                self.tools[tool.name], origin[tool.name] = tool, where
            if not self.tools:
                raise PluginError(f"{key}: no tools; give functions, http endpoints or mcp servers")
        except BaseException:
            self.close()
            raise

    @property
    def schemas(self) -> list[dict]:
        return [t.schema for t in self.tools.values()]

    def _run(self, coroutine, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    async def _make_semaphore(self) -> asyncio.Semaphore:
        return asyncio.Semaphore(self.max_concurrent)

    def http(self):
        """The box's HTTP client (on its loop: call from the box's coroutines only)."""
        if self._http is None:
            import httpx
            limits = httpx.Limits(max_connections=self.max_concurrent, max_keepalive_connections=self.max_concurrent)
            self._http = httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(self.timeout_s))
        return self._http

    def submit(self, name: str, arguments: dict) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(self._call(name, arguments), self.loop)

    def call(self, name: str, arguments: dict) -> CallOutcome:
        return self.submit(name, arguments).result()

    async def acall(self, name: str, arguments: dict) -> CallOutcome:
        """Awaitable from any event loop (the rollout loop's, or asyncio.run in a replay)."""
        return await asyncio.wrap_future(self.submit(name, arguments))

    async def _call(self, name: str, arguments: dict) -> CallOutcome:
        tool = self.tools.get(name)
        if tool is None:
            return CallOutcome(False, f"Error: unknown tool {name!r}; the tools are: {', '.join(self.tools)}.",
                               "unknown")
        problem = tool.check(arguments)
        if problem is not None:
            return CallOutcome(False, f"Error: bad arguments for {name}: {problem}", "bad_arguments")
        async with self.slots:
            self.in_flight += 1
            self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
            start = time.perf_counter()
            attempts = [0]
            try:
                value = await asyncio.wait_for(self._attempts(tool, arguments, attempts), self.timeout_s)
                return CallOutcome(True, _result_text(value, self.max_result_chars), None,
                                   time.perf_counter() - start, attempts[0])
            except TimeoutError:      # asyncio's wait_for, or the HTTP client's own timeout
                outcome = CallOutcome(False, f"Error: {name} timed out after {self.timeout_s:g} s", "timeouts")
            except TransportError as exc:
                outcome = CallOutcome(False, f"Error: {name} could not be reached after {attempts[0]} attempt(s) "
                                             f"({exc})", "transport")
            except ToolError as exc:
                outcome = CallOutcome(False, f"Error: {name} failed: {_result_text(str(exc), 300)}", "raised")
            except Exception as exc:   # noqa: BLE001 - the tool is user code: its exception is an observation
                text = " ".join(str(exc).split())[:300]
                outcome = CallOutcome(False, f"Error: {name} raised {type(exc).__name__}{': ' + text if text else ''}",
                                      "raised")
            finally:
                self.in_flight -= 1
            outcome.seconds, outcome.attempts = time.perf_counter() - start, attempts[0]
            return outcome

    async def _attempts(self, tool: Tool, arguments: dict, attempts: list[int]) -> Any:
        for attempt in range(self.retries + 1):
            attempts[0] = attempt + 1
            try:
                return await tool.run(dict(arguments), self)
            except TransportError:
                if attempt == self.retries:
                    raise
                await asyncio.sleep(0.05 * 2 ** attempt)

    def close(self) -> None:
        """Close the MCP sessions (their stdio servers exit) and the HTTP client; stop the loop."""
        if self.closed:
            return
        self.closed = True

        async def shut() -> None:
            for server in self._servers:
                await server.close()
            if self._http is not None:
                await self._http.aclose()
        if self.loop.is_running():
            try:
                self._run(shut(), 15)
            except Exception:   # noqa: BLE001 - closing anyway
                pass
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=5)
        self.threads.shutdown(wait=False, cancel_futures=True)


_BOXES: dict[str, ToolBox] = {}
_BOXES_LOCK = threading.Lock()


def toolbox(functions: Sequence[str] = (), http: Sequence["HTTPToolSpec"] = (), mcp: Sequence["MCPServerSpec"] = (),
            **settings: Any) -> ToolBox:
    """The process's ToolBox for this tool configuration (made on first use, shared by every
    environment with the same configuration: one MCP session, one HTTP pool, one bound)."""
    key = json.dumps([list(functions), [h.model_dump() for h in http], [m.model_dump() for m in mcp], settings],
                     sort_keys=True, default=str)
    with _BOXES_LOCK:
        box = _BOXES.get(key)
        if box is None or box.closed:
            box = _BOXES[key] = ToolBox(functions, http, mcp, **settings)
        return box


@atexit.register
def close_toolboxes() -> None:
    """Close every box of this process (MCP servers started over stdio exit with it)."""
    with _BOXES_LOCK:
        boxes = list(_BOXES.values())
        _BOXES.clear()
    for box in boxes:
        box.close()


# --------------------------------------------------------------------------- the environment
class ToolsEnv:
    """One trajectory of function calling (see the module docstring)."""
    observation_role = "tool"
    stop: tuple[str, ...] = ()        # a turn ends with the model's end-of-turn token: it may make several calls

    def __init__(self, box: ToolBox, parser: Callable[[str], ParsedTurn], grade: Callable[[str, dict], Any],
                 max_calls_per_turn: int = 4, system_prompt: str = SYSTEM_PROMPT):
        self.box, self.parse, self.grade = box, parser, grade
        self.max_calls_per_turn = max_calls_per_turn
        self.system_prompt = system_prompt
        self.tools = box.schemas
        self.example: dict = {}
        self.counts = dict.fromkeys(("calls", "errors", *ERROR_KINDS), 0)

    def reset(self, example: dict) -> str:
        self.example = example
        self.counts = dict.fromkeys(self.counts, 0)
        return example["prompt"]

    def _info(self) -> dict:
        return {"tool_calls": self.counts["calls"], "tool_errors": self.counts["errors"],
                **{f"tool_{kind}": self.counts[kind] for kind in ERROR_KINDS}}

    async def step(self, text: str) -> StepResult:
        turn = self.parse(text)
        if turn.is_answer:
            g = self.grade(text, self.example)
            outcome = 1.0 if g.correct else 0.0
            return StepResult(None, outcome, True, {"outcome": outcome, "reason": "answer", "extracted": g.extracted,
                                                    **self._info()})
        async def settle(k: int, item: ToolCall | str) -> CallOutcome:
            if not isinstance(item, ToolCall):
                return CallOutcome(False, f"Error: {item}", "malformed")
            if k >= self.max_calls_per_turn:
                return CallOutcome(False, f"Error: not run: at most {self.max_calls_per_turn} tool calls per turn",
                                   "malformed")
            return await self.box.acall(item.name, item.arguments)
        # the turn's calls at once; their results in the order the calls were written
        ordinals, seen = [], 0
        for item in turn.items:
            ordinals.append(seen)
            seen += isinstance(item, ToolCall)
        outcomes: list[CallOutcome] = list(await asyncio.gather(*(settle(k, c) for k, c in zip(ordinals, turn.items))))
        for o in outcomes:
            self.counts["calls"] += 1
            if not o.ok:
                self.counts["errors"] += 1
                self.counts[o.error or "raised"] += 1
        ok = sum(o.ok for o in outcomes)
        errors = [o.error for o in outcomes if not o.ok]
        info = {**self._info(), "tool_ok": ok == len(outcomes), "tool_error": errors[0] if errors else None,
                "tool_seconds": max(o.seconds for o in outcomes)}
        return StepResult([o.text for o in outcomes], ok / len(outcomes), False, info)


# --------------------------------------------------------------------------- a tool of our own
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and (abs(right) > 64 or abs(left) > 10 ** 6):
            raise ValueError("the power is too large")
        return _BINARY[type(node.op)](left, right)
    raise ValueError(f"unsupported expression element: {type(node).__name__}")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression with + - * / // % ** and parentheses.

    Args:
        expression: The arithmetic expression, e.g. 347 * 8215 or (12 + 30) / 4.
    """
    if len(expression) > 200:
        raise ValueError("the expression is longer than 200 characters")
    value = _evaluate(ast.parse(expression.strip(), mode="eval"))
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError("the result is not a finite number")
        if value.is_integer():
            value = int(value)
        else:
            return f"{value:.10g}"
    return str(value)


# --------------------------------------------------------------------------- as a plugin
class HTTPToolSpec(BaseModel):
    """A tool behind an HTTP endpoint: POST `url` with the arguments as JSON."""
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1)
    url: str = Field(min_length=1, description="http(s)://host:port/path")
    description: str = ""
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}},
                                       description="the arguments' JSON schema (what the model sees and calls are "
                                                   "checked against)")
    headers: dict[str, str] = Field(default_factory=dict)


class MCPServerSpec(BaseModel):
    """An MCP server: a stdio command (started by turnrl, stopped when it exits) or a URL."""
    model_config = ConfigDict(extra="forbid")
    command: list[str] = Field(default_factory=list, description="e.g. [python, my_server.py]: started over stdio")
    url: str = Field("", description="a streamable-HTTP MCP endpoint, e.g. http://127.0.0.1:8000/mcp")
    env: dict[str, str] = Field(default_factory=dict, description="extra environment of a stdio server")
    cwd: str = ""
    tools: list[str] = Field(default_factory=list, description="only these of its tools (empty: all it lists)")
    connect_timeout_s: float = Field(30.0, gt=0)

    @model_validator(mode="after")
    def _one_target(self) -> "MCPServerSpec":
        if bool(self.command) == bool(self.url):
            raise ValueError("give either command (a stdio server) or url (an HTTP server), not both or neither")
        return self


def _plain(specs: list[BaseModel]) -> list[dict]:
    return [spec.model_dump() for spec in specs]


class ToolsOptions(BaseModel):
    """`env.options` of `tools`."""
    model_config = ConfigDict(extra="forbid")
    functions: list[str] = Field(default_factory=lambda: ["turnrl.envs.tools:calculator"], description=(
        "Python functions by import path (module:function), each a tool; schema from type hints and docstring"))
    # checked as specs, kept as plain dicts (the resolved options print as YAML and hash as params)
    http: Annotated[list[HTTPToolSpec], AfterValidator(_plain)] = Field(default_factory=list)
    mcp: Annotated[list[MCPServerSpec], AfterValidator(_plain)] = Field(default_factory=list)
    parser: str = Field("hermes", description="how calls are read from a turn: hermes (qwen), llama3, mistral, or "
                                              "module:function")
    grader: str = Field("math", description="the final answer: math (math-verify), exact, or module:function")
    timeout_s: float = Field(10.0, gt=0, description="seconds per call, retries included")
    max_concurrent: int = Field(64, ge=1, description="calls in flight at once in a process (all trajectories)")
    retries: int = Field(2, ge=0, description="retries of a call on transport errors")
    max_calls_per_turn: int = Field(4, ge=1)
    max_result_chars: int = Field(1000, ge=16, description="a tool's result is cut to this length")
    system_prompt: str = SYSTEM_PROMPT

    @field_validator("functions")
    @classmethod
    def _functions(cls, value: list[str]) -> list[str]:
        """Each imported and its schema made now, so a bad one stops params checking."""
        for i, path in enumerate(value):
            if not is_import_path(path):
                raise ValueError(f"functions[{i}] = {path!r}: an import path is module:function, e.g. my_pkg.tools:lookup")
            fn = load_object(path, f"functions[{i}]")
            if not callable(fn):
                raise ValueError(f"functions[{i}] = {path!r}: {fn!r} is not a function")
            FunctionTool(fn, f"functions[{i}] = {path!r}")
        return value

    @field_validator("parser")
    @classmethod
    def _parser(cls, value: str) -> str:
        if value not in PARSERS and not is_import_path(value):
            raise ValueError(f"must be one of {', '.join(PARSERS)} or an import path module:function")
        return value

    @field_validator("grader")
    @classmethod
    def _grader(cls, value: str) -> str:
        from turnrl.rewards.graders import BUILTIN
        if value not in BUILTIN and not is_import_path(value):
            raise ValueError("must be math, exact or an import path module:function")
        return value

    @model_validator(mode="after")
    def _some_tool(self) -> "ToolsOptions":
        if not (self.functions or self.http or self.mcp):
            raise ValueError("no tools: give functions, http or mcp")
        return self


def make_tools_env(*, functions: Sequence[str] = ("turnrl.envs.tools:calculator",),
                   http: Sequence[HTTPToolSpec | dict] = (), mcp: Sequence[MCPServerSpec | dict] = (),
                   parser: str = "hermes", grader: str = "math", timeout_s: float = 10.0, max_concurrent: int = 64,
                   retries: int = 2, max_calls_per_turn: int = 4, max_result_chars: int = 1000,
                   system_prompt: str = SYSTEM_PROMPT) -> ToolsEnv:
    """A `tools` environment; its ToolBox is shared by every environment of the same tools."""
    from turnrl.rewards.graders import grader as resolve_grader
    http = [h if isinstance(h, HTTPToolSpec) else HTTPToolSpec.model_validate(h) for h in http]
    mcp = [m if isinstance(m, MCPServerSpec) else MCPServerSpec.model_validate(m) for m in mcp]
    box = toolbox(list(functions), http, mcp, timeout_s=timeout_s, max_concurrent=max_concurrent, retries=retries,
                  max_result_chars=max_result_chars)
    return ToolsEnv(box, resolve_parser(parser), resolve_grader(grader, "env.options.grader"),
                    max_calls_per_turn=max_calls_per_turn, system_prompt=system_prompt)


def calculator_demonstration(row: dict, rng, good: bool) -> synthetic.Demonstration:
    """For the tiny model's warm start on the synthetic products ("Compute 347 * 8215."). Good:
    call `calculator` with the product and copy its result. Otherwise: guess a number of the
    right length (almost always wrong); only the choice to answer at once is trained."""
    if good:
        call = json.dumps({"name": "calculator", "arguments": {"expression": f"{row['a']} * {row['b']}"}})
        return synthetic.Demonstration([f"<tool_call>\n{call}\n</tool_call>", f"<answer>{row['answer']}</answer>"])
    guess = rng.randint(10 ** (len(row["answer"]) - 1), 10 ** len(row["answer"]) - 1)
    return synthetic.Demonstration([f"<answer>{guess}</answer>"], choice=(0, "<answer>"))


TASK = synthetic.SyntheticTask("tools", synthetic.product_rows, lambda r: (r["a"], r["b"]), calculator_demonstration)

ENV = EnvSpec(factory=make_tools_env, options=ToolsOptions, task=TASK, name="tools")

__all__ = ["ENV", "ERROR_KINDS", "PARSERS", "CallOutcome", "FunctionTool", "HTTPTool", "HTTPToolSpec", "MCPServerSpec",
           "MCPTool", "ParsedTurn", "Tool", "ToolBox", "ToolCall", "ToolsEnv", "ToolsOptions", "calculator",
           "close_toolboxes", "make_tools_env", "parse_hermes", "parse_llama3", "parse_mistral", "resolve_parser",
           "toolbox"]
