"""One POST to a model server, with the retry rules every turnrl client of a model server keeps
(the judges', turnrl.rewards.judge, and the teacher's, turnrl.rewards.teacher): a request that
times out, cannot connect or gets 408/409/429/5xx is tried again (`retries` more times, backing
off 0.5, 1, 2 ... 8 s); any other answer is final."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

RETRY_STATUS = {408, 409, 429, 500, 502, 503, 504}


@dataclass
class Reply:
    body: Any            # the parsed JSON answer (status 200), else None
    error: str           # why there is none ("" with a body)
    tries: int
    text: str = ""       # the raw answer, for messages


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


def run(coroutine):
    """Run a coroutine to its end from sync code, also where an event loop already runs here."""
    import threading
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
