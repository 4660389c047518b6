"""Format rewards: small pure functions over the raw response text.

Tags are the plain ``<tag>...</tag>`` markers the environments use (``code``, ``output``,
``search``, ``answer``, ``result``). An opening tag may carry attributes (``<code lang="py">``);
matching is case-sensitive, like the environments' own parsers.

All functions accept any ``str`` (and ``None``, treated as empty text) and never raise.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from functools import lru_cache

__all__ = [
    "DEFAULT_TAGS",
    "xml_wellformed",
    "has_answer_tag",
    "format_reward",
    "tool_call_count",
]

#: Tags checked by :func:`xml_wellformed` when no ``tags`` are given.
DEFAULT_TAGS: tuple[str, ...] = ("code", "output", "search", "answer", "result")


@lru_cache(maxsize=64)
def _tag_re(tag: str) -> re.Pattern[str]:
    # group(1) is "/" for a closing tag, "" for an opening tag.
    return re.compile(r"<(/?)" + re.escape(tag) + r"(?:\s[^<>]*)?>")


@lru_cache(maxsize=64)
def _pair_re(tag: str) -> re.Pattern[str]:
    t = re.escape(tag)
    return re.compile(r"<" + t + r"(?:\s[^<>]*)?>(.*?)</" + t + r"\s*>", re.DOTALL)


def _tag_balanced(text: str, tag: str) -> bool:
    """True if every ``<tag>`` is closed by a later ``</tag>`` before the next ``<tag>``."""
    depth = 0
    for m in _tag_re(tag).finditer(text):
        if m.group(1):  # closing
            if depth == 0:
                return False  # close without open
            depth = 0
        else:  # opening
            if depth == 1:
                return False  # nested in itself (or an unclosed tag reopened)
            depth = 1
    return depth == 0


def xml_wellformed(text: str | None, tags: Iterable[str] = DEFAULT_TAGS) -> float:
    """1.0 if every listed tag that appears in ``text`` is balanced, else 0.0.

    For each tag in ``tags`` separately: each ``<tag>`` must be closed by a ``</tag>`` before the
    next ``<tag>`` opens (no nesting of a tag in itself), no ``</tag>`` may appear without an
    open ``<tag>``, and none may be left open at the end. Tags that do not appear at all are
    fine, so plain text scores 1.0. Interleaving of *different* tags
    (``<code><answer></code></answer>``) is not checked.

    >>> xml_wellformed("<search>q</search> ... <answer>x</answer>")
    1.0
    >>> xml_wellformed("<answer>x")
    0.0
    >>> xml_wellformed("<answer><answer>x</answer></answer>")
    0.0
    """
    text = text or ""
    return 1.0 if all(_tag_balanced(text, t) for t in tags) else 0.0


def has_answer_tag(text: str | None) -> float:
    """1.0 if ``text`` holds a complete ``<answer>...</answer>`` pair with non-blank content.

    >>> has_answer_tag("so <answer> 42 </answer>")
    1.0
    >>> has_answer_tag("<answer> </answer>"), has_answer_tag("<answer>42")
    (0.0, 0.0)
    """
    text = text or ""
    return 1.0 if any(m.group(1).strip() for m in _pair_re("answer").finditer(text)) else 0.0


def format_reward(text: str | None, required: Iterable[str] = ("answer",)) -> float:
    """1.0 if the text is well formed and contains each ``required`` tag, else 0.0.

    Well formed means :func:`xml_wellformed` over :data:`DEFAULT_TAGS` plus the required tags;
    "contains" means at least one complete ``<tag>...</tag>`` pair with non-blank content.

    >>> format_reward("<code>print(1)</code><output>1</output><answer>1</answer>")
    1.0
    >>> format_reward("the answer is 1")
    0.0
    >>> format_reward("<search>x</search><answer>y</answer>", required=("search", "answer"))
    1.0
    """
    text = text or ""
    required = tuple(required)
    tags = tuple(dict.fromkeys(DEFAULT_TAGS + required))
    if xml_wellformed(text, tags) != 1.0:
        return 0.0
    for tag in required:
        if not any(m.group(1).strip() for m in _pair_re(tag).finditer(text)):
            return 0.0
    return 1.0


def tool_call_count(text: str | None, tag: str) -> int:
    """Number of complete ``<tag>...</tag>`` pairs in ``text`` (non-overlapping, left to right).

    An unclosed trailing ``<tag>`` is not counted; empty pairs are.

    >>> tool_call_count("<code>a</code> <output>1</output> <code>b</code>", "code")
    2
    >>> tool_call_count("<search>q", "search")
    0
    """
    text = text or ""
    return sum(1 for _ in _pair_re(tag).finditer(text))
