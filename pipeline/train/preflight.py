"""The training driver's checks before any worker starts: the run to resume, the dataset
version and its files, the model and the user's hooks.

Ray retries failed workers `max_failures` times, and a deterministic error would only fail
again: each is found here once, on the driver, and ends the job with its exit code.
"""

from __future__ import annotations

import contextlib
import logging

from pipeline.core.errors import ConfigError, InputError
from pipeline.core.storage import Location
from pipeline.data.dataset import VERSIONS, Manifest, committed_versions, read_manifest
from pipeline.data.shards import check_files
from pipeline.model.checkpoint import CheckpointMeta, DamagedCheckpoint, ModelInput, read_meta
from pipeline.model.resume import check_resumable
from pipeline.model.runs import epoch_of, latest_checkpoint, run_checkpoints
from pipeline.train.config import TrainConfig
from pipeline.train.config_names import is_hook

log = logging.getLogger(__name__)


def pick_dataset_version(
    cfg: TrainConfig, dataset: Location, meta: CheckpointMeta | None, *, run: str
) -> str:
    """The dataset version this job trains on: the one asked for, else the newest; a resumed
    run only goes on with the version it trained on, unless told to switch."""
    versions = committed_versions(dataset)
    if not versions:
        raise InputError(
            f"no dataset at dataset={dataset.uri}: it has no committed version below "
            f"{VERSIONS}/. Run the preprocess job with output= this path first (or fix dataset=)"
        )
    wanted = cfg.dataset_version or versions[-1]
    if meta is None or meta.dataset_version == wanted:
        return wanted
    if not cfg.switch_dataset:
        pinned = meta.dataset_version
        stored = pinned in versions
        source = "dataset_version" if cfg.dataset_version else "the newest"
        finish = f"Pass dataset_version={pinned} to finish on the data it started on, or pass"
        raise ConfigError(
            f"run {run} trained on version {pinned} of dataset {dataset.uri}, which "
            f"{'is still stored' if stored else 'is no longer stored'}, and this job would "
            f"train on version {wanted} ({source}). {finish if stored else 'Pass'} "
            "switch_dataset=true to train on from that version (its history records the "
            "switch), or pick a new name= for a new run"
        )
    log.warning(
        "switch_dataset=true: the run trained on dataset version %s goes on with version %s",
        *(meta.dataset_version, wanted),
    )
    return wanted


def recorded_latest(run_dir: Location) -> tuple[Location | None, CheckpointMeta | None]:
    """Ray's latest checkpoint of the run and its metadata; where that metadata is damaged, the
    newest epoch checkpoint before it that reads (the workers go on from there)."""
    latest = latest_checkpoint(run_dir)
    if latest is None:
        return None, None
    try:
        return latest, read_meta(latest)
    except DamagedCheckpoint as e:
        log.warning("%s: the run goes on from the checkpoint before it", e)
    for epoch, step, where in run_checkpoints(run_dir):
        if step is None and epoch < epoch_of(latest.path):
            with contextlib.suppress(DamagedCheckpoint):
                return where, read_meta(where)
    return None, None


def newest_meta(run_dir: Location, meta: CheckpointMeta | None) -> CheckpointMeta | None:
    """The metadata of the run's newest whole checkpoint on storage, of either kind, that reads
    (the workers resume from it: pipeline.train.checkpointer), else `meta`, that of Ray's latest.
    It may be newer than Ray's latest: a run stopped mid-epoch, or while an epoch's checkpoint
    was uploading. Its dataset version is the one the run goes on with."""
    for _, _, where in run_checkpoints(run_dir):
        try:
            return read_meta(where)
        except DamagedCheckpoint as e:
            log.warning("%s: the run goes on from the checkpoint before it", e)
    return meta


def with_partitions(cfg: TrainConfig, newest: CheckpointMeta | None) -> TrainConfig:
    """`cfg` with the partitions the run started with (its newest checkpoint's), or, for a new
    run, those it starts with: an epoch's order is a function of them (order.EpochOrder)."""
    recorded = newest.config.get("partitions") if newest is not None else None
    if recorded and cfg.global_batch_size % recorded == 0:
        if cfg.partitions not in (None, recorded):
            log.info(
                "partitions stays %d, the run's (partitions=%d applies to a new run)",
                recorded,
                cfg.partitions,
            )
        return cfg.model_copy(update={"partitions": recorded})
    return cfg.model_copy(update={"partitions": cfg.partitions_at_start()})


def check_dataset(cfg: TrainConfig, dataset: Location, version: str) -> Manifest:
    """The manifest of `version`, if that version is complete and usable for this config."""
    manifest = read_manifest(dataset, version)
    check_files(dataset, manifest)
    train, val = manifest.splits["train"].rows, manifest.splits["val"].rows
    workers = cfg.scaling.max_workers
    if train < 2 * workers:
        raise InputError(
            f"dataset {dataset.uri} has {train} train images: too few for {workers} workers "
            "(each needs at least 2); preprocess more images or lower scaling.num_workers"
        )
    if train < cfg.global_batch_size:
        # Each rank keeps only whole batches: the epoch would train on nothing, and succeed.
        raise InputError(
            f"dataset {dataset.uri} has {train} train images, fewer than one step of "
            f"global_batch_size={cfg.global_batch_size}: preprocess more images or lower "
            "global_batch_size"
        )
    if val == 0:
        raise InputError(
            f"dataset {dataset.uri} has no val images, and checkpoints are scored on val "
            "accuracy: preprocess with val_fraction > 0"
        )
    if cfg.decode == "gpu" and manifest.image_format != "jpeg":
        raise ConfigError(
            f"decode=gpu decodes JPEG images only, and dataset {dataset.uri} stores "
            f"{manifest.image_format} images: use decode=auto or decode=cpu (the DataLoader "
            "processes decode them), or preprocess with image_format=jpeg"
        )
    return manifest


def recorded_mode(cfg: TrainConfig, recorded: dict) -> TrainConfig:
    """`cfg` with the run's recorded checkpoint.mode, where it ranks by the same metric and
    leaves the mode to it."""
    was = recorded.get("checkpoint", {})
    if cfg.checkpoint.mode is None and was.get("metric") == cfg.checkpoint.metric:
        return cfg.with_checkpoint_mode(was.get("mode"))
    return cfg


def check_hooks(cfg: TrainConfig, manifest: Manifest) -> TrainConfig:
    """The loss, metrics, augmentation and class weights the config names, checked once here
    rather than failing on every worker; returns `cfg` with checkpoint.mode resolved."""
    if not (cfg.loss or cfg.metrics or cfg.class_weights is not None or is_hook(cfg.augment)):
        return cfg  # nothing of the user's: no torchmetrics to import
    from pipeline.train.hooks import check_hooks

    return check_hooks(cfg, manifest)


def ranked_why(cfg: TrainConfig) -> str:
    """Where the order of the checkpoints' score comes from, for the log."""
    hook = cfg.ranked_by_hook()
    if hook is not None:
        return f", by {hook}'s Metric (higher_is_better) or checkpoint.mode"
    return " (checkpoint.metric)"


def check_model(cfg: TrainConfig, manifest: Manifest, dataset: Location) -> ModelInput:
    """The model's name, builder arguments, weights and head, checked once here rather than
    failing on every worker; returns what the network takes (its input size and
    normalisation)."""
    # Imports torchvision (and timm for its models), which the driver needs only here.
    from pipeline.model.check import check_model

    return check_model(
        cfg.model,
        num_classes=len(manifest.classes),
        stored_size=manifest.image_size,
        mean=manifest.mean,
        std=manifest.std,
        dataset=dataset.uri,
    )


def check_inputs(
    cfg: TrainConfig,
    dataset: Location,
    version: str,
    *,
    run_dir: Location,
    latest: Location | None,
    meta: CheckpointMeta | None,
) -> tuple[Manifest, ModelInput]:
    """The manifest of dataset `version` and what the network takes: a resumed run's own
    input (checked against the dataset), a new run's from its model, checked."""
    manifest = check_dataset(cfg, dataset, version)
    if meta is not None:
        check_resumable(meta, manifest, checkpoint=latest.uri, dataset=dataset.uri)
        log.info(
            "run %s has %d of %d epochs: resuming from %s, on dataset version %s",
            *(run_dir.uri, meta.epoch + 1, cfg.epochs, latest.uri, version),
        )
        # The run goes on as it started, whatever the defaults now.
        return manifest, meta.model_input
    log.info("new run %s on dataset version %s", run_dir.uri, version)
    return manifest, check_model(cfg, manifest, dataset)
