"""What preprocessing and inference wrote, each as one MLflow run once its output is committed,
tagged with the runs it came from: a dataset version's run (one per version: a preprocess job
that finds its dataset up to date adds none), and an inference run's, linked to the training
run of the checkpoint it used. A server that fails by then costs the job nothing: the job says
what was not logged, and its output stands.
"""

from __future__ import annotations

import logging
import posixpath
import time

from mlflow.entities import Metric

from pipeline.core.config import flatten_config
from pipeline.core.storage import Location
from pipeline.data.config import PreprocessConfig
from pipeline.infer.config import InferConfig
from pipeline.tracking.client import (
    CHECKPOINT,
    CODE_VERSION,
    DATASET,
    DATASET_FINGERPRINT,
    DATASET_VERSION,
    JOB,
    TRACKING_ERRORS,
    TRAINING_RUN,
    Connection,
    brief,
    code_version,
    log_files,
    log_params,
    params,
    run_of,
)

log = logging.getLogger(__name__)

PREDICTIONS_VERSION, INPUT, OUTPUT = "ray_cv.predictions_version", "ray_cv.input", "ray_cv.output"


def record_run(
    conn: Connection,
    *,
    name: str,
    tags: dict[str, str],
    config: dict,
    metrics: dict[str, float],
    dicts: dict[str, dict],
    files: list[Location] = (),
    existing=None,
) -> str:
    """One finished MLflow run of a job's output: `existing` (an unfinished run of the same
    output, whose params and metrics are kept) or a new one. Returns its id."""
    client = conn.client
    run = existing or client.create_run(conn.experiment_id, run_name=name, tags=tags)
    run_id = run.info.run_id
    log_params(conn, run_id, params(flatten_config(config)))
    have = run.data.metrics if existing else {}  # logged by the job that left it unfinished
    now = int(time.time() * 1000)
    values = [Metric(k, float(v), now, 0) for k, v in metrics.items() if k not in have]
    if values:
        client.log_batch(run_id, metrics=values)
    for artifact, content in dicts.items():
        client.log_dict(run_id, content, artifact)
    if files:
        log_files(conn, run_id, list(files))
    client.set_terminated(run_id, "FINISHED")
    return run_id


class DatasetTracker:
    """The preprocess job's: one MLflow run per dataset version."""

    def __init__(self, conn: Connection):
        self.conn = conn

    def log_dataset(self, cfg: PreprocessConfig, output: Location, manifest: dict) -> None:
        """Log the dataset version `manifest` (the committed manifest, as JSON) describes."""
        version = manifest["version"]
        splits = {name: info["rows"] for name, info in manifest["splits"].items()}
        metrics = {f"{name}_images": rows for name, rows in splits.items()}
        metrics |= {"classes": len(manifest["classes"]), "skipped": len(manifest["skipped"])}
        what = (
            f"the preprocess run of dataset {output.uri} version {version} "
            f"({', '.join(f'{rows} {name}' for name, rows in splits.items())} images)"
        )
        try:
            existing = self.runs_of(output.uri, version)
            finished = [r for r in existing if r.info.status == "FINISHED"]
            if finished:
                log.info(
                    "dataset version %s is tracked already: MLflow run %s",
                    *(version, finished[0].info.run_id),
                )
                return
            tags = {
                JOB: "preprocess",
                DATASET: output.uri,
                DATASET_VERSION: version,
                DATASET_FINGERPRINT: manifest["fingerprint"],
                CODE_VERSION: code_version(),
            }
            run_id = record_run(
                self.conn,
                name=f"preprocess {version}",
                tags=tags,
                config=cfg.model_dump(mode="json"),
                metrics=metrics,
                dicts={"manifest.json": manifest},
                existing=existing[0] if existing else None,
            )
        except TRACKING_ERRORS as e:
            log.warning("not logged to MLflow at %s: %s (%s)", self.conn.uri, what, brief(e))
            return
        log.info("logged %s as MLflow run %s", what, run_id)

    def runs_of(self, dataset: str, version: str) -> list:
        if "'" in dataset:  # MLflow's filters cannot quote it
            return []
        query = (
            f"tags.`{JOB}` = 'preprocess' and tags.`{DATASET}` = '{dataset}' and "
            f"tags.`{DATASET_VERSION}` = '{version}'"
        )
        return self.conn.client.search_runs([self.conn.experiment_id], filter_string=query)


class PredictionsTracker:
    """The infer job's: one MLflow run per predictions version, linked to the training run."""

    def __init__(self, conn: Connection):
        self.conn = conn

    def log_predictions(self, cfg: InferConfig, output: Location, summary: dict) -> None:
        """Log the predictions `summary` (the committed summary.json) describes."""
        checkpoint = summary["checkpoint"]
        what = (
            f"the inference run of {summary['images']} images with {checkpoint} into "
            f"{output.uri} (version {summary['version']})"
        )
        try:
            tags = {
                JOB: "infer",
                CHECKPOINT: checkpoint,
                INPUT: summary["input"],
                OUTPUT: output.uri,
                PREDICTIONS_VERSION: summary["version"],
                CODE_VERSION: code_version(),
            }
            if "dataset_version" in summary:
                tags[DATASET_VERSION] = summary["dataset_version"]
            training = self.training_run(Location.parse(cfg.model), checkpoint)
            if training:
                tags[TRAINING_RUN] = training
            metrics = {
                k: summary[k]
                for k in ("images", "images_per_s", "accuracy", "labelled_images")
                if k in summary
            }
            metrics["skipped"] = len(summary["skipped"])
            figure = summary.get("confusion_matrix_png")
            run_id = record_run(
                self.conn,
                name=f"infer {summary['version']}",
                tags=tags,
                config=cfg.model_dump(mode="json"),
                metrics=metrics,
                dicts={"summary.json": summary},
                files=[output.child(figure)] if figure else [],
            )
        except TRACKING_ERRORS as e:
            log.warning("not logged to MLflow at %s: %s (%s)", self.conn.uri, what, brief(e))
            return
        log.info(
            "logged %s as MLflow run %s%s",
            *(what, run_id, f", linked to training run {training}" if training else ""),
        )

    def training_run(self, model: Location, checkpoint: str) -> str | None:
        """The MLflow run of the training run the checkpoint belongs to, on this server."""
        base, sep, query = checkpoint.partition("?")
        run_dir = Location.parse(posixpath.dirname(base) + sep + query)
        for directory in (model, run_dir):
            record = run_of(directory)
            if record and record["tracking_uri"] == self.conn.uri:
                return record["run_id"]
            if record:
                log.info(
                    "%s is tracked at %s, not %s: this run is not linked to it",
                    *(directory.uri, record["tracking_uri"], self.conn.uri),
                )
                return None
        log.info("%s belongs to no tracked training run: this run is not linked to one", checkpoint)
        return None
