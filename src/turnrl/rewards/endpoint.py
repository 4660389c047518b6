"""Requests to a model server, with the rules every turnrl client of one keeps (the judges',
turnrl.rewards.judge, and the teacher's, turnrl.rewards.teacher):

- a request that times out, cannot connect or gets 408/409/429/5xx is tried again (`retries`
  more times, backing off 0.5, 1, 2 ... 8 s); any other answer is final (`post`);
- a request still out after `hedge_after_s` gets a twin, and the first answer of the two is
  taken, the other cancelled (`post_hedged`: "The Tail at Scale", Dean and Barroso 2013): a
  server's slowest answers stop setting the step's time, for a few more requests;
- every batch a client sends, from whichever thread, goes through one `Session`: one event loop
  on a thread of its own, one connection pool and one bound on the requests in flight, so
  `max_concurrency` holds however many batches are scored at once (turnrl.rollout.scored).
"""
from __future__ import annotations

import asyncio
import os
import threading
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from turnrl.plugins import PluginError

RETRY_STATUS = {408, 409, 429, 500, 502, 503, 504}


@dataclass
class Reply:
    body: Any            # the parsed JSON answer (status 200), else None
    error: str           # why there is none ("" with a body)
    tries: int
    text: str = ""       # the raw answer, for messages
    hedged: bool = False  # a twin request was sent (post_hedged)


async def post(client: Any, limit: asyncio.Semaphore, url: str, body: dict, *, retries: int,
               timeout_s: float) -> Reply:
    """POST `body` to `url` with an httpx.AsyncClient, at most `limit` in flight at once."""
    import httpx
    error, tries = "", 0
    for attempt in range(retries + 1):
        tries = attempt + 1
        if attempt:
            await asyncio.sleep(min(8.0, 0.5 * 2 ** (attempt - 1)))
        async with limit:
            try:
                answer = await client.post(url, json=body)
            except httpx.TimeoutException:
                error = f"no answer within timeout_s = {timeout_s:g} s"
                continue
            except httpx.HTTPError as exc:
                error = f"could not reach it ({type(exc).__name__}: {exc})"
                continue
        if answer.status_code != 200:
            error = f"HTTP {answer.status_code}: {answer.text[:200]}"
            if answer.status_code in RETRY_STATUS:
                continue
            return Reply(None, error, tries, answer.text)
        try:
            return Reply(answer.json(), "", tries, answer.text)
        except ValueError:
            return Reply(None, f"not JSON: {answer.text[:200]}", tries, answer.text)
    return Reply(None, error, tries)


async def post_hedged(client: Any, limit: asyncio.Semaphore, url: str, body: dict, *, retries: int,
                      timeout_s: float, hedge_after_s: float | None) -> Reply:
    """`post`, and if no answer came within `hedge_after_s` (None: never) the same request again
    beside it: the first of the two with an answer is returned (`hedged` set, `tries` the
    winner's), the other cancelled; where neither has one, the first one's failure."""
    first = asyncio.ensure_future(post(client, limit, url, body, retries=retries, timeout_s=timeout_s))
    if hedge_after_s is None:
        return await first
    done, _ = await asyncio.wait({first}, timeout=hedge_after_s)
    if done:
        return first.result()
    twin = asyncio.ensure_future(post(client, limit, url, body, retries=retries, timeout_s=timeout_s))
    pending, failed = {first, twin}, []
    try:
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                reply = task.result()
                if reply.body is not None:
                    reply.hedged = True
                    return reply
                failed.append((task is not first, reply))
    finally:
        for task in pending:
            task.cancel()
    reply = min(failed, key=lambda f: f[0])[1]
    reply.hedged = True
    return reply


def run(coroutine):
    """Run a coroutine to its end from sync code, also where an event loop already runs here: a
    one-off request (a game's endpoint player); a client's batches go through its `Session`."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    result: dict = {}

    def target():
        result["value"] = asyncio.run(coroutine)
    thread = threading.Thread(target=target, name="turnrl-endpoint")
    thread.start()
    thread.join()
    return result["value"]


class Session:
    """One server's requests from any thread: `call(make)` runs the coroutine `make(client,
    limit)` on this session's event loop (a daemon thread, started at the first call) with its
    httpx.AsyncClient and its semaphore of `max_concurrency`, and returns its result. Batches
    from several threads at once share the connections and the bound."""

    def __init__(self, max_concurrency: int, timeout_s: float, headers: dict[str, str] | None = None):
        self.max_concurrency, self.timeout_s, self.headers = max_concurrency, timeout_s, dict(headers or {})
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._client = self._limit = None

    @classmethod
    def for_server(cls, cfg: Any, key: str) -> "Session":
        """The session of a server's checked params (`max_concurrency`, `timeout_s`, `api_key_env`
        at config key `key`): its key sent as a bearer token. A variable named but unset is refused
        here, before any work, rather than answered 401 by the server mid-run."""
        headers = {}
        if cfg.api_key_env:
            api_key = os.environ.get(cfg.api_key_env)
            if not api_key:
                raise PluginError(f"{key}: api_key_env names {cfg.api_key_env}, which is not set in this "
                                 "environment: export it, or set api_key_env: \"\" for a server without a key")
            headers["Authorization"] = f"Bearer {api_key}"
        return cls(cfg.max_concurrency, cfg.timeout_s, headers)

    def call(self, make: Callable[[Any, asyncio.Semaphore], Awaitable[Any]]) -> Any:
        loop = self._started()

        async def run():
            if self._client is None:   # made on the loop it serves
                import httpx
                self._client = httpx.AsyncClient(timeout=self.timeout_s, headers=self.headers,
                                                 limits=httpx.Limits(max_connections=self.max_concurrency))
                self._limit = asyncio.Semaphore(self.max_concurrency)
            return await make(self._client, self._limit)
        return asyncio.run_coroutine_threadsafe(run(), loop).result()

    def _started(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                threading.Thread(target=loop.run_forever, name="turnrl-endpoint", daemon=True).start()
                self._loop = loop
            return self._loop

    def close(self) -> None:
        with self._lock:
            loop, self._loop = self._loop, None
        if loop is None:
            return
        if self._client is not None:
            asyncio.run_coroutine_threadsafe(self._client.aclose(), loop).result(timeout=10)
            self._client = None
        loop.call_soon_threadsafe(loop.stop)

    def __getstate__(self) -> dict:   # sent to another process: it starts its own loop there
        return {"max_concurrency": self.max_concurrency, "timeout_s": self.timeout_s, "headers": self.headers}

    def __setstate__(self, state: dict) -> None:
        self.__init__(**state)
