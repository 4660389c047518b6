"""The Recorder: what a stage records to MLflow goes through it, sent from a background thread,
so training never waits for the tracking server. A server that stops answering is retried for
`tracking.retry_s` seconds; then the stage goes on without it, with one warning naming what was
not recorded (and a count at the end of the stage). Also: metric names in sections
(`mlflow_name`)."""
from __future__ import annotations

import logging
import os
import queue
import re
import threading
import time
from typing import Any, Callable

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


# --------------------------------------------------------------------------- metric sections
_SECTION_RULES: list[tuple[str, str]] = [   # (regex on the flat name, section); first match wins
    (r"^health_", "health"),
    (r"^high_", "high"),
    (r"^mlmt_", "mlmt"),
    (r"^(tool_|env_tool|tools?_)|_tool_|^env_(answer_in_results|searches|tool_calls)", "tools"),
    (r"(_s|_s_mean)$|_idle_frac$|^gen_tokens_per_s|^prefix_cache_|^prefill_tokens", "timing"),
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


def clean_metrics(metrics: dict[str, Any]) -> dict[str, float]:
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


def is_outage(exc: BaseException) -> bool:
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


def outage_reason(exc: BaseException) -> str:
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
        clean = clean_metrics({mlflow_name(k) if sections else k: v for k, v in metrics.items()})
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
                if not is_outage(exc):
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
                    self._give_up(outage_reason(exc), kind, what)
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

