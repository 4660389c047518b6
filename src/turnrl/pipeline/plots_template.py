"""An HTML page template for `dvc plots show` with vega, vega-lite and vega-embed inlined, so the
plots open with their curves on a machine with no network (DVC's own page loads the three
scripts from a CDN, and offline it is blank).

The scripts are the builds of the versions DVC's page names, taken from the npm registry at
set-up time (`npm pack`, cached in .cache/plots/); nothing third-party is committed. `python -m
turnrl.pipeline.plots_template` (setup.sh runs it) writes the template to
.cache/plots/offline.html and points DVC at it in .dvc/config.local (`plots.html_template`), so
`dvc plots show` uses it in this checkout; without it DVC's default page is used as before.
"""
from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

#: the versions of dvc-render's page (VegaRenderer.SCRIPTS), if it cannot be read
_FALLBACK = {"vega": "5.20.2", "vega-lite": "5.2.0", "vega-embed": "6.18.2"}
CACHE = Path(".cache/plots")
TEMPLATE = CACHE / "offline.html"
# DVC fills {refresh_tag} and {plot_divs}; with no {scripts} placeholder it adds no CDN tags
_PAGE = """<!DOCTYPE html>
<html>
<head>
    {{refresh_tag}}
    <title>DVC Plot</title>
{scripts}
    <style>
        table {{
            border-spacing: 15px;
        }}
    </style>
</head>
<body>
    {{plot_divs}}
</body>
</html>
"""


class TemplateError(RuntimeError):
    """The scripts could not be had; the message says how to get them."""


def versions() -> dict[str, str]:
    """The vega packages and versions DVC's own page loads, so the inlined ones behave the same."""
    try:
        from dvc_render.vega import VegaRenderer
        found = dict(re.findall(r"npm/([a-z-]+)@([0-9.]+)", VegaRenderer.SCRIPTS))
    except ImportError:
        found = {}
    return found if set(found) == set(_FALLBACK) else dict(_FALLBACK)


def _tarball(cache: Path, name: str, version: str) -> Path:
    path = cache / f"{name}-{version}.tgz"
    if path.is_file():
        return path
    npm = shutil.which("npm")
    if npm is None:
        raise TemplateError(f"npm not found: it fetches {name}@{version} from the npm registry "
                            "(install Node.js and npm, then rerun setup.sh)")
    cache.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run([npm, "pack", f"{name}@{version}", "--pack-destination", str(cache), "--silent"],
                          capture_output=True, text=True, timeout=600)
    if proc.returncode != 0 or not path.is_file():
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise TemplateError(f"npm pack {name}@{version} failed: {last}")
    return path


def script(tarball: Path, name: str) -> str:
    """The package's minified browser build (what the CDN serves for it)."""
    with tarfile.open(tarball) as tar:
        member = tar.extractfile(f"package/build/{name}.min.js")
        if member is None:
            raise TemplateError(f"{tarball}: no package/build/{name}.min.js")
        text = member.read().decode("utf-8")
    return text.replace("</script", "<\\/script")   # never ends the inline <script> early


def page(cache: Path = CACHE) -> str:
    """The template's text: the three scripts inlined, in the order they load (vega first)."""
    tags = [f"    <script>/* {name}@{version} */\n{script(_tarball(cache, name, version), name)}\n    </script>"
            for name, version in versions().items()]
    return _PAGE.format(scripts="\n".join(tags))


def install(project: Path = Path(".")) -> Path:
    """Write the template under the project's .cache/plots and set `plots.html_template` in
    .dvc/config.local (relative to .dvc/, as DVC reads it). Safe to run again."""
    project = project.resolve()
    target = project / TEMPLATE
    text = page(project / CACHE)
    if not target.is_file() or target.read_text(encoding="utf-8") != text:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text, encoding="utf-8")
    subprocess.run([sys.executable, "-m", "dvc", "config", "--local", "plots.html_template",
                    f"../{TEMPLATE.as_posix()}"], cwd=project, check=True, capture_output=True, text=True)
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m turnrl.pipeline.plots_template",
                                     description="Make `dvc plots show` work offline: vega inlined in a local "
                                                 "HTML template, set in .dvc/config.local.")
    parser.add_argument("project", nargs="?", default=".", help="the DVC project folder (default: .)")
    args = parser.parse_args(argv)
    try:
        path = install(Path(args.project))
    except (TemplateError, subprocess.SubprocessError, OSError) as exc:
        print(f"error: offline plots template: {exc}", file=sys.stderr)
        return 2
    print(f"dvc plots show: vega inlined from {path} (plots.html_template in .dvc/config.local)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
