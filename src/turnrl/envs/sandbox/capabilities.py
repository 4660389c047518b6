"""What the host allows: the isolation layers a probe run gets (tried strongest first), the
folders the jail hides, and the configuration every later call runs with (`get_config`, probed
once per process; `sandbox_capabilities()` reports it)."""
from __future__ import annotations

import json
import os
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

from turnrl.envs.sandbox.boot import ALL_LAYERS
from turnrl.envs.sandbox.runner import launch
from turnrl.envs.sandbox.limits import SandboxLimits
from turnrl.envs.sandbox.uids import UID_BASE, UID_POOL, UidSlot

# TURNRL_SANDBOX_DISABLE="netns,jail,..." leaves layers out (debugging; see boot.ALL_LAYERS).


@dataclass
class SandboxConfig:
    python: str
    layers: frozenset
    hide: str            # "dir|rel1|rel2;dir2|..." for the boot helper
    need_fs_for_drop: bool
    nproc_mode: str      # "uid" (own uid), "userns" (own user namespace), "shared", "none"
    caps: dict


_config: SandboxConfig | None = None
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
            slot = UidSlot()
        uid = slot.uid if slot else -1
        raw = launch(python, layers, hide, need_fs, _PROBE_CODE, limits, strict=False, uid=uid,
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
    try:
        info = json.loads(raw.stdout.decode().strip().splitlines()[-1])
    except (ValueError, IndexError):
        return None
    return set(filter(None, done.split(","))), info

def _compute_config() -> SandboxConfig:
    t0 = time.monotonic()
    python = _python_executable()
    root = os.geteuid() == 0
    linux = sys.platform.startswith("linux")
    hide, need_fs, hidden_dirs, not_hidden = _hide_plan(python) if linux else ("", False, [], [])
    notes: list[str] = []
    layers, info, probe_ok = _probe_layers(python, root, linux, hide, need_fs, notes)
    if "jail" not in layers:
        hide, hidden_dirs = "", []
    elif not_hidden:
        notes.append(f"visible read-only (the interpreter or the staging directory is inside): "
                     f"{', '.join(not_hidden)}")
    _note_missing_layers(layers, root, notes)
    if "drop" in layers:
        nproc_mode = "uid"
    elif "userns" in layers:
        nproc_mode = "userns"
    elif root:
        nproc_mode = "none"
    else:
        nproc_mode = "shared"
    caps = _capabilities(python, root, layers, info, probe_ok, nproc_mode, hidden_dirs, notes)
    caps["probe_ms"] = round((time.monotonic() - t0) * 1000, 1)
    return SandboxConfig(python, frozenset(layers), hide, need_fs, nproc_mode, caps)


def _probe_layers(python: str, root: bool, linux: bool, hide: str, need_fs: bool,
                  notes: list[str]) -> tuple[set[str], dict, bool]:
    """The strongest set of layers a probe run gets: (layers, what the probe saw, whether any
    probe worked)."""
    disabled = set(filter(None, os.environ.get("TURNRL_SANDBOX_DISABLE", "").split(",")))
    if linux:
        full = set(ALL_LAYERS) - ({"userns", "capdrop"} if root else {"drop"})
        attempts = [full, full - {"jail", "proc", "drop"}, {"rlimits"}]
    else:
        attempts = [{"rlimits"}]
    attempts = [a - disabled for a in attempts]
    if disabled:
        notes.append(f"disabled by TURNRL_SANDBOX_DISABLE: {','.join(sorted(disabled))}")
    for want in attempts:
        res = _probe(python, want, hide, need_fs)
        if res is not None:
            return res[0], res[1], True
    notes.append("probe failed: every run will report a sandbox error")
    return set(), {}, False


def _note_missing_layers(layers: set[str], root: bool, notes: list[str]) -> None:
    """What the program can still do without the layers this host lacks."""
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


def _capabilities(python: str, root: bool, layers: set[str], info: dict, probe_ok: bool, nproc_mode: str,
                  hidden_dirs: list[str], notes: list[str]) -> dict:
    loopback = info.get("loopback")
    return {
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
    }


def get_config() -> SandboxConfig:
    global _config
    if _config is None:
        with _config_lock:
            if _config is None:
                _config = _compute_config()
    return _config


def sandbox_capabilities() -> dict:
    """Which isolation layers work on this host (probed once by running a sandbox; cached)."""
    try:
        caps = dict(get_config().caps)
        caps["notes"] = list(caps["notes"])
        return caps
    except Exception as e:  # never raise
        return {"probe_ok": False, "notes": [f"capability probe crashed: {type(e).__name__}: {e}"]}

