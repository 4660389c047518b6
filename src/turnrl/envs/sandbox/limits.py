"""The limits a sandboxed call runs under (`SandboxLimits`), what it returns (`SandboxResult`),
and how a raw run (the helper's output and wait status) becomes that result."""
from __future__ import annotations

import os
import re
import signal
import time
from dataclasses import dataclass

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



@dataclass
class RawRun:
    """What one run of the helper left: its output, its status lines, how it ended."""
    stdout: bytes
    stderr: bytes
    status: list[str]
    returncode: int | None
    timed_out: bool
    flooded: bool


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


def make_result(raw: RawRun, limits: SandboxLimits, t0: float) -> SandboxResult:
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
