"""Tools behind a transport: HTTP endpoints and MCP servers (stdio or streamable HTTP).

A lost MCP session is reopened, not given up on: a call that finds the connection closed (the
server restarted, its process died, the HTTP session is unknown to it) is a transport error;
the box retries it (`retries`, with backoff), and the retry reopens the session first,
restarting a stdio server's command. All calls waiting on one server share one reconnect, itself
bounded by `connect_timeout_s`; after a failed reconnect the next is tried no sooner than a
backoff (0.25 s doubling to 2 s), and calls in between fail at once as transport errors, so a
dead server costs each call milliseconds, not a timeout.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from turnrl.envs.tools.tool import Tool, ToolError, TransportError
from turnrl.plugins import PluginError

log = logging.getLogger(__name__)
RECONNECT_BACKOFF_S = (0.25, 2.0)   # first wait after a failed reconnect, and the longest


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


class HTTPTool(Tool):
    """POST `url` with the arguments as a JSON object. The reply: a JSON object's "result" (or
    its "error", which fails the call), else the JSON or the text. HTTP 502/503/504 and
    connection errors are transport errors (retried); other non-2xx statuses fail the call."""
    kind = "http"

    def __init__(self, spec: HTTPToolSpec):
        super().__init__(spec.name, spec.description, spec.parameters)
        self.url, self.headers = spec.url, dict(spec.headers)

    async def run(self, arguments: dict, box: Any) -> Any:
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


def connection_lost(exc: BaseException) -> bool:
    """Whether a call failed because the session is gone (reopen it), not because the tool did."""
    import anyio
    from mcp.shared.exceptions import MCPError
    from mcp_types.jsonrpc import CONNECTION_CLOSED
    if isinstance(exc, BaseExceptionGroup):
        return any(connection_lost(e) for e in exc.exceptions)
    if isinstance(exc, MCPError):
        return exc.code == CONNECTION_CLOSED or "session terminated" in exc.message.lower()
    if any(c.__name__ == "TransportError" and c.__module__.startswith("httpx") for c in type(exc).__mro__):
        return True   # httpx's, or the copy the MCP client ships (httpx2)
    return isinstance(exc, (anyio.ClosedResourceError, anyio.BrokenResourceError, anyio.EndOfStream,
                            ConnectionError, EOFError))


class MCPTool(Tool):
    """A tool an MCP server lists; called through the box's session with that server."""
    kind = "mcp"

    def __init__(self, server: "MCPSession", name: str, description: str, parameters: dict | None):
        super().__init__(name, description, parameters)
        self.server = server

    async def run(self, arguments: dict, box: Any) -> Any:
        client = await self.server.client_for_call()
        try:
            result = await client.call_tool(self.name, arguments)
        except Exception as exc:   # noqa: BLE001 - sorted below: a lost session, or the tool's own failure
            if connection_lost(exc):
                self.server.lost(client)
                raise TransportError(f"the MCP session was lost ({type(exc).__name__}: {exc}); reopening it") \
                    from exc
            raise
        texts = [getattr(c, "text", None) for c in result.content]
        text = "\n".join(t for t in texts if t is not None)
        if result.is_error:
            raise ToolError(text or "the MCP server reported an error")
        if text:
            return text
        return result.structured_content if result.structured_content is not None else ""


class MCPSession:
    """One MCP session, held by a task on the box's loop, and reopened when it is lost.

    `open()` connects and lists the tools (at the box's start; a failure stops the start).
    `client_for_call()` gives the live client, reopening a lost session first: one reconnect
    at a time, shared by every call that needs it, bounded by `connect_timeout_s`."""

    def __init__(self, spec: MCPServerSpec, key: str):
        self.spec, self.key = spec, key
        self.where = spec.url or " ".join(spec.command)
        self.client = None
        self._closing: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._reopening: asyncio.Task | None = None
        self._stopping: set[asyncio.Task] = set()   # lost sessions being closed
        self.failures = 0             # reconnects failed in a row
        self.retry_at = 0.0           # (loop time) no reconnect before
        self.last_error = ""
        self.reconnects = 0           # sessions reopened after a loss
        self.closed = False

    def target(self):
        from mcp import StdioServerParameters
        if self.spec.url:
            return self.spec.url
        from mcp.client.stdio import get_default_environment
        command, *args = self.spec.command
        return StdioServerParameters(command=command, args=args, env={**get_default_environment(), **self.spec.env},
                                     cwd=self.spec.cwd or None)

    async def _connect(self) -> list:
        """Start a session (a task holds it open until closed or lost); the tools it lists."""
        from mcp import Client
        closing = self._closing = asyncio.Event()
        ready: asyncio.Future = asyncio.get_running_loop().create_future()
        ready.add_done_callback(lambda f: f.cancelled() or f.exception())   # a failure after a timeout: no warning

        async def hold() -> None:
            client = None
            try:
                # no read timeout of the session's own: each call is bounded by timeout_s, the
                # handshake and listing by connect_timeout_s (below)
                async with Client(self.target()) as client:
                    listed = await client.list_tools()
                    self.client = client
                    ready.set_result(listed.tools)
                    await closing.wait()
            except BaseException as exc:   # noqa: BLE001 - reported through `ready`; a lost session is seen by calls
                if not ready.done():
                    ready.set_exception(exc)
            finally:
                if client is not None and self.client is client:
                    self.client = None   # lost or closed: the next call reopens it
        self._task = asyncio.create_task(hold())
        try:
            return await asyncio.wait_for(asyncio.shield(ready), self.spec.connect_timeout_s)
        except BaseException:
            self._task.cancel()
            raise

    async def open(self) -> list[MCPTool]:
        try:
            listed = await self._connect()
        except Exception as exc:   # noqa: BLE001 - one line naming the server
            while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:   # the cause, not a TaskGroup
                exc = exc.exceptions[0]
            raise PluginError(f"{self.key}: could not connect to the MCP server {self.where!r} "
                              f"({type(exc).__name__}: {exc})") from None
        tools = [MCPTool(self, t.name, t.description or "", dict(t.input_schema or {}))
                 for t in listed if not self.spec.tools or t.name in self.spec.tools]
        missing = sorted(set(self.spec.tools) - {t.name for t in tools})
        if missing:
            raise PluginError(f"{self.key}: the MCP server has no tool {', '.join(missing)}")
        return tools

    def lost(self, client) -> None:
        """A call found `client`'s connection gone: the next call reopens the session."""
        if self.client is client:
            self.client = None

    async def client_for_call(self):
        if self.client is not None:
            return self.client
        if self.closed:
            raise TransportError(f"the MCP server {self.where!r} is closed")
        if self._reopening is None:
            wait = self.retry_at - asyncio.get_running_loop().time()
            if wait > 0:
                raise TransportError(f"the MCP server {self.where!r} is unreachable ({self.last_error}); "
                                     f"the next reconnect in {wait:.1f} s")
            self._reopening = asyncio.create_task(self._reopen())
            self._reopening.add_done_callback(lambda t: t.cancelled() or t.exception())   # retrieved: no warning
        await asyncio.shield(self._reopening)
        if self.client is None:
            raise TransportError(f"the MCP session with {self.where!r} closed as it was reopened")
        return self.client

    async def _reopen(self) -> None:
        try:
            self._stop_later()          # what is left of the lost session, without waiting on it
            await self._connect()       # a stdio server's command starts again
            self.failures, self.reconnects = 0, self.reconnects + 1
            log.warning("%s: the MCP session with %r was lost and is reopened (%d reconnects)", self.key,
                        self.where, self.reconnects)
        except Exception as exc:   # noqa: BLE001 - a transport error of every call waiting on it
            self.failures += 1
            self.last_error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            if self.failures == 1:   # once per outage: its calls are counted in tools/<name>/error_frac
                log.warning("%s: the MCP session with %r was lost and reopening it failed (%s); retried on "
                            "later calls", self.key, self.where, self.last_error)
            backoff = min(RECONNECT_BACKOFF_S[0] * 2 ** (self.failures - 1), RECONNECT_BACKOFF_S[1])
            self.retry_at = asyncio.get_running_loop().time() + backoff
            raise TransportError(f"reconnecting to the MCP server {self.where!r} failed ({self.last_error})") \
                from None
        finally:
            self._reopening = None

    def _stop_later(self) -> None:
        if self._task is not None and not self._task.done():
            task = asyncio.create_task(self._stop(self._task, self._closing, 5))
            self._stopping.add(task)
            task.add_done_callback(self._stopping.discard)
        self._task = self._closing = None

    @staticmethod
    async def _stop(task: asyncio.Task | None, closing: asyncio.Event | None, timeout: float) -> None:
        if closing is not None:
            closing.set()
        if task is not None and not task.done():
            try:
                await asyncio.wait_for(task, timeout)
            except BaseException:   # noqa: BLE001 - closing: nothing left to do about it
                task.cancel()

    async def close(self) -> None:
        self.closed = True
        if self._reopening is not None:
            self._reopening.cancel()
        await asyncio.gather(self._stop(self._task, self._closing, 10), *self._stopping, return_exceptions=True)
