"""Python functions as tools, isolated so that no function can take the process down or use up
its capacity for good.

A synchronous function runs in a thread of its own (a daemon thread per call, not a pool): a
call that outlives `timeout_s` is abandoned with its thread, so a function that never returns
holds no slot and later calls run as before. Python cannot kill a thread, so an abandoned one
runs on until the function returns; once `max_abandoned` calls of one function are still
running, its further calls fail at once ("not run") instead of piling up more threads.

`SystemExit` (`sys.exit()`), `KeyboardInterrupt` and every other exception a function raises,
sync or async, end that call with an error observation; nothing reaches the box's event loop.
What no thread can guard against: `os._exit()`, a crash in native code, or an async function
that blocks the event loop (use a sync function for blocking work).
"""
from __future__ import annotations

import asyncio
import inspect
import logging
import threading
from typing import Any, Callable

from turnrl.envs.tools.tool import Tool, ToolError
from turnrl.plugins import PluginError

log = logging.getLogger(__name__)


def exit_error(exc: BaseException) -> ToolError:
    """A `SystemExit` or `KeyboardInterrupt` of a tool, as the call's failure."""
    if isinstance(exc, SystemExit):
        return ToolError(f"called sys.exit({exc.code!r}); a tool must return or raise an exception")
    return ToolError(f"raised {type(exc).__name__}; a tool must return or raise an exception")


def _argument_problem(fn: Callable) -> str | None:
    """Why `fn`'s arguments cannot be a tool's (JSON values, named), or None: *args or **kwargs,
    or a type JSON does not carry (an Enum, a pydantic model, a dataclass: the model would send a
    string or an object the function did not expect)."""
    import dataclasses
    import enum
    import typing

    from pydantic import BaseModel
    try:
        signature = inspect.signature(fn)
        hints = typing.get_type_hints(fn)
    except (TypeError, ValueError, NameError):   # no signature, unresolvable hints: get_json_schema says
        return None
    name = getattr(fn, "__qualname__", repr(fn))
    for param in signature.parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            return (f"{name} takes {'*' if param.kind is param.VAR_POSITIONAL else '**'}{param.name}; a tool's "
                    "arguments are named one by one (the model sends a JSON object of them)")
        kinds = [hints.get(param.name), *typing.get_args(hints.get(param.name))]
        for kind in kinds:
            if isinstance(kind, type) and (issubclass(kind, (enum.Enum, BaseModel)) or dataclasses.is_dataclass(kind)):
                fix = ("Literal[...] of its values" if issubclass(kind, enum.Enum) else
                       "dict (or one argument per field)")
                return (f"{name}'s argument {param.name!r} is a {kind.__name__}, which the model cannot send as "
                        f"JSON; take {fix} and build the {kind.__name__} inside the tool")
    return None


class FunctionTool(Tool):
    """A Python function (sync: a thread per call, abandoned on timeout; async: awaited on the
    box's loop)."""
    kind = "function"

    def __init__(self, fn: Callable, key: str, max_abandoned: int = 16):
        from transformers.utils import get_json_schema
        if problem := _argument_problem(fn):
            raise PluginError(f"{key}: {problem}")
        try:
            schema = get_json_schema(fn)["function"]
        except Exception as exc:   # noqa: BLE001 - TypeHintParsingException, DocstringParsingException
            raise PluginError(
                f"{key}: no tool schema from {getattr(fn, '__qualname__', fn)!r} ({exc}). Give every argument a "
                "type hint and a line in the docstring's Args: section (Google style), and the function a "
                "one-line description") from None
        parameters = schema.get("parameters") or {"type": "object", "properties": {}}
        # the function's own arguments only: an unknown one is the model's mistake (bad_arguments), not the tool's
        super().__init__(schema["name"], schema.get("description", ""), parameters, closed=True)
        self.integers = {name for name, p in parameters.get("properties", {}).items() if p.get("type") == "integer"}
        self.fn = fn
        self.is_async = inspect.iscoroutinefunction(fn)
        self.max_abandoned = max_abandoned
        self.running = 0          # sync calls whose thread has not returned
        self.abandoned = 0        # of them, calls given up on (timed out) and still running
        self._lock = threading.Lock()

    async def run(self, arguments: dict, box: Any) -> Any:
        # 3.0 for an integer: the schema check lets JSON's integral floats through, the function wants an int
        arguments = {k: int(v) if k in self.integers and isinstance(v, float) and v.is_integer() else v
                     for k, v in arguments.items()}
        if self.is_async:
            try:
                return await self.fn(**arguments)
            except (SystemExit, KeyboardInterrupt) as exc:   # would stop the box's loop
                raise exit_error(exc) from None
        if self.abandoned >= self.max_abandoned:
            raise ToolError(f"not run: {self.abandoned} earlier calls of {self.name} timed out and are still "
                            "running (a function that never returns)")
        value = await self._in_thread(arguments)
        if inspect.isawaitable(value):   # a sync wrapper around an async function
            return await value
        if inspect.isgenerator(value) or inspect.isasyncgen(value):
            raise ToolError("returned a generator; a tool returns its result")
        return value

    async def _in_thread(self, arguments: dict) -> Any:
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()
        state = {"finished": False, "abandoned": False}

        def deliver(ok: bool, value: Any) -> None:   # on the loop
            if not done.done():
                (done.set_result if ok else done.set_exception)(value)

        def work() -> None:
            try:
                ok, value = True, self.fn(**arguments)
            except (SystemExit, KeyboardInterrupt) as exc:
                ok, value = False, exit_error(exc)
            except BaseException as exc:   # noqa: BLE001 - user code: its exception is the call's failure
                ok, value = False, exc
            with self._lock:
                state["finished"] = True
                self.running -= 1
                if state["abandoned"]:
                    self.abandoned -= 1
            try:
                loop.call_soon_threadsafe(deliver, ok, value)
            except RuntimeError:   # the loop is closed: nobody waits any more
                pass

        with self._lock:
            self.running += 1
        threading.Thread(target=work, name=f"turnrl-tool-{self.name}", daemon=True).start()
        try:
            return await done
        except asyncio.CancelledError:   # timed out: let the thread go
            with self._lock:
                if not state["finished"]:
                    state["abandoned"] = True
                    self.abandoned += 1
            if state["abandoned"]:
                log.warning("tool %s: a call did not return within the timeout; its thread is abandoned "
                            "(%d abandoned, still running)", self.name, self.abandoned)
            raise
