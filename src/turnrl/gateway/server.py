"""The OpenAI-compatible gateway in front of a rollout engine.

    program --HTTP--> /v1/chat/completions --> render (exact ids) --> EngineLoop --> the engine
                      /v1/responses (as a chat completion: turnrl.gateway.responses)
                      /v1/models                 record the Call <-- sampled ids, logprobs, version
                      /turnrl/reward (or /v1/turnrl/reward): the episode's reward

One thread drives the engine (`EngineLoop`): the HTTP handlers hand it token prompts and wait;
between two engine steps it admits them and loads new weights, so the gateway's requests batch on
the engine together and run under the same weight pushes as every rollout. Each request is
stamped with the policy version the engine held when it was admitted.

Each episode has a key (the bearer token): a key gives access to its own episode only; an
unknown key is 401, a call after its episode ended 410 (neither is retried by OpenAI clients),
a malformed request, a prompt longer than the context, a spent call or token budget 400, each
with a message saying what to fix.
"""
from __future__ import annotations

import asyncio
import json
import logging
import secrets
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from turnrl.gateway.render import BadRequest, Produced, Renderer, normalize_messages, token_bytes
from turnrl.gateway.responses import chat_request, response_events, response_of
from turnrl.gateway.samples import Call
from turnrl.rollout.chat import is_byte_level
from turnrl.rollout.multi_turn import BatchStepper, Sample

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------- the engine's thread
@dataclass
class _Request:
    prompt_ids: list[int]
    max_tokens: int
    options: dict
    future: Future
    version: int = 0


class EngineLoop:
    """An engine driven by one thread of its own; `submit` from any thread returns a Future of
    (Sample, policy version). Weights given to `load_weights` are applied by that thread before
    its next engine step."""

    def __init__(self, engine: Any, *, version: int = 0):
        options = dict(stop=(), temperature=1.0, top_p=1.0)
        self.stepper = engine.stepper(**options) if hasattr(engine, "stepper") else BatchStepper(engine, **options)
        self.version = version
        self.busy_s = 0.0
        self._queue: deque[_Request] = deque()
        self._running: dict[int, _Request] = {}
        self._keys = 0
        self._weights: tuple[int, Callable[[], None]] | None = None
        self._cond = threading.Condition()
        self._stopped = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="turnrl-gateway-engine", daemon=True)
        self._thread.start()

    def submit(self, prompt_ids: Sequence[int], max_tokens: int, options: dict) -> Future:
        future: Future = Future()
        with self._cond:
            if self.error is not None or self._stopped:
                future.set_exception(RuntimeError(f"the rollout engine stopped: {self.error!r}"))
                return future
            self._queue.append(_Request(list(prompt_ids), max_tokens, dict(options), future))
            self._cond.notify_all()
        return future

    def load_weights(self, version: int, apply: Callable[[], None]) -> None:
        with self._cond:
            self._weights = (version, apply)
            self._cond.notify_all()

    def in_flight(self) -> int:
        with self._cond:
            return len(self._queue) + len(self._running)

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    self._cond.wait_for(lambda: self._stopped or self._queue or self._weights or self._running,
                                        timeout=0.5)
                    if self._stopped:
                        break
                    weights, self._weights = self._weights, None
                    admitted = list(self._queue)
                    self._queue.clear()
                if weights is not None:
                    weights[1]()
                    self.version = weights[0]
                for request in admitted:
                    request.version = self.version
                    self._keys += 1
                    try:
                        self.stepper.add(self._keys, request.prompt_ids, request.max_tokens, None, request.options)
                    except Exception as exc:   # noqa: BLE001 - this request's (its sampling options): its own error
                        request.future.set_exception(RuntimeError(f"the rollout engine refused this request: {exc!r}"))
                        continue
                    self._running[self._keys] = request
                if self.stepper.busy():
                    start = time.perf_counter()
                    for key, sample in self.stepper.step():
                        request = self._running.pop(key)
                        request.future.set_result((sample, request.version))
                    self.busy_s += time.perf_counter() - start
        except BaseException as exc:   # every waiting handler gets it
            self.error = exc
            log.error("the gateway's engine loop stopped: %r", exc)
        finally:
            self.stepper.abort()
            with self._cond:
                for request in list(self._running.values()) + list(self._queue):
                    if not request.future.done():
                        request.future.set_exception(RuntimeError(f"the rollout engine stopped: {self.error!r}"))
                self._running.clear()
                self._queue.clear()


# --------------------------------------------------------------------------- episodes
@dataclass
class Limits:
    """What one episode may use: sampling settings and budgets (from rollout.* / eval.*)."""
    temperature: float = 1.0
    top_p: float = 1.0
    max_calls: int = 8                 # rollout.max_turns
    max_tokens_per_call: int = 256     # rollout.max_tokens_per_turn
    max_tokens_total: int = 1 << 20    # rollout.max_tokens_total: sampled tokens over the episode
    context: int = 1 << 30             # the engine's context length
    request_sampling: bool = False     # env.options.sampling: request
    stop: tuple[str, ...] = ()         # env.stop: the stop strings of a call that sends none


@dataclass
class Episode:
    key: str
    example: dict
    limits: Limits
    script: list[str] | None = None    # a demonstration's assistant turns (the warm start), else None
    calls: list[Call] = field(default_factory=list)
    produced: list[Produced] = field(default_factory=list)
    started_calls: int = 0
    sampled_tokens: int = 0
    reserved_tokens: int = 0           # asked for by calls in flight (concurrent calls share the budget)
    reward: float | None = None
    components: dict[str, float] = field(default_factory=dict)
    call_rewards: dict[str, float] = field(default_factory=dict)
    ended: bool = False
    ended_why: str = ""
    lock: threading.Lock = field(default_factory=threading.Lock)


class HTTPError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param


def _number(value: Any, what: str) -> float:
    import math
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise HTTPError(400, f"{what} must be a finite number, got {value!r:.60}")
    return float(value)


class Gateway:
    """The HTTP server (Starlette on uvicorn, on a thread of its own) and its episodes."""

    REMEMBERED_ENDED = 100_000   # ended episodes' keys kept to answer their late calls with 410

    def __init__(self, engine_loop: EngineLoop, renderer: Renderer, *, host: str = "127.0.0.1", port: int = 0,
                 model_name: str = "turnrl-policy"):
        self.loop, self.renderer, self.host, self.model_name = engine_loop, renderer, host, model_name
        self.episodes: dict[str, Episode] = {}
        self._ended: OrderedDict[str, str] = OrderedDict()   # keys of forgotten episodes -> why they ended
        self._lock = threading.Lock()
        self._server, self.port = self._start(host, port)

    # ---------------------------------------------------------------- episodes (the runner's side)
    @property
    def base_url(self) -> str:
        """The URL programs get: this host's name when the gateway listens on every interface
        (a program on another machine can reach it), else the address it listens on."""
        import socket
        host = socket.gethostname() if self.host in ("0.0.0.0", "::", "") else self.host
        return f"http://{host}:{self.port}/v1"

    def open(self, example: dict, limits: Limits, script: Sequence[str] | None = None) -> Episode:
        episode = Episode(key="turnrl-" + secrets.token_urlsafe(18), example=example, limits=limits,
                          script=list(script) if script is not None else None)
        with self._lock:
            self.episodes[episode.key] = episode
        return episode

    def close(self, episode: Episode, why: str) -> None:
        """End the episode: its key stays known (later calls are told it ended) until forgotten."""
        with episode.lock:
            episode.ended, episode.ended_why = True, why

    def forget(self, episode: Episode) -> None:
        """Drop the episode's record; its key is remembered as ended (a late call gets 410)."""
        with self._lock:
            self.episodes.pop(episode.key, None)
            self._ended[episode.key] = episode.ended_why or "ended"
            while len(self._ended) > self.REMEMBERED_ENDED:
                self._ended.popitem(last=False)

    def shutdown(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)

    # ---------------------------------------------------------------- HTTP
    def _start(self, host: str, port: int):
        import uvicorn
        from starlette.applications import Starlette
        from starlette.routing import Route
        app = Starlette(routes=[
            Route("/v1/chat/completions", self._chat, methods=["POST"]),
            Route("/v1/responses", self._responses, methods=["POST"]),
            Route("/v1/models", self._models, methods=["GET"]),
            Route("/v1/models/{model:path}", self._model, methods=["GET"]),
            Route("/turnrl/reward", self._reward, methods=["POST"]),
            Route("/v1/turnrl/reward", self._reward, methods=["POST"]),
        ])
        config = uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off",
                                timeout_keep_alive=30, access_log=False)
        server = uvicorn.Server(config)
        server.install_signal_handlers = lambda: None   # not the main thread
        self._thread = threading.Thread(target=server.run, name="turnrl-gateway-http", daemon=True)
        self._thread.start()
        deadline = time.time() + 30
        while not server.started:
            if not self._thread.is_alive() or time.time() > deadline:
                raise RuntimeError(f"the agent gateway could not listen on {host}:{port} (env.options.host/port)")
            time.sleep(0.01)
        bound = server.servers[0].sockets[0].getsockname()[1]
        log.info("agent gateway listening on http://%s:%d/v1", host, bound)
        return server, bound

    def _episode_of(self, request) -> Episode:
        auth = request.headers.get("authorization", "")
        key = auth[7:].strip() if auth.lower().startswith("bearer ") else request.headers.get("api-key", "")
        with self._lock:
            episode = self.episodes.get(key)
            ended = self._ended.get(key)
        if episode is None and ended is not None:
            raise HTTPError(410, f"this episode has ended ({ended}); a program makes no calls after it returns or "
                                 "times out", "episode_ended")
        if episode is None:
            raise HTTPError(401, "unknown key: use the api_key turnrl gave this episode (OPENAI_API_KEY); a key "
                                 "gives access to its own episode only", "authentication_error")
        if episode.ended:
            raise HTTPError(410, f"this episode has ended ({episode.ended_why}); a program makes no calls after it "
                                 "returns or times out", "episode_ended")
        return episode

    @staticmethod
    def _error(exc: HTTPError):
        from starlette.responses import JSONResponse
        # OpenAI's shape: a 400's type is invalid_request_error, its code the kind (context_length_exceeded, ...),
        # which is what clients test (openai's `exc.code`)
        kind = "invalid_request_error" if exc.status == 400 else exc.kind
        return JSONResponse({"error": {"message": exc.message, "type": kind, "param": exc.param, "code": exc.kind}},
                            status_code=exc.status)

    async def _json(self, request) -> dict:
        try:
            body = await request.json()
        except Exception:   # noqa: BLE001 - anything that is not a JSON body
            raise HTTPError(400, "the body is not JSON") from None
        if not isinstance(body, dict):
            raise HTTPError(400, "the body must be a JSON object")
        return body

    async def _models(self, request):
        from starlette.responses import JSONResponse
        return JSONResponse({"object": "list", "data": [{"id": self.model_name, "object": "model",
                                                         "created": 0, "owned_by": "turnrl"}]})

    async def _model(self, request):
        from starlette.responses import JSONResponse
        if request.path_params["model"] != self.model_name:
            return self._error(HTTPError(404, f"no model {request.path_params['model']!r}; this gateway serves "
                                              f"{self.model_name!r}", "model_not_found"))
        return JSONResponse({"id": self.model_name, "object": "model", "created": 0, "owned_by": "turnrl"})

    async def _reward(self, request):
        from starlette.responses import JSONResponse
        try:
            episode = self._episode_of(request)
            body = await self._json(request)
            unknown = sorted(set(body) - {"reward", "components", "call_rewards"})
            if unknown:
                raise HTTPError(400, f"unknown field(s) {unknown}; post reward, components, call_rewards")
            for key in ("components", "call_rewards"):
                if not isinstance(body.get(key) or {}, dict):
                    raise HTTPError(400, f"{key} must be an object of names to numbers, got {body[key]!r:.60}")
            reward = _number(body["reward"], "reward") if body.get("reward") is not None else None
            components = {str(k): _number(v, f"components[{k!r}]") for k, v in (body.get("components") or {}).items()}
            per_call = {str(k): _number(v, f"call_rewards[{k!r}]") for k, v in (body.get("call_rewards") or {}).items()}
            with episode.lock:
                ids = {c.completion_id for c in episode.calls}
                missing = sorted(set(per_call) - ids)
                if missing:
                    raise HTTPError(400, f"call_rewards names {missing[:3]}, which this episode did not answer; "
                                         "use the `id` of a chat completion or Response it returned")
                if reward is not None:
                    episode.reward = reward
                episode.components.update(components)
                episode.call_rewards.update(per_call)
        except HTTPError as exc:
            return self._error(exc)
        return JSONResponse({"ok": True})

    async def _chat(self, request):
        try:
            episode = self._episode_of(request)
            body = await self._json(request)
            response = await self._complete(request, episode, body, "chatcmpl-")
        except HTTPError as exc:
            return self._error(exc)
        if body.get("stream"):
            from starlette.responses import StreamingResponse
            return StreamingResponse(_chunks(response, bool((body.get("stream_options") or {}).get("include_usage"))),
                                     media_type="text/event-stream")
        from starlette.responses import JSONResponse
        return JSONResponse(response)

    async def _responses(self, request):
        """The Responses API: the request as a chat completion's (turnrl.gateway.responses)."""
        try:
            episode = self._episode_of(request)
            body = await self._json(request)
            try:
                chat = chat_request(body)
            except BadRequest as exc:
                raise HTTPError(400, str(exc)) from None
            response = response_of(await self._complete(request, episode, chat, "resp_"), body)
        except HTTPError as exc:
            return self._error(exc)
        if body.get("stream"):
            from starlette.responses import StreamingResponse
            return StreamingResponse(response_events(response), media_type="text/event-stream")
        from starlette.responses import JSONResponse
        return JSONResponse(response)

    async def _complete(self, request, episode: Episode, body: dict, id_prefix: str) -> dict:
        """A Chat Completions request answered: sampled on the engine, recorded as the
        episode's calls; the chat completion (its id starting with `id_prefix`)."""
        prompt_ids, max_tokens, options, n, meta = self._prepare(episode, body)
        futures = [self.loop.submit(prompt_ids, max_tokens, options) for _ in range(n)]
        started = time.time()
        try:
            results = await asyncio.gather(*(asyncio.wrap_future(f) for f in futures))
        except RuntimeError as exc:
            raise HTTPError(503, str(exc), "engine_error") from None
        finally:
            with episode.lock:
                episode.reserved_tokens -= max_tokens * n
        meta["traceparent"] = request.headers.get("traceparent", "")[:128]
        return self._record(episode, prompt_ids, results, meta, started, id_prefix)

    def _prepare(self, episode: Episode, body: dict):
        """The request checked against the episode's budgets: (prompt ids, max tokens, sampling
        options, n, what the answer needs)."""
        limits = episode.limits
        if "messages" not in body:
            raise HTTPError(400, "missing `messages`")
        try:
            if body.get("functions") is not None or body.get("function_call") is not None:
                raise BadRequest("`functions` / `function_call` (OpenAI's deprecated function calling) are not served: "
                                 "give `tools` ([{type: function, function: {name, parameters}}]) and `tool_choice`")
            messages = normalize_messages(body["messages"])
            tools = body.get("tools") or []
            if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
                raise BadRequest("`tools` must be a list of {type: function, function: {...}} objects")
            for k, tool in enumerate(tools):
                function = tool.get("function")
                if tool.get("type", "function") != "function" or not isinstance(function, dict) or \
                        not isinstance(function.get("name"), str) or not function["name"]:
                    flat = " (the Responses API's flat tool; Chat Completions nests it under `function`)" \
                        if tool.get("name") else ""
                    raise BadRequest(f"tools[{k}] must be {{type: function, function: {{name, description, "
                                     f"parameters}}}}{flat}, got {tool!r:.120}")
            tool_choice = body.get("tool_choice", "auto")
            n = body.get("n", 1) if body.get("n") is not None else 1
            if not isinstance(n, int) or isinstance(n, bool) or n < 1 or n > 16:
                raise BadRequest(f"n = {n!r}: must be an integer from 1 to 16")
            with episode.lock:
                produced = list(episode.produced)
            prompt_ids = self.renderer.prompt_ids(messages, tools, produced)
        except BadRequest as exc:
            raise HTTPError(400, str(exc)) from None
        room = limits.context - len(prompt_ids)
        if room <= 0:
            raise HTTPError(400, f"the prompt has {len(prompt_ids)} tokens; the model's context holds {limits.context}. "
                                 "Shorten the conversation (drop or summarise old turns)", "context_length_exceeded")
        asked = body.get("max_completion_tokens", body.get("max_tokens"))
        if asked is not None and (not isinstance(asked, int) or isinstance(asked, bool) or asked < 1):
            raise HTTPError(400, f"max_tokens = {asked!r}: must be a positive integer")
        if asked is not None and asked > room:
            raise HTTPError(400, f"max_tokens = {asked} does not fit: the prompt has {len(prompt_ids)} tokens and the "
                                 f"context holds {limits.context} (at most {room} more)", "context_length_exceeded")
        if not isinstance(body.get("stream_options") or {}, dict):
            raise HTTPError(400, "stream_options must be an object, e.g. {\"include_usage\": true}")
        stop = body.get("stop") or list(limits.stop)   # the program's own, else env.stop
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop) or len(stop) > 8:
            raise HTTPError(400, "stop must be a string or a list of at most 8 strings")
        # checked whether or not they are used (sampling: policy ignores them), as OpenAI checks them
        asked_temperature, asked_top_p = body.get("temperature"), body.get("top_p")
        if asked_temperature is not None and _number(asked_temperature, "temperature") < 0:
            raise HTTPError(400, f"temperature = {asked_temperature!r}: must be 0 or more", param="temperature")
        if asked_top_p is not None and not 0 < _number(asked_top_p, "top_p") <= 1:
            raise HTTPError(400, f"top_p = {asked_top_p!r}: must be above 0 and at most 1", param="top_p")
        temperature, top_p = limits.temperature, limits.top_p
        if limits.request_sampling:
            temperature = float(asked_temperature) if asked_temperature is not None else temperature
            top_p = float(asked_top_p) if asked_top_p is not None else top_p
        with episode.lock:
            # a replayed demonstration answers each call with its next message (its budget: its length)
            if episode.script is not None and len(episode.script) < n:
                raise HTTPError(400, f"the demonstration has no assistant message left for this call (it gave "
                                     f"{episode.started_calls}, and the program made another): the demonstration hook "
                                     "must give one per call the program makes")
            if episode.started_calls + n > limits.max_calls:
                left_calls = limits.max_calls - episode.started_calls
                if left_calls > 0:
                    raise HTTPError(400, f"n = {n} asks for more completions than this episode has left ({left_calls} "
                                         f"of {limits.max_calls}, rollout.max_turns); ask for at most {left_calls}",
                                    "budget_exceeded", "n")
                raise HTTPError(400, f"this episode's call budget is spent ({limits.max_calls} completions, "
                                     "rollout.max_turns); end the episode and return its reward", "budget_exceeded")
            left = limits.max_tokens_total - episode.sampled_tokens - episode.reserved_tokens
            if left < n:
                raise HTTPError(400, f"this episode's token budget is spent ({limits.max_tokens_total} sampled tokens, "
                                     "rollout.max_tokens_total); end the episode", "budget_exceeded")
            script = None
            if episode.script is not None:
                script, episode.script = episode.script[:n], episode.script[n:]
            episode.started_calls += n
            max_tokens = min(asked or limits.max_tokens_per_call, limits.max_tokens_per_call, left // n, room)
            episode.reserved_tokens += max_tokens * n
        options: dict[str, Any] = {"temperature": temperature, "top_p": top_p, "stop": stop}
        if script is not None:
            options["script"] = script[0]   # n is 1 in a demonstration
        meta = {"messages": messages, "tools": tools, "parse_tools": bool(tools) and tool_choice != "none",
                "logprobs": bool(body.get("logprobs")), "top": body.get("top_logprobs")}
        return prompt_ids, max_tokens, options, n, meta

    def _record(self, episode: Episode, prompt_ids: list[int], results: list[tuple[Sample, int]], meta: dict,
                started: float, id_prefix: str = "chatcmpl-") -> dict:
        """Record each completion as a Call of the episode; the Chat Completions answer."""
        completion_id = id_prefix + secrets.token_hex(12)
        ended = time.time()
        choices = []
        with episode.lock:
            if episode.ended:
                raise HTTPError(410, f"this episode ended while the call ran ({episode.ended_why})", "episode_ended")
            for k, (sample, version) in enumerate(results):
                index = len(episode.calls)
                call_ref = f"{completion_id}-{k}" if k else completion_id   # choice k > 0 of n: the id + "-k"
                taken = [c["id"] for p in episode.produced for c in p.message.get("tool_calls") or []]
                message = self.renderer.answer(sample.token_ids, parse_tools=meta["parse_tools"],
                                               call_id=lambda j, i=index: f"call_{episode.key[-8:]}_{i}_{j}",
                                               taken_ids=taken)
                finish = "length" if sample.finish == "length" else ("tool_calls" if message.get("tool_calls") else "stop")
                text = self.renderer.fmt.tokenizer.decode(sample.token_ids, skip_special_tokens=False)
                episode.calls.append(Call(index=index, prompt_ids=list(prompt_ids), completion_ids=list(sample.token_ids),
                                          logprobs=list(sample.logprobs), version=version, finish=sample.finish, text=text,
                                          messages=meta["messages"], tools=meta["tools"], message=message,
                                          completion_id=call_ref, started=started, ended=ended,
                                          traceparent=meta.get("traceparent", "")))
                episode.produced.append(Produced(list(sample.token_ids), message))
                episode.sampled_tokens += len(sample.token_ids)
                choice = {"index": k, "message": message, "finish_reason": finish}
                if meta["logprobs"]:
                    choice["logprobs"] = {"content": self._logprobs(sample)}
                choices.append(choice)
        completion_tokens = sum(len(s.token_ids) for s, _ in results)
        return {"id": completion_id, "object": "chat.completion", "created": int(started), "model": self.model_name,
                "choices": choices, "system_fingerprint": f"turnrl-v{results[0][1]}",
                "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": completion_tokens,
                          "total_tokens": len(prompt_ids) + completion_tokens}}

    def _logprobs(self, sample: Sample) -> list[dict]:
        tokenizer = self.renderer.fmt.tokenizer
        out = []
        byte_level = is_byte_level(tokenizer)
        for token_id, logprob in zip(sample.token_ids, sample.logprobs):
            token = tokenizer.decode([token_id], skip_special_tokens=False)
            out.append({"token": token, "logprob": logprob, "bytes": token_bytes(tokenizer, token_id, byte_level),
                        "top_logprobs": [], "token_id": token_id})
        return out


def _chunks(response: dict, include_usage: bool):
    """A whole answer as Server-Sent Events in the Chat Completions streaming format."""
    base = {"id": response["id"], "object": "chat.completion.chunk", "created": response["created"],
            "model": response["model"], "system_fingerprint": response["system_fingerprint"]}

    def event(choices: list, **extra) -> str:
        return "data: " + json.dumps({**base, "choices": choices, **extra}) + "\n\n"

    for choice in response["choices"]:
        k, message = choice["index"], choice["message"]
        logprobs = {"logprobs": choice["logprobs"]} if choice.get("logprobs") else {}
        # the sampled tokens' logprobs ride on the content chunk, or, for a turn of tool calls only, the first
        yield event([{"index": k, "delta": {"role": "assistant", "content": ""}, "finish_reason": None,
                      **({} if message.get("content") else logprobs)}])
        if message.get("content"):
            yield event([{"index": k, "delta": {"content": message["content"]}, "finish_reason": None, **logprobs}])
        for j, call in enumerate(message.get("tool_calls") or []):
            yield event([{"index": k, "delta": {"tool_calls": [{"index": j, **call}]}, "finish_reason": None}])
        yield event([{"index": k, "delta": {}, "finish_reason": choice["finish_reason"]}])
    if include_usage:
        yield event([], usage=response["usage"])
    yield "data: [DONE]\n\n"
