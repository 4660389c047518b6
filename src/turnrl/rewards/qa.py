"""Question-answering rewards: SQuAD-style normalization, exact match and token F1.

``normalize_answer`` follows the SQuAD v1.1 evaluation script: lowercase, drop ASCII
punctuation, drop the articles a/an/the, collapse whitespace. ``exact_match`` and ``f1`` take
the best score over all gold answers (NQ-open lists several acceptable strings).
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Iterable

__all__ = ["normalize_answer", "numbers_in", "exact_match", "f1", "contains_answer"]

_PUNCT = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize_answer(s: str | None) -> str:
    """Lowercase, strip punctuation and articles, collapse whitespace.

    >>> normalize_answer("  The  Eiffel-Tower! ")
    'eiffeltower'
    >>> normalize_answer("A Tale of Two Cities")
    'tale of two cities'
    """
    if s is None:
        return ""
    s = str(s).lower()
    s = "".join(ch for ch in s if ch not in _PUNCT)
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())


def _as_list(golds: str | Iterable[str] | None) -> list[str]:
    if golds is None:
        return []
    if isinstance(golds, str):
        return [golds]
    return [str(g) for g in golds]


# A number as written: its sign, digits (thousands commas dropped first), decimal point, fraction bar
# or power, which SQuAD's punctuation stripping would erase (-3 would equal 3, 1/2 equal 12)
_NUMBER = re.compile(r"(?<![\w.])-?\d+(?:[./^]\d+)*")


def numbers_in(s: str | None) -> list[str]:
    """The numbers in `s` with their signs, points and bars: ``numbers_in("x = -1/2, y = 3.")`` is
    ``['-1/2', '3']`` (a sentence's closing period is not a decimal point)."""
    return _NUMBER.findall(re.sub(r"(?<=\d),(?=\d{3}\b)", "", str(s or "")))


def exact_match(pred: str | None, golds: str | Iterable[str]) -> float:
    """1.0 if the normalized prediction equals any normalized gold answer and writes the same
    numbers (`numbers_in`: -3 is not 3, 1/2 not 12, 3.5 not 35), else 0.0.

    A ``None`` prediction or an empty gold list scores 0.0.

    >>> exact_match("the Beatles", ["Beatles", "The Fab Four"])
    1.0
    >>> exact_match("-3", ["3"])
    0.0
    """
    if pred is None:
        return 0.0
    p, numbers = normalize_answer(pred), numbers_in(pred)
    return 1.0 if any(p == normalize_answer(g) and numbers == numbers_in(g) for g in _as_list(golds)) else 0.0


def _f1_one(pred_tokens: list[str], gold_tokens: list[str]) -> float:
    if not pred_tokens or not gold_tokens:
        # SQuAD v2 convention: two empty answers agree, one empty answer scores 0.
        return float(pred_tokens == gold_tokens)
    common = Counter(pred_tokens) & Counter(gold_tokens)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision = same / len(pred_tokens)
    recall = same / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def f1(pred: str | None, golds: str | Iterable[str]) -> float:
    """Token-level F1 between the normalized prediction and each gold; the maximum over golds.

    >>> round(f1("Wilhelm Röntgen", ["Wilhelm Conrad Röntgen"]), 3)
    0.8
    """
    if pred is None:
        return 0.0
    p = normalize_answer(pred).split()
    return max((_f1_one(p, normalize_answer(g).split()) for g in _as_list(golds)), default=0.0)


def contains_answer(text: str | None, golds: str | Iterable[str]) -> float:
    """1.0 if any normalized gold answer occurs in the normalized text as whole words.

    Used as the search step reward "the answer appears in the retrieved passages".

    >>> contains_answer("Röntgen won the first prize in 1901.", ["1901"])
    1.0
    >>> contains_answer("in 19011", ["1901"])
    0.0
    """
    if not text:
        return 0.0
    t = f" {normalize_answer(text)} "
    for g in _as_list(golds):
        g = normalize_answer(g)
        if g and f" {g} " in t:
            return 1.0
    return 0.0
