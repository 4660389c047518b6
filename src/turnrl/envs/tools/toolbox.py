"""The tools of one configuration in a process, and the event loop their calls run on.

Every call goes through one `ToolBox` per tool configuration: all trajectories' calls are in
flight at once up to `max_concurrent`, each bounded by `timeout_s` (retries included), retried
up to `retries` times on transport errors (connection refused or reset, HTTP 502/503/504, a lost
MCP session, which the retry reopens) with a short backoff. Whatever a tool does, a call ends
with a `CallOutcome`: a result, or an error observation of one of `ERROR_KINDS`.

Boxes are shared helpers of the process (turnrl.envs.helpers): one that fails to start (an MCP
server that cannot be reached) is remembered for `RETRY_START_S`: every trajectory's environment
then fails at once with the same error instead of each waiting `connect_timeout_s` in turn.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import json
import threading
import time
from typing import Any, Sequence

from turnrl.envs.helpers import Helpers
from turnrl.envs.tools.functions import FunctionTool, exit_error
from turnrl.envs.tools.tool import CallOutcome, Tool, ToolError, TransportError, result_text
from turnrl.envs.tools.transports import HTTPTool, HTTPToolSpec, MCPServerSpec, MCPSession
from turnrl.errors import one_line
from turnrl.plugins import PluginError, load_object

#: Seconds a failed start of a box is reused as its error before it is tried again.
RETRY_START_S = 10.0


class ToolBox:
    """The tools of one configuration in this process, and the event loop their calls run on.

    `call(name, arguments)` from any thread or event loop (`acall` awaits it); every call is
    checked against the tool's schema, waits for one of `max_concurrent` slots, and is bounded
    by `timeout_s` with up to `retries` retries on transport errors."""

    def __init__(self, functions: Sequence[str] = (), http: Sequence[HTTPToolSpec] = (),
                 mcp: Sequence[MCPServerSpec] = (), *, timeout_s: float = 10.0, max_concurrent: int = 64,
                 retries: int = 2, max_result_chars: int = 1000, key: str = "env.options"):
        self.timeout_s, self.retries, self.max_result_chars = timeout_s, retries, max_result_chars
        self.max_concurrent = max_concurrent
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="turnrl-tools", daemon=True)
        self.thread.start()
        self._http = None
        self._servers: list[MCPSession] = []
        self.in_flight = self.peak_in_flight = 0
        self.closed = False
        try:
            self.slots = self._run(self._make_semaphore())
            self.tools: dict[str, Tool] = {}
            self._add(self._made(functions, http, mcp, key))
            if not self.tools:
                raise PluginError(f"{key}: no tools; give functions, http endpoints or mcp servers")
        except BaseException:
            self.close()
            raise

    def _made(self, functions: Sequence[str], http: Sequence[HTTPToolSpec], mcp: Sequence[MCPServerSpec],
              key: str) -> list[tuple[str, Tool]]:
        """Every tool with where it comes from (an MCP server's: after connecting to it)."""
        tools: list[tuple[str, Tool]] = []
        for i, path in enumerate(functions):
            where = f"{key}.functions[{i}] = {path!r}"
            fn = load_object(path, f"{key}.functions[{i}]")
            if not callable(fn):
                raise PluginError(f"{where}: {fn!r} is not a function")
            tools.append((where, FunctionTool(fn, where, max_abandoned=self.max_concurrent)))
        for i, spec in enumerate(http):
            tools.append((f"{key}.http[{i}]", HTTPTool(spec)))
        if mcp:   # imported here, not on the box's loop, where importing would eat into connect_timeout_s
            import mcp as _mcp  # noqa: F401
            from mcp.client import stdio as _stdio  # noqa: F401
        for i, spec in enumerate(mcp):
            server = MCPSession(spec, f"{key}.mcp[{i}]")
            self._servers.append(server)
            tools += [(f"{key}.mcp[{i}]", t) for t in self._run(server.open(), spec.connect_timeout_s + 30)]
        return tools

    def _add(self, tools: list[tuple[str, Tool]]) -> None:
        origin: dict[str, str] = {}
        for where, tool in tools:
            if tool.name in self.tools:
                raise PluginError(f"{where}: a tool named {tool.name!r} comes from {origin[tool.name]} already; "
                                  "tool names must be unique")
            self.tools[tool.name], origin[tool.name] = tool, where

    @property
    def schemas(self) -> list[dict]:
        return [t.schema for t in self.tools.values()]

    @property
    def reconnects(self) -> int:
        """MCP sessions reopened after a loss, over the box's life."""
        return sum(s.reconnects for s in self._servers)

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

    def _lost(self, name: str) -> CallOutcome:
        """A call whose outcome never came back from the box's loop (it is gone)."""
        return CallOutcome(False, f"Error: {name} timed out after {self.timeout_s:g} s (the tool loop is gone)",
                           "timeouts", tool=name if name in self.tools else None)

    def call(self, name: str, arguments: dict) -> CallOutcome:
        future = self.submit(name, arguments)
        while True:   # a call may wait for a slot as long as it takes, but not on a loop that is gone
            try:
                return future.result(self.timeout_s + 5)
            except concurrent.futures.TimeoutError:
                if self.closed or not self.thread.is_alive():
                    future.cancel()
                    return self._lost(name)

    async def acall(self, name: str, arguments: dict) -> CallOutcome:
        """Awaitable from any event loop (the rollout loop's, or asyncio.run in a replay)."""
        future = asyncio.wrap_future(self.submit(name, arguments))
        while True:
            done, _ = await asyncio.wait({future}, timeout=self.timeout_s + 5)
            if done:
                return future.result()
            if self.closed or not self.thread.is_alive():
                future.cancel()
                return self._lost(name)

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
            start, attempts = time.perf_counter(), [0]
            try:
                value = await asyncio.wait_for(self._attempts(tool, arguments, attempts), self.timeout_s)
                outcome = CallOutcome(True, result_text(value, self.max_result_chars))
            except BaseException as exc:   # noqa: BLE001 - the tool is user code: its failure is an observation
                if isinstance(exc, asyncio.CancelledError) and asyncio.current_task().cancelling():
                    raise                # the box is closing
                outcome = self._failure(name, exc, attempts[0])
            finally:
                self.in_flight -= 1
            outcome.seconds, outcome.attempts, outcome.tool = time.perf_counter() - start, attempts[0], name
            return outcome

    def _failure(self, name: str, exc: BaseException, attempts: int) -> CallOutcome:
        if isinstance(exc, TimeoutError):      # asyncio's wait_for, or the HTTP client's own timeout
            return CallOutcome(False, f"Error: {name} timed out after {self.timeout_s:g} s", "timeouts")
        if isinstance(exc, TransportError):
            return CallOutcome(False, f"Error: {name} could not be reached after {attempts} attempt(s) ({exc})",
                               "transport")
        if isinstance(exc, ToolError):
            return CallOutcome(False, f"Error: {name} failed: {result_text(str(exc), 300)}", "raised")
        return CallOutcome(False, f"Error: {name} raised {one_line(exc)}", "raised")

    async def _attempts(self, tool: Tool, arguments: dict, attempts: list[int]) -> Any:
        for attempt in range(self.retries + 1):
            attempts[0] = attempt + 1
            try:
                return await tool.run(dict(arguments), self)
            except (SystemExit, KeyboardInterrupt) as exc:   # past here they would stop the box's loop
                raise exit_error(exc) from None
            except TransportError:
                if attempt == self.retries:
                    raise
                await asyncio.sleep(0.05 * 2 ** attempt)

    @property
    def alive(self) -> bool:
        return not self.closed and self.thread.is_alive()

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

_BOXES: Helpers[ToolBox] = Helpers(RETRY_START_S, failures=(PluginError,))


def toolbox(functions: Sequence[str] = (), http: Sequence[HTTPToolSpec] = (), mcp: Sequence[MCPServerSpec] = (),
            **settings: Any) -> ToolBox:
    """The process's ToolBox for this tool configuration (made on first use, shared by every
    environment with the same configuration: one MCP session, one HTTP pool, one bound)."""
    key = json.dumps([list(functions), [h.model_dump() for h in http], [m.model_dump() for m in mcp], settings],
                     sort_keys=True, default=str)
    return _BOXES.get(key, lambda: ToolBox(functions, http, mcp, **settings))


def close_toolboxes() -> None:
    """Close every box of this process (MCP servers started over stdio exit with it)."""
    _BOXES.close()
