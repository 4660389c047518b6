"""Hostile and ordinary programs through turnrl.envs.sandbox.

Each test states which isolation layer it relies on and skips (saying which layer is missing)
when sandbox_capabilities() reports that layer unavailable on this host.
"""
from __future__ import annotations

import os
import random
import re
import signal
import socket
import statistics
import subprocess
import time
from pathlib import Path

import pytest

from turnrl.envs.sandbox import (SandboxLimits, SandboxResult, run_many, run_python,
                                 sandbox_capabilities)

CAPS = sandbox_capabilities()


def needs(*layers: str):
    missing = [l for l in layers if not CAPS.get(l)]
    return pytest.mark.skipif(bool(missing), reason=f"sandbox layer(s) unavailable on this host: "
                                                    f"{', '.join(missing)}; "
                                                    f"notes: {CAPS.get('notes')}")


def needs_any(*layers: str):
    ok = any(CAPS.get(l) for l in layers)
    return pytest.mark.skipif(not ok, reason=f"needs one of the sandbox layers {layers}, none "
                                             f"available here; notes: {CAPS.get('notes')}")


def _status(pid: str) -> dict[str, str]:
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                k, _, v = line.partition(":")
                out[k] = v.strip()
    except OSError:
        pass
    return out


def _token() -> str:
    return f"sbx{random.randrange(10**8):08d}"  # fits the 15-char process name


def _name_self(token: str) -> str:
    """Program prologue: rename the process; forked children inherit the name."""
    return (f"try:\n    open('/proc/self/comm', 'w').write({token!r})\n"
            f"except OSError:  # a read-only /proc\n"
            f"    import ctypes\n    ctypes.CDLL(None).prctl(15, {token!r}.encode(), 0, 0, 0)\n")


def _live_processes(token: str) -> list[str]:
    """Live (non-zombie) host processes named `token` or with `token` on their command line."""
    found = []
    for p in os.listdir("/proc"):
        if not p.isdigit() or int(p) == os.getpid():
            continue
        st = _status(p)
        if not st or st.get("State", "").startswith(("Z", "X")):
            continue
        hit = st.get("Name") == token
        try:
            with open(f"/proc/{p}/cmdline", "rb") as f:
                hit = hit or token.encode() in f.read()
        except OSError:
            pass
        if hit:
            found.append(f"{p} {st.get('Name')} uid={st.get('Uid')}")
    return found


def _assert_nothing_left(token: str) -> None:
    deadline = time.monotonic() + 2.0
    while True:
        left = _live_processes(token)
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert not left, f"sandbox processes survived: {left}"


def _field(output: str, name: str) -> str | None:
    m = re.search(rf"^{name}=(.*)$", output, re.M)
    return m.group(1).strip() if m else None


# --- ordinary programs ------------------------------------------------------------------------
def test_print_returns_ok_and_output():
    r = run_python("print('hello', 6 * 7)")
    assert isinstance(r, SandboxResult)
    assert r.ok and r.error is None and r.exit_code == 0
    assert r.output == "hello 42\n"
    assert 0 < r.duration_s < 5


def test_exception_gives_last_traceback_line():
    r = run_python("def f():\n    return 1 / 0\n\nprint('before')\nf()\n")
    assert not r.ok and r.exit_code == 1
    assert r.error == "ZeroDivisionError: division by zero"
    assert r.output.startswith("before\n")
    assert r.output.rstrip().splitlines()[-1] == "ZeroDivisionError: division by zero"
    assert 'File "main.py", line 2, in f' in r.output
    assert "<string>" not in r.output  # the sandbox's own frames are hidden


def test_syntax_error_and_exit_codes():
    r = run_python("x = (\n")
    assert not r.ok and r.error.startswith("SyntaxError"), r
    r = run_python("import sys\nprint('bye')\nsys.exit(3)")
    assert not r.ok and r.exit_code == 3 and r.error == "exit code 3" and "bye" in r.output
    r = run_python("raise SystemExit(0)")
    assert r.ok and r.exit_code == 0


def test_stdlib_tmp_and_subprocesses_work_inside():
    scratch = "/tmp/scratch.txt" if CAPS["private_tmp"] else "scratch.txt"  # never the host's /tmp
    code = (
        "import json, math, decimal, sqlite3, multiprocessing, subprocess, sys, tempfile, os\n"
        f"with open({scratch!r}, 'w') as f: f.write('ok')\n"
        "with tempfile.NamedTemporaryFile() as t: pass\n"
        "with multiprocessing.Pool(2) as p: print('pool', p.map(math.isqrt, [4, 9]))\n"
        "print('sub', subprocess.run([sys.executable, '-c', 'print(2+2)'], capture_output=True,"
        " text=True).stdout.strip())\n"
        "print(json.dumps({'pi': round(math.pi, 3)}), decimal.Decimal('0.1') * 3)\n"
    )
    r = run_python(code, SandboxLimits(timeout_s=10))
    assert r.ok, r
    assert "pool [2, 3]" in r.output and "sub 4" in r.output and '{"pi": 3.142} 0.3' in r.output


def test_capabilities_are_reported_and_cached():
    caps = sandbox_capabilities()
    assert caps["probe_ok"] and caps["process_group"]
    for key in ("network_namespace", "pid_namespace", "mount_namespace", "drop_privileges",
                "user_namespace", "readonly_filesystem", "notes", "layers"):
        assert key in caps
    assert sandbox_capabilities() == caps
    print("\nsandbox layers:", caps["layers"], "notes:", caps["notes"])


def test_errors_never_raise():
    r = run_python(None)  # type: ignore[arg-type]
    assert not r.ok and "TypeError" in r.error
    r = run_python("print('a')\x00")
    assert not r.ok and "null" in (r.error + r.output)
    r = run_python("print(1)", SandboxLimits(timeout_s="soon"))  # type: ignore[arg-type]
    assert not r.ok and r.error.startswith("sandbox error: ValueError")


def test_working_dir_is_fresh_and_removed(monkeypatch):
    from turnrl.envs.sandbox import runner as sandbox   # stages each call with tempfile.mkdtemp
    staged = []
    real_mkdtemp = sandbox.tempfile.mkdtemp

    def recording_mkdtemp(*args, **kwargs):
        staged.append(real_mkdtemp(*args, **kwargs))
        return staged[-1]

    monkeypatch.setattr(sandbox.tempfile, "mkdtemp", recording_mkdtemp)
    code = ("import os\nprint('cwd=' + os.getcwd())\n"
            "print('files=' + ','.join(sorted(os.listdir('.'))))\n"
            "open('left_behind.txt', 'w').write('x' * 1000)\n")
    a, b = run_python(code), run_python(code)
    assert a.ok and b.ok, (a, b)
    assert _field(b.output, "files") == "main.py"  # nothing from the previous call
    assert len(staged) == 2 and not any(os.path.exists(d) for d in staged)  # removed
    assert not (Path(_field(a.output, "cwd")) / "left_behind.txt").exists()


# --- limits -----------------------------------------------------------------------------------
def test_infinite_loop_times_out():
    limits = SandboxLimits(timeout_s=1.5, cpu_s=30)
    t0 = time.monotonic()
    r = run_python("while True:\n    pass\n", limits)
    elapsed = time.monotonic() - t0
    assert not r.ok and r.error == "timeout after 1.5s" and r.exit_code is None
    assert elapsed < limits.timeout_s + 1.0, elapsed


def test_timeout_keeps_partial_output_and_closed_stdout_still_times_out():
    r = run_python("import time\nprint('started')\ntime.sleep(60)\n", SandboxLimits(timeout_s=1))
    assert not r.ok and r.error.startswith("timeout") and "started" in r.output
    t0 = time.monotonic()
    r = run_python("import os\nos.close(1)\nos.close(2)\nwhile True:\n    pass\n",
                   SandboxLimits(timeout_s=1, cpu_s=30))
    assert not r.ok and r.error.startswith("timeout") and time.monotonic() - t0 < 2.0


@needs("rlimits")
def test_cpu_limit_kills_with_sigxcpu():
    r = run_python("while True:\n    pass\n", SandboxLimits(timeout_s=10, cpu_s=1))
    assert not r.ok and "SIGXCPU" in r.error and r.exit_code == -signal.SIGXCPU, r
    assert r.duration_s < 5


@needs("rlimits")
def test_memory_bomb_fails_cleanly():
    t0 = time.monotonic()
    r = run_python("x = bytearray(4 * 1024 ** 3)\nprint('allocated')\n")
    assert not r.ok and "MemoryError" in r.error and "allocated" not in r.output, r
    r = run_python("chunks = []\nwhile True:\n    chunks.append(bytearray(64 * 1024 * 1024))\n",
                   SandboxLimits(memory_mb=256))
    assert not r.ok and "MemoryError" in r.error, r
    assert time.monotonic() - t0 < 10


def test_output_flood_is_truncated_and_fast():
    limits = SandboxLimits(timeout_s=10, max_output_chars=2000)
    for code in ("while True:\n    print('x' * 1000)\n",
                 "import sys\nwhile True:\n    sys.stderr.write('y' * 1000)\n"):
        t0 = time.monotonic()
        r = run_python(code, limits)
        assert not r.ok and "output limit" in r.error, r.error
        assert "truncated" in r.output and len(r.output) <= 2000 + 200
        assert time.monotonic() - t0 < 3.0


def test_large_finite_output_is_truncated_with_marker():
    r = run_python("print('a' * 5000)\n", SandboxLimits(max_output_chars=200))
    assert r.ok and r.output.startswith("a" * 200)
    assert "[... output truncated: 4801 more characters ...]" in r.output
    # On error the traceback's tail survives truncation.
    r = run_python("print('b' * 5000)\nraise ValueError('the end')\n",
                   SandboxLimits(max_output_chars=200))
    assert not r.ok and r.output.rstrip().endswith("ValueError: the end")


@needs("rlimits")
def test_file_size_limit():
    r = run_python("open('big.bin', 'wb').write(b'0' * (3 * 1024 * 1024))\n",
                   SandboxLimits(max_file_mb=1))
    assert not r.ok and "File too large" in r.error, r


# --- processes --------------------------------------------------------------------------------
_FORK_BOMB = """
import os, time
n = 0
for _ in range(200):
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        if n % 2:
            os.execv('/bin/sleep', ['sleep', '60', TOKEN])
        time.sleep(60)
        os._exit(0)
    n += 1
print('forked=%d' % n, flush=True)
time.sleep(60)
"""


@needs("rlimits")
@needs_any("pid_namespace", "drop_privileges")
def test_fork_bomb_is_contained_and_nothing_left():
    token = _token()
    limits = SandboxLimits(timeout_s=2, max_processes=16)
    code = _name_self(token) + f"TOKEN = {token!r}\n" + _FORK_BOMB
    r = run_python(code, limits)
    assert not r.ok and r.error.startswith("timeout"), r
    forked = int(_field(r.output, "forked"))
    assert forked >= 2
    if CAPS["nproc_enforced"]:
        assert forked <= limits.max_processes, forked
    _assert_nothing_left(token)


@needs_any("pid_namespace", "drop_privileges")
def test_daemonized_leftovers_are_cleaned_up():
    token = _token()
    code = _name_self(token) + f"""
import os, subprocess, time
subprocess.Popen(['sleep', '60', {token!r}], start_new_session=True, stdin=subprocess.DEVNULL,
                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
if os.fork() == 0:          # classic double-fork daemon that keeps our stdout open
    os.setsid()
    if os.fork() == 0:
        time.sleep(60)
    os._exit(0)
print('parent done', flush=True)
"""
    t0 = time.monotonic()
    r = run_python(code, SandboxLimits(timeout_s=10))
    assert r.ok and "parent done" in r.output, r
    assert time.monotonic() - t0 < 3.0  # did not wait for the daemon holding stdout
    _assert_nothing_left(token)


@needs_any("pid_namespace", "drop_privileges")
def test_cannot_kill_parent_or_host_processes():
    victim = subprocess.Popen(["sleep", "30"])
    try:
        code = f"""
import os, signal
for target in (os.getppid(), {os.getpid()}, {victim.pid}, 1):
    try:
        os.kill(target, signal.SIGKILL)
        print('sent', target)
    except OSError as e:
        print('denied', target, e.errno)
try:
    os.kill(-1, signal.SIGKILL)   # everything we may signal (never ourselves)
except OSError as e:
    print('kill(-1) denied', e.errno)
print('still here')
"""
        r = run_python(code)
        assert isinstance(r, SandboxResult)
        time.sleep(0.2)
        assert victim.poll() is None, "a host process was killed from inside the sandbox"
        os.kill(os.getpid(), 0)  # and we are obviously alive
    finally:
        victim.kill()
        victim.wait()


# --- filesystem, environment, network ---------------------------------------------------------
@needs_any("drop_privileges", "readonly_filesystem")
def test_cannot_write_outside_its_directory(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("original")
    created = tmp_path / "created.txt"
    token = f"{random.randrange(10**9)}"
    host_tmp = Path("/tmp") / f"turnrl-escape-{token}"
    repo_file = Path(__file__).resolve().parent / f"escape-{token}.txt"
    code = f"""
for path, mode in (({str(victim)!r}, 'a'), ({str(victim)!r}, 'w'), ({str(created)!r}, 'w'),
                   ({str(host_tmp)!r}, 'w'), ({str(repo_file)!r}, 'w'),
                   ('/etc/turnrl-escape', 'w')):
    try:
        with open(path, mode) as f:
            f.write('pwned')
        print('wrote', path)
    except OSError as e:
        print('blocked', path, e.strerror)
"""
    try:
        r = run_python(code)
        assert r.ok, r
        assert victim.read_text() == "original"
        assert not created.exists() and not repo_file.exists()
        assert not Path("/etc/turnrl-escape").exists()
        if CAPS["private_tmp"]:
            assert not host_tmp.exists()
    finally:
        for p in (host_tmp, repo_file):  # only if the test failed
            p.unlink(missing_ok=True)
        if Path("/etc/turnrl-escape").is_file():
            Path("/etc/turnrl-escape").unlink()


def test_parent_environment_is_not_visible(monkeypatch):
    secret = f"s3cr3t-{random.randrange(10**9)}"
    monkeypatch.setenv("TURNRL_SANDBOX_TEST_SECRET", secret)
    code = """
import os
print('env=' + ','.join(sorted(os.environ)))
print('secret=' + str(os.environ.get('TURNRL_SANDBOX_TEST_SECRET')))
hits = []
for p in os.listdir('/proc'):
    try:
        with open('/proc/%s/environ' % p, 'rb') as f:
            if b'TURNRL_SANDBOX_TEST_SECRET' in f.read():
                hits.append(p)
    except OSError:
        pass
print('proc_hits=%d' % len(hits))
"""
    r = run_python(code)
    assert r.ok, r
    assert secret not in r.output
    assert _field(r.output, "secret") == "None"
    assert _field(r.output, "env") == "HOME,LANG,PATH,TMPDIR"
    if CAPS["private_proc"] or CAPS["drop_privileges"]:
        assert _field(r.output, "proc_hits") == "0"


@needs("network_namespace")
def test_loopback_connection_to_host_fails():
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.bind(("127.0.0.1", 0))
    srv.listen(5)
    srv.setblocking(False)
    port = srv.getsockname()[1]
    try:
        code = f"""
import socket
try:
    socket.create_connection(('127.0.0.1', {port}), timeout=2).sendall(b'hi')
    print('connected')
except OSError as e:
    print('blocked', e.errno, e.strerror)
try:
    socket.getaddrinfo('example.com', 80)
    print('resolved')
except OSError as e:
    print('no dns', e)
"""
        r = run_python(code)
        assert r.ok, r
        assert "connected" not in r.output and "blocked" in r.output
        assert "resolved" not in r.output
        with pytest.raises(BlockingIOError):
            srv.accept()
    finally:
        srv.close()


# --- many -------------------------------------------------------------------------------------
def test_run_many_preserves_order_and_runs_in_parallel():
    sleeps = [0.8, 0.6, 0.4, 0.2]  # later ones finish first
    codes = [f"import time\ntime.sleep({s})\nprint({i})\n" for i, s in enumerate(sleeps)]
    t0 = time.monotonic()
    results = run_many(codes, SandboxLimits(timeout_s=5), max_workers=4)
    elapsed = time.monotonic() - t0
    assert [r.output for r in results] == ["0\n", "1\n", "2\n", "3\n"]
    assert all(r.ok for r in results)
    assert elapsed < sum(sleeps) * 0.8, elapsed  # serial would take >= 2.0 s
    assert run_many([], SandboxLimits()) == []


def test_per_call_overhead():
    run_python("print(1)")
    times = []
    for _ in range(10):
        t0 = time.perf_counter()
        r = run_python("print(1)")
        times.append(time.perf_counter() - t0)
        assert r.ok and r.output == "1\n"
    median_ms = statistics.median(times) * 1000
    print(f"\nper-call overhead for print(1): median {median_ms:.1f} ms, "
          f"min {min(times) * 1000:.1f} ms")
    assert median_ms < 1000
