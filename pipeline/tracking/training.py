"""A training run in MLflow: one MLflow run per run directory, continued by every worker
restart, elastic resize and submission of the run, with each epoch's metrics logged once.

The run directory names its MLflow run in mlflow_run.json, written once by the job that
created the MLflow run. Rank 0 logs an epoch once Ray Train has its checkpoint, and before, every
epoch of the checkpoint's history the server does not have yet: a restarted rank 0 asks the
server which epochs it holds, so that an epoch is never logged twice, and one that could not be
logged (the server down) is logged with a later one. The driver logs the rest once the run
ends: the epochs still missing, history.csv, curves.png and summary.json, and the best checkpoint
as a model (registry.py); what it cannot log, it lists.
"""

from __future__ import annotations

import json
import logging
import os
import posixpath
import time

from mlflow import MlflowClient
from mlflow.entities import Metric
from mlflow.exceptions import MlflowException

from pipeline.core.config import flatten_config
from pipeline.core.errors import ConfigError
from pipeline.core.storage import Location
from pipeline.model.checkpoint import read_meta
from pipeline.model.runs import COST_KEYS, CURVES_PNG, HISTORY_CSV, RUN_SUMMARY
from pipeline.tracking.client import (
    CODE_VERSION,
    DATASET,
    DATASET_VERSION,
    ERROR,
    HTTP_SETTINGS,
    JOB,
    PREPROCESS_RUN,
    RUN_DIR,
    RUN_RECORD,
    TRACKING_ERRORS,
    Connection,
    brief,
    code_version,
    end_run,
    log_files,
    log_params,
    log_steps,
    params,
    run_of,
    start_error,
    write_once,
)
from pipeline.tracking.registry import log_best_model
from pipeline.train.config import TrainConfig

log = logging.getLogger(__name__)

# Rank 0's note of the epochs the server took: what the driver's account at the end relies on
# when the server is down then (the server itself is asked whenever it answers).
EPOCHS_NOTE = "mlflow_epochs.json"
CHANGED = "ray_cv.changed."  # + key: a setting a later submission of the run changed, old -> new


def epoch_metrics(row: dict) -> list[Metric]:
    """An epoch's numbers of the history, at step = the epoch."""
    now, step = int(time.time() * 1000), int(row["epoch"])
    return [
        Metric(key, float(value), now, step)
        for key, value in row.items()
        if key != "epoch" and isinstance(value, int | float) and not isinstance(value, bool)
    ]


class EpochLog:
    """Rank 0's EpochSink: logs every epoch of a history that the MLflow run lacks. Picklable:
    it travels to the workers in their config, and makes its client there."""

    def __init__(self, uri: str, run_id: str, run_dir: Location):
        self.uri, self.run_id, self.run_dir = uri, run_id, run_dir
        self.logged: set[int] | None = None  # epochs the server holds; None: not asked yet
        self.failed = False  # the last attempt failed: the next success says it caught up
        self._client: MlflowClient | None = None

    def __getstate__(self) -> dict:
        return {"uri": self.uri, "run_id": self.run_id, "run_dir": self.run_dir}

    def __setstate__(self, state: dict) -> None:
        self.__init__(**state)

    @property
    def client(self) -> MlflowClient:
        if self._client is None:
            for name, value in HTTP_SETTINGS.items():
                os.environ.setdefault(name, value)
            self._client = MlflowClient(tracking_uri=self.uri)
        return self._client

    def log_epochs(self, history: list[dict]) -> None:
        """Log the epochs of `history` the run lacks; if the server fails, say so and go on."""
        try:
            done = self.catch_up(history)
        except TRACKING_ERRORS as e:
            self.failed = True
            log.warning(
                "MLflow run %s at %s did not take the metrics of epoch(s) %s (%s): training goes "
                "on, and they are logged with a later epoch's once the server answers, or at "
                "the job's end",
                *(self.run_id, self.uri, epochs_text(self.missing(history)), brief(e)),
            )
            return
        if self.failed and done:
            log.info("MLflow answers again: logged epoch(s) %s, caught up", epochs_text(done))
        self.failed = False

    def catch_up(self, history: list[dict]) -> list[int]:
        """Log each epoch of `history` the server does not hold; return those logged now."""
        if self.logged is None:
            steps = self.client.get_metric_history(self.run_id, "val_accuracy")
            self.logged = {m.step for m in steps}
        done = []
        for row in history:
            epoch = int(row["epoch"])
            if epoch not in self.logged:
                # One call per epoch, which the server stores whole or not at all: an epoch's
                # metrics are there together, and the check above is by one of them.
                self.client.log_batch(self.run_id, metrics=epoch_metrics(row))
                self.logged.add(epoch)
                done.append(epoch)
        if done:
            self.note()
        return done

    def missing(self, history: list[dict]) -> list[int]:
        """The epochs of `history` not known to be logged."""
        known = self.logged if self.logged is not None else self.noted()
        return [int(r["epoch"]) for r in history if int(r["epoch"]) not in known]

    def note(self) -> None:
        try:
            data = {"run_id": self.run_id, "epochs": sorted(self.logged or ())}
            self.run_dir.child(EPOCHS_NOTE).write_bytes(json.dumps(data).encode())
        except OSError as e:  # a note only: the server is the record
            log.warning("could not write %s: %s", self.run_dir.child(EPOCHS_NOTE).uri, e)

    def noted(self) -> set[int]:
        try:
            note = json.loads(self.run_dir.child(EPOCHS_NOTE).read_bytes())
        except FileNotFoundError:
            return set()
        return set(note["epochs"]) if note.get("run_id") == self.run_id else set()


def epochs_text(epochs: list[int]) -> str:
    return ", ".join(map(str, epochs)) or "none"


class MLflowTraining:
    """The driver's TrainingTracker: the MLflow run of one training run, on `conn`'s server."""

    def __init__(
        self, conn: Connection, registered_model: str | None, tags: dict[str, str] | None = None
    ):
        self.conn, self.registered_model = conn, registered_model
        self.tags = tags or {}  # on a new MLflow run: a sweep's trial names its parent run
        self.run_id: str | None = None
        self.sink: EpochLog | None = None

    def start(
        self, run_dir: Location, cfg: TrainConfig, *, version: str, changes: list[str]
    ) -> EpochLog:
        client = self.conn.client
        try:
            self.run_id = self.open(run_dir, cfg)
            tags = {DATASET: cfg.dataset, DATASET_VERSION: version, CODE_VERSION: code_version()}
            preprocess = self.preprocess_run(cfg.dataset, version)
            if preprocess:
                tags[PREPROCESS_RUN] = preprocess
            for change in changes:
                key, _, values = change.partition(": ")
                tags[CHANGED + key] = values
            for key, value in tags.items():
                client.set_tag(self.run_id, key, value)
            client.update_run(self.run_id, status="RUNNING")
        except TRACKING_ERRORS as e:
            raise start_error(self.conn.uri, e) from None
        self.sink = EpochLog(self.conn.uri, self.run_id, run_dir)
        return self.sink

    def open(self, run_dir: Location, cfg: TrainConfig) -> str:
        """The MLflow run that run_dir's record names, or a new one, recorded there."""
        client, record = self.conn.client, run_of(run_dir)
        if record is not None:
            self.check_record(run_dir, record)
            log.info(
                "continuing MLflow run %s (%s)", record["run_id"], run_dir.child(RUN_RECORD).uri
            )
            return record["run_id"]
        run = self.unrecorded_run(run_dir) or client.create_run(
            self.conn.experiment_id,
            run_name=cfg.name,
            tags={JOB: "train", RUN_DIR: run_dir.uri, **self.tags},
        )
        run_id = run.info.run_id
        log_params(self.conn, run_id, params(flatten_config(cfg.model_dump(mode="json"))))
        record = {
            "tracking_uri": self.conn.uri,
            "experiment_id": self.conn.experiment_id,
            "run_id": run_id,
        }
        stored = json.loads(write_once(run_dir.child(RUN_RECORD), json.dumps(record).encode()))
        if stored["run_id"] != run_id:  # a job beside this one recorded its run first
            client.delete_run(run_id)
            self.check_record(run_dir, stored)
            return stored["run_id"]
        log.info("new MLflow run %s for %s", run_id, run_dir.uri)
        return run_id

    def check_record(self, run_dir: Location, record: dict) -> None:
        where = run_dir.child(RUN_RECORD).uri
        if record["tracking_uri"] != self.conn.uri:
            raise ConfigError(
                f"run {run_dir.uri} is tracked in MLflow run {record['run_id']} at "
                f"{record['tracking_uri']} ({where}), not at {self.conn.uri}: set tracking.uri "
                "to that server to go on with it, or pick a new name= for a new run"
            )
        try:
            run = self.conn.client.get_run(record["run_id"])
        except MlflowException as e:
            if e.error_code != "RESOURCE_DOES_NOT_EXIST":
                raise
            run = None
        if run is None or run.info.lifecycle_stage == "deleted":
            raise ConfigError(
                f"MLflow run {record['run_id']}, which {where} names, is gone from "
                f"{self.conn.uri}: restore it (mlflow runs restore), or delete {where} to track "
                "the run in a new MLflow run from its history"
            )

    def unrecorded_run(self, run_dir: Location):
        """A run a job created for `run_dir` and died before recording: one with no metrics."""
        if "'" in run_dir.uri:  # MLflow's filters cannot quote it
            return None
        found = self.conn.client.search_runs(
            [self.conn.experiment_id], filter_string=f"tags.`{RUN_DIR}` = '{run_dir.uri}'"
        )
        return next((r for r in found if not r.data.metrics), None)

    def preprocess_run(self, dataset: str, version: str) -> str | None:
        """The MLflow run of the preprocess job that wrote this dataset version, if tracked."""
        if "'" in dataset:
            return None
        query = (
            f"tags.`{JOB}` = 'preprocess' and tags.`{DATASET}` = '{dataset}' and "
            f"tags.`{DATASET_VERSION}` = '{version}'"
        )
        found = self.conn.client.search_runs([self.conn.experiment_id], filter_string=query)
        return found[0].info.run_id if found else None

    def finish(self, run_dir: Location, summary: dict) -> None:
        assert self.run_id is not None and self.sink is not None, "finish() before start()"
        history = read_meta(Location.parse(summary["latest_checkpoint"])).history
        best = Location.parse(summary["best_checkpoint"])
        missing = []
        try:
            self.sink.catch_up(history)
        except TRACKING_ERRORS as e:
            log.warning("MLflow: %s", brief(e))
            missing.append(f"the metrics of epoch(s) {epochs_text(self.sink.missing(history))}")
        reports = [run_dir.child(f) for f in (HISTORY_CSV, CURVES_PNG, RUN_SUMMARY)]
        names = ", ".join(posixpath.basename(f.path) for f in reports)
        model = f"the best checkpoint {best.uri} as a model"
        if self.registered_model:
            model += f" and its version of {self.registered_model}"
        totals = [
            Metric(f"run_{key}", float(summary[key]), int(time.time() * 1000), 0)
            for key in COST_KEYS
            if summary.get(key) is not None
        ]
        steps = [
            (
                "the run's worker-hours, GPU-hours and cost",
                lambda: self.conn.client.log_batch(self.run_id, metrics=totals),
            ),
            (f"artifacts {names}", lambda: log_files(self.conn, self.run_id, reports)),
            (
                model,
                lambda: log_best_model(self.conn, self.run_id, best, self.registered_model),
            ),
        ]
        lacking, failed = log_steps(steps)
        missing += lacking + end_run(self.conn, self.run_id, "FINISHED", failed)
        if failed:
            log.warning(
                "MLflow run %s at %s is marked FAILED: %s. The training itself is whole on "
                "storage: fix that and submit the same run again (same name=, epochs=), and the "
                "job logs it without training",
                *(self.run_id, self.conn.uri, failed),
            )
        if missing:
            log.warning(
                "MLflow run %s at %s lacks %s. The training itself is whole on storage: submit "
                "the same run again (same name=, epochs=) once the server answers, and the job "
                "logs them without training",
                *(self.run_id, self.conn.uri, "; ".join(missing)),
            )
        elif not failed:
            log.info(
                "MLflow run %s at %s has every epoch, the reports and the model",
                self.run_id,
                self.conn.uri,
            )

    def fail(self, run_dir: Location, error: str) -> None:
        if self.run_id is None:
            return
        try:
            self.conn.client.set_terminated(self.run_id, "FAILED")
            self.conn.client.set_tag(self.run_id, ERROR, error[:5000])
        except TRACKING_ERRORS as e:
            log.warning("MLflow run %s could not be marked failed: %s", self.run_id, brief(e))
