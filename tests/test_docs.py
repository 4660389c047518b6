"""Docs that stay true: every YAML block in README.md and docs/*.md parses with the loader DVC
reads params.yaml with (so a block pasted into params.yaml does not stop `dvc repro`), import
paths (`module:function`) are quoted wherever YAML holds them, the README cites no internal issue
numbers, and every relative link points to a file of the repository."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
from dvc.utils.serialize import parse_yaml

from conftest import ROOT

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
YAML_FILES = [ROOT / "params.yaml", ROOT / "dvc.yaml", *sorted((ROOT / "configs").glob("*.yaml")),
              *sorted((ROOT / "examples").rglob("*.yaml"))]
_FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.S | re.M)
# an import path where YAML reads a value: dotted (a.b:c), or right after `key: `, `[`, `{` or `, `
_IMPORT_PATH = re.compile(r"(?<![\w'\"./:-])([a-z_]\w*(?:\.\w+)*):([A-Za-z_]\w*)(?![\w'\"])")


def _blocks(path: Path, lang: str) -> list[tuple[int, str]]:
    """(line of the fence, text) of each ```lang block."""
    text = path.read_text(encoding="utf-8")
    return [(text[:m.start()].count("\n") + 1, m.group(2)) for m in _FENCE.finditer(text) if m.group(1) == lang]


def _yaml_spans(path: Path) -> list[str]:
    """Inline code that is a YAML key and value (`env.name: my_tasks.guess:GuessEnv`), outside blocks."""
    prose = _FENCE.sub("", path.read_text(encoding="utf-8"))
    return [span for span in re.findall(r"`([^`\n]+)`", prose) if re.match(r"[\w.]+: \S", span)]


def _unquoted_import_paths(text: str) -> list[str]:
    found = []
    for m in _IMPORT_PATH.finditer(text):
        before = text[max(0, m.start() - 2):m.start()]
        if "." in m.group(1) or before in (": ", ", ") or before.endswith(("[", "{")):
            found.append(m.group(0))
    return found


YAML_BLOCKS = [pytest.param(path, line, text, id=f"{path.relative_to(ROOT)}:{line}")
               for path in DOCS for line, text in _blocks(path, "yaml")]


def test_the_docs_have_yaml_blocks():
    assert len(YAML_BLOCKS) >= 3      # the README's tools block, plugins.md's reward and benchmarks


@pytest.mark.parametrize("path, line, text", YAML_BLOCKS)
def test_every_yaml_block_parses_as_dvc_reads_params(path, line, text):
    parse_yaml(text, f"{path.name}:{line}")      # raises YAMLFileCorruptedError where DVC would stop
    assert not _unquoted_import_paths(text), f"{path.name}:{line}: quote {_unquoted_import_paths(text)}"


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_yaml_shown_inline_quotes_import_paths(path):
    bad = [span for span in _yaml_spans(path) if _unquoted_import_paths(span)]
    assert not bad, f"{path.name}: quote the import path in {bad}"


@pytest.mark.parametrize("path", YAML_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_yaml_files_and_their_comments_quote_import_paths(path):
    text = path.read_text(encoding="utf-8")
    parse_yaml(text, str(path))
    assert not _unquoted_import_paths(text), f"{path.name}: quote {_unquoted_import_paths(text)}"


def test_the_checker_finds_what_dvc_rejects():
    assert _unquoted_import_paths("functions: [my_tasks.rewards:fewer_guesses, b.c:d]") == [
        "my_tasks.rewards:fewer_guesses", "b.c:d"]
    assert _unquoted_import_paths("algorithm.name: my_algos:MY") == ["my_algos:MY"]
    assert not _unquoted_import_paths("functions: ['my_tasks.rewards:fewer_guesses'], uri: http://host:5000")
    assert not _unquoted_import_paths("# reported as file:line; address HOST:PORT")


def test_the_readme_cites_no_internal_issue_numbers():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    found = re.findall(r"(?i)\b(?:issues?|PR|pull request)\s*#?\d+\b|(?<![\w&/])#\d+\b", text)
    assert not found, f"README.md cites {found}: say what happened instead"


LINKS = [pytest.param(path, target, id=f"{path.relative_to(ROOT)}->{target}")
         for path in DOCS for target in re.findall(r"\]\(([^)\s]+)\)", _FENCE.sub("", path.read_text("utf-8")))
         if not re.match(r"[a-z]+:|#", target)]


def test_the_docs_have_relative_links():
    assert len(LINKS) >= 10


@pytest.mark.parametrize("path, target", LINKS)
def test_every_relative_link_resolves_inside_the_repository(path, target):
    resolved = (path.parent / target.split("#")[0]).resolve()
    assert resolved.exists(), f"{path.name}: link {target} -> {resolved} does not exist"
    assert resolved.is_relative_to(ROOT), f"{path.name}: link {target} leaves the repository"


def test_files_cited_in_the_code_exist():
    """Docstrings and comments that name a .md file name one the repository has."""
    cited = {}
    for py in [*(ROOT / "src").rglob("*.py"), *(ROOT / "stages").glob("*.py"), *(ROOT / "flows").glob("*.py")]:
        # a doc of the repository (docs/x.md, benchmarks/X.md, DESIGN.md), not a file the code writes
        for name in re.findall(r"(?:docs|benchmarks)/[\w.-]+\.md|\b[A-Z][A-Z0-9_]*\.md", py.read_text(encoding="utf-8")):
            cited.setdefault(name, py.relative_to(ROOT))
    known = {p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*.md") if ".venv" not in p.parts}
    missing = {name: str(where) for name, where in cited.items()
               if not any(k == name or k.endswith("/" + name) for k in known)}
    assert not missing, f"cited but not in the repository: {missing}"
