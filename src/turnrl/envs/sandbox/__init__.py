"""Run untrusted, model-written Python in a fresh, limited, isolated process.

    result = run_python("print(6 * 7)")            # SandboxResult(ok=True, output="42\\n", ...)
    results = run_many([code_a, code_b], limits)   # a thread pool, one process per call, order kept

Every call starts a new interpreter (the current one, ``-I -S``: isolated mode, no site-packages,
so only the standard library is importable) in its own session, with a clean environment,
stdin=/dev/null, a fresh working directory and bounded output capture. What else holds depends on
the host; ``sandbox_capabilities()`` probes once and reports the active layers. On a Linux host
where we are root (our container) the full stack is:

* setup helper (boot.py): unshares mount, network, pid and IPC namespaces (ctypes
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


Where each part lives: `limits` (SandboxLimits, SandboxResult, how a run becomes a result),
`boot` (the setup helper's source: namespaces, jail, rlimits, privilege drop), `runner` (one
process: staging, output capture, deadline, leftovers), `uids` (per-call uid slots, leftover
processes), `capabilities` (the host probe and the configuration calls run with); this module
holds the public API.
"""
from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor

from turnrl.envs.sandbox.capabilities import get_config, sandbox_capabilities
from turnrl.envs.sandbox.runner import MARKER, launch
from turnrl.envs.sandbox.limits import SandboxLimits, SandboxResult, make_result
from turnrl.envs.sandbox.uids import UID_BASE, UID_POOL, UidSlot, count_tasks_of

__all__ = ["SandboxLimits", "SandboxResult", "run_python", "run_many", "sandbox_capabilities",
           "MARKER", "UID_BASE", "UID_POOL"]


def run_python(code: str, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Run `code` as a fresh Python program in the sandbox. Never raises (except KeyboardInterrupt
    and the like): every failure comes back as ok=False with an error string."""
    t0 = time.monotonic()
    slot = None
    try:
        if not isinstance(code, str):
            raise TypeError(f"code must be str, not {type(code).__name__}")
        cfg = get_config()
        if not cfg.caps.get("probe_ok"):
            return SandboxResult(False, "", "sandbox unavailable: " + "; ".join(cfg.caps["notes"]),
                                 None, time.monotonic() - t0)
        uid = -1
        if "drop" in cfg.layers:
            slot = UidSlot()
            uid = slot.uid
        nproc = max(1, int(limits.max_processes))
        if cfg.nproc_mode == "shared":  # counted across all our uid's processes and threads
            nproc += count_tasks_of(os.getuid())
        elif cfg.nproc_mode == "none":
            nproc = -1
        raw = launch(cfg.python, cfg.layers, cfg.hide, cfg.need_fs_for_drop, code, limits,
                      strict=True, uid=uid, nproc=nproc)
        return make_result(raw, limits, t0)
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
    get_config()  # probe once, before the threads race for it
    with ThreadPoolExecutor(max_workers=max(1, min(int(max_workers), len(codes)))) as pool:
        return list(pool.map(lambda c: run_python(c, limits), codes))
