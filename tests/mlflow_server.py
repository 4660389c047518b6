"""A real `mlflow server` for tests: a sqlite backend and an artifact folder under `root`, on a
free loopback port. Started as its own process group so a test can kill it (SIGKILL: the way a
crashed or unplugged server goes away)."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MlflowServer:
    def __init__(self, root: Path, port: int | None = None) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.backend = f"sqlite:///{self.root / 'mlflow.db'}"
        self.log = self.root / "server.log"
        self.proc: subprocess.Popen | None = None
        self.started_in: float | None = None

    def start(self, timeout: float = 240) -> "MlflowServer":
        start = time.perf_counter()
        cmd = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(self.port),
               "--backend-store-uri", self.backend, "--artifacts-destination", str(self.root / "artifacts"),
               "--workers", "1"]
        env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true"}
        self.proc = subprocess.Popen(cmd, cwd=self.root, env=env, stdout=open(self.log, "w"),
                                     stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=5) as reply:
                    if reply.read().strip() == b"OK":
                        break
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"mlflow server not healthy after {time.perf_counter() - start:.0f} s:\n"
                                   + self.log.read_text()[-3000:])
            time.sleep(0.5)
        self.started_in = time.perf_counter() - start
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL the server and its workers (its process group)."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)

    def __enter__(self) -> "MlflowServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.kill()
