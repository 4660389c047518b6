"""Run untrusted, model-written Python in a fresh, limited, isolated process.

    result = run_python("print(6 * 7)")            # SandboxResult(ok=True, output="42\\n", ...)
    results = run_many([code_a, code_b], limits)   # a thread pool, one process per call, order kept

Every call starts a new interpreter (the current one, ``-I -S``: isolated mode, no site-packages,
so only the standard library is importable) in its own session, with a clean environment,
stdin=/dev/null, a fresh working directory and bounded output capture. What else holds depends on
the host; ``sandbox_capabilities()`` probes once and reports the active layers. On a Linux host
where we are root (our container) the full stack is:

* setup helper ("boot", below): unshares mount, network, pid and IPC namespaces (ctypes
  ``unshare``), builds a read-only view of the filesystem with a private tmpfs ``/tmp`` (the
  working directory) and ``/dev/shm``, a fresh ``/proc``, hides the directory that keeps the
  interpreter from unprivileged users (``/root`` here) behind a tmpfs that re-exposes only the
  interpreter's prefix, sets rlimits, then drops to a per-call unprivileged uid (a slot from a
  pool, locked with flock so concurrent sandboxes never share a uid) with no_new_privs.
* the user program then runs as a child of that helper, which is pid 1 of the new pid namespace:
  when the program exits, or the helper is killed on timeout, the kernel kills every process
  left in the namespace, including ones that called setsid() to leave the process group.

Without root, the same stack is built inside an unprivileged user namespace (capabilities are
dropped before user code runs; the process keeps the caller's uid). Without namespaces it falls
back to session/process-group kill, rlimits and a fresh directory; see docs/sandbox.md.

Errors never raise into the caller: every failure is a SandboxResult with ok=False.
"""
from __future__ import annotations

import fcntl
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

__all__ = ["SandboxLimits", "SandboxResult", "run_python", "run_many", "sandbox_capabilities"]


@dataclass(frozen=True)
class SandboxLimits:
    timeout_s: float = 5.0        # wall clock, enforced by the caller (SIGKILL to the sandbox)
    cpu_s: int = 5                # RLIMIT_CPU per process (SIGXCPU at cpu_s, SIGKILL at cpu_s + 1)
    memory_mb: int = 512          # RLIMIT_AS per process
    max_output_chars: int = 2000  # truncate combined stdout/stderr (a marker shows where)
    max_processes: int = 64       # RLIMIT_NPROC; includes the sandbox's own 1-2 helper processes
    max_file_mb: int = 16         # RLIMIT_FSIZE; the private /tmp tmpfs holds 4x this (>= 16 MB)


@dataclass(frozen=True)
class SandboxResult:
    ok: bool             # ran to completion with exit code 0 and no timeout
    output: str          # stdout (+ stderr on error), truncated with a visible marker
    error: str | None    # short reason: "timeout after 5.0s", "exit code 1", the exception line...
    exit_code: int | None  # the program's exit code; -N if killed by signal N; None if unknown
    duration_s: float


# Marker in every sandbox process's command line (lets tests and operators find leftovers).
MARKER = "--turnrl-sandbox"
# TURNRL_SANDBOX_DISABLE="netns,jail,..." leaves layers out (debugging; see _ALL_LAYERS).
# Unprivileged uids used when we are root: BASE .. BASE + POOL - 1 (uid == gid). Override with
# TURNRL_SANDBOX_UID_BASE. Uids that exist in the passwd database are skipped.
try:
    UID_BASE = int(os.environ.get("TURNRL_SANDBOX_UID_BASE", "1900000000"))
except ValueError:
    UID_BASE = 1900000000
UID_POOL = 256
_SAFE_PATH = "/usr/local/bin:/usr/bin:/bin"
_READ_CHUNK = 65536

# --------------------------------------------------------------------------------------------
# The setup helper. It runs as `python -I -S <stage>/boot.py args...` in its own session and:
#   P (this process):  unshare(namespaces) -> fork init -> wait for it, exit
#   init (pid 1 in the new pid namespace): mount jail, rlimits, drop privileges -> fork user
#       -> wait (reaping orphans) -> report the user's wait status on the status fd -> exit,
#       which makes the kernel kill everything left in the pid namespace.
#   user: runs the program in a fresh __main__ module.
# In probe mode ("0" strict flag) failed steps are skipped and the steps that worked are
# reported ("L..." line); in strict mode any failed step aborts the run ("E..." line), so a run
# never silently gets weaker isolation than sandbox_capabilities() reported.
# --------------------------------------------------------------------------------------------
_BOOT = r'''
import os, sys
A = sys.argv
SFD = int(A[1]); WANT = set(filter(None, A[2].split(","))); STRICT = A[3] == "1"
UID = int(A[4]); GID = int(A[5]); STAGE = A[6]; HIDE = A[7]
TIMEOUT = float(A[8]); CPU = int(A[9]); MEM = int(A[10]); NPROC = int(A[11])
FSIZE = int(A[12]); TMPFS = int(A[13]); NEED_FS_FOR_DROP = A[14] == "1"
DONE = []

def report(line):
    try:
        os.write(SFD, (line.replace("\n", " ") + "\n").encode("utf-8", "replace"))
    except OSError:
        pass

def step(name, fn):
    if name not in WANT:
        return False
    try:
        fn()
    except BaseException as e:
        if STRICT:
            report("E%s: %s: %s" % (name, type(e).__name__, e))
            os._exit(111)
        return False
    DONE.append(name)
    return True

with open(os.path.join(STAGE, "main.py"), "rb") as f:
    SRC = f.read()
os.unlink(A[0])  # this script: already compiled, and not for the program to see

def load_libc():
    # The C core of ctypes (~0.5 ms to import) instead of the ctypes package (~4 ms).
    import _ctypes as C
    T = {}
    for code in "iIlLQzP":
        T[code] = type("c_" + code, (C._SimpleCData,), {"_type_": code})
    fn_type = type("F", (C.CFuncPtr,), {"_flags_": C.FUNCFLAG_CDECL | C.FUNCFLAG_USE_ERRNO,
                                        "_restype_": T["i"]})
    handle = C.dlopen(None, 2)  # RTLD_NOW
    def fn(name, *argtypes):
        f = fn_type(C.dlsym(handle, name))
        if argtypes:
            f.argtypes = [T[a] for a in argtypes]
        return f
    class L:
        pass
    L.C, L.T = C, T
    L.unshare = fn("unshare", "i")
    L.mount = fn("mount", "z", "z", "z", "L", "z")
    L.prctl = fn("prctl", "i", "L", "L", "L", "L")
    L.syscall = fn("syscall")
    L.capset = fn("capset", "P", "P")
    return L

libc = load_libc() if WANT & {"userns", "mntns", "netns", "pidns", "ipcns", "nnp"} else None

def ck(r, what):
    if r != 0:
        e = libc.C.get_errno()
        raise OSError(e, "%s: %s" % (what, os.strerror(e)))

def mount(src, dst, fstype, flags, data=None):
    enc = lambda s: None if s is None else s.encode()
    ck(libc.mount(enc(src), enc(dst), enc(fstype), flags, enc(data)), "mount %s" % dst)

def unshare(flag):
    return lambda: ck(libc.unshare(flag), "unshare")

def userns():
    ck(libc.unshare(0x10000000), "unshare(CLONE_NEWUSER)")
    uid, gid = os.getuid(), os.getgid()
    for name, text in (("setgroups", "deny"), ("uid_map", "%d %d 1" % (uid, uid)),
                       ("gid_map", "%d %d 1" % (gid, gid))):
        with open("/proc/self/" + name, "w") as f:
            f.write(text)

if step("userns", userns) or os.geteuid() == 0:
    step("mntns", unshare(0x00020000))
    step("netns", unshare(0x40000000))
    step("pidns", unshare(0x20000000))
    step("ipcns", unshare(0x08000000))

def flush_all():
    for s in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            if s is not None:
                s.flush()
        except Exception:
            pass

def run_user():
    os.close(SFD)
    if libc is not None:
        libc.prctl(4, 1, 0, 0, 0)  # PR_SET_DUMPABLE: a normal /proc/self for the program
    main = type(sys)("__main__")
    main.__file__ = "main.py"
    main.__builtins__ = __builtins__
    sys.modules["__main__"] = main
    sys.argv = ["main.py"]
    sys.path.insert(0, os.getcwd())
    try:
        sys.stdout.reconfigure(line_buffering=True)  # partial output survives a timeout
    except Exception:
        pass
    status = 0
    try:
        try:
            code = compile(SRC, "main.py", "exec", dont_inherit=True)
        except BaseException as e:
            sys.excepthook(type(e), e, None)
            raise SystemExit(1)
        try:
            exec(code, main.__dict__)
        except SystemExit:
            raise
        except BaseException as e:
            tb = e.__traceback__.tb_next if e.__traceback__ else None  # hide this frame
            sys.excepthook(type(e), e.with_traceback(tb), tb)
            raise SystemExit(1)
    except SystemExit as e:
        if e.code is None:
            status = 0
        elif isinstance(e.code, int):
            status = e.code
        else:
            try:
                print(e.code, file=sys.stderr)
            except Exception:
                pass
            status = 1
    # What interpreter shutdown does that a program can observe, without the ~3 ms of
    # module teardown: join non-daemon threads, atexit handlers, flush (and let the program's
    # own objects go, which closes and flushes its files), exit.
    try:
        t = sys.modules.get("threading")
        if t is not None:
            t._shutdown()
        import atexit
        atexit._run_exitfuncs()
        flush_all()
        main.__dict__.clear()
        flush_all()
    except BaseException:
        pass
    os._exit(status & 0xFF)

def jail():
    MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
    MS_REMOUNT, MS_BIND, MS_MOVE, MS_REC, MS_PRIVATE = 32, 4096, 8192, 16384, 1 << 18
    mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing we do propagates to the host
    # Hide host folders (the project, /home, /run and its sockets, /root, ...) behind an empty
    # tmpfs, re-exposing only the interpreter's prefix; a top-level file behind an empty file.
    for n, spec in enumerate(filter(None, HIDE.split(";"))):
        hidden, *keep = spec.split("|")
        if not os.path.isdir(hidden):
            empty = os.path.join(STAGE, ".empty")
            open(empty, "w").close()
            mount(empty, hidden, None, MS_BIND)
            continue
        stashes = []
        for i, rel in enumerate(keep):
            stash = os.path.join(STAGE, ".stash%d_%d" % (n, i))
            os.mkdir(stash, 0o700)
            mount(os.path.join(hidden, rel), stash, None, MS_BIND | MS_REC)
            stashes.append((stash, rel))
        mount("tmpfs", hidden, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=1m")
        for stash, rel in stashes:
            target = os.path.join(hidden, rel)
            os.makedirs(target, 0o755, exist_ok=True)
            mount(stash, target, None, MS_MOVE)
            os.rmdir(stash)
    # Everything read-only: mount_setattr(AT_FDCWD, "/", AT_RECURSIVE, {attr_set=RDONLY}).
    C, T = libc.C, libc.T
    attr = type("A", (C.Array,), {"_type_": T["Q"], "_length_": 4})(1, 0, 0, 0)
    r = libc.syscall(T["l"](442), T["i"](-100), T["z"](b"/"), T["I"](0x8000), C.byref(attr),
                     T["L"](32))
    if r != 0:  # older kernels: remount each mount, keeping its other flags
        import re
        with open("/proc/self/mountinfo") as f:
            points = [l.split()[4] for l in f]
        for p in points:
            p = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), p) if "\\" in p else p
            if not os.path.exists(p):
                continue  # under a hidden folder
            fl = os.statvfs(p).f_flag
            keep = fl & (MS_NOSUID | MS_NODEV | MS_NOEXEC) | (1024 if fl & 1024 else 0) | \
                (2048 if fl & 2048 else 0) | ((1 << 21) if fl & 4096 else 0)
            mount(None, p, None, MS_BIND | MS_REMOUNT | MS_RDONLY | keep)
    # Fresh writable tmpfs: /tmp (the working directory and HOME) and /dev/shm.
    opts = "size=%dm,nr_inodes=16384,uid=%d,gid=%d" % (TMPFS, os.getuid() if UID < 0 else UID,
                                                       os.getgid() if GID < 0 else GID)
    mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777," + opts)
    if os.path.isdir("/dev/shm"):
        mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777," + opts)
    os.chdir("/tmp")
    with open("main.py", "wb") as f:  # for tracebacks with source lines
        f.write(SRC)

def limits():
    import resource
    R = resource
    for res, soft, hard in ((R.RLIMIT_CORE, 0, 0), (R.RLIMIT_CPU, CPU, CPU + 1),
                            (R.RLIMIT_AS, MEM, MEM), (R.RLIMIT_FSIZE, FSIZE, FSIZE),
                            (R.RLIMIT_NPROC, NPROC, NPROC)):
        if soft < 0:
            continue
        old_soft, old_hard = R.getrlimit(res)
        if old_hard != R.RLIM_INFINITY:
            soft, hard = min(soft, old_hard), min(hard, old_hard)
        R.setrlimit(res, (soft, hard))

def drop_root():
    os.setgroups([])
    os.setgid(GID)
    os.setuid(UID)  # from uid 0 to non-zero: all capabilities are cleared too
    if os.getuid() != UID or os.geteuid() != UID:
        raise OSError("setuid did not stick")

def drop_caps():  # inside our user namespace: no capabilities left for the program
    C, T = libc.C, libc.T
    hdr = type("H", (C.Array,), {"_type_": T["I"], "_length_": 2})(0x20080522, 0)
    data = type("D", (C.Array,), {"_type_": T["I"], "_length_": 6})()
    ck(libc.capset(C.byref(hdr), C.byref(data)), "capset")

def proc():
    mount("proc", "/proc", "proc", 2 | 4 | 8)

def init_main():
    import _signal as S  # the C module: "signal" would import enum & co (~8 ms)
    if "mntns" in DONE:
        step("jail", jail)
        if "pidns" in DONE:
            step("proc", proc)
    step("rlimits", limits)
    if not NEED_FS_FOR_DROP or "jail" in DONE:
        step("drop", drop_root)
    if "userns" in DONE:
        step("capdrop", drop_caps)
    if libc is not None:
        step("nnp", lambda: ck(libc.prctl(38, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)"))
        libc.prctl(1, 9, 0, 0, 0)  # PR_SET_PDEATHSIG=SIGKILL: die with P (after setuid)
    report("L" + ",".join(DONE))
    try:
        child = os.fork()
    except OSError as e:
        report("Estart: cannot fork the program (%s); max_processes=%d too low?" % (e, NPROC))
        os._exit(111)
    if child == 0:
        return True
    for s in (S.SIGINT, S.SIGTERM, S.SIGHUP, S.SIGQUIT, S.SIGUSR1, S.SIGUSR2, S.SIGPIPE):
        S.signal(s, S.SIG_IGN)
    def backstop(*_):  # the caller died or lost track of us: end the sandbox anyway
        report("T")
        if "pidns" not in DONE:
            os.killpg(0, 9)
        os._exit(0)
    S.signal(S.SIGALRM, backstop)
    S.alarm(int(TIMEOUT) + 3)
    while True:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            report("E?: program vanished")
            break
        if pid == child:
            report("S%d" % status)
            break
    if "pidns" not in DONE:
        try:
            os.killpg(0, 9)  # leftovers in our process group (we are in it, too)
        except OSError:
            pass
    os._exit(0)

try:
    init = os.fork()
except OSError as e:
    report("Efork: %s" % e)
    os._exit(111)
if init == 0:
    if init_main():
        run_user()
else:
    while True:
        try:
            _, st = os.waitpid(init, 0)
            break
        except ChildProcessError:
            st = 0
            break
    os._exit(min(255, abs(os.waitstatus_to_exitcode(st))))
'''

_ALL_LAYERS = ("userns", "mntns", "netns", "pidns", "ipcns", "jail", "proc", "rlimits", "drop",
               "capdrop", "nnp")


# --------------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------------
@dataclass
class _Config:
    python: str
    layers: frozenset
    hide: str            # "dir|rel1|rel2;dir2|..." for the boot helper
    need_fs_for_drop: bool
    nproc_mode: str      # "uid" (own uid), "userns" (own user namespace), "shared", "none"
    caps: dict


_config: _Config | None = None
_config_lock = threading.Lock()


def _python_executable() -> str:
    return os.path.realpath(os.environ.get("TURNRL_SANDBOX_PYTHON") or sys.executable)


def _interpreter_roots(python: str) -> list[str]:
    roots = [os.path.dirname(os.path.dirname(python))]  # <prefix>/bin/python3.x -> <prefix>
    if not os.environ.get("TURNRL_SANDBOX_PYTHON"):
        roots.append(os.path.realpath(sys.base_prefix))
    out: list[str] = []
    for r in sorted(set(roots), key=len):
        if not any(r == o or r.startswith(o + "/") for o in out):
            out.append(r)
    return out


# Top-level entries a program may see (read-only): the system. Everything else at the top level
# (/work, /home, /root, /run, /var, /opt, /mnt, /srv, files, ...) is covered by the jail.
_SYSTEM_TOP = frozenset({"bin", "sbin", "lib", "lib32", "lib64", "libx32", "usr", "etc", "dev",
                         "proc", "sys", "tmp"})


def _hide_plan(python: str) -> tuple[str, bool, list[str], list[str]]:
    """(plan for the boot helper, whether dropping root needs the jail, the hidden paths, the
    top-level paths that cannot be hidden). The plan covers folders with a tmpfs and
    re-exposes the interpreter's paths inside them."""
    roots = _interpreter_roots(python)
    hidden: dict[str, list[str]] = {}
    tmp = os.path.realpath(tempfile.gettempdir())
    if os.geteuid() == 0:
        # The first ancestor an unprivileged uid cannot traverse (no o+x), e.g. /root.
        for root in roots:
            parts = root.strip("/").split("/")
            for i in range(1, len(parts) + 1):
                d = "/" + "/".join(parts[:i])
                try:
                    if not os.stat(d).st_mode & 0o001:
                        hidden.setdefault(d, []).append(os.path.relpath(root, d) if d != root
                                                        else "")
                        break
                except OSError:
                    break
    else:
        home = os.path.realpath(os.path.expanduser("~"))
        if home not in ("/", "") and os.path.isdir(home):
            hidden[home] = [os.path.relpath(r, home) for r in roots
                            if r.startswith(home + "/")]
    # As root, the uid drop needs the jail when the interpreter is in a folder others cannot enter.
    need_fs = os.geteuid() == 0 and bool(hidden)
    try:
        top = sorted(os.listdir("/"))
    except OSError:
        top = []
    for name in top:
        d = "/" + name
        if name in _SYSTEM_TOP or os.path.islink(d):  # a link leads to the system or a hidden path
            continue
        for inner in [h for h in hidden if h.startswith(d + "/")]:
            del hidden[inner]  # covered by d, whose re-exposed paths are recomputed here
        hidden[d] = ["" if r == d else os.path.relpath(r, d) for r in roots
                     if r == d or r.startswith(d + "/")]
    plan, hidden_dirs, kept = [], [], []
    for d, keep in sorted(hidden.items()):
        if "" in keep or tmp == d or tmp.startswith(d + "/") or "|" in d or ";" in d:
            kept.append(d)  # cannot hide what we need whole, or the staging area
            continue
        plan.append("|".join([d, *keep]))
        hidden_dirs.append(d)
    return ";".join(plan), need_fs, hidden_dirs, kept


class _UidSlot:
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


def _kill_leftovers(sid: int, uid: int, rounds: int = 5) -> int:
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


def _count_tasks_of(uid: int) -> int:
    n = 0
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                if os.stat(f"/proc/{p}").st_uid == uid:
                    n += len(os.listdir(f"/proc/{p}/task"))
            except OSError:
                pass
    return n


# --- launching -------------------------------------------------------------------------------
@dataclass
class _Raw:
    stdout: bytes
    stderr: bytes
    status: list[str]
    returncode: int | None
    timed_out: bool
    flooded: bool


def _launch(cfg_python: str, layers, hide: str, need_fs: bool, code: str, limits: SandboxLimits,
            strict: bool, uid: int, nproc: int) -> _Raw:
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
            f.write(_BOOT)
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


def _collect(proc: subprocess.Popen, status_fd: int, deadline: float, limits: SandboxLimits,
             uid: int, pidns: bool) -> _Raw:
    cap = max(64 * 1024, 16 * int(limits.max_output_chars))
    out_fd, err_fd = proc.stdout.fileno(), proc.stderr.fileno()
    bufs = {out_fd: bytearray(), err_fd: bytearray()}
    poller = select.poll()
    for fd in bufs:
        poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
    try:  # readable once the helper exits: no polling loop needed
        pidfd = os.pidfd_open(proc.pid)
        poller.register(pidfd, select.POLLIN)
    except (AttributeError, OSError):
        pidfd = -1
    open_fds, total = set(bufs), 0
    exited = timed_out = flooded = leftover = False

    def read_ready(wait_s: float) -> bool:
        nonlocal total, flooded, exited
        events = poller.poll(max(0, int(wait_s * 1000 + 0.999)))
        for fd, _ in events:
            if fd == pidfd:
                exited = True
                poller.unregister(pidfd)
                continue
            try:
                data = os.read(fd, _READ_CHUNK)
            except BlockingIOError:
                continue
            if not data:
                poller.unregister(fd)
                open_fds.discard(fd)
                continue
            bufs[fd] += data[:max(0, cap - total)]
            total += len(data)
            flooded = flooded or total > cap
        return bool(events)

    try:
        while not (exited and not open_fds) and not flooded:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                timed_out = True
                break
            wait = remaining if pidfd >= 0 and not exited else min(remaining, 0.05)
            got = read_ready(wait)
            if pidfd < 0 and not exited:
                exited = _exited(proc.pid)
            if exited and open_fds and not got:
                # The helper is gone (with a pid namespace, so is everything it started), yet
                # something still holds the pipes open and is silent: leftovers to kill.
                leftover = True
                break
    finally:
        if pidfd >= 0:
            if not exited:
                poller.unregister(pidfd)
            os.close(pidfd)
            pidfd = -1
    if timed_out or flooded:
        _kill_group(proc)
    if not pidns or leftover:
        # No pid namespace to take leftovers down with it: kill the session's processes (and,
        # with a sandbox uid, everything running as that uid: it also catches setsid escapes).
        _kill_group(proc)
        _kill_leftovers(proc.pid, uid)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        proc.wait()
    # Drain what is left in the pipes (writers are dead), still bounded.
    end = time.monotonic() + 0.5
    while open_fds and not flooded and time.monotonic() < end:
        if not read_ready(0.05):
            break
    proc.stdout.close()
    proc.stderr.close()
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
    return _Raw(bytes(bufs[out_fd]), bytes(bufs[err_fd]),
                status.decode("utf-8", "replace").splitlines(),
                proc.returncode, timed_out, flooded)


# --- capabilities ----------------------------------------------------------------------------
_PROBE_CODE = r'''
import json, os, socket
r = {"uid": os.getuid(), "pid": os.getpid(), "cwd": os.getcwd()}
with open("probe.txt", "w") as f:
    f.write("ok")
s = socket.socket()
s.settimeout(0.2)
try:
    s.connect(("127.0.0.1", 9))
    r["loopback"] = "connected"
except OSError as e:
    r["loopback"] = e.errno
print(json.dumps(r))
'''


def _probe(python: str, layers, hide: str, need_fs: bool) -> tuple[set[str], dict] | None:
    limits = SandboxLimits(timeout_s=10.0, cpu_s=10, memory_mb=1024)
    slot = None
    try:
        if "drop" in layers:
            slot = _UidSlot()
        uid = slot.uid if slot else -1
        raw = _launch(python, layers, hide, need_fs, _PROBE_CODE, limits, strict=False, uid=uid,
                      nproc=64 if uid >= 0 else -1)
    except Exception:
        return None
    finally:
        if slot:
            slot.release()
    done = next((s[1:] for s in raw.status if s.startswith("L")), None)
    statuses = [s for s in raw.status if s.startswith("S")]
    if done is None or not statuses or statuses[-1] != "S0" or raw.timed_out:
        return None
    import json
    try:
        info = json.loads(raw.stdout.decode().strip().splitlines()[-1])
    except (ValueError, IndexError):
        return None
    return set(filter(None, done.split(","))), info


def _compute_config() -> _Config:
    t0 = time.monotonic()
    python = _python_executable()
    root = os.geteuid() == 0
    linux = sys.platform.startswith("linux")
    hide, need_fs, hidden_dirs, not_hidden = _hide_plan(python) if linux else ("", False, [], [])
    notes: list[str] = []
    attempts = []
    disabled = set(filter(None, os.environ.get("TURNRL_SANDBOX_DISABLE", "").split(",")))
    if linux:
        full = set(_ALL_LAYERS) - ({"userns", "capdrop"} if root else {"drop"})
        attempts = [full, full - {"jail", "proc", "drop"}, {"rlimits"}]
    else:
        attempts = [{"rlimits"}]
    attempts = [a - disabled for a in attempts]
    if disabled:
        notes.append(f"disabled by TURNRL_SANDBOX_DISABLE: {','.join(sorted(disabled))}")
    layers: set[str] = set()
    info: dict = {}
    probe_ok = False
    for want in attempts:
        res = _probe(python, want, hide, need_fs)
        if res is not None:
            layers, info = res
            probe_ok = True
            break
    else:
        notes.append("probe failed: every run will report a sandbox error")
    if "jail" not in layers:
        hide, hidden_dirs = "", []
    elif not_hidden:
        notes.append(f"visible read-only (the interpreter or the staging directory is inside): "
                     f"{', '.join(not_hidden)}")
    if root and "drop" not in layers:
        notes.append("running as root without a uid drop: the program can write any file, signal"
                     " host processes outside a pid namespace, and RLIMIT_NPROC does not apply")
    if not root and "userns" not in layers:
        notes.append("no user namespace: mount/net/pid namespaces unavailable without root")
    if "netns" not in layers:
        notes.append("no network namespace: the program has the host's network")
    if "pidns" not in layers:
        notes.append("no pid namespace: leftovers that leave the session are found by their uid"
                     if "drop" in layers else
                     "no pid namespace and no own uid: a leftover that calls setsid() survives")
    if "jail" not in layers:
        notes.append("no mount jail: files writable by the sandbox uid stay writable")
    if "drop" in layers:
        nproc_mode = "uid"
    elif "userns" in layers:
        nproc_mode = "userns"
    elif root:
        nproc_mode = "none"
    else:
        nproc_mode = "shared"
    loopback = info.get("loopback")
    caps = {
        "platform": sys.platform,
        "euid": os.geteuid(),
        "python": python,
        "probe_ok": probe_ok,
        "process_group": True,
        "clean_env": True,
        "rlimits": "rlimits" in layers,
        "nproc_enforced": nproc_mode != "none",
        "user_namespace": "userns" in layers,
        "mount_namespace": "mntns" in layers,
        "readonly_filesystem": "jail" in layers,
        "private_tmp": "jail" in layers,
        "hidden_dirs": hidden_dirs,
        "private_proc": "proc" in layers,
        "network_namespace": "netns" in layers,
        "loopback_blocked": "netns" in layers and loopback != "connected",
        "pid_namespace": "pidns" in layers,
        "ipc_namespace": "ipcns" in layers,
        "drop_privileges": "drop" in layers,
        "sandbox_uids": [UID_BASE, UID_BASE + UID_POOL - 1] if "drop" in layers else None,
        "capabilities_dropped": "drop" in layers or "capdrop" in layers or not root,
        "no_new_privs": "nnp" in layers,
        "layers": sorted(layers),
        "notes": notes,
        "probe_ms": round((time.monotonic() - t0) * 1000, 1),
    }
    return _Config(python, frozenset(layers), hide, need_fs, nproc_mode, caps)


def _get_config() -> _Config:
    global _config
    if _config is None:
        with _config_lock:
            if _config is None:
                _config = _compute_config()
    return _config


def sandbox_capabilities() -> dict:
    """Which isolation layers work on this host (probed once by running a sandbox; cached)."""
    try:
        caps = dict(_get_config().caps)
        caps["notes"] = list(caps["notes"])
        return caps
    except Exception as e:  # never raise
        return {"probe_ok": False, "notes": [f"capability probe crashed: {type(e).__name__}: {e}"]}


# --- results -------------------------------------------------------------------------------------
_EXC_LINE = re.compile(r"^(SyntaxError|IndentationError|TabError)\b")


def _truncate_output(stdout: str, stderr: str, limit: int, cut: bool) -> str:
    """stdout head (+ stderr tail), at most `limit` characters of program output plus a marker."""
    limit = max(0, int(limit))
    if len(stdout) + len(stderr) <= limit and not cut:
        return stdout + stderr
    err_keep = min(len(stderr), max(limit // 2, limit - len(stdout)))
    out_keep = min(len(stdout), limit - err_keep)
    dropped = len(stdout) - out_keep + len(stderr) - err_keep
    marker = (f"\n[... output truncated: {dropped} more characters"
              + (", output limit reached, program killed" if cut else "") + " ...]\n")
    return stdout[:out_keep] + marker + (stderr[len(stderr) - err_keep:] if err_keep else "")


def _signal_reason(sig: int, limits: SandboxLimits) -> str:
    try:
        name = signal.Signals(sig).name
    except ValueError:
        name = f"signal {sig}"
    hint = {signal.SIGKILL: "; memory limit?", signal.SIGXCPU: f": cpu time limit {limits.cpu_s}s",
            signal.SIGXFSZ: f": file size limit {limits.max_file_mb} MB",
            signal.SIGSEGV: "; stack overflow or memory limit?"}.get(sig, "")
    return f"killed by signal {sig} ({name}{hint})"


def _make_result(raw: _Raw, limits: SandboxLimits, t0: float) -> SandboxResult:
    stdout = raw.stdout.decode("utf-8", "replace")
    stderr = raw.stderr.decode("utf-8", "replace")
    duration = time.monotonic() - t0
    setup = next((s[1:] for s in raw.status if s.startswith("E")), None)
    statuses = [s[1:] for s in raw.status if s.startswith("S")]
    exit_code: int | None = None
    if statuses:
        try:
            exit_code = os.waitstatus_to_exitcode(int(statuses[-1]))
        except ValueError:
            exit_code = None
    if raw.flooded:
        cap = max(64 * 1024, 16 * int(limits.max_output_chars))
        error = f"output limit exceeded ({cap} bytes); program killed"
    elif raw.timed_out:
        error = f"timeout after {limits.timeout_s}s"
    elif setup is not None:
        error = f"sandbox setup failed: {setup}"
    elif exit_code is None:
        rc = raw.returncode
        if "T" in raw.status:
            error = f"timeout after {limits.timeout_s}s (sandbox backstop)"
        elif rc is not None and rc < 0:
            error = f"sandbox helper killed by signal {-rc}"
        else:
            error = f"sandbox helper failed (exit {rc}): {stderr.strip()[-300:]}"
    elif exit_code < 0:
        error = _signal_reason(-exit_code, limits)
    elif exit_code != 0:
        last = next((l.strip() for l in reversed(stderr.splitlines()) if l.strip()), "")
        if last and ("Traceback (most recent call last):" in stderr or _EXC_LINE.match(last)):
            error = last if len(last) <= 300 else last[:297] + "..."
        else:
            error = f"exit code {exit_code}"
    else:
        error = None
    ok = error is None
    if raw.timed_out or raw.flooded:
        exit_code = None
    output = _truncate_output(stdout, "" if ok else stderr, limits.max_output_chars, raw.flooded)
    return SandboxResult(ok, output, error, exit_code, duration)


# --- public API ----------------------------------------------------------------------------------
def run_python(code: str, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Run `code` as a fresh Python program in the sandbox. Never raises (except KeyboardInterrupt
    and the like): every failure comes back as ok=False with an error string."""
    t0 = time.monotonic()
    slot = None
    try:
        if not isinstance(code, str):
            raise TypeError(f"code must be str, not {type(code).__name__}")
        cfg = _get_config()
        if not cfg.caps.get("probe_ok"):
            return SandboxResult(False, "", "sandbox unavailable: " + "; ".join(cfg.caps["notes"]),
                                 None, time.monotonic() - t0)
        uid = -1
        if "drop" in cfg.layers:
            slot = _UidSlot()
            uid = slot.uid
        nproc = max(1, int(limits.max_processes))
        if cfg.nproc_mode == "shared":  # counted across all our uid's processes and threads
            nproc += _count_tasks_of(os.getuid())
        elif cfg.nproc_mode == "none":
            nproc = -1
        raw = _launch(cfg.python, cfg.layers, cfg.hide, cfg.need_fs_for_drop, code, limits,
                      strict=True, uid=uid, nproc=nproc)
        return _make_result(raw, limits, t0)
    except Exception as e:
        return SandboxResult(False, "", f"sandbox error: {type(e).__name__}: {e}", None,
                             time.monotonic() - t0)
    finally:
        if slot is not None:
            slot.release()


def run_many(codes: list[str], limits: SandboxLimits = SandboxLimits(),
             max_workers: int = 2) -> list[SandboxResult]:
    """run_python over `codes` with a thread pool (each call its own process); order preserved."""
    codes = list(codes)
    if not codes:
        return []
    _get_config()  # probe once, before the threads race for it
    with ThreadPoolExecutor(max_workers=max(1, min(int(max_workers), len(codes)))) as pool:
        return list(pool.map(lambda c: run_python(c, limits), codes))
