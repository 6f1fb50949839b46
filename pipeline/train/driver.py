"""Fault-tolerant distributed training with Ray Train's TorchTrainer: the driver.

`train` checks the config, the model, the dataset and any run to resume before `fit()`: Ray
retries failed workers `max_failures` times, and a deterministic error would only fail again.
The workers run `pipeline.train.worker`; the run's record (best checkpoint, reports) is
`pipeline.model.runs`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Iterator, Sequence

import ray
import ray.train
import ray.train.torch
from ray.train.v2.api.callback import UserCallback

from pipeline.core.errors import ClusterError, ConfigError, InputError
from pipeline.core.job_table import this_job_id
from pipeline.core.logs import RAY_TRAIN_LOG_LEVEL
from pipeline.core.ray_internals import (
    HANG_DETECTOR_DIRNAME,
    WORKER_GROUP_START_TIMEOUT_S_ENV_VAR,
    ControllerCallback,
    InitializingState,
    ReschedulingState,
    RestartingState,
    UserExceptionWithTraceback,
    WorkerGroupStartupTimeoutError,
)
from pipeline.core.storage import Location
from pipeline.core.tracking import EpochSink, TrainingTracker
from pipeline.data.dataset import (
    VERSIONS,
    Manifest,
    check_files,
    committed_versions,
    read_manifest,
)
from pipeline.model.checkpoint import (
    CheckpointMeta,
    DamagedCheckpoint,
    ModelInput,
    config_score,
    read_meta,
)
from pipeline.model.runs import (
    RUN_SUMMARY,
    DivergedRun,
    check_resumable,
    epoch_of,
    latest_checkpoint,
    mark_training,
    resume_changes,
    run_checkpoints,
    write_reports,
)
from pipeline.train.config import TrainConfig, is_hook
from pipeline.train.run_lock import hold_run
from pipeline.train.stall_watch import StallWatch, TrainingStalled

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


# A run whose step loop waits for input more than this share of its time is input-bound.
INPUT_BOUND_SHARE = 0.1


def input_verdict(summary: dict, cfg: TrainConfig) -> str:
    """One line: whether the run waited for its input, and what to try if it did."""
    share = summary.get("input_wait_share")
    if share is None:
        return "input wait: not measured (the run's epochs are from before it was)"
    if share <= INPUT_BOUND_SHARE:
        return f"not input-bound: the step loop waited for input {share:.0%} of its time"
    advice = (
        "more CPUs to decode with (scaling.cpus_per_worker, with scaling.loader_workers up to "
        "it), or preprocess at a smaller image_size"
    )
    if cfg.scaling.use_gpu and cfg.ingest == "torch" and cfg.decode != "gpu":
        advice = (
            f"Decode on the GPUs (decode=gpu, for a JPEG dataset), or give each worker {advice}"
        )
    else:
        advice = f"Give each worker {advice}"
    return f"input-bound: the step loop waited for input {share:.0%} of its time. {advice}"


def train(
    cfg: TrainConfig,
    *,
    dataset: Location,
    runs: Location,
    tracking: TrainingTracker | None = None,
    callbacks: Sequence[UserCallback] = (),
) -> dict:
    """Train (or resume) the run `<runs>/<name>`; return its summary (Ray initialised). With
    `tracking`, the run is tracked too (pipeline.tracking); `callbacks` go to Ray Train (a
    sweep's trial passes its reports to Ray Tune). A run another live train job holds is
    refused (pipeline.train.run_lock)."""
    with hold_run(runs.child(cfg.name)):
        return _train(cfg, dataset=dataset, runs=runs, tracking=tracking, callbacks=callbacks)


def _train(
    cfg: TrainConfig,
    *,
    dataset: Location,
    runs: Location,
    tracking: TrainingTracker | None,
    callbacks: Sequence[UserCallback],
) -> dict:
    started = time.monotonic()
    run_dir = runs.child(cfg.name)
    latest, meta = recorded_latest(run_dir)
    if meta is not None:
        cfg = recorded_mode(cfg, meta.config)  # a resume keeps the run's: resume_changes checks
    newest = newest_meta(run_dir, meta)
    cfg = with_partitions(cfg, newest)
    changes = resume_changes(meta.config, cfg) if meta is not None else []
    if meta is not None:
        for change in changes:
            log.info("changed since the run's last epoch, applied from here on: %s", change)
        if meta.epoch + 1 >= cfg.epochs:
            log.info(
                "run %s is complete (%d epochs, epochs=%d): nothing to train. Raise epochs= to "
                "train on, or pick a new name= for a new run",
                *(run_dir.uri, meta.epoch + 1, cfg.epochs),
            )
            if tracking is not None:  # logs what an earlier job could not
                tracking.start(run_dir, cfg, version=meta.dataset_version, changes=changes)
            score = config_score(cfg.model_dump())
            summary = write_reports(run_dir, score, wall_time_s=time.monotonic() - started)
            if tracking is not None:
                tracking.finish(run_dir, summary)
            return summary
    version = pick_dataset_version(cfg, dataset, newest, run=run_dir.uri)
    manifest = check_dataset(cfg, dataset, version)
    if meta is not None:
        check_resumable(meta, manifest, checkpoint=latest.uri, dataset=dataset.uri)
        log.info(
            "run %s has %d of %d epochs: resuming from %s, on dataset version %s",
            *(run_dir.uri, meta.epoch + 1, cfg.epochs, latest.uri, version),
        )
        inputs = meta.model_input  # the run goes on as it started, whatever the defaults now
    else:
        log.info("new run %s on dataset version %s", run_dir.uri, version)
        inputs = check_model(cfg, manifest, dataset)
    cfg = check_hooks(cfg, manifest)
    score = config_score(cfg.model_dump())
    log.info("checkpoints ranked by %s%s", score, ranked_why(cfg))

    # Before the workers start: a tracking server that cannot take the run fails the job now.
    sink = tracking.start(run_dir, cfg, version=version, changes=changes) if tracking else None
    # Until write_reports: inference must not take a run trained again as finished.
    mark = mark_training(run_dir) if run_dir.child(RUN_SUMMARY).exists() else None
    try:
        with sigterm_raises():
            fit(
                cfg,
                manifest,
                inputs,
                dataset=dataset,
                runs=runs,
                tracking=sink,
                callbacks=callbacks,
            )
        if mark is not None:
            mark.release(restore=False)
        summary = write_reports(run_dir, score, wall_time_s=time.monotonic() - started)
    except BaseException as e:
        if mark is not None:
            mark.release(restore=True)  # failed or stopped: the run is as it last finished
        if isinstance(e, ClusterError | DivergedRun) and tracking is not None:
            tracking.fail(run_dir, str(e))
        raise
    if tracking is not None:
        tracking.finish(run_dir, summary)
    return summary


@contextlib.contextmanager
def sigterm_raises() -> Iterator[None]:
    """Within: SIGTERM raises SystemExit in the main thread, so that `except` and `finally`
    blocks run; by default Python dies at once. `ray job stop` sends it to the job's driver,
    then SIGKILL RAY_JOB_STOP_WAIT_TIME_S (3 by default) later. Ray's blocking calls check for
    signals while they wait, so it arrives within one of them too."""
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread may set handlers
        return

    def stop(signum, frame):
        log.warning("SIGTERM: the job is being stopped")
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def train_loop_per_worker(config: dict) -> None:
    """Each worker's loop, imported there: the driver needs neither torchvision nor
    torchmetrics, which cost seconds to import."""
    from pipeline.train.worker import train_loop_per_worker

    train_loop_per_worker(config)


# Attempts at placing the workers when max_failures=-1 (recover from worker failures always):
# a cluster without room must still end the job, as with the default max_failures=3.
STARTUP_ATTEMPTS_UNLIMITED = 4


def startup_attempts(cfg: TrainConfig) -> int:
    """How many times the workers' start is tried before the job fails.

    An elastic run gets one more: right after a node is lost (or reaches its preemption
    deadline), Ray Train can size the new group by the cluster's resources from before the
    cluster declared the node dead, and that attempt times out; the next one counts right if
    startup_timeout_s outlasts that stale view: Ray Data's autoscaling coordinator, which Ray
    Train asks, refreshes it every 20 s, after the node's death is detected (about 17 s by
    default)."""
    attempts = cfg.max_failures + 1 if cfg.max_failures >= 0 else STARTUP_ATTEMPTS_UNLIMITED
    return attempts + 1 if cfg.scaling.elastic else attempts


def failure_config(cfg: TrainConfig) -> ray.train.FailureConfig:
    """Ray Train's failure handling for `cfg`.

    Ray Train waits startup_timeout_s for the workers' placement group, then retries forever
    unless controller failures are capped: capped so that a worker group that cannot be placed,
    or that fails to start (a node lost while its workers import torch), is retried like a
    worker failure, and a cluster without room ends the job after `startup_attempts` attempts.
    A preemption (a node drained as preempted, then lost) is retried apart from max_failures:
    Ray Train waits for the drain's deadline, then restarts from the latest checkpoint.
    """
    return ray.train.FailureConfig(
        max_failures=cfg.max_failures,
        controller_failure_limit=startup_attempts(cfg) - 1,
        # Ray's default too; set here so that the config says it, and can change it.
        max_preemption_failures=cfg.max_preemptions,
    )


class WorkersNotPlacedError(RuntimeError):
    """Raised on Ray Train's controller when an elastic run has waited its limit for room."""


class ElasticWaitLimit(ControllerCallback):
    """Ends an elastic run that waits longer than `limit_s` for room for its minimum workers.

    With a [min, max] worker range Ray Train starts a worker group only once the cluster has
    room for `min` workers, and until then waits with no time limit (the startup timeout counts
    only once a group is being placed). Runs on the controller, which calls it on every turn
    of its loop: a state that waits for a scaling decision starts the clock, any other stops it.
    """

    WAITING = (InitializingState, RestartingState, ReschedulingState)

    def __init__(self, limit_s: float, min_workers: int):
        self.limit_s, self.min_workers = limit_s, min_workers
        self.waiting_since: float | None = None

    def after_controller_state_update(self, previous_state, current_state) -> None:
        if not isinstance(current_state, self.WAITING):
            self.waiting_since = None
            return
        now = time.monotonic()
        if self.waiting_since is None:
            self.waiting_since = now
        elif now - self.waiting_since > self.limit_s:
            raise WorkersNotPlacedError(
                f"waited {self.limit_s:.0f} s for room for {self.min_workers} workers"
            )


class WorkerInputError(RuntimeError):
    """Raised on Ray Train's controller when a worker failed on its input (an InputError)."""


class InputErrorsEndTheRun(ControllerCallback):
    """Ends a run at a worker's InputError (a stored image damaged since it was written, a
    shard gone) instead of retrying it `max_failures` times: the same rows fail again. Runs on
    the controller, on the state its failure policy picked for a failed worker group."""

    def after_controller_state_update(self, previous_state, current_state) -> None:
        error = getattr(current_state, "training_failed_error", None)
        if (cause := worker_input_error(error)) is not None:
            raise WorkerInputError(str(cause))


def worker_input_error(error: BaseException | None) -> InputError | None:
    """The InputError a worker raised, where that is what failed its worker group."""
    for failure in getattr(error, "worker_failures", {}).values():
        if isinstance(failure, UserExceptionWithTraceback):
            failure = failure._base_exc
        if isinstance(failure, InputError):
            return failure
    return None


def fit(
    cfg: TrainConfig,
    manifest: Manifest,
    inputs: ModelInput,
    *,
    dataset: Location,
    runs: Location,
    tracking: EpochSink | None = None,
    callbacks: Sequence[UserCallback] = (),
) -> None:
    from ray.train.v2.api.exceptions import ControllerError, NCCLHangError, PreemptionError

    s, score = cfg.scaling, config_score(cfg.model_dump())
    per_worker = {"CPU": s.cpus_per_worker} | ({"GPU": 1} if s.use_gpu else {})
    os.environ[WORKER_GROUP_START_TIMEOUT_S_ENV_VAR] = str(s.startup_timeout_s)
    workers = f"{s.min_workers} to {s.max_workers}" if s.elastic else str(s.max_workers)
    data = {}
    if cfg.ingest == "ray_data":
        from pipeline.train.augment import transform_options
        from pipeline.train.input.ray_data import ExactValConfig, datasets

        data = {
            "datasets": datasets(manifest, dataset, seed=cfg.seed, **transform_options(cfg)),
            "dataset_config": ExactValConfig(),
        }
        spare = ray.cluster_resources().get("CPU", 0) - s.max_workers * s.cpus_per_worker
        log.info("ingest=ray_data: decoding on the cluster's spare CPUs (%g now)", spare)
        if spare < 1:
            log.warning(
                "ingest=ray_data needs CPUs beside the training workers' to decode, and the "
                "cluster has none spare now: training waits until a node with CPUs joins"
            )
    # The same bound as for a fixed count: startup_attempts placements of startup_timeout_s each.
    limit_s = startup_attempts(cfg) * s.startup_timeout_s
    waits = [ElasticWaitLimit(limit_s, s.min_workers)] if s.elastic else []
    watch = StallWatch(runs.child(cfg.name), multiple=cfg.stall.multiple, min_s=cfg.stall.min_s)
    trainer = ray.train.torch.TorchTrainer(
        train_loop_per_worker,
        train_loop_config={
            "config": cfg.model_dump(mode="json"),
            "dataset": dataset,
            "dataset_version": manifest.version,
            "model_input": inputs,
            "run_dir": runs.child(cfg.name),
            "tracking": tracking,  # rank 0 logs each epoch there
            "job_id": this_job_id(),  # what the workers' metrics and progress name
        },
        scaling_config=ray.train.ScalingConfig(
            # A (min, max) range makes Ray Train elastic: it starts with as many workers as
            # the cluster has room for, restarts with fewer when a node is lost, and grows
            # (a restart from the latest checkpoint) when it finds room, checked every
            # resize_interval_s.
            num_workers=(s.min_workers, s.max_workers) if s.elastic else s.max_workers,
            elastic_resize_monitor_interval_s=s.resize_interval_s,
            use_gpu=s.use_gpu,
            resources_per_worker=per_worker,
        ),
        **data,
        run_config=ray.train.RunConfig(
            name=cfg.name,
            storage_path=runs.path,
            storage_filesystem=runs.fs,
            logging_config=ray.train.LoggingConfig(log_level=RAY_TRAIN_LOG_LEVEL),
            failure_config=failure_config(cfg),
            callbacks=[*callbacks, *waits, InputErrorsEndTheRun(), watch],
            checkpoint_config=ray.train.CheckpointConfig(
                num_to_keep=cfg.checkpoint.num_to_keep,
                checkpoint_score_attribute=score.key,
                checkpoint_score_order=score.mode,
            ),
        ),
    )
    log.info(
        "starting %s workers with %s each; waiting up to %.0f s for them (startup_timeout_s)",
        *(workers, per_worker, s.startup_timeout_s),
    )
    try:
        trainer.fit()
    except ControllerError as e:
        have = {k: v for k, v in ray.cluster_resources().items() if k in ("CPU", "GPU")}
        advice = (
            f"it has {have} in total. Lower {'the minimum of ' if s.elastic else ''}"
            "scaling.num_workers or scaling.cpus_per_worker, add nodes (or GPUs), or raise "
            "scaling.startup_timeout_s if the cluster is autoscaling"
        )
        if isinstance(e.controller_failure, WorkersNotPlacedError):
            raise ClusterError(
                f"the cluster had no room for {s.min_workers} training workers (the least of "
                f"scaling.num_workers={list(s.num_workers)}) with {per_worker} each for "
                f"{startup_attempts(cfg) * s.startup_timeout_s:.0f} s ({startup_attempts(cfg)} "
                f"times startup_timeout_s={s.startup_timeout_s:.0f}); {advice}"
            ) from None
        if isinstance(e.controller_failure, WorkerGroupStartupTimeoutError):
            raise ClusterError(
                f"the cluster could not place {workers} training workers with "
                f"{per_worker} each within {s.startup_timeout_s:.0f} s (startup_timeout_s), "
                f"{startup_attempts(cfg)} times (max_failures={cfg.max_failures}); {advice}"
            ) from None
        if isinstance(e.controller_failure, WorkerInputError):
            raise InputError(str(e.controller_failure)) from None
        if isinstance(e.controller_failure, TrainingStalled):
            raise ClusterError(str(e.controller_failure)) from None
        raise ClusterError(f"training failed: {e}") from None
    except PreemptionError as e:
        raise ClusterError(
            f"training failed: more than max_preemptions={cfg.max_preemptions} node "
            f"preemptions; the last: {e}"
        ) from None
    except NCCLHangError as e:
        raise ClusterError(nccl_hang(e, cfg, runs.child(cfg.name))) from None
    except ray.train.TrainingFailedError as e:
        if (cause := worker_input_error(e)) is not None:  # max_failures=0: no retry to stop
            raise InputError(str(cause)) from None
        raise ClusterError(
            f"training failed and max_failures={cfg.max_failures} retries are used up; "
            f"the last error: {e}"
        ) from None


def nccl_hang(error: Exception, cfg: TrainConfig, run_dir: Location) -> str:
    """One line for Ray Train's NCCLHangError (its NCCL RAS hang detector, turned on with
    RAY_TRAIN_ENABLE_NCCL_HANG_DETECTOR=1): what Ray found, and where it put the stacks."""
    found = str(error).partition(":\n")[2] or str(error)
    found = found.strip().partition("\n")[0].partition(". ")[0]
    return (
        f"training hung in NCCL: Ray Train's hang detector found that {found}, through "
        f"max_failures={cfg.max_failures} retries. Stacks of every rank and the ncclras "
        f"reports: {run_dir.child(HANG_DETECTOR_DIRNAME).uri}/. Resubmit to resume from the "
        "last checkpoint"
    )
