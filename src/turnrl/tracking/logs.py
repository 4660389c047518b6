"""Stage logs that read as progress bars plus the lines that matter: vLLM's logging (in this
process and in the Ray actors it starts) at WARNING, each repeated warning once, and the
expected warnings of a weight push dropped; MLflow's and alembic's chatter kept down."""
from __future__ import annotations

import json
import logging
import os
import re
import warnings
from pathlib import Path

class OnceFilter(logging.Filter):
    """Lets a warning through the first time only: a message repeated every step (a library's
    warning after each weight push or generation) is shown once. Messages
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


#: vLLM's logger that warns "<layer class>: Failed to load weights" after a weight push
RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
_ROTARY = re.compile(r"^\w*RotaryEmbedding: Failed to load weights$")


class RotaryCacheFilter(logging.Filter):
    """Drops vLLM's `RotaryEmbedding: Failed to load weights`, logged after every weight push.
    It is expected: vLLM's layerwise reload counts every tensor of a layer as loadable, and a
    rotary embedding's only tensor is `cos_sin_cache`, a non-persistent buffer computed from the
    model's config (rope theta, positions) when the engine starts, never in a checkpoint nor in
    the pushed weights. Finding none of its tensors pushed, vLLM warns and puts the layer's own
    tensors back, so the cache stays what it was. The same warning for any other layer means real
    weights were not pushed, and passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name != RELOAD_LOGGER or record.levelno != logging.WARNING:
            return True
        try:
            return not _ROTARY.match(record.getMessage())
        except Exception:   # noqa: BLE001 - a record that cannot be formatted is not ours to drop
            return True


def vllm_logging_config(level: str) -> dict:
    """vLLM's own logging configuration at `level`, with RotaryCacheFilter and OnceFilter on its
    handler."""
    fmt = ("%(vllm_process_name)s pid=%(process)d) %(levelname)s %(asctime)s [%(fileinfo)s:%(lineno)d] "
           "%(message)s")
    return {
        "version": 1, "disable_existing_loggers": False,
        "formatters": {"vllm": {"()": "vllm.logging_utils.NewLineFormatter", "datefmt": "%m-%d %H:%M:%S",
                                "format": "(" + fmt}},
        "filters": {"rotary": {"()": "turnrl.tracking.logs.RotaryCacheFilter"},
                    "once": {"()": "turnrl.tracking.logs.OnceFilter"}},
        "handlers": {"vllm": {"class": "logging.StreamHandler", "formatter": "vllm", "level": level,
                              "stream": "ext://sys.stdout", "filters": ["rotary", "once"]}},
        "loggers": {"vllm": {"handlers": ["vllm"], "level": level, "propagate": False}},
    }


def quiet_logs() -> None:
    """Stage logs that read as progress bars plus the lines that matter: vLLM (in this process
    and, through the environment, in the Ray actors it starts) logs warnings and errors only,
    each repeated warning once (`VLLM_LOGGING_LEVEL=INFO` brings its startup report back), and
    the expected `RotaryEmbedding: Failed to load weights` of every weight push not at all
    (RotaryCacheFilter says why); this process's own handlers drop repeated warnings too."""
    level = os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING").upper()
    if "VLLM_LOGGING_CONFIG_PATH" not in os.environ and os.environ.get("VLLM_CONFIGURE_LOGGING", "1") != "0":
        import hashlib
        import tempfile
        text = json.dumps(vllm_logging_config(level), indent=1)
        # named by its content: two turnrl versions on one machine (a CI run beside a user's older
        # checkout) must not hand each other's actors a config naming filters they do not have
        digest = hashlib.sha256(text.encode()).hexdigest()[:12]
        path = Path(tempfile.gettempdir()) / f"turnrl-vllm-logging-{level.lower()}-{digest}.json"
        try:
            if not path.exists() or path.read_text() != text:
                tmp = path.with_name(f"{path.name}.{os.getpid()}")
                tmp.write_text(text)
                tmp.replace(path)
            os.environ["VLLM_LOGGING_CONFIG_PATH"] = str(path)
        except OSError:
            pass
    reload = logging.getLogger(RELOAD_LOGGER)   # also when vLLM's logging is configured by the user
    if not any(isinstance(f, RotaryCacheFilter) for f in reload.filters):
        reload.addFilter(RotaryCacheFilter())
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, OnceFilter) for f in handler.filters):
            handler.addFilter(OnceFilter())
    # MLflow's hints when it infers a table's or a data set's schema: about its own conventions, every time
    warnings.filterwarnings("ignore", message="Hint: Inferred schema contains integer column", module="mlflow")
    warnings.filterwarnings("ignore", message="The specified dataset source can be interpreted", module="mlflow")
    for name in ("mlflow.tracing.fluent", "mlflow.tracking._tracking_service.client", "alembic.runtime.migration",
                 "mlflow.store.db.utils", "mlflow.system_metrics.system_metrics_monitor"):
        logging.getLogger(name).setLevel(logging.WARNING)

