"""System metrics (CPU, memory, disk, network, GPU) of a stage run, sent through its Recorder."""
from __future__ import annotations

import threading

from turnrl.tracking.recorder import Recorder, background_priority


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
