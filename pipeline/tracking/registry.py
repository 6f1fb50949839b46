"""The best checkpoint of a training run as an MLflow model, registered under a name; and back:
a registered model version (`models:/<name>/<version>`) to a checkpoint a job can load.

The model is an MLflow model of the pyfunc flavor (pyfunc.py), which MLflow's own tools load
and serve; its artifacts/checkpoint/ is the checkpoint directory less its optimizer state
(train_state.pt): the weights, the EMA's if any, and metadata.json, which says how to rebuild
and feed the model. One logged model and one model version per best checkpoint of a run: a
finished run submitted again finds them and adds none; a run trained on to more epochs adds a
version if its best checkpoint changed.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import posixpath
import tempfile
from pathlib import Path

from mlflow.entities import LoggedModelStatus
from mlflow.exceptions import MlflowException

from pipeline.core.config import REGISTERED_MODEL, registered_model
from pipeline.core.errors import ClusterError, ConfigError, InputError
from pipeline.core.storage import Location
from pipeline.model.checkpoint import (
    METADATA,
    TRAIN_STATE,
    CheckpointMeta,
    config_score,
    read_meta,
    served_weights,
)
from pipeline.tracking.client import (
    CHECKPOINT,
    CODE_VERSION,
    DATASET,
    DATASET_FINGERPRINT,
    DATASET_VERSION,
    HTTP_SETTINGS,
    MODEL_SPEC,
    Connection,
    brief,
    unreachable,
)

log = logging.getLogger(__name__)

EPOCH, WEIGHTS_SERVED, ACCURACY = "ray_cv.epoch", "ray_cv.weights", "ray_cv.val_accuracy"
BEST_BY = "ray_cv.best_by"  # the run's checkpoint.metric and mode: `val_loss (min)`


def model_spec(meta: CheckpointMeta) -> str:
    """The checkpoint's model spec (a name, or the fields that build the network) as JSON."""
    spec = meta.model_dump(mode="json")["model"]
    return spec if isinstance(spec, str) else json.dumps(spec, sort_keys=True)


def model_tags(checkpoint: Location, meta: CheckpointMeta, run_tags: dict[str, str]) -> dict:
    """What a model version says of where it came from: data, model, code and checkpoint."""
    return {
        DATASET: run_tags.get(DATASET, ""),
        DATASET_VERSION: meta.dataset_version,
        DATASET_FINGERPRINT: meta.dataset_fingerprint,
        MODEL_SPEC: model_spec(meta),
        CODE_VERSION: run_tags.get(CODE_VERSION, ""),
        CHECKPOINT: checkpoint.uri,
        EPOCH: str(meta.epoch),
        ACCURACY: str(meta.metrics.get("val_accuracy")),
        BEST_BY: str(config_score(meta.config)),
        WEIGHTS_SERVED: served_weights(meta),
    }


def log_best_model(
    conn: Connection, run_id: str, checkpoint: Location, registered_model: str | None
) -> None:
    """Log `checkpoint` as a model of run `run_id` and register it as a version of
    `registered_model` (unless None); each only if not done already."""
    meta = read_meta(checkpoint)
    tags = model_tags(checkpoint, meta, conn.client.get_run(run_id).data.tags)
    model = find_logged_model(conn, run_id, tags)
    if model is None:
        model = log_model(conn, run_id, checkpoint, meta, tags)
    if registered_model is not None:
        register_model(conn, run_id, checkpoint, model.model_id, registered_model, tags)


def log_model(
    conn: Connection, run_id: str, checkpoint: Location, meta: CheckpointMeta, tags: dict
):
    """A new logged model of run `run_id`: `checkpoint` (but its training state) as a pyfunc
    model, READY once its artifacts are in, FAILED where they did not get there."""
    # torch, pandas: only where a model is logged
    from pipeline.tracking.pyfunc import CHECKPOINT, save

    client = conn.client
    model = client.create_logged_model(
        conn.experiment_id,
        name=posixpath.basename(posixpath.dirname(checkpoint.path)) or "model",
        source_run_id=run_id,
        tags=tags,
        params={"epoch": str(meta.epoch), "classes": json.dumps(meta.classes)},
    )
    try:
        with tempfile.TemporaryDirectory(prefix="ray-cv-model-") as d:
            copy = Path(d) / CHECKPOINT
            for f in checkpoint.list_files():
                name = posixpath.relpath(f.path, checkpoint.path)
                if name != TRAIN_STATE:  # the optimizer's state: for resuming, not for use
                    (copy / name).parent.mkdir(parents=True, exist_ok=True)
                    (copy / name).write_bytes(checkpoint.child(name).read_bytes())
            save(copy, Path(d) / "model", meta)
            client.log_model_artifacts(model.model_id, str(Path(d) / "model"))
    except BaseException:
        # Not left PENDING: a later submission logs a new one (find_logged_model).
        with contextlib.suppress(MlflowException, OSError):
            client.finalize_logged_model(model.model_id, "FAILED")
        raise
    client.finalize_logged_model(model.model_id, "READY")
    log.info("logged checkpoint %s as MLflow model %s", checkpoint.uri, model.model_id)
    return model


def register_model(
    conn: Connection,
    run_id: str,
    checkpoint: Location,
    model_id: str,
    registered_model: str,
    tags: dict,
) -> None:
    """Register the logged model `model_id` as a new version of `registered_model`, unless a
    version of the run already is it."""
    client = conn.client
    query = f"name = '{registered_model}' and run_id = '{run_id}'"
    source = f"models:/{model_id}"
    versions = [v for v in client.search_model_versions(query) if v.source == source]
    if versions:
        log.info("%s version %s is this checkpoint already", registered_model, versions[0].version)
        return
    try:
        client.create_registered_model(registered_model)
    except MlflowException as e:
        if e.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
    version = client.create_model_version(
        registered_model,
        source=source,
        run_id=run_id,
        tags=tags,
        model_id=model_id,
    )
    log.info(
        "registered checkpoint %s as models:/%s/%s",
        checkpoint.uri,
        registered_model,
        version.version,
    )


def find_logged_model(conn: Connection, run_id: str, tags: dict):
    """The run's finished logged model of this checkpoint, if there is one."""
    query = f"source_run_id = '{run_id}'"
    for model in conn.client.search_logged_models([conn.experiment_id], filter_string=query):
        same = all(model.tags.get(k) == tags[k] for k in (CHECKPOINT, EPOCH, ACCURACY))
        if same and model.status == LoggedModelStatus.READY:
            return model
    return None


def registered_version(model_uri: str, *, uri: str | None) -> tuple[str, CheckpointMeta]:
    """`models:/<name>/<version>` for `model_uri` (an alias, `models:/<name>@<alias>`, pinned to
    the version it names now), and that version's checkpoint metadata, read from the registry
    without the weights: what a deploy checks before any replica downloads them."""
    with _registry(model_uri, uri) as (client, name, version):
        checkpoint = _checkpoint_in(client.get_model_version_download_uri(name, version), uri)
        with tempfile.TemporaryDirectory(prefix="ray-cv-registered-") as d:
            path = _download(f"{checkpoint}/{METADATA}", d, uri)
            meta = read_meta(Location.parse(os.path.dirname(path)))
    return f"{REGISTERED_MODEL}{name}/{version}", meta


def registered_checkpoint(
    model_uri: str, *, uri: str | None, dst: str | Path | None = None
) -> Location:
    """A registered model version's checkpoint, copied from the server into `dst` (default: a
    new temporary directory), the model's artifacts/checkpoint/ alone; load it as any checkpoint
    (pipeline.model)."""
    dst = str(dst or tempfile.mkdtemp(prefix="ray-cv-registered-"))
    with _registry(model_uri, uri) as (client, name, version):
        checkpoint = _checkpoint_in(client.get_model_version_download_uri(name, version), uri)
        path = _download(checkpoint, dst, uri)
    checkpoint = Location.parse(path)
    read_meta(checkpoint)  # a checkpoint of this bundle's, or an InputError that says it is not
    return checkpoint


@contextlib.contextmanager
def _registry(model_uri: str, uri: str | None):
    """(client, name, version) of `model_uri` on the server `uri`; the registry's errors inside
    as exit codes: the server not answering is a ClusterError, a version it lacks an InputError."""
    if not model_uri.startswith(REGISTERED_MODEL):
        raise ConfigError(
            f"{model_uri!r} is not a registered model: give models:/<name>/<version> or "
            "models:/<name>@<alias>"
        )
    if not uri:
        raise ConfigError(
            f"{model_uri}: no tracking server to read it from: set MLFLOW_TRACKING_URI (or "
            "tracking.uri) to the MLflow server that holds the registry"
        )
    from mlflow import MlflowClient

    for name, value in HTTP_SETTINGS.items():
        os.environ.setdefault(name, value)
    name, version, alias = registered_model(model_uri)
    try:
        client = MlflowClient(tracking_uri=uri, registry_uri=uri)
        if not version:
            version = client.get_model_version_by_alias(name, alias).version
        yield client, name, version
    except (MlflowException, OSError) as e:
        if unreachable(e):
            raise ClusterError(
                f"the tracking server {uri} does not answer ({brief(e)}), so {model_uri} "
                "cannot be read: start it, or fix MLFLOW_TRACKING_URI"
            ) from None
        raise InputError(
            f"{model_uri} is no registered model version at {uri} ({brief(e)}): check the name "
            "and version in the registry (mlflow models or the UI's Models page)"
        ) from None


def _checkpoint_in(source: str, uri: str) -> str:
    """The artifact URI of the checkpoint in a version's model at `source`: its MLflow model's
    artifacts/checkpoint/, or the model itself for a version logged before it was an MLflow
    model (the checkpoint's files alone)."""
    import mlflow.artifacts
    from mlflow.models.model import MLMODEL_FILE_NAME

    from pipeline.tracking.pyfunc import CHECKPOINT_PATH

    source = source.rstrip("/")
    files = mlflow.artifacts.list_artifacts(artifact_uri=source, tracking_uri=uri)
    if any(posixpath.basename(f.path) == MLMODEL_FILE_NAME for f in files):
        return f"{source}/{CHECKPOINT_PATH}"
    return source


def _download(artifact_uri: str, dst: str, uri: str) -> str:
    import mlflow.artifacts

    return mlflow.artifacts.download_artifacts(
        artifact_uri=artifact_uri, dst_path=dst, tracking_uri=uri
    )
