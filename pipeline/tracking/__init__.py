"""Experiment tracking in MLflow, optional: on when a job has a tracking URI (its config's
`tracking.uri`, else MLFLOW_TRACKING_URI in its environment), off otherwise.

Each job opens its tracker here, first thing: None when tracking is off, and mlflow is imported
only when it is on (clients and jobs without a URI never load it). A server that does not
answer then fails the job before any work (exit 3); once the work runs, no tracking failure
stops it.

client.py     the connection, its short retries, errors sorted into exit codes, the run tags
training.py   a training run: one MLflow run per run directory, each epoch once, the reports
registry.py   the best checkpoint as a logged and registered model; `models:/` to a checkpoint
pyfunc.py     that model as MLflow's tools load and serve it: the pyfunc flavor
outputs.py    what preprocessing and inference wrote, each linked to the runs it came from
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipeline.core.config import TrackingConfig
    from pipeline.core.storage import Location
    from pipeline.data.config import PreprocessConfig
    from pipeline.infer.config import InferConfig
    from pipeline.model.checkpoint import CheckpointMeta
    from pipeline.tracking.outputs import DatasetTracker, PredictionsTracker
    from pipeline.tracking.sweep import MLflowSweep
    from pipeline.tracking.training import MLflowTraining
    from pipeline.train.config import TrainConfig
    from pipeline.tune.config import SweepConfig

URI_ENV = "MLFLOW_TRACKING_URI"


def tracking_uri(cfg: TrackingConfig) -> str | None:
    """Where the job's runs go: `tracking.uri`, else MLFLOW_TRACKING_URI; None: tracking off."""
    return cfg.uri or os.environ.get(URI_ENV) or None


def training_tracker(cfg: TrainConfig) -> MLflowTraining | None:
    """The train job's tracker, connected; None when tracking is off."""
    uri = tracking_uri(cfg.tracking)
    if uri is None:
        return None
    from pipeline.tracking.client import connect
    from pipeline.tracking.training import MLflowTraining

    return MLflowTraining(connect(uri, cfg.tracking.experiment), cfg.tracking.registered_model)


def sweep_tracker(cfg: SweepConfig) -> MLflowSweep | None:
    """The sweep job's tracker, connected: its trials' train config's tracking settings; None
    when tracking is off."""
    tracking = cfg.base_train().tracking
    uri = tracking_uri(tracking)
    if uri is None:
        return None
    from pipeline.tracking.client import connect
    from pipeline.tracking.sweep import MLflowSweep

    conn = connect(uri, tracking.experiment)
    return MLflowSweep(conn, tracking.experiment, tracking.registered_model)


def dataset_tracker(cfg: PreprocessConfig) -> DatasetTracker | None:
    """The preprocess job's tracker, connected; None when tracking is off."""
    uri = tracking_uri(cfg.tracking)
    if uri is None:
        return None
    from pipeline.tracking.client import connect
    from pipeline.tracking.outputs import DatasetTracker

    return DatasetTracker(connect(uri, cfg.tracking.experiment))


def predictions_tracker(cfg: InferConfig) -> PredictionsTracker | None:
    """The infer job's tracker, connected; None when tracking is off."""
    uri = tracking_uri(cfg.tracking)
    if uri is None:
        return None
    from pipeline.tracking.client import connect
    from pipeline.tracking.outputs import PredictionsTracker

    return PredictionsTracker(connect(uri, cfg.tracking.experiment))


def registered_checkpoint(
    model_uri: str, *, uri: str | None = None, dst: str | Path | None = None
) -> Location:
    """The checkpoint of a registered model version, `models:/<name>/<version>` (or
    `models:/<name>@<alias>`), copied from the tracking server `uri` (default
    MLFLOW_TRACKING_URI) into `dst` (default: a new temporary directory)."""
    from pipeline.tracking.registry import registered_checkpoint

    return registered_checkpoint(model_uri, uri=uri or os.environ.get(URI_ENV), dst=dst)


def registered_version(model_uri: str, *, uri: str | None = None) -> tuple[str, CheckpointMeta]:
    """`models:/<name>/<version>` of a registered model version, an alias pinned to the version
    it names now, and its checkpoint's metadata, read without the weights."""
    from pipeline.tracking.registry import registered_version

    return registered_version(model_uri, uri=uri or os.environ.get(URI_ENV))
