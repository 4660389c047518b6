"""MkDocs hook: the benchmark write-ups (`benchmarks/*.md`) as the site's Results pages.

They stay where they are in the repository (one copy in git): each is added to the build as a
virtual page `results/<name>.md` read from its file, and the nav section titled "Results" in
mkdocs.yml (`- Results: []`) is filled with them, `RESULTS.md` first. Their relative links are
resolved against their real place in benchmarks/ by the `repo_links` hook.
"""
from __future__ import annotations

from pathlib import Path

FOLDER = "benchmarks"
SECTION = "Results"
FIRST = "RESULTS.md"


def site_name(source: Path) -> str:
    """benchmarks/DYNAMIC_SAMPLING.md -> results/dynamic-sampling.md"""
    return f"results/{source.stem.lower().replace('_', '-')}.md"


def sources(root: Path) -> list[Path]:
    return sorted((root / FOLDER).glob("*.md"), key=lambda p: (p.name != FIRST, p.name.lower()))


def _root(config) -> Path:
    return Path(config.config_file_path).resolve().parent


def on_config(config):
    for item in config.nav or []:
        if isinstance(item, dict) and item.get(SECTION) == []:
            item[SECTION] = [site_name(p) for p in sources(_root(config))]
    return config


def on_files(files, config):
    from mkdocs.structure.files import File
    for source in sources(_root(config)):
        files.append(File.generated(config, site_name(source), abs_src_path=str(source)))
    return files
