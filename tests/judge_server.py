"""Judges on loopback for the tests: real OpenAI-compatible HTTP servers (Starlette on uvicorn,
on a thread) that answer like a judge, count their requests and the most in flight."""
from __future__ import annotations

import asyncio
import re
import socket
import threading
import time


def serve(chat, path: str = "/v1/chat/completions", more: dict | None = None) -> tuple:
    """A Starlette app answering POST `path` with `chat` (and each path of `more` with its
    (handler, methods)), on uvicorn on a free loopback port, on a thread: (the server, its
    thread, its URL)."""
    import uvicorn
    from starlette.applications import Starlette
    from starlette.routing import Route
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(Starlette(routes=[Route(path, chat, methods=["POST"]),
                                                             *(Route(p, h, methods=m) for p, (h, m) in (more or {}).items())]),
                                           host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    return server, thread, f"http://127.0.0.1:{port}/v1"


def answer(text: str):
    from starlette.responses import JSONResponse
    return JSONResponse({"choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                      "finish_reason": "stop"}]})


class JudgeServer:
    """Answers by the prompt: 'score N' -> 'N', 'babble' -> no number, 'slow N' -> N after 3 s,
    'flaky N' -> 503 on its first request then N, 'lagging N' -> N, after 3 s on its first request
    only; counts requests and the most in flight."""

    def __init__(self, delay_s: float = 0.05):
        from starlette.responses import JSONResponse
        self.delay_s, self.in_flight, self.most_in_flight, self.requests = delay_s, 0, 0, {}

        async def chat(request):
            prompt = (await request.json())["messages"][0]["content"]
            self.requests[prompt] = self.requests.get(prompt, 0) + 1
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
            try:
                word, _, value = prompt.partition(" ")
                lagging = word == "lagging" and self.requests[prompt] == 1
                await asyncio.sleep(3.0 if word == "slow" or lagging else self.delay_s)
                if word == "flaky" and self.requests[prompt] == 1:
                    return JSONResponse({"error": "overloaded"}, status_code=503)
                return answer("I would rather not say" if word == "babble" else f"Score: {value}")
            finally:
                self.in_flight -= 1
        self.server, self.thread, self.url = serve(chat)


class ReferenceJudge:
    """A judge that knows the truth, as the issue's benchmark wants one: 'Reference: R\nAnswer: A'
    scores 10 when A holds R, else 0, after a judge-like latency."""

    def __init__(self):
        self.calls = 0

        async def chat(request):
            prompt = (await request.json())["messages"][0]["content"]
            self.calls += 1
            reference = re.search(r"Reference: (.*)", prompt).group(1).strip()
            await asyncio.sleep(0.02)
            return answer(f"Score: {10 if reference and reference in prompt.split('Answer:', 1)[1] else 0}")
        self.server, self.thread, self.url = serve(chat)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=5)


class TeacherServer:
    """vLLM's /v1/completions with prompt_logprobs as a teacher answers: log p(token) = -token / 100
    (position 0: null); with prompt_logprobs k also k top tokens, ids 100.. with logprobs -0.001,
    -0.002, ... 'down' mode answers 503 always; 'bare' answers without prompt_logprobs.
    With a `tokenizer`, it answers vLLM's /tokenize with its ids, and /v1/models, too."""

    def __init__(self, mode: str = "ok", tokenizer=None):
        from starlette.responses import JSONResponse
        self.mode, self.requests = mode, 0

        async def completions(request):
            body = await request.json()
            self.requests += 1
            if self.mode == "down":
                return JSONResponse({"error": "overloaded"}, status_code=503)
            k = body.get("prompt_logprobs") or 0   # top k as vLLM adds them: ids 100.., logprob -(j + 1) / 1000
            top = {str(100 + j): {"logprob": -(j + 1) / 1000, "rank": j + 1} for j in range(k)}
            entries = [None] + [{**top, str(tok): {"logprob": -tok / 100, "rank": k + 1}} for tok in body["prompt"][1:]]
            choice = {"index": 0, "text": "x", **({"prompt_logprobs": entries} if self.mode == "ok" else {})}
            return JSONResponse({"choices": [choice]})
        async def tokenize(request):
            body = await request.json()
            ids = tokenizer(body["prompt"], add_special_tokens=body.get("add_special_tokens", True))["input_ids"]
            return JSONResponse({"tokens": ids, "count": len(ids)})
        async def models(request):
            return JSONResponse({"object": "list", "data": [{"id": "teacher", "object": "model"}]})
        self.server, self.thread, self.url = serve(
            completions, path="/v1/completions",
            more={"/tokenize": (tokenize, ["POST"]), "/v1/models": (models, ["GET"])} if tokenizer is not None else None)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=5)
