"""Where the model to classify with comes from: what a user names as `model=` (a training run or
one checkpoint, local or on storage) turned into one checkpoint. Batch inference, export and
serving resolve it here; a registered model version (`models:/`), which only serving takes, is
read through pipeline.tracking. And which version of its own dataset a checkpoint is read
against: the one it was trained on."""

from __future__ import annotations

import logging

from pipeline.core.errors import ConfigError, InputError
from pipeline.core.storage import Location
from pipeline.data.dataset import committed_versions
from pipeline.model.checkpoint import METADATA, CheckpointMeta
from pipeline.model.run_status import TRAINING, describe_marker, run_summary
from pipeline.model.runs import RUN_SUMMARY, SNAPSHOT, best_checkpoint, load_result, summary_score

log = logging.getLogger(__name__)


def resolve_checkpoint(model: Location) -> Location:
    """`model` itself if it is a checkpoint, else the best checkpoint of the run it names, by
    the score the run recorded (its checkpoint.metric)."""
    if model.child(METADATA).exists():
        return model
    if model.child(SNAPSHOT).exists():
        if not model.child(RUN_SUMMARY).exists():
            # A scheduler that retries inference must not classify with a half-trained model.
            raise InputError(
                f"run {model.uri} has not finished training (no {RUN_SUMMARY}): let its train "
                "job finish (submitting it again resumes it), or pass one checkpoint directory "
                f"as model={model.uri}/epoch_NNNN"
            )
        summary = run_summary(model)
        if summary.get("status") == TRAINING:
            # Retention may delete the best checkpoint of now while the run trains on.
            raise ConfigError(
                f"model={model.uri} is a run that a train job has been training again since "
                f"{describe_marker(summary)}: its best checkpoint is not settled yet. Run "
                "inference once that job has finished, or pass one checkpoint directory as "
                f"model={model.uri}/epoch_NNNN"
            )
        result = load_result(model)
        if not result.best_checkpoints:
            raise InputError(f"run {model.uri} has no checkpoint yet: train it first")
        best, _ = best_checkpoint(model, result, summary_score(summary))
        return best
    if not model.exists():
        raise InputError(f"model={model.uri} does not exist")
    raise InputError(
        f"model={model.uri} is neither a training run (no {SNAPSHOT}) nor a checkpoint (no "
        f"{METADATA}): point it at <storage_path>/<name> of a train job, or one epoch_* in it"
    )


def trained_version(
    meta: CheckpointMeta, dataset: Location, asked: str | None, *, key: str
) -> str | None:
    """The version of `dataset` to read with the checkpoint of `meta`: `asked` if given; else,
    where `dataset` is the dataset it was trained on, the version it was trained on (so a
    version committed since changes nothing); else None, the newest."""
    trained_on = meta.config.get("dataset")
    if asked is not None or not trained_on or not dataset.same_place(trained_on):
        return asked
    version, versions = meta.dataset_version, committed_versions(dataset)
    if not versions:
        return None  # no dataset there now: the job says so as for any other
    if version not in versions:
        raise InputError(
            f"{key}={dataset.uri} is the dataset the checkpoint was trained on, but no longer "
            f"holds version {version}, the one it was trained on (removed retention_hours after "
            f"a newer one was committed). Pass dataset_version= to read another (it has: "
            f"{', '.join(versions[-3:])})"
        )
    log.info(
        "%s=%s is the dataset the checkpoint was trained on: reading version %s, the one it "
        "was trained on (dataset_version= reads another)",
        *(key, dataset.uri, version),
    )
    return version
