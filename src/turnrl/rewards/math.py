"""Math answer rewards on top of math-verify.

``extract_answer`` finds the model's final answer (the last ``<answer>...</answer>`` or the last
balanced ``\\boxed{...}``); ``grade_math`` parses it and the reference with ``math_verify.parse``
and compares them with ``math_verify.verify`` (symbolic and numeric equivalence: fractions vs
decimals, radicals, intervals, sets, matrices, degrees, ``\\text{(C)}`` vs ``C`` ...).

Timeouts: math-verify bounds parsing and comparison with ``signal.alarm``, which only works in
the main thread. In the main thread (no alarm of the caller's pending) it is used as is, with
:data:`TIMEOUT_SECONDS` per step. Elsewhere (Ray actor threads, thread pools, Prefect task
runners) the parse/verify step runs in a reused worker process where the same timeouts work
and which is killed if it overruns, so a pathological answer (``9^{9^{9^{9}}}``) costs seconds,
never a hang. Answers identical up to spacing/markup match without parsing; answers longer than
:data:`MAX_ANSWER_CHARS` are compared as strings only. ``grade_math`` never raises.

Imported as ``turnrl.rewards.math``; it does not shadow the standard library ``math`` (absolute
imports).
"""

from __future__ import annotations

import atexit
import logging
import re
import signal
import threading
from dataclasses import dataclass
from typing import Any

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify
from math_verify.errors import TimeoutException

__all__ = [
    "MathGrade",
    "extract_answer",
    "last_boxed",
    "balanced_close",
    "grade_math",
    "grade_any",
    "references",
    "is_equivalent",
    "math_reward",
    "MAX_ANSWER_CHARS",
    "TIMEOUT_SECONDS",
]

#: Seconds math-verify may spend on one parse or one comparison (main thread only).
TIMEOUT_SECONDS = 3
#: Longer extracted answers are compared as normalized strings, never parsed.
MAX_ANSWER_CHARS = 1000

# LaTeX first (boxed content is what we hand it), then plain expressions such as "1/2" or "0.5".
_EXTRACTION = (LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig())


class _DropTimeoutDisabled(logging.Filter):
    """math-verify logs a warning the first time its timeout is disabled; we disable it on
    purpose off the main thread, so drop just that message."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_DropTimeoutDisabled())


@dataclass(frozen=True)
class MathGrade:
    """The verdict on one response: ``correct``, the ``extracted`` answer (None if none was
    found) and a human-readable ``reason``."""

    correct: bool
    extracted: str | None
    reason: str

    @property
    def reward(self) -> float:
        return 1.0 if self.correct else 0.0


# --------------------------------------------------------------------------- extraction
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_BOXED = re.compile(r"\\boxed\s*\{")


def balanced_close(text: str, open_idx: int) -> int | None:
    """Index of the ``}`` closing the ``{`` at ``open_idx`` (escaped ``\\{ \\}`` skipped)."""
    depth = 0
    i = open_idx
    n = len(text)
    while i < n:
        ch = text[i]
        if ch == "\\":
            i += 2  # skip the escaped character (\{, \}, \\)
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    return None


def _last_boxed_span(text: str) -> tuple[int, str] | None:
    """(start, content) of the last balanced ``\\boxed{...}``, or None."""
    for m in reversed(list(_BOXED.finditer(text))):
        close = balanced_close(text, m.end() - 1)
        if close is not None:
            return m.start(), text[m.end() : close]
    return None


def last_boxed(text: str | None) -> str | None:
    """Content of the last balanced ``\\boxed{...}`` (nested braces handled), or None.

    >>> last_boxed(r"so \\boxed{\\frac{1}{2}} and \\boxed{3")
    '\\\\frac{1}{2}'
    """
    if not text:
        return None
    span = _last_boxed_span(text)
    return None if span is None else span[1].strip()


def extract_answer(text: str | None) -> str | None:
    """The model's final answer: the content of the last ``<answer>...</answer>`` or of the last
    balanced ``\\boxed{...}``, whichever starts last (so a ``\\boxed{}`` inside the answer tag
    wins); stripped of surrounding whitespace. None if there is neither.

    >>> extract_answer(r"first \\boxed{1}, then <answer>2</answer>")
    '2'
    >>> extract_answer(r"<answer>x</answer> on reflection \\boxed{\\frac{1}{2}}")
    '\\\\frac{1}{2}'
    >>> extract_answer("no marker") is None
    True
    """
    if not text:
        return None
    try:
        tag = None
        for tag in _ANSWER_TAG.finditer(text):
            pass
        boxed = _last_boxed_span(text)
        if tag is None and boxed is None:
            return None
        if boxed is not None and (tag is None or boxed[0] >= tag.start()):
            return boxed[1].strip()
        return tag.group(1).strip()  # type: ignore[union-attr]
    except Exception:  # noqa: BLE001 - never raise from a reward
        return None


# --------------------------------------------------------------------------- grading
_MATH_DELIMS = (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]"))


def _clean(ans: str) -> str:
    """Unwrap what the answer is wrapped in: an inner ``\\boxed{}``, ``$...$``, a final period."""
    s = ans.strip()
    inner = last_boxed(s)
    if inner is not None:
        s = inner
    for left, right in _MATH_DELIMS:
        if len(s) > len(left) + len(right) and s.startswith(left) and s.endswith(right):
            s = s[len(left) : -len(right)].strip()
            break
    return s.rstrip(" .").strip()


_TEXT_CMD = re.compile(r"\\(?:text|textbf|textit|textnormal|mathrm|mathbf|mbox|operatorname)\s*\{([^{}]*)\}")


def _norm_str(s: str) -> str:
    """A conservative string normal form for answers math-verify cannot parse (words, labels)."""
    s = _TEXT_CMD.sub(r"\1", s)
    s = s.replace("\\left", "").replace("\\right", "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    for tok in ("\\!", "\\,", "\\;", "\\:", "\\ ", "$"):
        s = s.replace(tok, "")
    return re.sub(r"\s+", "", s).rstrip(".")


def _signal_timeout_usable() -> bool:
    """math-verify's SIGALRM timeout works here: main thread, POSIX, no alarm of the caller's pending."""
    if threading.current_thread() is not threading.main_thread():
        return False
    try:
        return signal.getitimer(signal.ITIMER_REAL)[0] == 0
    except (AttributeError, OSError, ValueError):  # no SIGALRM on this platform
        return False


def _parse(ans: str, timeout: int | None) -> list[Any]:
    """math-verify's parse of one answer; prefers a result with a sympy object.

    Tried as ``\\boxed{ans}`` (math-verify's strongest anchor), then ``$ans$`` (handles e.g.
    ``10\\%``), then bare (plain expressions like ``1/2``). Falls back to string matches. A
    timeout stops the search (the other wrappings would time out too).
    """
    fallback: list[Any] = []
    for cand in (f"\\boxed{{{ans}}}", f"${ans}$", ans):
        try:
            res = parse(cand, extraction_config=_EXTRACTION, parsing_timeout=timeout, raise_on_error=True)
        except TimeoutException:
            break
        except Exception:  # noqa: BLE001 - unparseable in this wrapping: try the next
            continue
        if any(not isinstance(x, str) for x in res):
            return res
        if res and not fallback:
            fallback = res
    return fallback


_GOLD_CACHE: dict[str, list[Any]] = {}
_GOLD_CACHE_SIZE = 4096


def _parse_reference(ref: str, timeout: int | None) -> list[Any]:
    """``_parse`` for references, memoized: the n samples of a group share one reference."""
    hit = _GOLD_CACHE.get(ref)
    if hit is not None:
        return hit
    res = _parse(ref, timeout)
    if res:  # never memoize a failure (it may have been a timeout on a busy machine)
        if len(_GOLD_CACHE) >= _GOLD_CACHE_SIZE:
            _GOLD_CACHE.pop(next(iter(_GOLD_CACHE)))
        _GOLD_CACHE[ref] = res
    return res


def _short(s: str, n: int = 80) -> str:
    return s if len(s) <= n else s[: n - 3] + "..."


def _compare_symbolic(a: str, r: str, timeout: int | None) -> tuple[bool, str]:
    """math-verify's verdict on two cleaned answers (``timeout``: seconds per step, None = none)."""
    gold = _parse_reference(r, timeout)
    pred = _parse(a, timeout)
    if not pred:
        return False, f"parse failed: could not parse answer {_short(a)}"
    if not gold:
        return False, f"parse failed: could not parse reference {_short(r)}"
    try:
        ok = bool(verify(gold, pred, timeout_seconds=timeout))
    except (Exception, TimeoutException):  # noqa: BLE001
        return False, "parse failed: comparison error"
    if ok:
        return True, "equivalent to reference"
    return False, f"not equivalent: got {_short(a)}, expected {_short(r)}"


def _malformed(answer: str) -> bool:
    """Stray tags, or more closing than opening brackets (any kind: "(0, 1]" is fine)."""
    if "</" in answer or "<answer" in answer:
        return True
    stripped = answer.replace("\\{", "").replace("\\}", "")
    depth = 0
    for ch in stripped:
        depth += ch in "([{"
        depth -= ch in ")]}"
        if depth < 0:
            return True
    return depth != 0


def _compare(answer: str, reference: str, *, string_shortcut: bool = True) -> tuple[bool, str]:
    """(equivalent?, reason) for two already-extracted answers.

    Identical answers up to spacing and ``\\text``/``\\left`` markup match without parsing
    (``string_shortcut``); everything else goes through math-verify: in this thread with its
    signal timeout when that is possible, otherwise in a worker process (see ``_IsolatedWorker``).
    """
    a, r = _clean(answer), _clean(reference)
    if not a:
        return False, "no answer found"
    if not r:
        return False, "parse failed: empty reference"
    if string_shortcut and _norm_str(a) == _norm_str(r):
        return True, "equivalent to reference"
    if _malformed(a):
        # math-verify reads a number out of almost anything ("3)</)</>60" parses as 3): a
        # policy must not learn to be rewarded for such text
        return False, f"malformed answer: {_short(a)} (stray markup or unbalanced brackets)"
    if len(a) > MAX_ANSWER_CHARS or len(r) > MAX_ANSWER_CHARS:
        return False, f"not equivalent: got {_short(a)}, expected {_short(r)} (too long to parse)"
    if _signal_timeout_usable():
        return _compare_symbolic(a, r, TIMEOUT_SECONDS)
    return _isolated_compare(a, r)


# --------------------------------------------------------------------------- off the main thread
# SIGALRM cannot interrupt a thread, and a model can write answers that make sympy run for
# minutes (power towers, deeply nested input). Off the main thread the comparison therefore
# runs in a small worker process, where math-verify's own timeouts work (its main thread), and
# the worker is killed if it overruns anyway. Workers are started on demand (one per
# concurrently grading thread), reused, and exit when their stdin closes.
_WORKER_CMD = "from turnrl.rewards.math import _worker_main; _worker_main()"
_WORKER_START_SECONDS = 120.0
_idle_workers: list["_IsolatedWorker"] = []
_workers_lock = threading.Lock()


def _worker_main() -> None:
    """Worker loop: one JSON request per stdin line -> one JSON verdict per stdout line."""
    import json
    import sys

    out = sys.stdout
    sys.stdout = sys.stderr  # nothing but verdicts may reach the protocol stream
    out.write("ready\n")
    out.flush()
    for line in sys.stdin:
        try:
            req = json.loads(line)
            ok, reason = _compare_symbolic(req["a"], req["r"], int(req["timeout"]))
        except BaseException as exc:  # noqa: BLE001
            ok, reason = False, f"parse failed: {type(exc).__name__}"
        out.write(json.dumps({"ok": ok, "reason": reason}) + "\n")
        out.flush()


class _IsolatedWorker:
    """One worker process speaking JSON lines over pipes."""

    def __init__(self) -> None:
        import os
        import subprocess
        import sys
        from pathlib import Path

        env = dict(os.environ)
        src = str(Path(__file__).resolve().parents[2])  # the directory holding the turnrl package
        env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _WORKER_CMD],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            bufsize=1,
            env=env,
        )
        if self._readline(_WORKER_START_SECONDS) != "ready":
            self.kill()
            raise RuntimeError("math-verify worker did not start")

    def _readline(self, timeout: float) -> str | None:
        import select

        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            return None
        line = self.proc.stdout.readline()
        return line.strip() if line else None

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        try:
            self.proc.kill()
            self.proc.wait(timeout=5)
        except Exception:  # noqa: BLE001
            pass

    def compare(self, a: str, r: str, timeout: int) -> tuple[bool, str] | None:
        """The verdict, or None if the worker overran or died (it is then killed)."""
        import json

        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps({"a": a, "r": r, "timeout": timeout}) + "\n")
            self.proc.stdin.flush()
            # parse reference + parse answer + verify, each bounded in the worker, plus slack
            line = self._readline(3 * timeout + 5)
            if line:
                res = json.loads(line)
                return bool(res["ok"]), str(res["reason"])
        except Exception:  # noqa: BLE001 - broken pipe, bad output: treat like an overrun
            pass
        self.kill()
        return None


def _isolated_compare(a: str, r: str) -> tuple[bool, str]:
    with _workers_lock:
        worker = _idle_workers.pop() if _idle_workers else None
    if worker is None:
        try:
            worker = _IsolatedWorker()
        except Exception:  # noqa: BLE001 - cannot start processes here: compare in-thread, no timeout
            return _compare_symbolic(a, r, None)
    verdict = worker.compare(a, r, TIMEOUT_SECONDS)
    if verdict is None:
        return False, f"parse failed: timed out comparing {_short(a)} to {_short(r)}"
    with _workers_lock:
        _idle_workers.append(worker)
    return verdict


@atexit.register
def _stop_workers() -> None:
    with _workers_lock:
        while _idle_workers:
            _idle_workers.pop().kill()


def is_equivalent(answer: str | None, reference: Any) -> bool:
    """True if an already-extracted ``answer`` is mathematically equivalent to ``reference``.

    >>> is_equivalent("0.5", r"\\frac{1}{2}"), is_equivalent("2", "3")
    (True, False)
    """
    if answer is None:
        return False
    try:
        return _compare(str(answer), str(reference))[0]
    except Exception:  # noqa: BLE001
        return False


def grade_math(response_text: str | None, reference: Any) -> MathGrade:
    """Extract the final answer from ``response_text`` and compare it to ``reference``.

    Never raises: any failure is a ``correct=False`` grade whose ``reason`` says why
    ("no answer found", "equivalent to reference", "not equivalent: got X, expected Y",
    "parse failed: ...").

    >>> grade_math(r"... so the answer is \\boxed{\\dfrac{1}{2}}.", "0.5").correct
    True
    """
    try:
        extracted = extract_answer(response_text if isinstance(response_text, str) else None)
        if extracted is None or not extracted.strip():
            return MathGrade(False, extracted, "no answer found")
        ok, reason = _compare(extracted, "" if reference is None else str(reference))
        return MathGrade(ok, extracted, reason)
    except BaseException as exc:  # noqa: BLE001 - a reward must never take the trainer down
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        return MathGrade(False, None, f"parse failed: {type(exc).__name__}")


def references(example: dict) -> list[str]:
    """The acceptable answers of a data row: its `answers` list (any element is right), else
    `[answer]`."""
    answers = example.get("answers")
    if isinstance(answers, str):
        answers = [answers]
    out = [str(a) for a in (answers if answers is not None else []) if a is not None and str(a).strip()]
    answer = example.get("answer")
    if answer is not None and str(answer) not in out:
        out.insert(0, str(answer))
    return out


def grade_any(response_text: str | None, example: dict) -> MathGrade:
    """`grade_math` against each of the row's acceptable answers (`references`): correct if any
    matches; the grade returned is the first correct one, else the first answer's."""
    refs = references(example) or [""]
    first = None
    for ref in refs:
        grade = grade_math(response_text, ref)
        if grade.correct:
            return grade
        first = first or grade
        if grade.extracted is None:   # nothing to compare: the other answers cannot match either
            break
    return first


def math_reward(text: str | None, reference: Any) -> float:
    """1.0 if the response's final answer is equivalent to ``reference``, else 0.0."""
    return 1.0 if grade_math(text, reference).correct else 0.0
