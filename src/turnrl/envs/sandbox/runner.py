"""One sandboxed process: `launch` stages the program and the setup helper in a fresh folder,
starts the helper in its own session, and collects its output (bounded), its wait status and its
leftovers, killing it at the deadline."""
from __future__ import annotations

import os
import select
import shutil
import signal
import subprocess
import tempfile
import time

from turnrl.envs.sandbox.boot import BOOT
from turnrl.envs.sandbox.limits import RawRun, SandboxLimits
from turnrl.envs.sandbox.uids import kill_leftovers

# Marker in every sandbox process's command line (lets tests and operators find leftovers).
MARKER = "--turnrl-sandbox"
_SAFE_PATH = "/usr/local/bin:/usr/bin:/bin"
_READ_CHUNK = 65536


def launch(cfg_python: str, layers, hide: str, need_fs: bool, code: str, limits: SandboxLimits,
            strict: bool, uid: int, nproc: int) -> RawRun:
    stage = tempfile.mkdtemp(prefix="turnrl-sbx-")
    r = w = -1
    proc = None
    try:
        with open(os.path.join(stage, "main.py"), "w", encoding="utf-8",
                  errors="surrogatepass") as f:
            f.write(code)
        os.chmod(os.path.join(stage, "main.py"), 0o644)
        boot = os.path.join(stage, "boot.py")
        with open(boot, "w", encoding="utf-8") as f:
            f.write(BOOT)
        if uid >= 0:
            os.chown(stage, uid, uid)
        home = "/tmp" if strict and "jail" in layers else stage
        env = {"PATH": _SAFE_PATH, "HOME": home, "TMPDIR": home, "LANG": "C.UTF-8"}
        mb = 1024 * 1024
        r, w = os.pipe()  # status from the helper: "L<layers>", "S<wait status>", "E<error>"
        args = [cfg_python, "-I", "-S", boot, str(w), ",".join(sorted(layers)),
                "1" if strict else "0", str(uid), str(uid), stage, hide,
                repr(float(limits.timeout_s)), str(max(1, int(limits.cpu_s))),
                str(max(1, int(limits.memory_mb)) * mb), str(nproc),
                str(max(0, int(limits.max_file_mb)) * mb),
                str(max(16, 4 * int(limits.max_file_mb))),
                "1" if need_fs else "0", MARKER]
        deadline = time.monotonic() + max(0.0, float(limits.timeout_s))
        try:
            proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, cwd=stage, env=env, close_fds=True,
                                    pass_fds=(w,), start_new_session=True)
        finally:
            os.close(w)
            w = -1
        return _collect(proc, r, deadline, limits, uid, "pidns" in layers)
    finally:
        if proc is not None and proc.returncode is None:
            _kill_group(proc)
            try:
                proc.wait(timeout=5)
            except Exception:
                pass
        for fd in (r, w):
            if fd >= 0:
                os.close(fd)
        shutil.rmtree(stage, ignore_errors=True)


def _kill_group(proc: subprocess.Popen) -> None:
    # Only while proc is unreaped, so its pid (== pgid == sid) cannot have been reused.
    for kill, target in ((os.killpg, proc.pid), (os.kill, proc.pid)):
        try:
            kill(target, signal.SIGKILL)
        except OSError:
            pass


def _exited(pid: int) -> bool:
    """True once pid has exited, without reaping it (the pid stays ours)."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True

class _Output:
    """The helper's stdout and stderr, read as they come, `cap` bytes kept in all (beyond that
    the run is flooded); a pidfd, where the kernel has them, says when the helper exits."""

    def __init__(self, proc: subprocess.Popen, cap: int):
        self.cap = cap
        self.out_fd, self.err_fd = proc.stdout.fileno(), proc.stderr.fileno()
        self.bufs = {self.out_fd: bytearray(), self.err_fd: bytearray()}
        self.poller = select.poll()
        for fd in self.bufs:
            self.poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
        try:  # readable once the helper exits: no polling loop needed
            self.pidfd = os.pidfd_open(proc.pid)
            self.poller.register(self.pidfd, select.POLLIN)
        except (AttributeError, OSError):
            self.pidfd = -1
        self.open_fds, self.total = set(self.bufs), 0
        self.exited = self.flooded = False

    def read_ready(self, wait_s: float) -> bool:
        events = self.poller.poll(max(0, int(wait_s * 1000 + 0.999)))
        for fd, _ in events:
            if fd == self.pidfd:
                self.exited = True
                self.poller.unregister(self.pidfd)
                continue
            try:
                data = os.read(fd, _READ_CHUNK)
            except BlockingIOError:
                continue
            if not data:
                self.poller.unregister(fd)
                self.open_fds.discard(fd)
                continue
            self.bufs[fd] += data[:max(0, self.cap - self.total)]
            self.total += len(data)
            self.flooded = self.flooded or self.total > self.cap
        return bool(events)

    def close_pidfd(self) -> None:
        if self.pidfd >= 0:
            if not self.exited:
                self.poller.unregister(self.pidfd)
            os.close(self.pidfd)
            self.pidfd = -1


def _collect(proc: subprocess.Popen, status_fd: int, deadline: float, limits: SandboxLimits,
             uid: int, pidns: bool) -> RawRun:
    out = _Output(proc, max(64 * 1024, 16 * int(limits.max_output_chars)))
    try:
        timed_out, leftover = _read_until_exit(proc, out, deadline)
    finally:
        out.close_pidfd()
    if timed_out or out.flooded:
        _kill_group(proc)
    if not pidns or leftover:
        # No pid namespace to take leftovers down with it: kill the session's processes (and,
        # with a sandbox uid, everything running as that uid: it also catches setsid escapes).
        _kill_group(proc)
        kill_leftovers(proc.pid, uid)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        proc.wait()
    # Drain what is left in the pipes (writers are dead), still bounded.
    end = time.monotonic() + 0.5
    while out.open_fds and not out.flooded and time.monotonic() < end:
        if not out.read_ready(0.05):
            break
    proc.stdout.close()
    proc.stderr.close()
    return RawRun(bytes(out.bufs[out.out_fd]), bytes(out.bufs[out.err_fd]), _read_status(status_fd),
                  proc.returncode, timed_out, out.flooded)


def _read_until_exit(proc: subprocess.Popen, out: _Output, deadline: float) -> tuple[bool, bool]:
    """Read until the helper has exited and closed its pipes, the output floods, or the deadline:
    (timed out, leftovers hold the pipes open)."""
    while not (out.exited and not out.open_fds) and not out.flooded:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return True, False
        wait = remaining if out.pidfd >= 0 and not out.exited else min(remaining, 0.05)
        got = out.read_ready(wait)
        if out.pidfd < 0 and not out.exited:
            out.exited = _exited(proc.pid)
        if out.exited and out.open_fds and not got:
            # The helper is gone (with a pid namespace, so is everything it started), yet
            # something still holds the pipes open and is silent: leftovers to kill.
            return False, True
    return False, False


def _read_status(status_fd: int) -> list[str]:
    """The helper's status lines ("L<layers>", "S<wait status>", "E<error>", "T")."""
    status = b""
    os.set_blocking(status_fd, False)
    try:
        while True:
            chunk = os.read(status_fd, 4096)
            if not chunk:
                break
            status += chunk
    except BlockingIOError:
        pass
    return status.decode("utf-8", "replace").splitlines()
