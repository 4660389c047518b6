"""MLflow: one parent run per pipeline run, one child run per stage execution.

Stages run as separate processes under `dvc repro` (or a Prefect flow), so they find their
common parent run by a key: `$TURNRL_PIPELINE_KEY` if set (the Prefect flow sets it to its
flow run id), else the id and start time of the `dvc` process they run under, else their own
process (a stage run by hand gets a parent of its own).

Default store: a sqlite file `mlflow.db` and a folder `mlartifacts/` in the project; see them
with `mlflow ui --backend-store-uri sqlite:///mlflow.db`. `tracking.uri` selects any server.

What a stage records goes through a `Recorder`: per-step metrics and traces are sent from a
background thread, so training never waits for the tracking server. A server that stops
answering is retried for `tracking.retry_s` seconds; then the stage goes on without it, with
one warning naming what was not recorded (and a count at the end of the stage). Local results
(plots/, metrics/, checkpoints/, models/) never depend on it.

The parent run is what runs are compared by: the params that identify a pipeline run
(environment, algorithm, model, seed, steps, and every key changed from its default), the
headline metrics (per benchmark: baseline, final, diff; training wall time and mean step time)
and a description with the report's table. Stage runs carry every param, metrics in sections
(`rollout/`, `loss/`, `timing/`, `tools/`, `eval/<benchmark>/`, ... so the UI groups them),
system metrics (`system/`), their data sets as run inputs (digest: the file's DVC md5), and
traces of sampled trajectories (turnrl.tracking.traces). The train run logs the final policy as an
MLflow transformers model; `tracking.register_model` adds a registry version after `eval`.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import queue
import re
import subprocess
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator

from turnrl.config import Config

PIPELINE_KEY_TAG = "turnrl.pipeline_key"
FINGERPRINT_TAG = "turnrl.model_fingerprint"
log = logging.getLogger(__name__)

# MLflow's HTTP client retries a failed request 7 times with exponential backoff (about four
# minutes per call); the Recorder does its own retrying, so each attempt should fail fast.
# Set (unless set already) when a stage opens its run.
MLFLOW_ENV_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "20",
                 # traces are exported by the Recorder's thread itself, so it sees their failures
                 "MLFLOW_ENABLE_ASYNC_TRACE_LOGGING": "false",
                 # trace and span ids from a private generator: OpenTelemetry's default draws them
                 # from the global `random`, which every stage seeds alike, so the baseline and the
                 # final evaluation made the same trace ids and the server kept one of each pair
                 # (and drawing them would move the training's random stream)
                 "MLFLOW_TRACE_USE_ISOLATED_RANDOM_ID_GENERATOR": "true",
                 "MLFLOW_DISABLE_TELEMETRY": "true"}


def project_root() -> Path:
    return Path(os.environ.get("DVC_ROOT") or os.getcwd()).resolve()


def tracking_uri(cfg: Config, root: str | Path | None = None) -> str:
    return cfg.tracking.uri or f"sqlite:///{Path(root).resolve() if root else project_root()}/mlflow.db"


def ui_url(cfg: Config) -> str:
    """The MLflow UI's base address: tracking.ui_url, else tracking.uri when it is a server."""
    if cfg.tracking.ui_url:
        return cfg.tracking.ui_url.rstrip("/")
    if cfg.tracking.uri.startswith(("http://", "https://")):
        return cfg.tracking.uri.rstrip("/")
    return "http://127.0.0.1:5000"


def run_link(cfg: Config, experiment_id: str, run_id: str) -> str:
    return f"{ui_url(cfg)}/#/experiments/{experiment_id}/runs/{run_id}"


def pipeline_key() -> str:
    if os.environ.get("TURNRL_PIPELINE_KEY"):
        return os.environ["TURNRL_PIPELINE_KEY"]
    try:
        import psutil
        proc = psutil.Process().parent()
        while proc is not None:
            # `dvc ...` or `python .../bin/dvc ...`
            if any(Path(arg).name == "dvc" for arg in proc.cmdline()[:2]):
                return f"dvc:{proc.pid}:{int(proc.create_time())}"
            proc = proc.parent()
    except Exception:  # no psutil, no /proc: fall back to this process
        pass
    return f"proc:{os.getpid()}:{int(time.time())}"


def git_commit() -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
                             cwd=project_root()).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, timeout=10, cwd=project_root()).stdout.strip()
        return (sha or "unknown") + ("-dirty" if dirty else "")
    except Exception:
        return "unknown"


# --------------------------------------------------------------------------- quiet logs
class OnceFilter(logging.Filter):
    """Lets a warning through the first time only: a message repeated every step (vLLM's
    `RotaryEmbedding: Failed to load weights` after each weight push) is shown once. Messages
    are compared with their numbers masked. INFO and below, errors, and turnrl's own warnings
    (each says something new, e.g. a health check failing again) pass unchanged."""

    def __init__(self, name: str = "") -> None:
        super().__init__(name)
        self.seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING or record.levelno >= logging.ERROR or record.name.startswith("turnrl"):
            return True
        try:
            key = f"{record.name}:{re.sub(r'[0-9.]+', '#', record.getMessage())}"
        except Exception:
            return True
        if key in self.seen:
            return False
        self.seen.add(key)
        return True


def vllm_logging_config(level: str) -> dict:
    """vLLM's own logging configuration at `level`, with OnceFilter on its handler."""
    fmt = ("%(vllm_process_name)s pid=%(process)d) %(levelname)s %(asctime)s [%(fileinfo)s:%(lineno)d] "
           "%(message)s")
    return {
        "version": 1, "disable_existing_loggers": False,
        "formatters": {"vllm": {"()": "vllm.logging_utils.NewLineFormatter", "datefmt": "%m-%d %H:%M:%S",
                                "format": "(" + fmt}},
        "filters": {"once": {"()": "turnrl.tracking.OnceFilter"}},
        "handlers": {"vllm": {"class": "logging.StreamHandler", "formatter": "vllm", "level": level,
                              "stream": "ext://sys.stdout", "filters": ["once"]}},
        "loggers": {"vllm": {"handlers": ["vllm"], "level": level, "propagate": False}},
    }


def quiet_logs() -> None:
    """Stage logs that read as progress bars plus the lines that matter: vLLM (in this process
    and, through the environment, in the Ray actors it starts) logs warnings and errors only,
    each repeated warning once (`VLLM_LOGGING_LEVEL=INFO` brings its startup report back);
    this process's own handlers drop repeated warnings too."""
    level = os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING").upper()
    if "VLLM_LOGGING_CONFIG_PATH" not in os.environ and os.environ.get("VLLM_CONFIGURE_LOGGING", "1") != "0":
        import tempfile
        path = Path(tempfile.gettempdir()) / f"turnrl-vllm-logging-{level.lower()}.json"
        text = json.dumps(vllm_logging_config(level), indent=1)
        try:
            if not path.exists() or path.read_text() != text:
                tmp = path.with_name(f"{path.name}.{os.getpid()}")
                tmp.write_text(text)
                tmp.replace(path)
            os.environ["VLLM_LOGGING_CONFIG_PATH"] = str(path)
        except OSError:
            pass
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, OnceFilter) for f in handler.filters):
            handler.addFilter(OnceFilter())
    # MLflow's hints when it infers a table's or a data set's schema: about its own conventions, every time
    warnings.filterwarnings("ignore", message="Hint: Inferred schema contains integer column", module="mlflow")
    warnings.filterwarnings("ignore", message="The specified dataset source can be interpreted", module="mlflow")
    for name in ("mlflow.tracing.fluent", "mlflow.tracking._tracking_service.client", "alembic.runtime.migration",
                 "mlflow.store.db.utils", "mlflow.system_metrics.system_metrics_monitor"):
        logging.getLogger(name).setLevel(logging.WARNING)


# --------------------------------------------------------------------------- metric sections
_SECTION_RULES: list[tuple[str, str]] = [   # (regex on the flat name, section); first match wins
    (r"^health_", "health"),
    (r"^high_", "high"),
    (r"^mlmt_", "mlmt"),
    (r"^(tool_|env_tool|tools?_)|_tool_|^env_(answer_in_results|searches|tool_calls)", "tools"),
    (r"(_s|_s_mean)$|_idle_frac$|^gen_tokens_per_s", "timing"),
    (r"^advantage", "advantage"),
    (r"^(value_|explained_variance|critic_|returns?_)", "critic"),
    (r"^logp_gap", "logprob_gap"),
    (r"^(loss|entropy|grad_norm|clip_fraction|dual_clip_fraction|approx_kl|ratio_|kl_|pg_|policy_)", "loss"),
    (r"^(reward|accuracy|turns?|response_tokens|groups_|finish_|env_|trained_tokens|tool_calls_mean)", "rollout"),
]


def mlflow_name(key: str, default: str = "train") -> str:
    """The MLflow name of a flat metric key, in its section: `reward_mean` -> `rollout/reward_mean`,
    `loss` -> `loss/loss`, `step_s` -> `timing/step_s`, `tool_success_rate` -> `tools/...`,
    `health_no_signal` -> `health/no_signal` (prefix dropped where it names the section). Keys
    that already have a section pass unchanged. plots/train.csv and metrics/*.json keep the flat
    keys."""
    if "/" in key:
        return key
    for pattern, section in _SECTION_RULES:
        if re.search(pattern, key):
            name = key.removeprefix(f"{section}_") if section in ("health", "high", "mlmt") else key
            return f"{section}/{name}"
    return f"{default}/{key}"


def _clean(metrics: dict[str, Any]) -> dict[str, float]:
    """Numeric entries (NaN, inf, bools and non-numbers skipped), names made MLflow-safe."""
    out = {}
    for k, v in metrics.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or v in (float("inf"), float("-inf")):
            continue
        out[re.sub(r"[^\w\-. :/]", "_", k)] = float(v)
    return out


# --------------------------------------------------------------------------- the recorder
class _Outage(Exception):
    """The tracking server did not take a request (connection refused, timeout, 5xx)."""


def _is_outage(exc: BaseException) -> bool:
    """A failure a retry may fix (the server or store is unreachable, busy or broken), as
    opposed to a request the server refused (4xx: a bad value, a duplicate)."""
    from mlflow.exceptions import MlflowException
    if isinstance(exc, _Outage):
        return True
    if isinstance(exc, MlflowException):
        try:
            status = exc.get_http_status_code()
        except Exception:
            status = 500
        text = str(exc)
        if "database is locked" in text:
            return True
        return status >= 500 or status == 429
    return isinstance(exc, (OSError, TimeoutError, ConnectionError)) or "requests" in type(exc).__module__ \
        or "urllib3" in type(exc).__module__ or "sqlalchemy" in type(exc).__module__


def _reason(exc: BaseException) -> str:
    """An outage's cause in a few words (MLflow wraps the HTTP client's error in a long message)."""
    text = " ".join(str(exc).split())
    for needle, words in (("Connection refused", "connection refused"), ("timed out", "timed out"),
                          ("Read timed out", "timed out"), ("Name or service not known", "unknown host"),
                          ("Connection reset", "connection reset"), ("Remote end closed", "connection closed")):
        if needle in text:
            return words
    found = re.search(r"response code (\d+)|status code (\d+)|HTTP (\d{3})", text)
    if found:
        return f"HTTP {next(g for g in found.groups() if g)}"
    return f"{type(exc).__name__}: {text[:160]}"


class _ThreadWarnings(logging.Handler):
    """Collects the warnings the Recorder's own thread logs (MLflow's trace exporter reports a
    failed export as a warning instead of raising; urllib3 warns on every retry) and keeps them
    out of the stage log: the Recorder reports outages itself, once."""

    def __init__(self, thread_name: str) -> None:
        super().__init__(logging.WARNING)
        self.thread_name = thread_name
        self.caught: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        pass

    def filter(self, record: logging.LogRecord) -> bool:  # as a filter on other handlers: False hides it
        if record.threadName != self.thread_name or record.levelno < logging.WARNING or record.name.startswith("turnrl"):
            return True
        self.caught.append(record.getMessage())
        return False


class Recorder:
    """Records to MLflow without holding the stage up.

    `submit(kind, what, fn)` queues `fn(client)` for a background thread; `now(kind, what, fn)`
    runs `fn()` at once in the caller's thread (for the fluent API's calls at the end of a
    stage, e.g. logging the model). Both retry a call that fails on an outage for `retry_s`
    seconds (from the outage's start), then give up: one warning saying what is not recorded,
    and everything after that is dropped without trying, counted, and summed up when the stage
    ends. A request the server refuses (a 4xx) drops that item only, with a warning once per
    kind."""

    run_id: str | None = None   # the stage run (set by stage_run): where metrics go by default

    def __init__(self, uri: str, *, retry_s: float = 30.0, stage: str = "stage", max_queue: int = 10_000) -> None:
        from mlflow import MlflowClient
        self.uri, self.retry_s, self.stage = uri, retry_s, stage
        self.client = MlflowClient(uri)
        self.queue: queue.PriorityQueue = queue.PriorityQueue(maxsize=max_queue)   # metrics first
        self._seq = 0
        self.down: str | None = None           # why it gave up, once it has
        self.outage_since: float | None = None
        self.dropped: dict[str, list[str]] = {}
        self.refused: dict[str, int] = {}
        self.sent = 0
        self.busy_s = 0.0                      # time the background thread spent sending
        self.cpu_s = 0.0                       # ... and the CPU time it used (what it can take from training)
        self.cpu_by_kind: dict[str, float] = {}   # ... split by what was sent (traces, metrics, ...)
        self._cond = threading.Condition()
        self._pending = 0                      # submitted, not yet handled
        self._closed = False
        self.thread = threading.Thread(target=self._work, name=f"turnrl-mlflow-{stage}", daemon=True)
        self._warnings = _ThreadWarnings(self.thread.name)
        self._hidden: list[tuple[Any, logging.Filterer]] = []
        self._hide_thread_warnings()
        self.thread.start()

    # ----------------------------------------------------------------- what stages call
    def submit(self, kind: str, what: str, fn: Callable[[Any], Any], priority: int = 1) -> threading.Event:
        """Queue `fn(client)` (lower `priority` first, then in order); never blocks (a full queue
        drops the item, counted). The event is set once the item was handled (sent or dropped)."""
        done = threading.Event()
        with self._cond:
            if self.down or self._closed:
                self._drop(kind, what)
                done.set()
                return done
            try:
                self._seq += 1
                self.queue.put_nowait((priority, self._seq, (kind, what, fn, done)))
                self._pending += 1
            except queue.Full:
                self._drop(kind, what)
                done.set()
        return done

    def now(self, kind: str, what: str, fn: Callable[[], Any]) -> Any:
        """Run `fn()` here with the same retry-then-drop rule; None when it was dropped."""
        if self.down:
            with self._cond:
                self._drop(kind, what)
            return None
        return self._attempt(kind, what, fn)

    def metrics(self, metrics: dict[str, Any], step: int | None = None, run_id: str | None = None,
                sections: bool = True, kind: str = "metrics") -> threading.Event | None:
        """Queue a batch of metrics (ahead of traces and artifacts); the event says when sent."""
        from mlflow.entities import Metric
        clean = _clean({mlflow_name(k) if sections else k: v for k, v in metrics.items()})
        if not clean:
            return None
        stamp = int(time.time() * 1000)
        batch = [Metric(k, v, stamp, step or 0) for k, v in clean.items()]
        target = run_id or self.run_id
        return self.submit(kind, f"step {step}" if step is not None else "summary",
                           lambda c: [c.log_batch(target, metrics=batch[i:i + 900]) for i in range(0, len(batch), 900)],
                           priority=0)

    def flush(self, timeout: float) -> bool:
        """Wait up to `timeout` s for what was submitted to be handled (not during an outage:
        then it returns at once); True when nothing is pending."""
        with self._cond:
            if self.down or self.outage_since is not None:
                return self._pending == 0
            return self._cond.wait_for(lambda: self._pending == 0 or self.down is not None, timeout)

    def close(self) -> None:
        """Send what is queued (the stage is over; an outage ends it after the retry window),
        stop the thread, and log what was not recorded."""
        with self._cond:
            self._closed = True
            self._cond.wait_for(lambda: self._pending == 0)
        self.queue.put((99, 0, None))
        self.thread.join(timeout=10)
        self._show_thread_warnings()
        if self.dropped:
            log.info("not recorded to MLflow (%s): %s", self.uri, self.dropped_summary())

    def dropped_summary(self) -> str:
        parts = []
        for kind, items in self.dropped.items():
            if kind == "metrics":
                steps = sorted({int(m.group(1)) for i in items if (m := re.match(r"step (\d+)", i))})
                other = sum(1 for i in items if not re.match(r"step \d+", i))
                text = f"metrics of {len(steps)} steps" + (f" ({steps[0]}-{steps[-1]})" if steps else "")
                parts.append(text + (f" and {other} other metric batches" if other else ""))
            elif kind in ("traces", "system metrics"):
                parts.append(f"{len(items)} {kind}")
            else:
                parts.append(f"{kind}: {', '.join(dict.fromkeys(items))}")
        return "; ".join(parts)

    # ----------------------------------------------------------------- the thread
    def _work(self) -> None:
        background_priority()
        while True:
            item = self.queue.get()[2]
            if item is None:
                return
            kind, what, fn, done = item
            start, cpu = time.perf_counter(), time.thread_time()
            if self.down:
                with self._cond:
                    self._drop(kind, what)
            else:
                self._attempt(kind, what, lambda: fn(self.client))
            self.busy_s += time.perf_counter() - start
            used = time.thread_time() - cpu
            self.cpu_s += used
            self.cpu_by_kind[kind] = self.cpu_by_kind.get(kind, 0.0) + used
            done.set()
            with self._cond:
                self._pending -= 1
                self._cond.notify_all()

    def _attempt(self, kind: str, what: str, call: Callable[[], Any]) -> Any:
        delay = 0.5
        while True:
            if self.down:
                with self._cond:
                    self._drop(kind, what)
                return None
            before = len(self._warnings.caught)
            try:
                result = call()
                failed = [m for m in self._warnings.caught[before:] if "Failed to" in m]
                if failed:
                    raise _Outage(failed[0])
                with self._cond:
                    self.outage_since = None
                self.sent += 1
                return result
            except Exception as exc:   # noqa: BLE001 - recording must never stop the stage
                if not _is_outage(exc):
                    with self._cond:
                        self.refused[kind] = self.refused.get(kind, 0) + 1
                        first = self.refused[kind] == 1
                    if first:
                        log.warning("MLflow refused to record %s (%s): %s: %s", kind, what, type(exc).__name__,
                                    str(exc)[:300])
                    return None
                now = time.monotonic()
                with self._cond:
                    self.outage_since = self.outage_since or now
                    since = self.outage_since
                if now - since >= self.retry_s:
                    self._give_up(_reason(exc), kind, what)
                    return None
                time.sleep(max(0.05, min(delay, self.retry_s - (now - since))))
                delay = min(delay * 2, 8.0)

    def _give_up(self, why: str, kind: str, what: str) -> None:
        with self._cond:
            self._drop(kind, what)
            if self.down:
                return
            self.down = why
            while True:   # what is queued will not be sent either
                try:
                    item = self.queue.get_nowait()[2]
                except queue.Empty:
                    break
                if item is not None:
                    self._drop(item[0], item[1])
                    item[3].set()
                    self._pending -= 1
            self._cond.notify_all()
        log.warning("MLflow at %s did not answer for %.0f s (%s): the %s stage goes on without it. Not "
                    "recorded: %s (%s) and everything this stage would record after it (metrics, traces, "
                    "artifacts, the model; counted at the end of the stage). Local results (plots/, metrics/, "
                    "checkpoints/, models/) are complete.",
                    self.uri, self.retry_s, why.replace("\n", " ")[:300], self.stage, kind, what)

    def _drop(self, kind: str, what: str) -> None:   # with self._cond held
        self.dropped.setdefault(kind, []).append(what)

    # the loggers whose warnings from this thread are caught (an outage is reported once, by the Recorder)
    _QUIET = ("", "mlflow", "urllib3", "urllib3.connectionpool", "mlflow.tracing.export.mlflow_v3",
              "mlflow.tracing.client", "mlflow.tracking._tracking_service.client")

    def _hide_thread_warnings(self) -> None:
        for name in self._QUIET:
            logger = logging.getLogger(name)
            for target in [logger, *logger.handlers]:
                target.addFilter(self._warnings)
                self._hidden.append((name, target))

    def _show_thread_warnings(self) -> None:
        for _, target in self._hidden:
            target.removeFilter(self._warnings)
        self._hidden.clear()


def background_priority(nice: int = 19) -> None:
    """Lower the calling thread's CPU priority (Linux: per thread): recording then runs on the
    cores' idle time and gives way to the training actors when they need it."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except (AttributeError, OSError):
        pass


_recorder: Recorder | None = None
_stage: "StageRun | None" = None


def recorder() -> Recorder | None:
    """The active stage's Recorder (None outside `stage_run`)."""
    return _recorder


def current_run() -> "StageRun | None":
    """The active `stage_run` (None outside one)."""
    return _stage


# --------------------------------------------------------------------------- system metrics
class SystemMetrics:
    """CPU, memory, disk, network (and GPU where there is one) every `interval` seconds as
    `system/...` metrics of the stage run (MLflow's own monitors, sent through the Recorder)."""

    def __init__(self, rec: Recorder, run_id: str, interval: float = 10.0) -> None:
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor
        self.monitor = SystemMetricsMonitor(run_id, sampling_interval=interval, tracking_uri=rec.uri)
        # MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL, when set, wins (MLflow's own rule)
        self.rec, self.run_id, self.interval = rec, run_id, float(self.monitor.sampling_interval)
        self.stop_event = threading.Event()
        self.step = 0
        self.thread = threading.Thread(target=self._loop, name="turnrl-system-metrics", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        background_priority()
        while not self.stop_event.wait(self.interval):
            try:
                self.monitor.collect_metrics()
                values = self.monitor.aggregate_metrics()
                for m in self.monitor.monitors:
                    m.clear_metrics()
            except Exception:   # noqa: BLE001 - a monitor that fails stops quietly
                return
            self.rec.metrics({f"system/{k}": v for k, v in values.items()}, step=self.step, run_id=self.run_id,
                             sections=False, kind="system metrics")
            self.step += 1

    def stop(self) -> None:
        self.stop_event.set()
        self.thread.join(timeout=5)


# --------------------------------------------------------------------------- runs
def _experiment_id(mlflow, name: str) -> str:
    exp = mlflow.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    location = None
    if mlflow.get_tracking_uri().startswith("sqlite:"):
        location = (project_root() / "mlartifacts").as_uri()
    try:
        return mlflow.create_experiment(name, artifact_location=location)
    except Exception:  # created concurrently
        return mlflow.get_experiment_by_name(name).experiment_id


def find_parent(client, experiment_id: str, key: str):
    found = client.search_runs([experiment_id], filter_string=f"tags.`{PIPELINE_KEY_TAG}` = '{key}'", max_results=1)
    return found[0] if found else None


def _parent_run_id(mlflow, experiment_id: str, key: str) -> str:
    found = find_parent(mlflow.MlflowClient(), experiment_id, key)
    if found:
        return found.info.run_id
    name = os.environ.get("DVC_EXP_NAME") or time.strftime("pipeline %Y-%m-%d %H:%M:%S")
    client = mlflow.MlflowClient()
    run = client.create_run(experiment_id, run_name=name,
                            tags={PIPELINE_KEY_TAG: key, "turnrl.git_commit": git_commit(),
                                  "mlflow.source.git.commit": git_commit()})
    return run.info.run_id


#: Params every pipeline run's parent carries, changed or not: what identifies a run.
IDENTIFYING = ("env.name", "algorithm.name", "model.path", "seed", "train.steps", "rollout.n", "rollout.max_turns",
               "rollout.engine", "train.lr", "train.prompts_per_step", "data.train_set", "data.heldout_set")


def identifying_params(cfg: Config) -> dict[str, str]:
    """The parent run's params: IDENTIFYING, plus every key whose value differs from its default
    (so two runs that differ in a knob show it in the compare view)."""
    flat, default = cfg.flat(), Config().flat()
    keys = [k for k in IDENTIFYING if k in flat] + sorted(k for k in flat if k not in IDENTIFYING
                                                         and flat[k] != default.get(k) and not k.startswith("tracking."))
    return {k: _param(flat[k]) for k in keys}


class StageRun:
    """What `stage_run` yields: the stage's MLflow run, its pipeline parent, and the Recorder."""

    def __init__(self, run, parent_id: str, experiment_id: str, rec: Recorder, cfg: Config, stage: str) -> None:
        self.run, self.parent_id, self.experiment_id, self.recorder = run, parent_id, experiment_id, rec
        self.cfg, self.stage = cfg, stage

    @property
    def info(self):   # so `with stage_run(...) as run: run.info.run_id` keeps working
        return self.run.info

    @property
    def run_id(self) -> str:
        return self.run.info.run_id


@contextlib.contextmanager
def stage_run(stage: str, cfg: Config, resume_run_id: str | None = None) -> Iterator[StageRun]:
    """Open the pipeline's parent run and a nested run for `stage`; log the config, params,
    git commit and DVC stage, start the Recorder and system metrics. On an exception both runs
    are marked FAILED.

    `resume_run_id` (a stage continuing after a crash, e.g. train from a checkpoint): that
    run is reopened and continued, where it was, so its metrics stay one history; the
    pipeline's parent run gets a tag pointing at it. If it is not in this store, a new run
    is made and tagged `turnrl.resumed_from_run` instead."""
    global _recorder, _stage
    for key, value in MLFLOW_ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    quiet_logs()
    import mlflow
    uri = tracking_uri(cfg)
    try:
        mlflow.set_tracking_uri(uri)
        experiment_id = _experiment_id(mlflow, cfg.tracking.experiment)
        parent = _parent_run_id(mlflow, experiment_id, pipeline_key())
    except Exception as exc:
        raise RuntimeError(
            f"MLflow at {uri} is not usable ({type(exc).__name__}: {exc}). "
            "Check tracking.uri in params.yaml (empty = the sqlite file in the project) "
            "and that the server is running") from None
    client = mlflow.MlflowClient()
    reopened = _existing_run(mlflow, resume_run_id, experiment_id)
    if reopened:   # the crashed pipeline's parent run never ended: say so
        crashed = reopened.data.tags.get("mlflow.parentRunId")
        if crashed and crashed != parent and client.get_run(crashed).info.status == "RUNNING":
            client.set_terminated(crashed, "KILLED")
    rec = Recorder(uri, retry_s=cfg.tracking.retry_s, stage=stage)
    system = None
    status = "FINISHED"
    try:
        mlflow.start_run(run_id=parent, experiment_id=experiment_id)
        mlflow.set_tag(f"turnrl.pipeline.stage.{stage}", f"resumed run {reopened.info.run_id}" if reopened else "ran")
        parent_params = client.get_run(parent).data.params
        new = {k: v for k, v in identifying_params(cfg).items() if k not in parent_params}
        if new:
            mlflow.log_params(new)
        run = mlflow.start_run(run_id=reopened.info.run_id if reopened else None,
                               run_name=None if reopened else stage, nested=True, experiment_id=experiment_id)
        mlflow.set_tags({"turnrl.pipeline.stage": stage, "dvc.stage": os.environ.get("DVC_STAGE", stage),
                         "mlflow.source.git.commit": git_commit(),
                         "dvc.exp_name": os.environ.get("DVC_EXP_NAME", "")})
        params = {k: _param(v) for k, v in cfg.flat().items()}
        if reopened:   # MLflow keeps a param's first value: record what changed as a tag
            logged = reopened.data.params
            changed = {k: v for k, v in params.items() if k in logged and logged[k] != v}
            params = {k: v for k, v in params.items() if k not in logged}
            if changed:
                mlflow.set_tag("turnrl.params_changed_on_resume", json.dumps(changed)[:5000])
        elif resume_run_id:
            mlflow.set_tag("turnrl.resumed_from_run", resume_run_id)
        mlflow.log_params(params)
        mlflow.log_dict(cfg.model_dump(), "config.json")
        rec.run_id = run.info.run_id
        _recorder = rec
        if cfg.tracking.system_metrics:
            system = SystemMetrics(rec, run.info.run_id)
        _stage = StageRun(run, parent, experiment_id, rec, cfg, stage)
        yield _stage
    except BaseException:
        status = "FAILED"
        raise
    finally:
        if system is not None:
            system.stop()
        if rec.run_id:   # what recording cost this stage: the Recorder thread's time, read when sent (last)
            from mlflow.entities import Metric

            def cost(client, run_id=rec.run_id):
                stamp = int(time.time() * 1000)
                totals = [("thread_busy_s", rec.busy_s), ("thread_cpu_s", rec.cpu_s), ("items_sent", rec.sent)]
                by_kind = [(f"thread_cpu_s/{kind.replace(' ', '_')}", used) for kind, used in rec.cpu_by_kind.items()]
                client.log_batch(run_id, metrics=[Metric(f"timing/mlflow_{k}", float(v), stamp, 0)
                                                  for k, v in totals + by_kind])
            rec.submit("metrics", "recording cost", cost, priority=9)
        rec.close()
        _recorder = _stage = None
        _end_runs(rec, status)
        _release_tracer()


def _release_tracer() -> None:
    """Drop MLflow's tracer provider once the stage's traces are sent (the next trace makes a
    new one). Its isolated id generator unregisters itself in `__del__` from a module global;
    collected at interpreter exit, after that global became None, it printed a traceback
    ("Exception ignored in ... __del__") at the end of every stage's log."""
    import mlflow.tracing.provider
    mlflow.tracing.provider.reset()


def _end_runs(rec: Recorder, status: str) -> None:
    """End the stage run and the parent (on a server that answers: one that went away is not
    waited for again, and the runs stay RUNNING there)."""
    from mlflow.tracking.fluent import _active_run_stack
    stack = _active_run_stack.get()
    while stack:
        run_id = stack.pop().info.run_id
        rec.now("run status", f"{run_id} {status}", lambda: rec.client.set_terminated(run_id, status))


def _existing_run(mlflow, run_id: str | None, experiment_id: str):
    """The run `run_id` if this store has it (not deleted) in this experiment, else None."""
    if not run_id:
        return None
    try:
        run = mlflow.MlflowClient().get_run(run_id)
    except Exception:
        return None
    ok = run.info.experiment_id == experiment_id and run.info.lifecycle_stage == "active"
    return run if ok else None


def _param(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, str) else value
    return text[:500]


def log_metrics(metrics: dict[str, float], step: int | None = None, sections: bool = True):
    """Log the numeric entries (NaN and non-numbers skipped) to the stage run, names made
    MLflow-safe and put in their section (`mlflow_name`); through the Recorder inside
    `stage_run` (returns the event set once they were sent), else directly to the active run."""
    if _recorder is not None:
        return _recorder.metrics(metrics, step, sections=sections)
    import mlflow
    clean = _clean({mlflow_name(k) if sections else k: v for k, v in metrics.items()})
    if clean:
        mlflow.log_metrics(clean, step=step)


def backfill_steps(run: StageRun, history: list[dict], probe: str = "reward_mean") -> None:
    """Per-step metrics of `history` (a resumed checkpoint's) that the run does not have yet:
    a crashed stage may die with steps still queued. Which steps are there is read from the
    history of `probe` (queued, in the Recorder's thread)."""
    from mlflow.entities import Metric

    def fill(client):
        have = {m.step for m in client.get_metric_history(run.run_id, mlflow_name(probe))}
        stamp = int(time.time() * 1000)
        for row in history:
            step = row.get("step")
            if step is None or step in have:
                continue
            batch = [Metric(k, v, stamp, int(step)) for k, v in _clean(
                {mlflow_name(k): v for k, v in row.items() if k != "step"}).items()]
            for i in range(0, len(batch), 900):
                client.log_batch(run.run_id, metrics=batch[i:i + 900])
    run.recorder.submit("metrics", "the checkpoint's steps", fill, priority=0)


def log_parent(run: StageRun, *, metrics: dict[str, float] | None = None, params: dict[str, Any] | None = None,
               tags: dict[str, str] | None = None) -> None:
    """Headline metrics, params or tags on the pipeline's parent run (queued)."""
    from mlflow.entities import Metric, Param, RunTag
    stamp = int(time.time() * 1000)
    batch_metrics = [Metric(k, v, stamp, 0) for k, v in _clean(metrics or {}).items()]
    batch_params = [Param(k, _param(v)) for k, v in (params or {}).items()]
    batch_tags = [RunTag(k, str(v)[:5000]) for k, v in (tags or {}).items()]
    if batch_metrics or batch_params or batch_tags:
        run.recorder.submit("parent run", ", ".join([*(metrics or {}), *(params or {}), *(tags or {})])[:200],
                            lambda c: c.log_batch(run.parent_id, metrics=batch_metrics, params=batch_params,
                                                  tags=batch_tags))


def log_traces(run: StageRun, plans: list, run_id: str | None = None) -> None:
    """Queue traces (turnrl.tracking.traces.TracePlan) linked to the stage run."""
    from turnrl.tracking import traces
    for plan in plans:
        run.recorder.submit("traces", plan.root.name,
                            lambda c, p=plan: traces.log(c, p, experiment_id=run.experiment_id,
                                                         run_id=run_id or run.run_id))


def log_artifacts(run: StageRun, local: str | Path, artifact_path: str | None = None) -> None:
    """A file or folder as artifacts of the stage run (queued)."""
    local = Path(local)
    if not local.exists():
        return
    what = f"{artifact_path}/{local.name}" if artifact_path else local.name
    if local.is_dir():
        run.recorder.submit("artifacts", what, lambda c: c.log_artifacts(run.run_id, str(local), artifact_path))
    else:
        run.recorder.submit("artifacts", what, lambda c: c.log_artifact(run.run_id, str(local), artifact_path))


def log_dict(run: StageRun, data: Any, name: str) -> None:
    run.recorder.submit("artifacts", name, lambda c: c.log_dict(run.run_id, data, name))


def log_table(run: StageRun, data: Any, name: str) -> None:
    """A table artifact (queued); `data` may be a function making it (called by the Recorder's thread)."""
    run.recorder.submit("artifacts", name, lambda c: c.log_table(run.run_id, data() if callable(data) else data, name))


# --------------------------------------------------------------------------- data sets
def dvc_out_md5(path: str | Path, root: str | Path | None = None) -> str | None:
    """The md5 dvc.lock records for the out holding `path` (a file or a `.dir` folder), if any."""
    import yaml
    lock = Path(root or project_root()) / "dvc.lock"
    if not lock.exists():
        return None
    try:
        stages = (yaml.safe_load(lock.read_text()) or {}).get("stages", {})
    except Exception:
        return None
    target = Path(path).as_posix()
    for stage in stages.values():
        for out in stage.get("outs", []) or []:
            p = str(out.get("path", ""))
            if target == p or target.startswith(p.rstrip("/") + "/"):
                return out.get("md5")
    return None


def file_md5(path: str | Path) -> str:
    """md5 of a file's content: what DVC records for it (in an out's `.dir` listing)."""
    digest = hashlib.md5()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def log_datasets(run: StageRun, sets: dict[str, tuple[str | Path, str]], parent: bool = True) -> None:
    """Data sets as run inputs: {name: (parquet path, context)}, context e.g. `training`,
    `evaluation`. Each is an MLflow dataset whose digest is the file's DVC md5, its source the
    file, tagged with the DVC out's md5 (`dvc.out_md5`, from dvc.lock) and the context; on the
    stage run and (`parent`) on the pipeline's parent run."""
    import mlflow
    import pandas as pd
    from mlflow.entities import DatasetInput, InputTag

    inputs = []
    for name, (path, context) in sets.items():
        path = Path(path)
        if not path.exists():
            continue
        try:
            frame = pd.read_parquet(path)
            digest = file_md5(path)
            dataset = mlflow.data.from_pandas(frame, source=path.resolve().as_uri(), name=name, digest=digest[:36])
            tags = [InputTag("mlflow.data.context", context), InputTag("dvc.md5", digest)]
            out = dvc_out_md5(path)
            if out:
                tags.append(InputTag("dvc.out_md5", out))
            inputs.append(DatasetInput(dataset._to_mlflow_entity(), tags=tags))
        except Exception as exc:   # noqa: BLE001 - an unreadable file is the stage's problem, not tracking's
            log.warning("data set %s (%s) not logged to MLflow: %s", name, path, exc)
    if not inputs:
        return
    names = ", ".join(sets)
    run.recorder.submit("datasets", names, lambda c: c.log_inputs(run.run_id, datasets=inputs))
    if parent:
        run.recorder.submit("datasets", names, lambda c: c.log_inputs(run.parent_id, datasets=inputs))


# --------------------------------------------------------------------------- the model
def fingerprint(folder: str | Path) -> str:
    """sha256 over a folder's files (relative paths and contents): which weights these are."""
    digest = hashlib.sha256()
    root = Path(folder)
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        with open(path, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 22), b""):
                digest.update(chunk)
    return digest.hexdigest()


def model_requirements() -> list[str]:
    """What loading the policy needs, pinned to this environment (given explicitly: the
    transformers flavor's default adds torchvision and imports it, and setup.sh removes it)."""
    import importlib.metadata as md
    out = []
    for package in ("transformers", "torch", "tokenizers", "safetensors", "accelerate"):
        try:
            out.append(f"{package}=={md.version(package).split('+')[0]}")
        except md.PackageNotFoundError:
            continue
    return out


def _folder_mb(folder: Path) -> float:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) / 2**20


class _ReferenceFlavor:
    """Writes a transformers-flavor MLflow model whose weights stay in `folder`: the flavor's
    hub reference (source_model_name, source_model_revision) names the local folder and its
    content fingerprint, so `mlflow.transformers.load_model` reads the folder itself."""

    def __init__(self, folder: Path, revision: str) -> None:
        self.folder, self.revision = folder.resolve(), revision

    def save_model(self, path: str, mlflow_model, **_: Any) -> None:
        import transformers
        import yaml
        from mlflow.models import Model  # noqa: F401
        from mlflow.pyfunc import add_to_model
        from mlflow.utils.environment import _mlflow_conda_env, _PythonEnv
        from transformers import AutoTokenizer

        os.makedirs(path, exist_ok=True)
        config = json.loads((self.folder / "config.json").read_text())
        tokenizer = AutoTokenizer.from_pretrained(self.folder)
        requirements = model_requirements()
        mlflow_model.add_flavor(
            "transformers", transformers_version=transformers.__version__, code=None, components=["tokenizer"],
            instance_type="TextGenerationPipeline", pipeline_model_type=(config.get("architectures") or ["?"])[0],
            source_model_name=str(self.folder), source_model_revision=self.revision, task="text-generation",
            tokenizer_type=type(tokenizer).__name__, tokenizer_name=str(self.folder),
            tokenizer_revision=self.revision)
        add_to_model(mlflow_model, loader_module="mlflow.transformers", conda_env="conda.yaml",
                     python_env="python_env.yaml")
        Path(path, "requirements.txt").write_text("\n".join(requirements) + "\n")
        Path(path, "conda.yaml").write_text(yaml.safe_dump(_mlflow_conda_env(additional_pip_deps=requirements)))
        _PythonEnv.current().to_yaml(str(Path(path, "python_env.yaml")))
        Path(path, "README.md").write_text(
            f"turnrl policy: a reference to {self.folder} (content sha256 {self.revision}); the weights are not "
            "copied. `dvc checkout` of the commit that produced it restores the folder.\n")
        mlflow_model.save(str(Path(path, "MLmodel")))


def log_policy(run: StageRun, folder: str | Path, *, name: str = "policy") -> str | None:
    """The final policy in `folder` (a Hugging Face folder) as an MLflow transformers model of
    the stage run, tagged with its content fingerprint: a copy when it is at most
    `tracking.model_copy_max_mb`, else a reference to the folder (path and fingerprint).
    Returns the model's id (None when not recorded). Loadable with
    `mlflow.transformers.load_model(f"models:/{model_id}", return_type="components")`."""
    cfg = run.cfg
    folder = Path(folder)
    if not cfg.tracking.log_model or not (folder / "config.json").exists():
        return None
    revision = fingerprint(folder)
    size_mb = _folder_mb(folder)
    copy = size_mb <= cfg.tracking.model_copy_max_mb
    tags = {FINGERPRINT_TAG: revision, "turnrl.env": cfg.env.name, "turnrl.algorithm": cfg.algorithm.name,
            "turnrl.storage": "copy" if copy else f"reference to {folder.resolve()}",
            "turnrl.size_mb": f"{size_mb:.1f}"}

    def log_it():
        import mlflow
        if copy:
            from huggingface_hub import ModelCard
            from transformers import AutoModelForCausalLM, AutoTokenizer
            model = AutoModelForCausalLM.from_pretrained(folder)
            tokenizer = AutoTokenizer.from_pretrained(folder)
            card = ModelCard(f"---\nlicense: other\n---\n# turnrl policy\n\n{cfg.algorithm.name} on {cfg.env.name}, "
                             f"{cfg.train.steps} steps, from {cfg.model.path}.\n")
            quiet = logging.getLogger("mlflow.transformers")
            level, quiet.level = quiet.level, logging.ERROR   # "Unable to find license information": it is ours
            try:
                info = mlflow.transformers.log_model({"model": model, "tokenizer": tokenizer}, name=name,
                                                     task="text-generation", pip_requirements=model_requirements(),
                                                     model_card=card, tags=tags)
            finally:
                quiet.setLevel(level)
        else:
            from mlflow.models import Model
            info = Model.log(artifact_path=None, name=name, flavor=_ReferenceFlavor(folder, revision),
                             run_id=run.run_id, tags=tags)
        mlflow.set_tag(FINGERPRINT_TAG, revision)
        return info.model_id

    return run.recorder.now("model", f"the {name} model ({'copy' if copy else 'reference'}, {size_mb:.0f} MB)",
                            log_it)


def register_policy(run: StageRun, folder: str | Path, baseline: dict, final: dict) -> Any:
    """With `tracking.register_model: NAME`: the logged model whose fingerprint is `folder`'s
    becomes a new version of NAME, tagged with environment, algorithm and headline accuracy."""
    cfg = run.cfg
    name = cfg.tracking.register_model
    if not name:
        return None
    revision = fingerprint(folder)

    def register():
        import mlflow
        found = mlflow.search_logged_models(experiment_ids=[run.experiment_id],
                                            filter_string=f"tags.`{FINGERPRINT_TAG}` = '{revision}'",
                                            order_by=[{"field_name": "creation_time", "ascending": False}],
                                            max_results=1, output_format="list")
        if not found:
            log.warning("tracking.register_model %s: no logged model of %s (fingerprint %s) in experiment %s; "
                        "was tracking.log_model off when it was trained?", name, folder, revision[:12],
                        cfg.tracking.experiment)
            return None
        tags = {"env": cfg.env.name, "algorithm": cfg.algorithm.name, "model.path": cfg.model.path,
                "pipeline_run": run.parent_id, "eval_run": run.run_id, "fingerprint": revision}
        for bench, block in final.items():
            if isinstance(block, dict) and isinstance(block.get("accuracy"), (int, float)):
                tags[f"accuracy.{bench}"] = f"{block['accuracy']:.4f}"
                base = (baseline.get(bench) or {}).get("accuracy")
                if isinstance(base, (int, float)):
                    tags[f"accuracy_diff.{bench}"] = f"{block['accuracy'] - base:+.4f}"
        headline = "task" if "task" in final else next(iter(final), None)
        if headline and f"accuracy.{headline}" in tags:
            tags["accuracy"] = tags[f"accuracy.{headline}"]
        version = mlflow.register_model(f"models:/{found[0].model_id}", name, tags=tags)
        log.info("registered %s version %s (%s)", name, version.version, f"models:/{name}/{version.version}")
        mlflow.set_tag("turnrl.registered_model", f"{name}/{version.version}")
        return version

    return run.recorder.now("registry", f"version of {name}", register)


# --------------------------------------------------------------------------- the parent run's headline
def headline_metrics(baseline: dict | None, final: dict | None) -> dict[str, float]:
    """Per evaluation block: `eval/<block>/accuracy_baseline`, `..._final`, `..._diff`."""
    out: dict[str, float] = {}
    for block in dict.fromkeys([*(baseline or {}), *(final or {})]):
        values = {}
        for label, metrics in (("baseline", baseline), ("final", final)):
            value = ((metrics or {}).get(block) or {}).get("accuracy") if isinstance((metrics or {}).get(block),
                                                                                        dict) else None
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                values[label] = float(value)
                out[f"eval/{block}/accuracy_{label}"] = float(value)
        if len(values) == 2:
            out[f"eval/{block}/accuracy_diff"] = values["final"] - values["baseline"]
    return out


def description(cfg: Config, baseline: dict | None, final: dict | None, extra: str = "") -> str:
    """The pipeline run's description (Markdown): what ran, and the report's summary table."""
    from turnrl.pipeline.report import summary_table
    lines = [f"**{cfg.algorithm.name}** on **{cfg.env.name}**, {cfg.train.steps} steps from `{cfg.model.path}` "
             f"(seed {cfg.seed}, group size {cfg.rollout.n}, up to {cfg.rollout.max_turns} turns).", ""]
    if baseline or final:
        lines += summary_table(baseline or {}, final or {}, ("baseline", "trained"))
    if extra:
        lines += ["", extra]
    return "\n".join(lines)


def log_headline(run: StageRun, baseline: dict | None, final: dict | None, extra: str = "") -> None:
    """The evaluation's headline on the pipeline's parent run: accuracies (baseline, final,
    diff per block) and the description with the summary table."""
    log_parent(run, metrics=headline_metrics(baseline, final),
               tags={"mlflow.note.content": description(run.cfg, baseline, final, extra)})
