"""The jobs' Prometheus metrics, published through Ray's own metrics agent (`ray.util.metrics`):
each node exports them on its --metrics-export-port beside Ray's, as `ray_<name>`, so whatever
scrapes a Ray cluster scrapes them (docs/metrics.md lists them, with PromQL).

Ray exports a gauge's value only in the report interval it was set in
(RAY_metrics_report_interval_ms, 10 s by default) and drops it from the next: a value set once
would vanish before most scrapes.
`Gauges` keeps each value set, from a thread of its own, until the job closes it.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Metric:
    """One gauge: its name (exported as ray_<name>), what it measures, and the labels it has
    beyond its job's."""

    name: str
    help: str
    labels: tuple[str, ...] = ()


# A training run's, labelled `run` (its name) and `job_id` (the submission id of its job).
TRAIN_LABELS = ("run", "job_id")
TRAIN = (
    Metric("cv_train_images_per_second", "Images/s of this rank, its recent steps", ("rank",)),
    Metric(
        "cv_train_input_wait_share",
        "Share (0-1) of this rank's recent step time spent waiting for input",
        ("rank",),
    ),
    Metric("cv_train_step_seconds", "Median step time of this rank, its recent steps", ("rank",)),
    Metric("cv_train_epoch", "The epoch in progress (0-based)"),
    Metric("cv_train_epochs", "The run's epochs"),
    Metric("cv_train_step", "Steps done of the epoch in progress"),
    Metric("cv_train_steps", "Steps of the epoch in progress"),
    Metric("cv_train_progress", "Share (0-1) of the run's steps done"),
    Metric("cv_train_eta_seconds", "Seconds the run has left"),
    Metric(
        "cv_train_checkpoint_hold_seconds",
        "Seconds the last checkpoint held the training loop",
        ("kind",),
    ),
    Metric(
        "cv_train_checkpoint_upload_seconds",
        "Seconds the last checkpoint took to reach storage",
        ("kind",),
    ),
    Metric("cv_train_val", "The last finished epoch's val scores", ("metric",)),
    Metric("cv_train_worker_hours", "Worker-hours of the run's epochs so far"),
    Metric("cv_train_gpu_hours", "GPU-hours of the run's epochs so far"),
    Metric("cv_train_cost", "Cost of the run's epochs so far, at cost.price_per_worker_hour"),
)
# An inference run's, labelled `output` (the output's name) and `job_id`.
INFER_LABELS = ("output", "job_id")
INFER = (
    Metric("cv_infer_images_done", "Images classified of the input"),
    Metric("cv_infer_images", "Images of the input"),
    Metric("cv_infer_progress", "Share (0-1) of the input's images classified"),
    Metric("cv_infer_images_per_second", "Images/s, the last minute"),
    Metric("cv_infer_eta_seconds", "Seconds the run has left"),
)
# How often a kept value is set again: well within Ray's shortest report interval.
KEEP_S = 0.5


def exported(metric: Metric) -> str:
    """The name Prometheus sees."""
    return f"ray_{metric.name}"


class Gauges:
    """The gauges `metrics`, labelled `labels` (e.g. the run and its job) and each value's own,
    kept set until `close`. Outside a Ray worker or driver (no Ray connected) it publishes
    nothing; `values()` holds what was set either way."""

    def __init__(self, metrics: tuple[Metric, ...], labels: dict[str, str]):
        self.labels = {k: str(v) for k, v in labels.items()}
        self.metrics = {m.name: m for m in metrics}
        self._values: dict[tuple[str, tuple], float] = {}
        self._lock = threading.Lock()
        self._gauges = self._make(metrics)
        self._stop = threading.Event()
        self._thread = None
        if self._gauges:
            self._thread = threading.Thread(target=self._keep, name="metrics", daemon=True)
            self._thread.start()

    def _make(self, metrics: tuple[Metric, ...]) -> dict:
        import ray

        if not ray.is_initialized():
            return {}
        from ray.util.metrics import Gauge

        keys = tuple(self.labels)
        return {m.name: Gauge(m.name, m.help, tag_keys=keys + m.labels) for m in metrics}

    def set(self, name: str, value: float | None, **labels: str) -> None:
        """Gauge `name` is `value` from now on (None: unknown, not published)."""
        metric = self.metrics[name]
        if set(labels) != set(metric.labels):
            raise ValueError(f"{name} takes the labels {metric.labels}, not {tuple(labels)}")
        key = (name, tuple(sorted((k, str(v)) for k, v in labels.items())))
        with self._lock:
            if value is None:
                self._values.pop(key, None)
            else:
                self._values[key] = float(value)
        self._publish(key, value)

    def values(self) -> dict[str, float]:
        """What is set, by name (with its own labels, as name{k=v})."""
        with self._lock:
            return {_shown(name, own): v for (name, own), v in self._values.items()}

    def _publish(self, key: tuple[str, tuple], value: float | None) -> None:
        gauge = self._gauges.get(key[0])
        if gauge is not None and value is not None:
            gauge.set(value, tags=self.labels | dict(key[1]))

    def _keep(self) -> None:
        while not self._stop.wait(KEEP_S):
            with self._lock:
                kept = list(self._values.items())
            for key, value in kept:
                try:
                    self._publish(key, value)
                except Exception as e:  # a metrics agent going away must not end a run
                    log.debug("metrics: %s", e)

    def close(self) -> None:
        """Stop keeping the values: Ray drops them from its next report."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)


def _shown(name: str, own: tuple) -> str:
    return name + ("{" + ",".join(f"{k}={v}" for k, v in own) + "}" if own else "")
