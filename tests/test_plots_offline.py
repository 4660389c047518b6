"""`dvc plots show` opens with its curves on a machine with no network: the page DVC writes with
the project's template (turnrl.pipeline.plots_template, installed by setup.sh) inlines vega,
vega-lite and vega-embed, loads nothing from elsewhere, and holds the data; with Node.js at hand,
every plot is drawn to SVG by the inlined scripts alone."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import pytest
import yaml

from turnrl.pipeline import plots_template

from conftest import ROOT

DVC = [sys.executable, "-m", "dvc"]
COLUMNS = ["step", "reward_mean", "accuracy", "kl_ref", "response_tokens_mean", "step_s", "rollout_s", "train_s",
           "sync_s"]

# Runs the page's own inlined vega and vega-lite (no module system, as a browser does), compiles
# each spec DVC wrote and draws it to SVG; prints {plot id: number of lines drawn (a line mark
# with at least one segment)}.
RENDER_JS = r"""
const fs = require("fs"), vm = require("vm");
const html = fs.readFileSync(process.argv[2], "utf8");
for (const name of ["vega", "vega-lite"]) {
  const m = html.match(new RegExp("<script>/\\* " + name + "@[0-9.]+ \\*/\\n([\\s\\S]*?)\\n    </script>"));
  if (!m) throw new Error("no inlined " + name);
  vm.runInThisContext(m[1]);
}
(async () => {
  const out = {};
  for (const m of html.matchAll(/var spec = (\{[\s\S]*?\});\s*vegaEmbed\('#([^']+)'/g)) {
    const view = new vega.View(vega.parse(vegaLite.compile(JSON.parse(m[1])).spec), {renderer: "none"});
    out[m[2]] = ((await view.toSVG()).match(/aria-roledescription="line mark" d="M[^"]*L/g) || []).length;
  }
  console.log(JSON.stringify(out));
})().catch(e => { console.error(String(e)); process.exit(1); });
"""


def _run(cmd, cwd, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=600,
                          env={"PATH": f"{sys.prefix}/bin:/usr/local/bin:/usr/bin:/bin", "HOME": str(cwd),
                               "DVC_NO_ANALYTICS": "1"}, **kw)


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    """A git + DVC project with this project's plots definitions and DVC config, a small
    plots/train.csv and the offline template installed as setup.sh installs it; `dvc plots show`."""
    project = tmp_path_factory.mktemp("plots")
    for cmd in (["git", "init", "-q"], DVC + ["init", "-q"]):
        assert _run(cmd, project).returncode == 0
    shutil.copy(ROOT / ".dvc" / "config", project / ".dvc" / "config")
    plots = yaml.safe_load((ROOT / "dvc.yaml").read_text())["plots"]
    (project / "dvc.yaml").write_text(yaml.safe_dump({"plots": plots}, sort_keys=False))
    rows = [[step, 0.1 + 0.0123457 * step, 0.25, 0.001 * step, 40 + step, 2.5, 1.5, 0.75, 0.25] for step in range(1, 6)]
    (project / "plots").mkdir()
    (project / "plots" / "train.csv").write_text(
        "\n".join(",".join(map(str, row)) for row in [COLUMNS, *rows]) + "\n")
    cached = ROOT / plots_template.CACHE           # the tarballs setup.sh fetched: no registry needed
    if cached.is_dir():
        shutil.copytree(cached, project / plots_template.CACHE, ignore=shutil.ignore_patterns("*.html"))
    elif shutil.which("npm") is None:
        pytest.skip("neither the npm packages fetched by setup.sh nor npm to fetch them")
    plots_template.install(project)
    proc = _run(DVC + ["plots", "show", "-o", "out"], project)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return project, (project / "out" / "index.html").read_text(encoding="utf-8"), plots


def test_the_page_inlines_vega_and_loads_nothing_from_a_network(page):
    project, html, _ = page
    assert "<script src=" not in html and "<script src=\"http" not in html
    for name, version in plots_template.versions().items():
        assert f"<script>/* {name}@{version} */" in html
    assert "vegaEmbed(" in html and len(html) > 700_000     # vega (~500 kB), vega-lite, vega-embed
    config = _run(DVC + ["config", "--local", "plots.html_template"], project).stdout.strip()
    assert config == "../.cache/plots/offline.html"


def test_the_page_holds_every_plot_and_its_data(page):
    _, html, plots = page
    for plot in plots:
        assert f"vegaEmbed('#{next(iter(plot))}'" in html
    specs = [json.loads(m) for m in re.findall(r"var spec = (\{.*?\});\s*vegaEmbed", html, flags=re.S)]
    values = [row for spec in specs for row in spec["data"]["values"]]
    assert any(float(row.get("reward_mean", -1)) == pytest.approx(0.1 + 0.0123457 * 5) for row in values)
    assert {str(row["step"]) for row in values} >= {"1", "5"}


@pytest.mark.skipif(shutil.which("node") is None, reason="Node.js draws the plots with the page's scripts")
def test_the_inlined_scripts_draw_every_curve(page, tmp_path):
    project, _, plots = page
    script = tmp_path / "render.js"
    script.write_text(RENDER_JS)
    proc = _run(["node", str(script), str(project / "out" / "index.html")], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    drawn = json.loads(proc.stdout)
    assert set(drawn) >= {next(iter(plot)) for plot in plots}
    assert all(lines >= 1 for lines in drawn.values()), drawn
    assert drawn["reward"] >= 2 and drawn["step_time"] >= 4, drawn       # a curve per y field


def test_the_curve_csv_keeps_columns_that_appear_after_step_one(tmp_path):
    """Held-out accuracy is measured every train.eval_every steps: its column must not be lost
    because step 1 has none (the csv's columns are every step's keys, not the first step's)."""
    import csv

    from turnrl.pipeline.plots import write_csv
    history = [{"step": 1, "reward_mean": 0.1}, {"step": 2, "reward_mean": 0.2, "heldout_accuracy": 0.5},
               {"step": 3, "reward_mean": 0.3, "health_staleness": 1.0}]
    write_csv(history, tmp_path / "train.csv")
    rows = list(csv.DictReader((tmp_path / "train.csv").open()))
    assert list(rows[0]) == ["step", "reward_mean", "heldout_accuracy", "health_staleness"]
    assert [r["heldout_accuracy"] for r in rows] == ["", "0.5", ""]
    assert rows[2]["health_staleness"] == "1.0"
