"""Screenshots of the MLflow and Prefect UIs on a turnrl run, for docs/mlflow.md and docs/prefect.md.

    python docs/screenshots.py --project PATH     # PATH: a turnrl project that ran the pipeline
                                                  # through Prefect (its mlflow.db, .prefect/)

It starts `mlflow server` on PATH/mlflow.db (or uses --mlflow-url) and `prefect server` on
PATH/.prefect (or --prefect-url), drives headless Chromium through the DevTools protocol (open a
page, wait for what it must show, click, screenshot) and writes docs/img/*.png:

    mlflow-runs.png             the experiment's runs table: pipeline runs with their params and headline metrics
    mlflow-compare.png          two pipeline runs compared (params, metrics)
    mlflow-parent-run.png       a pipeline run: description with the report table, params, metrics, data sets
    mlflow-train-metrics.png    the train run's charts, grouped by section
    mlflow-system-metrics.png   the train run's system metrics
    mlflow-traces.png           the Traces tab (rollouts and evaluation generations)
    mlflow-trace.png            one rollout opened: a span per turn, generation and tool call
    mlflow-registered-model.png the registered policy's versions with their tags
    mlflow-sft-metrics.png      the sft stage's charts (loss, held-out loss, tokens/s), where it trained
    prefect-flow-run.png        the Prefect flow run: stages as task runs, its artifacts
    prefect-results.png         the result artifact (baseline against trained)

Needs Debian's `chromium` (apt-get install -y chromium). Nothing leaves the machine: both
servers listen on 127.0.0.1 and Chromium runs with networking features off.
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import functools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run", "--hide-scrollbars",
                  "--disable-features=Translate,OptimizationHints,MediaRouter", "--force-device-scale-factor=1"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout: float = 180, ok=lambda body: True) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=5) as reply:
                if ok(reply.read()):
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} did not answer in {timeout:.0f} s")


class Service:
    """A server process of ours, stopped (its process group) at the end."""

    def __init__(self, cmd: list[str], env: dict, log: Path) -> None:
        self.proc = subprocess.Popen(cmd, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def stop(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.proc.pid, sig)
                self.proc.wait(timeout=10)
                return
            except ProcessLookupError:
                return
            except subprocess.TimeoutExpired:
                continue


# --------------------------------------------------------------------------- Chromium over CDP
class Browser:
    def __init__(self, width: int = 1600, height: int = 1000) -> None:
        self.port = free_port()
        self.profile = tempfile.mkdtemp(prefix="turnrl-chromium-")
        self.width, self.height = width, height
        self.proc = subprocess.Popen(
            ["chromium", *CHROMIUM_FLAGS, f"--user-data-dir={self.profile}", f"--remote-debugging-port={self.port}",
             f"--window-size={width},{height}", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        wait_http(f"http://127.0.0.1:{self.port}/json/version", 60)
        pages = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{self.port}/json").read())
        self.ws_url = next(p["webSocketDebuggerUrl"] for p in pages if p["type"] == "page")
        self.loop = asyncio.new_event_loop()
        self.ws = self.loop.run_until_complete(self._connect())
        self.ids = 0
        self.call("Page.enable")
        self.call("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False)

    async def _connect(self):
        import websockets
        return await websockets.connect(self.ws_url, max_size=1 << 28)

    def call(self, method: str, **params):
        return self.loop.run_until_complete(self._call(method, params))

    async def _call(self, method: str, params: dict):
        self.ids += 1
        my = self.ids
        await self.ws.send(json.dumps({"id": my, "method": method, "params": params}))
        while True:
            message = json.loads(await self.ws.recv())
            if message.get("id") == my:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message.get("result", {})

    def js(self, expression: str):
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        return result.get("result", {}).get("value")

    def open(self, url: str, wait_text: str | list[str] | None = None, timeout: float = 90, settle: float = 2.0):
        self.call("Page.navigate", url=url)
        self.wait_for(wait_text, timeout)
        time.sleep(settle)

    def wait_for(self, text: str | list[str] | None, timeout: float = 90) -> None:
        texts = [text] if isinstance(text, str) else (text or [])
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            body = self.js("document.body ? document.body.innerText : ''") or ""
            if all(t in body for t in texts) and self.js("document.readyState") == "complete":
                return
            time.sleep(0.5)
        raise RuntimeError(f"page did not show {texts} within {timeout:.0f} s; it shows:\n"
                           + (self.js("document.body ? document.body.innerText : ''") or "")[:2000])

    def click_text(self, text: str, selector: str = "button, a, [role=tab], [role=button], span, div") -> bool:
        """Click the innermost visible element whose text is exactly `text`."""
        return bool(self.js(f"""(() => {{
            const all = [...document.querySelectorAll({json.dumps(selector)})]
              .filter(e => e.innerText && e.innerText.trim() === {json.dumps(text)} && e.offsetParent !== null);
            const el = all.find(e => ![...e.children].some(c => c.innerText && c.innerText.trim() === {json.dumps(text)}))
                       || all[0];
            if (!el) return false; el.scrollIntoView({{block: 'center'}}); el.click(); return true; }})()"""))

    def shot(self, path: Path, height: int | None = None) -> None:
        if height:
            self.call("Emulation.setDeviceMetricsOverride", width=self.width, height=height, deviceScaleFactor=1,
                      mobile=False)
            time.sleep(1.0)
        data = self.call("Page.captureScreenshot", format="png")["data"]
        path.write_bytes(base64.b64decode(data))
        if height:
            self.call("Emulation.setDeviceMetricsOverride", width=self.width, height=self.height,
                      deviceScaleFactor=1, mobile=False)
        print(f"wrote {path}")

    def close(self) -> None:
        try:
            self.loop.run_until_complete(self.ws.close())
        except Exception:
            pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=10)
        shutil.rmtree(self.profile, ignore_errors=True)


# --------------------------------------------------------------------------- what to show
def close_mlflow_assistant(browser: Browser) -> None:
    """The assistant panel opens by itself and takes a third of the page: its own Close button
    (not the page's); and the traces page's feature tip."""
    browser.js("""(() => { const b = [...document.querySelectorAll('button[aria-label="Close"]')]
        .find(e => { for (let p = e.parentElement; p; p = p.parentElement)
                       if (p.innerText && p.innerText.includes('MLflow Assistant')) return p.offsetWidth < innerWidth;
                     return false; });
        if (b) b.click(); })()""")
    browser.click_text("Got it", "button")
    time.sleep(1)


def mlflow_pages(browser: Browser, url: str, out: Path, experiment: str) -> None:
    import mlflow
    client = mlflow.MlflowClient(url)
    exp = client.get_experiment_by_name(experiment)
    runs = client.search_runs([exp.experiment_id], order_by=["attributes.start_time DESC"])
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags and r.data.metrics]
    parent = parents[0]
    children = {r.data.tags.get("turnrl.pipeline.stage"): r for r in runs if r.data.tags.get("mlflow.parentRunId") ==
                parent.info.run_id}
    train = children["train"]
    base = f"{url}/#/experiments/{exp.experiment_id}"

    # the UI keeps the runs table's view in localStorage: show the columns pipeline runs are
    # compared by (by default it shows none of them)
    columns = ([f"params.`{k}`" for k in ("env.name", "algorithm.name", "seed", "train.steps")]
               + [f"metrics.`{k}`" for k in sorted(parent.data.metrics) if k.startswith("eval/") or k ==
                  "train/step_s_mean"])
    view = {"orderByKey": "attributes.start_time", "orderByAsc": False, "startTime": "ALL",
            "lifecycleFilter": "Active", "selectedColumns": columns}
    browser.open(f"{url}/", settle=1)
    state_key = 'MLflowLocalStorage-1.1-ExperimentPage-["%s"]-ReactComponentState' % exp.experiment_id
    browser.js(f"localStorage.setItem({json.dumps(state_key)}, {json.dumps(json.dumps(view))})")

    close_assistant = functools.partial(close_mlflow_assistant, browser)

    # the runs table: parent runs only, with their headline columns
    browser.open(f"{base}/runs", wait_text=parent.info.run_name, settle=3)
    close_assistant()
    browser.shot(out / "mlflow-runs.png")
    if len(parents) >= 2:
        ids = json.dumps([p.info.run_id for p in parents[:2]])
        browser.open(f"{url}/#/compare-runs?runs={urllib.request.quote(ids)}&experiments="
                     f"{urllib.request.quote(json.dumps([exp.experiment_id]))}",
                     wait_text=["eval/task/accuracy_final"], settle=3)
        close_assistant()
        browser.shot(out / "mlflow-compare.png", height=1400)
    browser.open(f"{base}/runs/{parent.info.run_id}", wait_text=["accuracy baseline", "env.name"], settle=3)
    close_assistant()
    browser.click_text("Show more", "button, a, span")   # the description's report table, unfolded
    time.sleep(1)
    browser.shot(out / "mlflow-parent-run.png", height=1500)
    browser.open(f"{base}/runs/{train.info.run_id}/model-metrics", wait_text=["rollout", "timing"], settle=6)
    close_assistant()
    browser.shot(out / "mlflow-train-metrics.png", height=1300)
    browser.open(f"{base}/runs/{train.info.run_id}/system-metrics", wait_text=["cpu_utilization_percentage"],
                 settle=6)
    close_assistant()
    browser.shot(out / "mlflow-system-metrics.png")

    mlflow.set_tracking_uri(url)
    rollouts = mlflow.search_traces(locations=[exp.experiment_id], run_id=train.info.run_id, return_type="list",
                                    order_by=["timestamp_ms DESC"])
    # a rollout that used the tool and was rewarded, with the most turns
    pick = max(rollouts, key=lambda t: (int(t.info.tags.get("turns", 0)), t.info.tags.get("reward") == "1"))
    browser.open(f"{base}/traces", wait_text=["Traces", "Rows per page"], settle=4)
    close_assistant()
    browser.shot(out / "mlflow-traces.png")
    browser.open(f"{base}/traces?selectedEvaluationId={pick.info.trace_id}", wait_text=["turn 1", "generate"],
                 settle=4)
    close_assistant()
    browser.click_text("code") or browser.click_text("search") or browser.click_text("turn 1")
    time.sleep(2)
    browser.shot(out / "mlflow-trace.png", height=1100)

    registered = client.search_registered_models()
    if registered:
        name = registered[0].name
        browser.open(f"{url}/#/models/{urllib.request.quote(name)}", wait_text=[name, "Version"], settle=3)
        close_assistant()
        browser.shot(out / "mlflow-registered-model.png")


def sft_page(browser: Browser, url: str, out: Path, experiment: str) -> bool:
    """The newest sft stage run that trained (has `sft/loss`): its charts. False if there is none."""
    import mlflow
    client = mlflow.MlflowClient(url)
    exp = client.get_experiment_by_name(experiment)
    runs = [r for r in client.search_runs([exp.experiment_id], "tags.`turnrl.pipeline.stage` = 'sft'",
                                          order_by=["attributes.start_time DESC"]) if "sft/loss" in r.data.metrics]
    if not runs:
        return False
    browser.open(f"{url}/#/experiments/{exp.experiment_id}/runs/{runs[0].info.run_id}/model-metrics",
                 wait_text=["sft", "heldout_loss"], settle=6)
    close_mlflow_assistant(browser)
    browser.shot(out / "mlflow-sft-metrics.png", height=1000)
    return True


def prefect_pages(browser: Browser, api: str, ui: str, out: Path) -> None:
    def post(path: str, body: dict):
        request = urllib.request.Request(f"{api}{path}", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        return json.loads(urllib.request.urlopen(request, timeout=30).read())
    runs = post("/flow_runs/filter", {"sort": "START_TIME_DESC", "limit": 10,
                                      "flow_runs": {"state": {"type": {"any_": ["COMPLETED"]}}}})
    run = runs[0]
    artifacts = post("/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [run["id"]]}}})
    browser.open(f"{ui}/runs/flow-run/{run['id']}", wait_text=["train", "Artifacts"], settle=4)
    browser.click_text("Artifacts", "li.p-tab, [role=tab], button")   # Prefect's tabs are list items
    browser.wait_for(["turnrl-results"])
    time.sleep(2)
    browser.shot(out / "prefect-flow-run.png")
    result = next(a for a in artifacts if a["key"] == "turnrl-results")
    browser.open(f"{ui}/artifacts/artifact/{result['id']}", wait_text=["Baseline against trained"], settle=3)
    browser.shot(out / "prefect-results.png", height=1200)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Screenshots of both UIs on a turnrl run (headless Chromium).")
    ap.add_argument("--project", type=Path, required=True, help="a turnrl project that ran the pipeline")
    ap.add_argument("--mlflow-url", default=None, help="an MLflow server with the runs (default: serve PATH/mlflow.db)")
    ap.add_argument("--prefect-url", default=None, help="a Prefect server (default: serve PATH/.prefect)")
    ap.add_argument("--experiment", default="turnrl")
    ap.add_argument("--out", type=Path, default=HERE / "img")
    ap.add_argument("--only", choices=["mlflow", "prefect", "sft"], default=None,
                    help="sft: only the sft stage's charts (a project whose pipeline ran it)")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    project = args.project.resolve()
    services: list[Service] = []
    browser = None
    env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true", "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    bin_dir = Path(sys.executable).parent
    try:
        mlflow_url = args.mlflow_url
        if not mlflow_url and args.only != "prefect":
            port = free_port()
            mlflow_url = f"http://127.0.0.1:{port}"
            services.append(Service([str(bin_dir / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port),
                                     "--backend-store-uri", f"sqlite:///{project / 'mlflow.db'}",
                                     "--artifacts-destination", str(project / "mlartifacts"), "--workers", "1"],
                                    env, Path(tempfile.gettempdir()) / "turnrl-screenshots-mlflow.log"))
            wait_http(f"{mlflow_url}/health", 240, lambda body: body.strip() == b"OK")
        prefect_ui = args.prefect_url
        if not prefect_ui and args.only in (None, "prefect"):
            port = free_port()
            prefect_ui = f"http://127.0.0.1:{port}"
            services.append(Service([str(bin_dir / "prefect"), "server", "start", "--host", "127.0.0.1", "--port",
                                     str(port)], {**env, "PREFECT_HOME": str(project / ".prefect"),
                                                 # the UI calls this API (else the default port 4200)
                                                 "PREFECT_UI_API_URL": f"{prefect_ui}/api"},
                                    Path(tempfile.gettempdir()) / "turnrl-screenshots-prefect.log"))
            wait_http(f"{prefect_ui}/api/health", 240)
        browser = Browser()
        if args.only in (None, "mlflow"):
            mlflow_pages(browser, mlflow_url, args.out, args.experiment)
        if args.only in (None, "mlflow", "sft"):
            sft_page(browser, mlflow_url, args.out, args.experiment)
        if args.only in (None, "prefect"):
            prefect_pages(browser, f"{prefect_ui}/api", prefect_ui, args.out)
    finally:
        if browser:
            browser.close()
        for service in services:
            service.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
