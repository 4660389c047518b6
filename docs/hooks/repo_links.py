"""MkDocs hook: relative links that leave the site's pages, kept working and checked.

The pages are written to be read on GitHub too, so they link to files of the repository by their
path there: `../examples/guess`, `results/async-fast.json`, `../benchmarks/ASYNC.md`. Each
relative link (or image) is resolved against the page's real source file, then:

- a file the site builds (a docs page, an image, a results page added by `results_pages`) becomes
  a link to it, relative to the page's place in the site (MkDocs then checks it as usual);
- any other file or folder of the repository becomes a relative link from the built page to it
  in the repository, which works when the site is opened from its folder inside the repository
  (`site/`);
- a target that does not exist fails the build (strict or not), naming the page and the link.

Links inside code are never links (the rewriting runs on the parsed page, before MkDocs' own
link check). State: the page being rendered, set by `on_page_markdown` just before MkDocs
renders it.
"""
from __future__ import annotations

import os
import posixpath
from pathlib import Path
from urllib.parse import unquote, urlsplit

from markdown import Extension
from markdown.treeprocessors import Treeprocessor
from mkdocs.exceptions import PluginError
from mkdocs.plugins import get_plugin_logger

log = get_plugin_logger(__name__)

MARK = "turnrl-repo:"       # a repository link between the two passes: MkDocs leaves URLs with a scheme alone


def resolve(url: str, source: Path, pages: dict[Path, str], page_uri: str, dest: Path, root: Path
            ) -> tuple[str, str | None]:
    """The URL to write for `url`, found in the page whose source file is `source` (its place in
    the site `page_uri`, its built file `dest`), and the problem with it if any. `pages` maps the
    source files the site builds to their place in the site; `root` is the repository."""
    scheme, netloc, path, query, fragment = urlsplit(url)
    if scheme or netloc or not path or url.startswith(("/", "\\")):
        return url, None                       # external, absolute, or an anchor on this page
    target = Path(os.path.normpath(source.parent / unquote(path)))
    tail = (f"?{query}" if query else "") + (f"#{fragment}" if fragment else "")
    if target in pages:
        return posixpath.relpath(pages[target], posixpath.dirname(page_uri) or ".") + tail, None
    if not target.exists():
        return url, f"the link '{url}' points to {target}, which does not exist"
    if not target.is_relative_to(root):
        return url, f"the link '{url}' points to {target}, outside the repository"
    return MARK + Path(os.path.relpath(target, dest.parent)).as_posix() + tail, None


class _Links(Treeprocessor):
    """Before MkDocs' link check: rewrite each link (mark the repository ones)."""

    def __init__(self, md, hook: "_State"):
        super().__init__(md)
        self.hook = hook

    def run(self, root):
        for element in root.iter():
            key = {"a": "href", "img": "src"}.get(element.tag)
            if key and element.get(key) is not None:
                element.set(key, self.hook.rewrite(element.get(key)))


class _Unmark(Treeprocessor):
    """After MkDocs' link check: the repository links become plain relative links."""

    def run(self, root):
        for element in root.iter():
            key = {"a": "href", "img": "src"}.get(element.tag)
            if key and (element.get(key) or "").startswith(MARK):
                element.set(key, element.get(key)[len(MARK):])


class _State(Extension):
    def __init__(self):
        super().__init__()
        self.page = self.config = None
        self.pages: dict[Path, str] = {}
        self.problems: list[str] = []

    def extendMarkdown(self, md):
        # MkDocs' own link processor ("relpath") has priority 0: run on both sides of it.
        md.treeprocessors.register(_Links(md, self), "turnrl_repo_links", 5)
        md.treeprocessors.register(_Unmark(md), "turnrl_repo_unmark", -5)

    def rewrite(self, url: str) -> str:
        if self.page is None:
            return url
        file, root = self.page.file, Path(self.config.config_file_path).resolve().parent
        source = file.abs_src_path or os.path.join(self.config.docs_dir, file.src_uri)   # made in memory: as if in docs/
        new, problem = resolve(url, Path(os.path.normpath(source)), self.pages, file.src_uri,
                               Path(file.abs_dest_path), root)
        if problem:
            message = f"Doc file '{self.page.file.src_uri}': {problem}"
            self.problems.append(message)
            log.error(message)
        return new


STATE = _State()


def on_config(config):
    STATE.config, STATE.problems = config, []
    if STATE not in config.markdown_extensions:    # once, also when `mkdocs serve` reloads the config
        config.markdown_extensions.append(STATE)
    return config


def on_files(files, config):
    # source file -> place in the site, for every file the site builds; a file made in memory
    # (the params reference) stands where it would be in docs/
    STATE.pages = {Path(os.path.normpath(f.abs_src_path or os.path.join(config.docs_dir, f.src_uri))): f.src_uri
                   for f in files if f.inclusion.is_included()}
    return files


def on_page_markdown(markdown, page, config, files):
    STATE.page = page
    return markdown


def on_post_build(config):
    if STATE.problems:
        raise PluginError(f"{len(STATE.problems)} broken link(s) to files of the repository:\n  "
                          + "\n  ".join(STATE.problems))
