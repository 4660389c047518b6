"""Hostile programs through the code tool, exactly as the trainer runs them.

Each case is a program the policy could write. It goes through `turnrl.envs.make("code_tool")`
and `env.step("<code>...</code>")`, like `turnrl.rollout.multi_turn` does, and the test then checks:

* the call came back within its time limit as an observation (an error or a harmless one),
* the host is untouched: canary files and folders the test owns (in the project and in /tmp),
  host shared memory, the test's listening sockets (TCP, UDP, a Unix socket), a victim process,
  the test process's environment; and no process of the program is left (checked in /proc),
* the environment keeps going: a normal tool call and an answer work right after,
* which isolation layer stopped it, read from the program's own report (errno names, the
  sandbox's error) and the active layers of `sandbox_capabilities()`.

`python tests/test_sandbox_hostile.py` prints the table (case | stopped by | outcome) that
docs/sandbox.md shows; under pytest it is printed at the end of the module.
"""
from __future__ import annotations

import os
import random
import re
import socket
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest

from turnrl import envs
from turnrl.envs.sandbox import sandbox_capabilities

from conftest import print_past_capture
from test_sandbox import _assert_nothing_left, _name_self   # name / find the program's processes

CAPS = sandbox_capabilities()
ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 3.0           # the env's wall-clock limit in this suite (params default: 5 s); a normal
                          # call must fit in it on a 2-core host shared with other jobs
SLACK_S = 1.5             # process start-up and teardown on that host
EXAMPLE = {"prompt": "Compute 347 * 8215.", "answer": "2850605"}


# --------------------------------------------------------------------------- the host
@dataclass
class Host:
    """What a hostile program could damage, set up by the test, checked after the call."""
    token: str
    canary: Path                 # a file in the project
    canary_dir: Path             # a folder in the project, with a file in it
    tmp_canary: Path             # a file in the host's /tmp
    shm_canary: Path             # a POSIX shared-memory object of the host (/dev/shm)
    secret_file: Path            # mode 0600, in the project
    unix_path: Path              # a listening Unix socket, connectable by anyone (0777)
    tcp: socket.socket           # listening on 0.0.0.0 (so 127.0.0.1 and the host's address)
    udp: socket.socket           # bound to 127.0.0.1
    abstract: socket.socket      # a listening abstract Unix socket
    unix: socket.socket          # listening on unix_path
    victim: subprocess.Popen     # an unrelated host process
    secret: str                  # in os.environ of the test process, and in secret_file
    snapshot: dict = field(default_factory=dict)

    @property
    def tcp_port(self) -> int:
        return self.tcp.getsockname()[1]

    @property
    def udp_port(self) -> int:
        return self.udp.getsockname()[1]

    def files(self) -> dict[str, tuple]:
        out = {}
        for p in (self.canary, self.canary_dir, *sorted(self.canary_dir.iterdir()), self.tmp_canary,
                  self.shm_canary, self.secret_file):
            st = p.stat()
            out[str(p)] = (st.st_mode, st.st_uid, st.st_mtime_ns, st.st_size,
                           p.read_bytes() if p.is_file() else None)
        return out


def _environ() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}  # pytest's own


def _host_address() -> str | None:
    """A non-loopback address of this host, if it has one."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))          # no packet is sent for UDP connect
            addr = s.getsockname()[0]
        return None if addr.startswith("127.") else addr
    except OSError:
        return None


@pytest.fixture
def host(monkeypatch):
    token = f"hx{random.randrange(10**9):09d}"   # fits a 15-character process name
    base = ROOT / f".hostile-{token}"
    base.mkdir()
    (base / "dir").mkdir()
    h = None
    try:
        canary, canary_dir = base / "canary.txt", base / "dir"
        canary.write_text("canary: the sandbox must not change me\n")
        (canary_dir / "inside.txt").write_text("inside\n")
        secret = f"s3cr3t-{token}"
        secret_file = base / "secret.txt"
        secret_file.write_text(secret + "\n")
        secret_file.chmod(0o600)
        tmp_canary = Path("/tmp") / f"turnrl-hostile-{token}"
        tmp_canary.write_text("host tmp canary\n")
        shm_canary = Path("/dev/shm") / f"turnrl-hostile-{token}"
        shm_canary.write_bytes(b"host shm canary\n")
        unix_path = base / "sock"
        unix = socket.socket(socket.AF_UNIX)
        unix.bind(str(unix_path))
        unix_path.chmod(0o777)
        unix.listen(8)
        tcp = socket.socket(socket.AF_INET)
        tcp.bind(("0.0.0.0", 0))
        tcp.listen(8)
        udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        udp.bind(("127.0.0.1", 0))
        abstract = socket.socket(socket.AF_UNIX)
        abstract.bind(f"\0turnrl-hostile-{token}")
        abstract.listen(8)
        for s in (unix, tcp, udp, abstract):
            s.setblocking(False)
        victim = subprocess.Popen(["sleep", "60"])
        monkeypatch.setenv("TURNRL_HOSTILE_SECRET", secret)
        h = Host(token, canary, canary_dir, tmp_canary, shm_canary, secret_file, unix_path, tcp, udp,
                 abstract, unix, victim, secret)
        h.snapshot = {"files": h.files(), "environ": _environ()}
        yield h
    finally:
        if h is not None:
            h.victim.kill()
            h.victim.wait()
            for s in (h.unix, h.tcp, h.udp, h.abstract):
                s.close()
        for p in (Path("/tmp") / f"turnrl-hostile-{token}", Path("/dev/shm") / f"turnrl-hostile-{token}"):
            p.unlink(missing_ok=True)
        subprocess.run(["rm", "-rf", str(base)], check=False)


# --------------------------------------------------------------------------- host checks
def _nothing_accepted(sock: socket.socket) -> bool:
    try:
        conn, _ = sock.accept()
    except BlockingIOError:
        return True
    conn.close()
    return False


def assert_host_untouched(h: Host) -> None:
    _assert_nothing_left(h.token)
    assert h.files() == h.snapshot["files"], "a host file or folder was changed"
    assert sorted(p.name for p in h.canary_dir.iterdir()) == ["inside.txt"]
    assert sorted(p.name for p in h.canary.parent.iterdir()) == ["canary.txt", "dir", "secret.txt", "sock"]
    assert not any(Path("/tmp").glob(f"*{h.token}*written*")), "a file appeared in the host's /tmp"
    assert _environ() == h.snapshot["environ"]
    for s in (h.tcp, h.unix, h.abstract):
        assert _nothing_accepted(s), f"the program connected to the host's {s.family.name} socket"
    with pytest.raises(BlockingIOError):
        h.udp.recvfrom(64)
    assert h.victim.poll() is None, "an unrelated host process was killed"


def assert_env_keeps_going(env) -> None:
    ok = env.step("<code>print(347 * 8215)</code>")
    assert ok.observation == "<output>2850605</output>" and ok.reward == 1.0, ok
    done = env.step("<answer>2850605</answer>")
    assert done.done and done.reward == 1.0


# --------------------------------------------------------------------------- the cases
# Shared helper for the programs: try an action, print "label:OK" or "label:<errno name>".
_TRY = """
import errno, os
def attempt(label, fn):
    try:
        r = fn()
        print(label + ':OK' + ('' if r is None else '=' + str(r)[:40]), flush=True)
        return True
    except OSError as e:
        print(label + ':' + errno.errorcode.get(e.errno, str(e.errno)), flush=True)
    except Exception as e:
        print(label + ':' + type(e).__name__, flush=True)
    return False
"""


@dataclass
class Case:
    name: str
    what: str                                     # the attack, for the table
    program: Callable[[Host], str]
    # (regex over the observation, layer it shows): every match names a layer that stopped it
    evidence: list[tuple[str, str]]
    needs: tuple[str, ...] = ()                   # capabilities the containment relies on
    forbidden: Callable[[Host], list[str]] = lambda h: []   # must never appear in the observation
    check: Callable[[Host, object, object], None] | None = None  # extra checks (host, result, env)


TIMEOUT = (r"timeout after", "wall-clock timeout, SIGKILL to the session (always)")
XCPU = (r"SIGXCPU", "rlimits: RLIMIT_CPU")


def _fork_bomb(h: Host) -> str:
    return _name_self(h.token) + """
import os, errno
n, first = 0, None
while True:
    try:
        os.fork()
        n += 1
    except OSError as e:
        if first is None:
            first = errno.errorcode[e.errno]
            print('fork refused:' + first, flush=True)
"""


def _fork_memory_bomb(h: Host) -> str:
    return _name_self(h.token) + """
import os, errno, time
children = 0
for i in range(64):
    try:
        pid = os.fork()
    except OSError as e:
        print('fork refused:%s after %d children' % (errno.errorcode[e.errno], children), flush=True)
        break
    if pid == 0:
        try:
            block = b'x' * (160 << 20)      # 160 MB, touched
            time.sleep(30)
        except MemoryError:
            pass
        os._exit(0)
    children += 1
time.sleep(0.3)
print('children=%d' % children, flush=True)
"""


def _check_fork_memory(h: Host, result, env) -> None:
    m = re.search(r"children=(\d+)", result.observation)
    assert m, result.observation
    # RLIMIT_NPROC counts the helper and the program: at most max_processes - 2 children, so the
    # program's memory is bounded by max_processes x memory_mb.
    assert int(m.group(1)) <= env.limits.max_processes - 2, result.observation


def _busy_threads(h: Host) -> str:
    return _name_self(h.token) + """
import threading
def spin():
    while True:
        pass
n = 0
try:
    for _ in range(500):
        threading.Thread(target=spin).start()
        n += 1
except RuntimeError as e:
    print('thread refused after %d: %s' % (n, e), flush=True)
spin()
"""


def _write_outside(h: Host) -> str:
    return _TRY + f"""
import shutil
canary, folder, tmp_canary = {str(h.canary)!r}, {str(h.canary_dir)!r}, {str(h.tmp_canary)!r}
attempt('overwrite', lambda: open(canary, 'w').write('pwned'))
attempt('append', lambda: open(canary, 'a').write('pwned'))
attempt('chmod', lambda: os.chmod(canary, 0o777))
attempt('utime', lambda: os.utime(canary, (0, 0)))
attempt('rename', lambda: os.rename(canary, canary + '.moved'))
attempt('delete', lambda: os.remove(canary))
attempt('rmtree', lambda: shutil.rmtree(folder))
attempt('new_in_project', lambda: open({str(ROOT / ('written-' + h.token))!r}, 'w').write('x'))
attempt('tmp_delete', lambda: os.remove(tmp_canary))
attempt('tmp_new', lambda: open('/tmp/{h.token}-written', 'w').write('x'))
attempt('var_tmp_new', lambda: open('/var/tmp/{h.token}-written', 'w').write('x'))
attempt('etc_new', lambda: open('/etc/{h.token}-written', 'w').write('x'))
"""


def _check_write_outside(h: Host, result, env) -> None:
    assert not (ROOT / f"written-{h.token}").exists()
    for d in ("/var/tmp", "/etc"):
        assert not (Path(d) / f"{h.token}-written").exists()
    # what the program could do happened in its own /tmp only
    assert "tmp_new:OK" in result.observation or not CAPS["private_tmp"], result.observation


def _read_host(h: Host) -> str:
    return _TRY + f"""
attempt('secret_file', lambda: open({str(h.secret_file)!r}).read())
attempt('params_yaml', lambda: open({str(ROOT / 'params.yaml')!r}).read(20))
attempt('tmp_canary', lambda: open({str(h.tmp_canary)!r}).read())
attempt('root_home', lambda: os.listdir('/root'))
"""


def _read_env(h: Host) -> str:
    return _TRY + """
print('environ=' + ','.join(sorted(os.environ)))
print('secret=' + str(os.environ.get('TURNRL_HOSTILE_SECRET')))
pids = [p for p in os.listdir('/proc') if p.isdigit()]
found = 0
for p in pids:
    try:
        found += b'TURNRL_HOSTILE_SECRET' in open('/proc/%s/environ' % p, 'rb').read()
    except OSError:
        pass
print('visible_pids=%d found_in_proc=%d' % (len(pids), found))
attempt('parent_environ', lambda: open('/proc/%d/environ' % os.getppid(), 'rb').read(40))
"""


def _network(h: Host) -> str:
    addr = _host_address()
    targets = [("127.0.0.1", h.tcp_port), ("localhost", h.tcp_port)] + ([(addr, h.tcp_port)] if addr else [])
    return _TRY + f"""
import socket
for host, port in {targets!r}:
    attempt('tcp_' + host, lambda: socket.create_connection((host, port), timeout=1).sendall(b'hi'))
attempt('tcp6_loopback', lambda: socket.create_connection(('::1', {h.tcp_port}), timeout=1))
def udp():
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    return s.sendto(b'hi', ('127.0.0.1', {h.udp_port}))
attempt('udp_loopback', udp)
attempt('dns', lambda: socket.getaddrinfo('pypi.org', 443))
attempt('internet', lambda: socket.create_connection(('1.1.1.1', 53), timeout=1))
"""


def _unix_sockets(h: Host) -> str:
    abstract = "\0turnrl-hostile-" + h.token
    return _TRY + f"""
import socket
def connect(addr):
    s = socket.socket(socket.AF_UNIX)
    s.connect(addr)
    s.sendall(b'hi')
attempt('unix_path', lambda: connect({str(h.unix_path)!r}))
attempt('unix_abstract', lambda: connect({abstract!r}))
"""


def _shared_memory(h: Host) -> str:
    return _TRY + f"""
attempt('shm_read', lambda: open('/dev/shm/turnrl-hostile-{h.token}', 'rb').read())
attempt('shm_overwrite', lambda: open('/dev/shm/turnrl-hostile-{h.token}', 'wb').write(b'pwned'))
attempt('shm_delete', lambda: os.remove('/dev/shm/turnrl-hostile-{h.token}'))
attempt('sysv_shm_list', lambda: open('/proc/sysvipc/shm').read().count(chr(10)) - 1)
"""


def _kill_parent(h: Host) -> str:
    return _TRY + f"""
import signal
attempt('kill_parent', lambda: os.kill(os.getppid(), signal.SIGKILL))
attempt('kill_trainer', lambda: os.kill({os.getpid()}, signal.SIGKILL))
attempt('kill_victim', lambda: os.kill({h.victim.pid}, signal.SIGKILL))
attempt('kill_pid1', lambda: os.kill(1, signal.SIGKILL))
attempt('kill_all', lambda: os.kill(-1, signal.SIGKILL))
print('still here', flush=True)
"""


def _leftovers(h: Host) -> str:
    return _name_self(h.token) + f"""
import os, signal, subprocess, time
subprocess.Popen(['sleep', '60', {h.token!r}], start_new_session=True, stdin=subprocess.DEVNULL,
                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
if os.fork() == 0:                    # double-fork daemon that keeps our stdout open
    os.setsid()
    if os.fork() == 0:
        for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
            signal.signal(s, signal.SIG_IGN)
        time.sleep(60)
    os._exit(0)
print('parent done', flush=True)
"""


def _escalate(h: Host) -> str:
    return _TRY + """
import subprocess
attempt('setuid0', lambda: os.setuid(0))
attempt('no_new_privs', lambda: [l for l in open('/proc/self/status') if l.startswith('NoNewPrivs')][0].split()[1])
def setuid_binary():  # mount is setuid root on most systems: with no_new_privs it runs as us
    r = subprocess.run(['mount', '-t', 'tmpfs', 'none', '/tmp'], capture_output=True, timeout=2)
    return 'exit %d' % r.returncode
attempt('setuid_mount', setuid_binary)
attempt('uid', lambda: os.getuid())
"""


def _fill_disk(h: Host) -> str:
    return _TRY + """
def fill(name, mb):
    with open(name, 'wb') as f:
        for _ in range(mb):
            f.write(b'0' * (1 << 20))
attempt('one_big_file', lambda: fill('/tmp/big', 64))
n = 0
def many_files():
    global n
    while True:
        fill('/tmp/part%d' % n, 15)
        n += 1
attempt('many_files', many_files)
print('files=%d' % n)
"""


CASES = [
    Case("infinite_loop", "`while True: pass`", lambda h: "while True:\n    pass\n",
         [TIMEOUT, XCPU]),
    Case("sleep_forever_stopped", "stops itself with SIGSTOP (never exits)",
         lambda h: "import os, signal\nos.kill(os.getpid(), signal.SIGSTOP)\n", [TIMEOUT]),
    Case("fork_bomb", "every process forks forever", _fork_bomb,
         [(r"fork refused:EAGAIN", "rlimits: RLIMIT_NPROC (own uid)"), TIMEOUT, XCPU],
         needs=("rlimits", "nproc_enforced")),
    Case("fork_memory_bomb", "64 children each touching 160 MB", _fork_memory_bomb,
         [(r"fork refused:EAGAIN", "rlimits: RLIMIT_NPROC x RLIMIT_AS bound the total"), TIMEOUT],
         needs=("rlimits", "nproc_enforced"), check=_check_fork_memory),
    Case("memory_bomb", "appends 32 MB blocks forever",
         lambda h: "x = []\nwhile True:\n    x.append(b'x' * (32 << 20))\n",
         [(r"MemoryError", "rlimits: RLIMIT_AS"), TIMEOUT], needs=("rlimits",)),
    Case("stdout_flood", "prints 1 kB lines forever", lambda h: "while True:\n    print('x' * 1000)\n",
         [(r"output limit exceeded", "bounded reader kills the program (always)")]),
    Case("stderr_binary_flood", "writes random bytes to stderr forever",
         lambda h: "import os\nwhile True:\n    os.write(2, os.urandom(65536))\n",
         [(r"output limit exceeded", "bounded reader kills the program (always)")]),
    Case("fill_disk", "writes a 64 MB file, then 15 MB files until the disk is full", _fill_disk,
         [(r"one_big_file:EFBIG", "rlimits: RLIMIT_FSIZE"),
          (r"many_files:ENOSPC", "jail: its /tmp is a small private tmpfs"), TIMEOUT], needs=("rlimits",)),
    Case("busy_threads", "starts 500 spinning threads", _busy_threads,
         [(r"thread refused", "rlimits: RLIMIT_NPROC counts threads"), XCPU, TIMEOUT], needs=("rlimits",)),
    Case("write_outside", "overwrites, chmods, renames, deletes project / host-/tmp canaries; new files "
         "in the project, /tmp, /var/tmp, /etc", _write_outside,
         [(r"overwrite:EROFS", "jail: read-only mounts"),
          (r"overwrite:ENOENT", "jail: host folders hidden (empty tmpfs)"),
          (r"overwrite:EACCES", "drop: unprivileged uid"),
          (r"tmp_delete:ENOENT", "jail: private /tmp")],
         needs=("readonly_filesystem",), check=_check_write_outside),
    Case("read_host_files", "reads a 0600 secret and params.yaml in the project, the host's /tmp, /root",
         _read_host,
         [(r"secret_file:ENOENT", "jail: host folders hidden (empty tmpfs)"),
          (r"secret_file:EACCES", "drop: unprivileged uid"),
          (r"tmp_canary:ENOENT", "jail: private /tmp")],
         needs=("readonly_filesystem",),
         forbidden=lambda h: [h.secret, "turnrl parameters"]),
    Case("read_parent_env", "reads os.environ, /proc/*/environ, the parent's environ", _read_env,
         [(r"environ=HOME,LANG,PATH,TMPDIR\n", "clean environment (always)"),
          (r"visible_pids=2 ", "proc: own /proc of the pid namespace"),
          (r"parent_environ:(EACCES|EPERM)", "drop: unprivileged uid")],
         forbidden=lambda h: [h.secret]),
    Case("network", "TCP to the test's listener on 127.0.0.1 / localhost / the host's address, ::1, "
         "UDP to 127.0.0.1, DNS, the internet", _network,
         [(r"tcp_127\.0\.0\.1:ENETUNREACH", "netns: no network, loopback down")],
         needs=("network_namespace",)),
    Case("unix_sockets", "connects to the test's Unix sockets (a 0777 path, an abstract name)", _unix_sockets,
         [(r"unix_path:ENOENT", "jail: host folders hidden (empty tmpfs)"),
          (r"unix_abstract:ECONNREFUSED", "netns: abstract sockets are per network namespace")],
         needs=("network_namespace", "readonly_filesystem")),
    Case("shared_memory", "overwrites / deletes the host's /dev/shm object, lists SysV segments",
         _shared_memory,
         [(r"shm_read:ENOENT", "jail: private /dev/shm"),
          (r"sysv_shm_list:OK=0", "ipcns: own IPC namespace")],
         needs=("readonly_filesystem",)),
    Case("kill_parent", "SIGKILL to its parent, the trainer, a host process, pid 1, and kill(-1)",
         _kill_parent,
         [(r"kill_trainer:ESRCH", "pidns: host processes cannot be named"),
          (r"kill_parent:OK[\s\S]*still here", "pidns: its parent is the namespace's init, which "
           "signals from inside cannot kill")],
         needs=("pid_namespace",), check=lambda h, result, env: _assert_ran(result)),
    Case("daemon_leftovers", "a setsid() double-fork daemon ignoring SIGTERM/SIGHUP and a new-session "
         "`sleep 60`, then exits", _leftovers,
         [(r"parent done", "pidns: the kernel kills the namespace when its init exits")],
         needs=("pid_namespace",)),
    Case("become_root", "setuid(0), a setuid-root binary (mount)", _escalate,
         [(r"setuid0:EPERM", "drop: unprivileged uid, no capabilities"),
          (r"no_new_privs:OK=1", "nnp: setuid binaries grant nothing")],
         needs=("drop_privileges",), check=lambda h, result, env: _assert_no_root(result)),
    Case("segfault", "dereferences NULL (ctypes)", lambda h: "import ctypes\nctypes.string_at(0)\n",
         [(r"SIGSEGV", "own process (always)")]),
]

def _assert_ran(result) -> None:
    assert result.info["tool_ok"], result.observation   # its parent, the helper, survived


def _assert_no_root(result) -> None:
    assert "uid:OK=0" not in result.observation and "setuid_mount:OK=exit 0" not in result.observation


TABLE: list[tuple[str, str, str, str]] = []


def _run_case(case: Case, h: Host):
    missing = [c for c in case.needs if not CAPS.get(c)]
    if missing:
        pytest.skip(f"{case.name} is only contained with the sandbox layer(s) {missing}, which this host "
                    f"lacks; notes: {CAPS.get('notes')}")
    env = envs.make("code_tool", timeout_s=TIMEOUT_S, max_output_chars=1000)
    env.reset(EXAMPLE)
    code = case.program(h)
    assert "</code>" not in code
    t0 = time.monotonic()
    result = env.step(f"<code>{code}</code>")
    elapsed = time.monotonic() - t0
    assert elapsed < TIMEOUT_S + SLACK_S, f"{case.name}: {elapsed:.1f}s"
    obs = result.observation
    assert not result.done and obs.startswith("<output>") and obs.endswith("</output>"), result
    assert len(obs) < 1000 + 300                       # the observation budget holds
    for text in case.forbidden(h):
        assert text not in obs, f"{case.name}: leaked {text!r}: {obs}"
    layers = [layer for pattern, layer in case.evidence if re.search(pattern, obs)]
    assert layers, f"{case.name}: no known layer shows in the observation: {obs}"
    if case.check:
        case.check(h, result, env)
    assert_host_untouched(h)
    assert_env_keeps_going(env)
    refused = sorted(set(re.findall(r"^[\w ]+:(?!OK)[A-Z][A-Za-z]*", obs[8:], re.M)))
    outcome = result.info["tool_error"] or (
        "returned; refused: " + ", ".join(refused) if refused else "returned normally")
    TABLE.append((case.name, case.what, "; ".join(dict.fromkeys(layers)), f"{outcome} ({elapsed:.1f} s)"))
    return result


@pytest.fixture(scope="module", autouse=True)
def _print_table(request):
    yield
    if TABLE:
        print_past_capture(request, "\n\n" + format_table())


def format_table() -> str:
    lines = [f"{len(TABLE)} hostile programs through envs.make('code_tool'); active layers: "
             f"{', '.join(CAPS.get('layers', []))}", "",
             "| case | attack | stopped by | outcome |", "|---|---|---|---|"]
    lines += [f"| {n} | {w} | {l} | {o} |" for n, w, l, o in TABLE]
    return "\n".join(lines)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_hostile_program_is_contained(case, host):
    _run_case(case, host)


def test_hostile_calls_beside_normal_ones_in_the_trainers_thread_pool(host):
    """The rollout loop steps environments from a thread pool: a fork bomb and a memory bomb in
    flight must not break the normal calls running beside them."""
    for needed in ("rlimits", "nproc_enforced", "pid_namespace"):
        if not CAPS.get(needed):
            pytest.skip(f"needs the sandbox layer {needed}; notes: {CAPS.get('notes')}")
    bombs = {0: _fork_bomb(host), 3: "x = []\nwhile True:\n    x.append(b'x' * (32 << 20))\n"}
    texts = [f"<code>{bombs[i]}</code>" if i in bombs else f"<code>print({i} * 1001)</code>"
             for i in range(6)]
    env_list = [envs.make("code_tool", timeout_s=TIMEOUT_S) for _ in texts]
    for e in env_list:
        e.reset(EXAMPLE)
    t0 = time.monotonic()
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda k: env_list[k].step(texts[k]), range(len(texts))))
    elapsed = time.monotonic() - t0
    for i, r in enumerate(results):
        if i in bombs:
            assert r.reward == 0.0 and r.observation.startswith("<output>Error:"), r
        else:
            assert r.observation == f"<output>{i * 1001}</output>" and r.reward == 1.0, r
    assert elapsed < 2 * (TIMEOUT_S + SLACK_S), elapsed
    assert_host_untouched(host)


def test_every_case_names_a_layer_the_sandbox_reports():
    """The table's layer names refer to layers sandbox_capabilities() knows."""
    known = {"always", "rlimits", "jail", "drop", "netns", "pidns", "proc", "ipcns", "nnp"}
    for case in CASES:
        for _, layer in case.evidence:
            assert any(k in layer for k in known), (case.name, layer)


if __name__ == "__main__":
    # Print the table without pytest's output capture: python tests/test_sandbox_hostile.py
    raise SystemExit(pytest.main([__file__, "-q", "-p", "no:cacheprovider", "-k", "contained"]))
