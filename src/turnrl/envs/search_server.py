"""The search environment's BM25 index as an HTTP service (`SearchService`), one index for many
rollout workers (as Search-R1 and RoSTE run their retrievers); `turnrl serve-search`
(:mod:`turnrl.pipeline.serve_search`) starts it from params.

Its endpoints and options are described in `turnrl.pipeline.serve_search`.
"""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from turnrl.envs.search import SearchIndex, format_results


class SearchService(ThreadingHTTPServer):
    """A threading HTTP server answering searches over one index."""
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 256      # listen backlog (socketserver's default of 5 stalls bursts of connections by 1 s)

    def __init__(self, index: SearchIndex, *, top_k: int = 1, max_passage_chars: int = 120,
                 host: str = "127.0.0.1", port: int = 0, max_k: int = 100):
        self.index, self.top_k, self.max_passage_chars, self.max_k = index, top_k, max_passage_chars, max_k
        super().__init__((host, port), _Handler)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    def search(self, body: Any) -> tuple[int, dict]:
        if not isinstance(body, dict) or not isinstance(body.get("query"), str):
            return 400, {"error": 'send a JSON object {"query": "...", "k": <optional int>}'}
        k = body.get("k", body.get("top_k", self.top_k))
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= self.max_k:
            return 400, {"error": f"k must be an integer from 1 to {self.max_k}"}
        passages = self.index.search(body["query"], k)
        result = format_results(passages, self.max_passage_chars) if passages else "<result>\nNo results.\n</result>"
        return 200, {"passages": passages, "result": result}

    def health(self) -> dict:
        return {"ok": True, "passages": len(self.index), "digest": self.index.digest, "top_k": self.top_k,
                "max_passage_chars": self.max_passage_chars}

    def start(self) -> "SearchService":
        """Serve on a background thread (tests, notebooks); `stop()` ends it."""
        self._thread = threading.Thread(target=self.serve_forever, name="turnrl-search-service", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self.shutdown()
        self.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)


class _Handler(BaseHTTPRequestHandler):
    server: SearchService
    protocol_version = "HTTP/1.1"      # keep-alive: a rollout worker reuses its connections

    def _send(self, status: int, payload: dict) -> None:
        data = json.dumps(payload, ensure_ascii=False).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:   # noqa: N802 - http.server's name
        if self.path.rstrip("/") == "/health":
            self._send(200, self.server.health())
        else:
            self._send(404, {"error": "GET /health or POST /search"})

    def do_POST(self) -> None:   # noqa: N802
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        if self.path.rstrip("/") != "/search":
            self._send(404, {"error": "POST /search"})
            return
        try:
            body = json.loads(raw or b"null")
        except ValueError:
            self._send(400, {"error": "the body is not JSON"})
            return
        try:
            self._send(*self.server.search(body))
        except Exception as exc:   # noqa: BLE001 - a bad query must not take the service down
            self._send(500, {"error": f"{type(exc).__name__}: {exc}"})

    def log_message(self, format: str, *args: Any) -> None:   # noqa: A002 - quiet: one line per request is noise
        pass
