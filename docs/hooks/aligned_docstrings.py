"""Griffe extension (mkdocs.yml: mkdocstrings' `extensions`): turnrl's docstrings are written to be
read as plain text, and many hold a table of names in aligned columns:

    rewards        [B]     each trajectory's reward: ...
    turn_rewards   [B, K]  each policy turn's reward from the environment (`StepResult.reward`), 0 for
                           turns a trajectory did not reach

Markdown would run such lines together into one paragraph. `fence_aligned` finds them (at least
two lines whose columns line up, with the lines that continue them) and shows them as written, in
a text block. Nothing else of a docstring changes; the source is not touched.
"""
from __future__ import annotations

import re

import griffe

_GAP = re.compile(r"\S( {2,})(?=\S)")   # a gap of two spaces or more inside a line


def _columns(line: str) -> set[int]:
    """Where the text after each wide gap of `line` starts."""
    return {m.end() for m in _GAP.finditer(line)}


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def _table_end(lines: list[str], start: int) -> int:
    """The end of the aligned table starting at `start` (== start when there is none): the lines
    from there that keep at least its indent, up to a blank line; a gap of its first line must end
    on the same column as one of another line's."""
    indent, end = _indent(lines[start]), start
    while end < len(lines) and lines[end].strip() and _indent(lines[end]) >= indent \
            and not lines[end].lstrip().startswith("```"):
        end += 1
    counts: dict[int, int] = {}
    for line in lines[start:end]:
        for column in _columns(line):
            counts[column] = counts.get(column, 0) + 1
    return end if end - start >= 2 and any(counts[c] >= 2 for c in _columns(lines[start])) else start


def fence_aligned(text: str) -> str:
    lines, out, i, fenced = text.split("\n"), [], 0, False
    while i < len(lines):
        line = lines[i]
        if line.lstrip().startswith("```"):
            fenced = not fenced
        end = i if fenced or not _columns(line) else _table_end(lines, i)
        if end == i:
            out.append(line)
            i += 1
            continue
        indent = _indent(line)
        out += ["", "```text", *(row[indent:] for row in lines[i:end]), "```", ""]
        i = end
    return "\n".join(out)


class AlignedDocstrings(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = fence_aligned(obj.docstring.value)
