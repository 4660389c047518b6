"""Per-call unprivileged uids (`UidSlot`: a slot from a pool, flock-ed so concurrent sandboxes
never share one) and the processes a run may leave behind (found by session or uid, killed)."""
from __future__ import annotations

import fcntl
import os
import signal
import tempfile
import time

# Unprivileged uids used when we are root: BASE .. BASE + POOL - 1 (uid == gid). Override with
# TURNRL_SANDBOX_UID_BASE. Uids that exist in the passwd database are skipped.
try:
    UID_BASE = int(os.environ.get("TURNRL_SANDBOX_UID_BASE", "1900000000"))
except ValueError:
    UID_BASE = 1900000000
UID_POOL = 256


class UidSlot:
    """A uid nobody else uses while we hold it: an flock per uid, across threads and processes."""

    _dir: str | None = None

    def __init__(self) -> None:
        self.uid = -1
        self._fd = -1
        d = self._lock_dir()
        # Lowest free uid first: a small working set keeps the passwd/group checks cached.
        for k in range(UID_POOL):
            uid = UID_BASE + k
            if _uid_taken(uid):
                continue
            fd = os.open(os.path.join(d, f"uid-{uid}.lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC,
                         0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                continue
            self.uid, self._fd = uid, fd
            return
        raise RuntimeError(f"all {UID_POOL} sandbox uids are busy")

    @classmethod
    def _lock_dir(cls) -> str:
        if cls._dir is None:
            for base in ("/run", tempfile.gettempdir()):
                d = os.path.join(base, f"turnrl-sandbox-{os.geteuid()}")
                try:
                    os.makedirs(d, 0o700, exist_ok=True)
                    st = os.lstat(d)
                    if st.st_uid == os.geteuid() and not st.st_mode & 0o022 and os.path.isdir(d):
                        cls._dir = d
                        break
                except OSError:
                    continue
            else:
                raise RuntimeError("no safe directory for sandbox uid locks")
        return cls._dir

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


_uid_taken_cache: dict[int, bool] = {}


def _uid_taken(uid: int) -> bool:
    if uid not in _uid_taken_cache:
        import pwd
        import grp
        taken = False
        for lookup in (pwd.getpwuid, grp.getgrgid):
            try:
                lookup(uid)
                taken = True
            except KeyError:
                pass
        _uid_taken_cache[uid] = taken
    return _uid_taken_cache[uid]


def _proc_info(pid: str) -> tuple[int, int] | None:
    """(real uid, session id) of a live (non-zombie) process, from /proc/<pid>/status."""
    uid = sid = None
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"State:") and line.split()[1] in (b"Z", b"X"):
                    return None
                if line.startswith(b"Uid:"):
                    uid = int(line.split()[1])
                elif line.startswith(b"NSsid:"):
                    sid = int(line.split()[1])
                    break
    except (OSError, ValueError, IndexError):
        return None
    return None if uid is None else (uid, -1 if sid is None else sid)


def kill_leftovers(sid: int, uid: int, rounds: int = 5) -> int:
    """SIGKILL live processes in session `sid` or (if uid >= 0) running as `uid`; a few rounds
    because a fork bomb races us. Returns how many were signalled."""
    me, total = os.getpid(), 0
    for _ in range(rounds):
        hit = 0
        try:
            pids = [p for p in os.listdir("/proc") if p.isdigit() and int(p) != me]
        except OSError:
            return total
        for p in pids:
            info = _proc_info(p)
            if info and (info[1] == sid or (uid >= 0 and info[0] == uid)):
                try:
                    os.kill(int(p), signal.SIGKILL)
                    hit += 1
                except OSError:
                    pass
        total += hit
        if not hit:
            break
        time.sleep(0.005)
    return total


def count_tasks_of(uid: int) -> int:
    n = 0
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                if os.stat(f"/proc/{p}").st_uid == uid:
                    n += len(os.listdir(f"/proc/{p}/task"))
            except OSError:
                pass
    return n

