"""The program host: agent programs given as Python functions run in a process of their own.

    rollout actor (engine, gateway)                     program host (python -m turnrl.gateway.host)
      ProgramHost.submit(task, base_url, key) --job-->    a thread per episode: fn(task, base_url=, api_key=)
      Future <-- (job, value) or (job, error) ---------     its HTTP calls go to the gateway like any client's

Why a process: a program's own Python work (its OpenAI client building and parsing requests and
answers, its tools) would otherwise share the engine's interpreter lock, and every engine step,
which gives the lock up at each torch call, would wait for it (measured on the example agent, 128
episodes: the engine's steps took 1.6x as long beside the programs). A program that calls
`os._exit`, crashes the interpreter or leaks memory also takes down its host, not the rollout
actor: the host's episodes fail as environment errors and the next episode starts a new host.

One host per runner, started on first use with the rollout actor's `sys.path` and working
folder, running up to env.options.max_concurrent episodes at once (the runner bounds them). A
sync function past its timeout cannot be stopped: its thread runs on in the host and its later
calls to the gateway are refused (410); its result is dropped.
"""
from __future__ import annotations

import logging
import os
import pickle
import socket
import subprocess
import sys
import threading
from concurrent.futures import Future
from multiprocessing.connection import Connection
from typing import Any

from turnrl.errors import one_line
from turnrl.gateway.program import AgentOptions, AgentProgram, ProgramError, plain, tracking_env
from turnrl.rollout.multi_turn import error_text

log = logging.getLogger(__name__)


class HostedFailure(ProgramError):
    """An episode that failed in the host; its message is the failure as the host described it
    (the exception's type and message: `error_text`), reported as written."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class ProgramHost:
    """A process running one program's episodes; `submit` returns a Future of what it returned
    (raising ProgramError / TimeoutError for a failure, as `AgentProgram.run` does)."""

    def __init__(self, options: AgentOptions):
        self.options = options
        self._lock = threading.Lock()
        self._pending: dict[int, Future] = {}   # the current host process's episodes, by job
        self._jobs = 0
        self._proc: subprocess.Popen | None = None
        self._conn: Connection | None = None

    def submit(self, example: dict, base_url: str, api_key: str) -> Future:
        future: Future = Future()
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._start()
            self._jobs += 1
            self._pending[self._jobs] = future
            try:
                self._conn.send((self._jobs, dict(example), base_url, api_key))
            except (OSError, ValueError) as exc:   # the host died between two jobs
                self._pending.pop(self._jobs)
                future.set_exception(HostedFailure(f"ProgramError: the program's host process could not take the "
                                                   f"episode: {exc}"))
        return future

    def close(self) -> None:
        with self._lock:
            proc, conn, self._proc, self._conn = self._proc, self._conn, None, None
        if proc is None:
            return
        try:
            conn.send(None)
        except (OSError, ValueError):
            pass
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        conn.close()

    # ------------------------------------------------------------------ the actor's side
    def _start(self) -> None:
        ours, theirs = socket.socketpair()
        path = os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))
        env = {**os.environ, **tracking_env(), "PYTHONPATH": path}
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "turnrl.gateway.host", str(theirs.fileno()), self.options.model_dump_json()],
            pass_fds=[theirs.fileno()], env=env, cwd=os.getcwd())
        theirs.close()
        self._conn = Connection(ours.detach())
        self._pending = {}   # a host that went keeps its own: its reader fails them, not the new host's
        threading.Thread(target=self._read, args=(self._proc, self._conn, self._pending), name="turnrl-program-host",
                         daemon=True).start()
        log.info("agent program host started (pid %d) for %s", self._proc.pid, self.options.program)

    def _read(self, proc: subprocess.Popen, conn: Connection, pending: dict[int, Future]) -> None:
        """Resolve the host's futures as it answers; when it goes, fail what it still held."""
        while True:
            try:
                job, ok, payload = conn.recv()
            except (EOFError, OSError):
                break
            with self._lock:
                future = pending.pop(job, None)
            if future is None:
                continue
            try:   # the value pickled by the host alone: one that cannot be read here fails its episode only
                value = pickle.loads(payload)
            except Exception as exc:   # noqa: BLE001
                ok, value = False, (f"ProgramError: what the program returned could not be read back "
                                    f"({one_line(exc)}); return a number or a dict of numbers")
            if ok:
                future.set_result(value)
            else:
                future.set_exception(HostedFailure(value))
        code = proc.wait()
        with self._lock:
            lost = [pending.pop(job) for job in list(pending)]
        for future in lost:
            future.set_exception(HostedFailure(
                f"ProgramError: the program's host process exited (code {code}) while this episode ran: the program "
                "ended its interpreter (os._exit, a crash, out of memory); the next episodes start a new one"))


# ---------------------------------------------------------------------- the host's side
def _serve(fd: int, options_json: str) -> None:
    conn = Connection(fd)
    program = AgentProgram(AgentOptions.model_validate_json(options_json))
    send_lock = threading.Lock()

    def answer(job: int, ok: bool, value: Any) -> None:
        try:   # pickled here, plainly (not by the connection's reducers: a torch tensor's would share memory)
            payload = pickle.dumps(plain(value))
        except Exception as exc:   # noqa: BLE001 - a value that does not pickle
            ok, payload = False, pickle.dumps(f"ProgramError: the program returned {type(value).__name__}, which "
                                              f"cannot be sent back ({one_line(exc)}); return a number or a dict")
        with send_lock:
            try:
                conn.send((job, ok, payload))
            except (OSError, ValueError):
                pass   # the actor is gone

    def episode(job: int, example: dict, base_url: str, api_key: str) -> None:
        try:
            value = program.run(example, base_url, api_key)
        except BaseException as exc:   # noqa: BLE001 - the user's program
            answer(job, False, error_text(exc))
            return
        answer(job, True, value)

    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):
            break
        if job is None:
            break
        threading.Thread(target=episode, args=job, name="turnrl-agent-episode", daemon=True).start()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)   # episodes still running (a sync program past its timeout) end with the host



if __name__ == "__main__":
    _serve(int(sys.argv[1]), sys.argv[2])
