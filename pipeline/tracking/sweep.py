"""A sweep in MLflow: one parent run for the sweep, each trial's training run its child.

The sweep's directory names its MLflow run in mlflow_run.json, as a training run's does, so a
resumed sweep continues it. Each trial's run is a training run tracked as the train job tracks
one (training.py), tagged as the sweep's child and registering nothing; the sweep's run logs
the sweep's summary and figure once it ends, and registers the best trial's best checkpoint.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

from pipeline.core.errors import ConfigError
from pipeline.core.storage import Location
from pipeline.tracking.client import (
    CODE_VERSION,
    DATASET,
    DATASET_VERSION,
    JOB,
    RUN_DIR,
    RUN_RECORD,
    TRACKING_ERRORS,
    Connection,
    brief,
    code_version,
    connect,
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
from pipeline.tracking.training import MLflowTraining

log = logging.getLogger(__name__)

PARENT = "mlflow.parentRunId"  # MLflow's own tag: its UI nests the child run under the parent
BEST_RUN = "ray_cv.best_run"  # the sweep's best trial's run directory


@dataclass(frozen=True)
class TrialTracking:
    """What a trial needs to track its run as the sweep's child: picklable, sent to trials."""

    uri: str
    experiment: str
    parent_run_id: str

    def tracker(self) -> MLflowTraining:
        """A trial's TrainingTracker, connected: its run a child of the sweep's, unregistered."""
        conn = connect(self.uri, self.experiment)
        return MLflowTraining(conn, None, tags={PARENT: self.parent_run_id})

    def close(self, run_dir: Location, error: str | None) -> None:
        """Mark a trial's run as the trial ended where the trial could not: failed, or (stopped
        by the scheduler) finished; `error` None for the latter, once its reports are written."""
        record = run_of(run_dir)
        if record is None:  # the trial ended before it tracked anything
            return
        try:
            client = connect(self.uri, self.experiment).client
            client.set_terminated(record["run_id"], "FAILED" if error else "FINISHED")
            if error:
                client.set_tag(record["run_id"], "ray_cv.error", error[:5000])
        except TRACKING_ERRORS as e:
            log.warning("MLflow run %s could not be closed: %s", record["run_id"], brief(e))


class MLflowSweep:
    """The driver's tracker of a sweep: its parent run on `conn`'s server."""

    def __init__(self, conn: Connection, experiment: str, registered_model: str | None):
        self.conn, self.experiment, self.registered_model = conn, experiment, registered_model
        self.run_id: str | None = None

    def start(self, sweep_dir: Location, config: dict, *, version: str) -> TrialTracking:
        """Open the sweep's MLflow run (the one its directory names, or a new one) before any
        trial starts; `config`: the sweep's config, logged as its params."""
        client = self.conn.client
        try:
            record = run_of(sweep_dir)
            if record is not None:
                self.check_record(sweep_dir, record)
                self.run_id = record["run_id"]
                log.info("continuing MLflow run %s of sweep %s", self.run_id, sweep_dir.uri)
            else:
                self.run_id = self.create(sweep_dir, config)
            tags = {DATASET: config["dataset"], DATASET_VERSION: version}
            tags[CODE_VERSION] = code_version()
            for key, value in tags.items():
                client.set_tag(self.run_id, key, value)
            client.update_run(self.run_id, status="RUNNING")
        except TRACKING_ERRORS as e:
            raise start_error(self.conn.uri, e) from None
        return TrialTracking(self.conn.uri, self.experiment, self.run_id)

    def create(self, sweep_dir: Location, config: dict) -> str:
        client = self.conn.client
        run = client.create_run(
            self.conn.experiment_id,
            run_name=config["name"],
            tags={JOB: "tune", RUN_DIR: sweep_dir.uri},
        )
        flat = {k: v for k, v in config.items() if k not in ("train", "space")}
        flat |= {f"space.{k}": v for k, v in config["space"].items()}
        log_params(self.conn, run.info.run_id, params(flat))
        record = {
            "tracking_uri": self.conn.uri,
            "experiment_id": self.conn.experiment_id,
            "run_id": run.info.run_id,
        }
        stored = json.loads(write_once(sweep_dir.child(RUN_RECORD), json.dumps(record).encode()))
        if stored["run_id"] != run.info.run_id:  # a driver beside this one recorded first
            client.delete_run(run.info.run_id)
            return stored["run_id"]
        log.info("new MLflow run %s for sweep %s", run.info.run_id, sweep_dir.uri)
        return run.info.run_id

    def check_record(self, sweep_dir: Location, record: dict) -> None:
        if record["tracking_uri"] != self.conn.uri:
            raise ConfigError(
                f"sweep {sweep_dir.uri} is tracked in MLflow run {record['run_id']} at "
                f"{record['tracking_uri']}, not at {self.conn.uri}: set train.tracking.uri to "
                "that server to go on with it, or pick a new name= for a new sweep"
            )

    def finish(self, sweep_dir: Location, summary: dict, files: list[Location]) -> None:
        """Log the sweep's outcome: the best score, its run, `files`, the best checkpoint as a
        model (registered as a version of registered_model); say what could not be logged."""
        assert self.run_id is not None, "finish() before start()"
        best = summary["best_run"]
        steps = [("the best score", lambda: self.log_best(summary))]
        steps.append(("artifacts", lambda: log_files(self.conn, self.run_id, files)))
        if best is not None:
            checkpoint = json.loads(Location.parse(best).child("summary.json").read_bytes())
            steps.append(
                (
                    "the best checkpoint as a model",
                    lambda: log_best_model(
                        self.conn,
                        self.run_id,
                        Location.parse(checkpoint["best_checkpoint"]),
                        self.registered_model,
                    ),
                )
            )
        status = "FINISHED" if best is not None else "FAILED"
        missing, failed = log_steps(steps)
        missing += end_run(self.conn, self.run_id, status, failed)
        if failed:
            log.warning(
                "MLflow run %s of sweep %s is marked FAILED: %s. The sweep itself is whole on "
                "storage: fix that and submit the sweep again, and it logs it without training",
                *(self.run_id, sweep_dir.uri, failed),
            )
        if missing:
            log.warning(
                "MLflow run %s of sweep %s lacks %s: submit the sweep again once the server "
                "answers, and it logs them without training",
                *(self.run_id, sweep_dir.uri, "; ".join(missing)),
            )

    def log_best(self, summary: dict) -> None:
        client = self.conn.client
        if summary["best_score"] is not None:
            client.log_metric(self.run_id, f"best_{summary['metric']}", summary["best_score"])
            client.set_tag(self.run_id, BEST_RUN, summary["best_run"])
        for status, n in summary["counts"].items():
            client.log_metric(self.run_id, f"trials_{status.replace(' ', '_')}", n)
