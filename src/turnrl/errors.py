"""An exception as the one line a user reads: `Type: first line that says something`.

Every one-line error turnrl prints about an environment, an adapter's library or a stage's
failure goes through `one_line`, so none reads as an empty reason. Libraries write messages that
a plain `str(exc).splitlines()[0]` gets wrong: NLTK's LookupError (TextArena's Wordle without its
word list) starts with a blank line and a row of asterisks, some colour their names with ANSI
codes, and pydantic's ValidationError opens with a count ("1 validation error for ...").

This module imports nothing of turnrl: every layer may use it.
"""
from __future__ import annotations

import re

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_SAYS_SOMETHING = re.compile(r"\w")   # a line of only `****` or `----` is decoration


def first_line(exc: BaseException | str) -> str:
    """The first line of the exception's message that has a letter or digit in it, ANSI colour
    codes removed and whitespace collapsed; "" when the message has none."""
    text = exc if isinstance(exc, str) else _message(exc)
    for line in _ANSI.sub("", text).splitlines():
        if _SAYS_SOMETHING.search(line):
            return " ".join(line.split())
    return ""


def one_line(exc: BaseException, limit: int = 300) -> str:
    """`Type: first line` (just `Type` when the message says nothing), at most `limit` characters
    of message."""
    name = type(exc).__name__
    text = first_line(exc)
    if len(text) > limit:
        text = text[:max(0, limit - 3)] + "..."
    return f"{name}: {text}" if text else name


def _message(exc: BaseException) -> str:
    errors = getattr(exc, "errors", None)
    if callable(errors) and type(exc).__name__ == "ValidationError":   # pydantic's: each field and why
        try:
            return "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in errors()[:3])
        except Exception:   # noqa: BLE001 - fall back to its text
            pass
    try:
        return str(exc)
    except Exception:   # noqa: BLE001 - a __str__ that raises still leaves the type
        return ""


class Terminated(KeyboardInterrupt):
    """SIGTERM (a scheduler's stop, `kill`, `docker stop`), raised in the main thread where the
    program asked for it (`raise_on_sigterm`): every cleanup Ctrl-C runs, runs (the MLflow run
    closed as killed, Ray's actors stopped), and the program says so in one line."""


def raise_on_sigterm() -> None:
    """From now on SIGTERM raises Terminated in the main thread (call it from there)."""
    import signal

    def handler(signum, frame):
        raise Terminated(f"signal {signum}")
    signal.signal(signal.SIGTERM, handler)
