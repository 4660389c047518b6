"""The docs site (mkdocs.yml): it builds in strict mode, its params reference holds every key of
the typed config, a broken link or a missing reference fails a build through the same hooks,
and the built site, opened from disk in a headless browser, shows the home page, the params
reference and an API page with their content, and finds pages with its offline search.

Without a browser (chromium, google-chrome) the browser tests skip, saying so; in CI (CI=true),
where setup.sh installs one, they fail."""
from __future__ import annotations

import html
import importlib.util
import inspect
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Literal
from urllib.parse import unquote, urlsplit

import pytest
from pydantic import BaseModel, Field

from conftest import ROOT

if os.environ.get("CI") != "true":      # in CI the docs extra is installed: its absence fails
    pytest.importorskip("mkdocs", reason="the docs extra is not installed: pip install -e '.[docs]'")

from mkdocs.commands.build import build  # noqa: E402
from mkdocs.config import load_config  # noqa: E402
from mkdocs.exceptions import Abort  # noqa: E402

HOOKS = ROOT / "docs" / "hooks"
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome")


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"docs_hook_{name}", HOOKS / f"{name}.py")
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)   # dataclasses look it up
    spec.loader.exec_module(module)
    return module


params_reference = _load("params_reference")


# --------------------------------------------------------------------------- the params reference
def _every_key(model: type[BaseModel], prefix: str = "") -> dict[str, object]:
    """Walked here independently of the hook: dotted key -> its field, through sections, lists
    of sections ([*]) and Annotated wrappers."""
    from typing import Annotated, get_args, get_origin

    def section(annotation):
        while get_origin(annotation) is Annotated:
            annotation = get_args(annotation)[0]
        if inspect.isclass(annotation) and issubclass(annotation, BaseModel):
            return annotation, ""
        if get_origin(annotation) is list:
            inner, _ = section(get_args(annotation)[0]) or (None, None)
            return (inner, "[*]") if inner else None
        return None

    keys = {}
    for name, info in model.model_fields.items():
        key = f"{prefix}.{name}" if prefix else name
        keys[key] = info
        found = section(info.annotation)
        if found:
            keys.update(_every_key(found[0], key + found[1]))
    return keys


def _row(page: str, key: str) -> list[str]:
    """The cells of the params table row of `key` (Markdown: a pipe in code or escaped is no border)."""
    rows = [line for line in page.splitlines() if line.startswith(f"| `{key}` |")]
    assert len(rows) == 1, f"{key}: {len(rows)} rows"
    cells, cell, code, line = [], "", False, rows[0].strip()[1:-1]
    for i, char in enumerate(line):
        code ^= char == "`"
        if char == "|" and not code and line[i - 1] != "\\":
            cells, cell = cells + [cell.strip()], ""
        else:
            cell += char
    return cells + [cell.strip()]


def test_the_params_reference_lists_every_key_of_every_section():
    from turnrl.config.sections import Config
    page = params_reference.params_page()
    keys = _every_key(Config)
    assert len(keys) > 150
    missing = [key for key in keys if f"| `{key}` |" not in page]
    assert not missing, f"keys missing from the params reference: {missing}"
    # every section has its heading, with its docstring where it has one
    assert "## `train.health` { #params-train-health }" in page
    assert "## `reward.judges[*]` { #params-reward-judges }" in page
    assert "## `eval.benchmarks[*]`" in page
    assert "The embedded Qwen2-architecture model built by `prepare_model`" in page


def test_the_params_reference_shows_types_defaults_bounds_and_descriptions():
    page = params_reference.params_page()
    assert _row(page, "train.steps")[1:3] == ["`int` (&gt; 0)", "`40`"]
    assert _row(page, "model.dtype")[1:3] == ['`"float32" | "bfloat16" | "float16"`', "`float32`"]
    assert _row(page, "algorithm.value_clip")[1:3] == ["`float | null` (&gt; 0)", "`0.2`"]
    assert _row(page, "algorithm.dual_clip")[2] == "`null`"
    assert _row(page, "env.options")[1:3] == ["`dict[str, any]`", "`{}`"]
    assert _row(page, "tracking.uri")[2] == "`''`"
    assert _row(page, "reward.judges[*].template")[2] == "`required`"      # a key with no default
    assert _row(page, "reward.judges")[1].startswith("`list[section]`, [keys below](#params-reward-judges)")
    assert "math500" in _row(page, "eval.benchmarks")[2]                     # a default_factory's value
    assert _row(page, "rollout.n")[3] == "group size: samples per prompt"      # the field's description
    assert "matches `^[A-Za-z_][A-Za-z0-9_]*$`" in _row(page, "reward.judges[*].name")[1]


def test_the_params_walk_on_a_model_of_its_own():
    class Leaf(BaseModel):
        """A leaf section."""
        x: int = Field(1, gt=0, description="a <b> | c_d *e*")

    class Root(BaseModel):
        leaf: Leaf = Leaf()
        items: list[Leaf] = []
        by_name: dict[str, Leaf] = {}
        mode: Literal["a", 2] = "a"
        need: str

    found = params_reference.sections(Root)
    assert [s.path for s in found] == ["", "leaf", "items[*]", "by_name.<name>"]
    assert [k.path for k in found[0].keys] == ["leaf", "items", "by_name", "mode", "need"]
    assert found[0].keys[3].type == '"a" | 2' and found[0].keys[4].default == "required"
    assert found[1].doc == "A leaf section." and found[2].keys[0].path == "items[*].x"
    import markdown
    out = markdown.markdown(params_reference.render(found), extensions=["tables", "attr_list"])
    assert "<td>a &lt;b&gt; | c_d *e*</td>" in out            # shown as written: no tag, no new cell, no emphasis
    assert out.count("<table>") == 4


def test_aligned_docstring_tables_are_shown_as_written():
    fence = _load("aligned_docstrings").fence_aligned
    doc = textwrap.dedent("""\
        What it reads.

        rewards        [B]     each trajectory's reward
        turn_rewards   [B, K]  each turn's reward, 0 for
                               turns not reached
        last [B] one more

        A paragraph.  With a double space, once.
        loss(batch) -> x, with:
            logp       the policy's logprob
            old_logp   the logprob the ratio is taken to
        and the rest.""")
    out = fence(doc)
    assert "```text\nrewards        [B]     each trajectory's reward\n" in out
    assert "                       turns not reached\nlast [B] one more\n```" in out
    assert "\nA paragraph.  With a double space, once.\n" in out                 # prose stays prose
    assert "\n\n```text\nlogp       the policy's logprob\nold_logp   the logprob the ratio is taken to\n```\n\nand" in out
    assert fence("Plain text.\n\n```python\nx  =  1\ny  =  2\n```\n") == "Plain text.\n\n```python\nx  =  1\ny  =  2\n```\n"


# --------------------------------------------------------------------------- strict builds fail
def _project(tmp_path: Path, page: str, api: bool = False) -> Path:
    """A tiny MkDocs project through turnrl's hooks: docs/index.md is `page`, data.json a file of
    the "repository" beside docs/; with `api`, mkdocstrings over a module of its own (tiny.py)."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "tiny.py").write_text('class There:\n    """A class that is there."""\n')
    (tmp_path / "docs" / "index.md").write_text(page)
    (tmp_path / "docs" / "other.md").write_text("# Other\n\n## A part\n")
    (tmp_path / "data.json").write_text("{}")
    plugins = ["search"] + ([{"mkdocstrings": {"handlers": {"python": {"paths": ["src"]}}}}] if api else [])
    import yaml
    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump({
        "site_name": "t", "docs_dir": "docs", "use_directory_urls": False, "theme": {"name": "mkdocs"},
        "hooks": [str(HOOKS / "repo_links.py")], "plugins": plugins,
        "validation": {"links": {"not_found": "warn", "anchors": "warn", "unrecognized_links": "warn"}},
        "nav": ["index.md", "other.md"]}))
    return tmp_path / "mkdocs.yml"


def _build(config: Path, strict: bool = True) -> Path:
    site = config.parent / "site"
    build(load_config(str(config), strict=strict, site_dir=str(site)))
    return site


def test_a_tiny_project_through_the_hooks_builds_and_keeps_its_repository_links(tmp_path):
    config = _project(tmp_path, "# Home\n\n[other](other.md#a-part), [the data](../data.json), "
                                "[folder](../docs)\n\n`[not a link](../nothing.json)`\n")
    built = (_build(config) / "index.html").read_text()
    assert 'href="other.html#a-part"' in built
    assert 'href="../data.json"' in built and (config.parent / "site" / "../data.json").exists()
    assert "turnrl-repo:" not in built


@pytest.mark.parametrize("page, problem", [
    ("[gone](gone.md)", "'gone.md', but the target is not found among documentation files"),
    ("[part](other.md#no-such-part)", "does not contain an anchor '#no-such-part'"),
    ("[data](../nothing.json)", "the link '../nothing.json' points to"),
])
def test_a_broken_link_fails_the_strict_build(tmp_path, caplog, page, problem):
    with pytest.raises(Abort):
        _build(_project(tmp_path, f"# Home\n\n{page}\n"))
    assert problem in caplog.text


def test_a_link_to_a_missing_repository_file_fails_even_without_strict(tmp_path, caplog):
    with pytest.raises(Abort):
        _build(_project(tmp_path, "# Home\n\n![plot](../plots/none.png)\n"), strict=False)
    assert "1 broken link(s) to files of the repository" in caplog.text and "../plots/none.png" in caplog.text


def test_an_api_reference_builds_through_the_hooks(tmp_path):
    built = (_build(_project(tmp_path, "# Home\n\n::: tiny.There\n\nSee [There][tiny.There].\n", api=True))
             / "index.html").read_text()
    assert "A class that is there." in built and 'href="#tiny.There"' in built


@pytest.mark.parametrize("page, problem", [
    ("::: tiny.NotThere", "tiny.NotThere"),
    ("See [There][tiny.NotThere].", "tiny.NotThere"),
])
def test_a_missing_api_reference_fails_the_strict_build(tmp_path, caplog, page, problem):
    with pytest.raises(Abort):
        _build(_project(tmp_path, f"# Home\n\n{page}\n", api=True))
    assert problem in caplog.text


# --------------------------------------------------------------------------- the real site
@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("docs-site") / "site"
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)], cwd=ROOT,
                         capture_output=True, text=True, timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert run.returncode == 0, f"mkdocs build --strict failed:\n{run.stdout}\n{run.stderr}"
    return out


def test_the_site_has_its_pages_and_every_link_of_it_resolves(site):
    results = _load("results_pages")
    pages = [results.site_name(path).replace(".md", ".html") for path in results.sources(ROOT)]
    assert len(pages) >= 5 and sorted(p.relative_to(site).as_posix() for p in site.glob("results/*.html")) == sorted(pages)
    for page in ("index.html", "first-run.html", "reference/params.html", "reference/environments.html",
                 "search/search_index.js"):
        assert (site / page).is_file(), page
    broken = []
    for page in set(site.rglob("*.html")) - {site / "404.html"}:     # 404.html: absolute links, for a server
        for url in re.findall(r'<(?:a|img|link|script)\b[^>]*?\b(?:href|src)="([^"]*)"', page.read_text()):
            parts = urlsplit(html.unescape(url))
            if parts.scheme or parts.netloc or not parts.path:
                continue
            if not (page.parent / unquote(parts.path)).exists():
                broken.append(f"{page.relative_to(site)}: {url}")
    assert not broken, f"links from the built site to nothing: {broken[:20]}"
    # nothing is fetched from the network when a page is read (fonts, scripts, styles)
    index = (site / "index.html").read_text()
    assert not re.findall(r'<(?:link|script)\b[^>]*\b(?:href|src)="https?://', index)


def _browser() -> str:
    for name in BROWSERS:
        if shutil.which(name):
            return shutil.which(name)
    message = f"no headless browser found ({', '.join(BROWSERS)}): setup.sh installs chromium with apt as root"
    if os.environ.get("CI") == "true":
        pytest.fail(message)
    pytest.skip(message)


PAGES = {"home": "index.html?q=StepResult", "params": "reference/params.html", "api": "reference/environments.html"}


@pytest.fixture(scope="module")
def doms(site, tmp_path_factory) -> dict[str, str]:
    """Each page's DOM after its scripts ran, opened from disk (file://): three browsers at once."""
    browser, tmp = _browser(), tmp_path_factory.mktemp("browser")
    runs = {}
    for name, page in PAGES.items():
        path, _, query = page.partition("?")
        runs[name] = subprocess.Popen(
            [browser, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", f"--user-data-dir={tmp / name}",
             "--virtual-time-budget=5000", "--dump-dom", (site / path).as_uri() + (f"?{query}" if query else "")],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out = {}
    for name, run in runs.items():
        stdout, stderr = run.communicate(timeout=120)
        assert run.returncode == 0 and "</html>" in stdout, f"{PAGES[name]}: {stderr[-2000:]}"
        assert re.search(r'<html\b[^>]*class="[^"]*\bjs\b', stdout), f"{PAGES[name]}: its scripts did not run"
        out[name] = stdout
    return out


def _text(dom: str) -> str:
    dom = re.sub(r"<(script|style)\b.*?</\1>", " ", dom, flags=re.S)
    return re.sub(r"\s+", " ", html.unescape(re.sub(r"<[^>]+>", " ", dom))).replace(" ,", ",").replace(" .", ".")


def _docline(obj) -> str:
    """The first line of `obj`'s docstring as the page shows it (no backticks)."""
    return re.sub(r"\s+", " ", inspect.getdoc(obj).splitlines()[0].replace("`", "")).strip()


def test_the_home_page_renders(doms):
    dom = doms["home"]
    assert re.search(r"<title>[^<]*turnrl", dom)
    for link in ("first-run.html", "reference/params.html", "reference/environments.html"):
        assert f'href="{link}"' in dom, link
    assert re.search(r'href="results/[\w-]+\.html"', dom)          # the Results section
    assert "md-sidebar" in dom and "Params" in _text(dom)


def test_search_works_from_disk(doms):
    found = re.search(r'md-search-result__meta">(\d+) matching document', doms["home"])
    assert found and int(found.group(1)) > 0, "offline search found nothing for StepResult"
    results = doms["home"].split('class="md-search-result__list"', 1)[1]
    assert "reference/environments.html" in results.split("</ol>", 1)[0]


def test_the_params_reference_renders_keys_with_their_defaults(doms):
    from turnrl.config.sections import AlgorithmCfg, TrainCfg
    dom = doms["params"]
    rows = {re.sub(r"<[^>]+>", "", r.split("</td>")[0]).strip(): r for r in re.findall(r"<tr>\s*<td>(.*?)</tr>", dom, re.S)}
    assert f"<code>{TrainCfg.model_fields['steps'].default}</code>" in rows["train.steps"]
    assert "<code>k3</code>" in rows["algorithm.kl_estimator"] and AlgorithmCfg().kl_estimator == "k3"
    assert "group size: samples per prompt" in rows["rollout.n"]
    assert 'id="params-train-health"' in dom


def test_an_api_page_renders_classes_with_their_docstrings(doms):
    from turnrl.envs.base import EnvContext, EnvSpec
    text = _text(doms["api"])
    for name in ("StepResult", "EnvSpec", "EnvContext", "step_result_problem", "register"):
        assert name in text
    assert _docline(EnvSpec) in text and _docline(EnvContext) in text
