"""Long-lived helpers that every environment of a process shares: a tool box (its event loop, its
MCP sessions), a verifiers bridge, an OpenEnv server. One `Helpers` per kind keeps them by
configuration key:

- made on first use, and made again once dead (a killed bridge, a server that exited);
- a failed start is remembered for `retry_s`: every trajectory's environment then fails at once
  with the same error instead of each waiting out the start's timeout in turn;
- every helper is closed when the process ends (`close()` closes one kind's now; tests call it).
  A Ray worker is killed, not exited, so no atexit runs there: helpers that are processes exit at
  the end of their stdin (MCP over stdio, bridges) or are watched (OpenEnv servers).
"""
from __future__ import annotations

import atexit
import threading
import time
from typing import Callable, Generic, Protocol, TypeVar


class Helper(Protocol):
    @property
    def alive(self) -> bool: ...

    def close(self) -> None: ...


H = TypeVar("H", bound=Helper)
_EVERY_KIND: list["Helpers"] = []


class Helpers(Generic[H]):
    """This process's helpers of one kind, by key. `failures`: the exceptions of a failed start
    (remembered `retry_s` seconds); anything else a start raises propagates unremembered."""

    def __init__(self, retry_s: float, failures: tuple[type[BaseException], ...]):
        self.retry_s, self.failures = retry_s, failures
        self.live: dict[str, H] = {}
        self.failed: dict[str, tuple[float, BaseException]] = {}   # key -> (when, why)
        self.lock = threading.Lock()
        _EVERY_KIND.append(self)

    def get(self, key: str, start: Callable[[], H]) -> H:
        """The helper for `key`: the live one, else a new one from `start()` (at most one start at
        a time in this process; its failure is raised again for `retry_s`)."""
        with self.lock:
            current = self.live.get(key)
            if current is not None and current.alive:
                return current
            failed = self.failed.get(key)
            if failed is not None and time.monotonic() - failed[0] < self.retry_s:
                raise failed[1]
            if current is not None:
                current.close()   # what is left of a dead one (threads, a process group)
            try:
                current = self.live[key] = start()
            except self.failures as exc:
                self.live.pop(key, None)
                self.failed[key] = (time.monotonic(), exc)
                raise
            self.failed.pop(key, None)
            return current

    def close(self) -> None:
        """Close every helper of this kind and forget failed starts."""
        with self.lock:
            helpers = list(self.live.values())
            self.live.clear()
            self.failed.clear()
        for helper in helpers:
            helper.close()


@atexit.register
def close_all() -> None:
    for kind in list(_EVERY_KIND):
        kind.close()
