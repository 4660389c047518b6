"""Docs that stay true: every YAML block in README.md and docs/*.md parses with the loader DVC
reads params.yaml with (so a block pasted into params.yaml does not stop `dvc repro`), import
paths (`module:function`) are quoted wherever YAML holds them, the README cites no internal issue
numbers, every relative link points to a file of the repository (and to a heading of it, where it
names one), and the README stays short and links every page of the user guide."""
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
    assert len(YAML_BLOCKS) >= 3      # the README's params example, tools.md's tools, plugins.md's reward and benchmarks


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


# pages the docs site's hooks write at build time (mkdocs.yml: docs/hooks/), linked from docs/
GENERATED = {ROOT / "docs" / "reference" / "params.md"}


@pytest.mark.parametrize("path, target", LINKS)
def test_every_relative_link_resolves_inside_the_repository(path, target):
    resolved = (path.parent / target.split("#")[0]).resolve()
    if resolved in GENERATED:
        return
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


# The user guide's pages in docs/ (mkdocs.yml's nav), in the order the README lists them.
GUIDE = ["index.md", "first-run.md", "your-task.md", "plugins.md", "tools.md", "agents.md", "ecosystem.md",
         "ecosystem-reasoning-gym.md", "ecosystem-text-games.md", "ecosystem-skyrl-gym.md", "ecosystem-openenv.md",
         "ecosystem-verifiers.md", "algorithms.md", "post-training.md", "async.md", "models-and-gpus.md",
         "cluster-demo.md", "sandbox.md", "mlflow.md", "prefect.md", "reliability.md", "troubleshooting.md"]
README_MAX_LINES = 260


def test_the_readme_fits_on_a_few_screens():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines (at most {README_MAX_LINES}): move detail to docs/"


def test_the_readme_links_every_guide_page():
    targets = {t.split("#")[0] for t in re.findall(r"\]\(([^)\s]+)\)", _FENCE.sub("", (ROOT / "README.md").read_text("utf-8")))}
    pages = [p for p in GUIDE + [p.name for p in (ROOT / "docs").glob("ecosystem*.md")] if (ROOT / "docs" / p).exists()]
    missing = sorted({p for p in pages if f"docs/{p}" not in targets})
    assert not missing, f"README.md does not link {missing}"


def test_every_guide_page_has_a_title():
    for name in GUIDE:
        path = ROOT / "docs" / name
        if path.exists():
            assert path.read_text(encoding="utf-8").startswith("# "), f"docs/{name} does not open with a # title"


SITE_PAGES = [*DOCS, *sorted((ROOT / "benchmarks").glob("*.md"))]
_SHALLOW_NESTED = re.compile(r"^ {1,3}(?:[-*+]|\d+\.) ", re.M)


def shallow_nested_items(text: str) -> list[str]:
    """List items indented 1-3 spaces outside code fences: GitHub nests them, but the site's
    Python-Markdown needs 4 and renders them as one flat list."""
    return [m.group(0) + text[m.end():].split("\n", 1)[0] for m in _SHALLOW_NESTED.finditer(_FENCE.sub("", text))]


_ITEM = re.compile(r"^ *(?:[-*+]|\d+\.) ")


def items_glued_to_a_paragraph(text: str) -> list[str]:
    """List items right under a paragraph that is not itself a list item (no blank line between):
    GitHub starts a list there, the site's Python-Markdown reads the item as the paragraph's text."""
    lines = _FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text).split("\n")
    found, first = [], None
    for line in lines:
        if not line.strip():
            first = None
        elif first is None:
            first = line
        elif _ITEM.match(line) and not _ITEM.match(first) and not first.lstrip().startswith(("|", "#", ">")):
            found.append(line)
            first = line
    return found


def test_the_list_checkers_find_what_the_site_renders_flat():
    assert shallow_nested_items("1. a\n   - b\n") and not shallow_nested_items("1. a\n    - b\n```\n  - c\n```\n")
    assert items_glued_to_a_paragraph("Text:\n- a\n") and not items_glued_to_a_paragraph("Text:\n\n- a\n- b\n")
    assert not items_glued_to_a_paragraph("- a\n  more\n- b\n| x |\n")


@pytest.mark.parametrize("path", SITE_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_lists_render_as_lists_on_the_site(path):
    text = path.read_text(encoding="utf-8")
    nested, glued = shallow_nested_items(text), items_glued_to_a_paragraph(text)
    assert not nested, f"{path.relative_to(ROOT)}: indent these 4 spaces (the site renders them flat): {nested[:3]}"
    assert not glued, f"{path.relative_to(ROOT)}: put a blank line before these (the site reads them as text): {glued[:3]}"


def _slug(heading: str) -> str:
    """A heading's anchor as GitHub and MkDocs (toc's slugify) both make it: code marks and
    punctuation dropped, lower case, runs of spaces and hyphens as one hyphen."""
    text = re.sub(r"[^\w\s-]", "", heading.replace("`", "")).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def _anchors(path: Path) -> set[str]:
    prose = _FENCE.sub("", path.read_text(encoding="utf-8"))
    return {_slug(h) for h in re.findall(r"^#{1,6} +(.+?) *#*$", prose, re.M)}


ANCHORED = [pytest.param(path, target, id=f"{path.relative_to(ROOT)}->{target}")
            for path in DOCS for target in re.findall(r"\]\(([^)\s]+#[^)\s]+)\)", _FENCE.sub("", path.read_text("utf-8")))
            if not re.match(r"[a-z]+:", target) and target.split("#")[0].endswith(".md") or target.startswith("#")]


def test_the_slugs_are_those_of_github_and_mkdocs():
    assert _slug("Tools that fail (`env.name: tools`)") == "tools-that-fail-envname-tools"
    assert _slug("When a rerun resumes, and when it starts afresh") == "when-a-rerun-resumes-and-when-it-starts-afresh"
    assert _slug("The corrections (`algorithm.policy_loss`)") == "the-corrections-algorithmpolicy_loss"


@pytest.mark.parametrize("path, target", ANCHORED)
def test_every_link_to_a_heading_finds_it(path, target):
    page, anchor = target.split("#", 1)
    linked = (path.parent / page).resolve() if page else path
    assert linked.exists(), f"{path.name}: link {target}: no such file"
    assert anchor in _anchors(linked), f"{path.name}: link {target}: {linked.name} has no heading with that anchor"


def test_the_docs_link_to_headings():
    assert len(ANCHORED) >= 20
    assert _anchors(ROOT / "docs" / "reliability.md") >= {"checkpoints", "after-a-crash-rerun"}


#: `<a checkpoint>` or `$(...)`: a word the reader fills in (a closing tag like '</answer>' is a value)
_PLACEHOLDER = re.compile(r"<[A-Za-z_ ]|\$\(")


def _exp_runs(path: Path) -> list[tuple[int, list[str], bool]]:
    """(line, -S overrides, whether the docs say it fails) of each runnable `dvc exp run` in the
    bash blocks; commands with a placeholder (`<a checkpoint>`) or a `$(...)` are left out."""
    import shlex
    found = []
    for line_no, block in _blocks(path, "bash"):
        for k, line in enumerate(block.replace("\\\n", " ").splitlines()):
            try:
                words = shlex.split(line.partition(" #")[0])
            except ValueError:      # not one shell line (a quote opened in an earlier one)
                continue
            fails = "fails" in line.partition(" #")[2]
            commands, current = [], []
            for word in words + ["&&"]:
                if word in ("&&", ";"):
                    commands.append(current)
                    current = []
                else:
                    current.append(word)
            for cmd in commands:
                if cmd[:3] != ["dvc", "exp", "run"] or any(_PLACEHOLDER.search(w) for w in cmd):
                    continue
                found.append((line_no + k, [cmd[i + 1] for i, w in enumerate(cmd[:-1]) if w == "-S"], fails))
    return found


EXP_RUNS = [pytest.param(path, line, overrides, fails, id=f"{path.relative_to(ROOT)}:{line}")
            for path in DOCS for line, overrides, fails in _exp_runs(path)]


def test_the_docs_show_experiments():
    assert len(EXP_RUNS) >= 30
    assert any(path.name == "README.md" for path, *_ in (p.values for p in EXP_RUNS))


@pytest.mark.parametrize("path, line, overrides, fails", EXP_RUNS)
def test_every_dvc_exp_run_in_the_docs_gives_valid_params(path, line, overrides, fails, tmp_path):
    """Each `-S` is applied to a copy of params.yaml as `dvc exp run` applies it (DVC's own override
    parser), and the result passes turnrl's params check: an example that names a key, value, plugin
    or option that does not exist fails here instead of in a user's first minute."""
    from dvc.utils.hydra import apply_overrides
    from turnrl.config.loading import load_config
    from turnrl.config.sections import ConfigError

    params = tmp_path / "params.yaml"
    params.write_text((ROOT / "params.yaml").read_text(encoding="utf-8"), encoding="utf-8")
    apply_overrides(str(params), overrides)
    if fails:
        with pytest.raises(ConfigError):
            load_config(params)
    else:
        load_config(params)
