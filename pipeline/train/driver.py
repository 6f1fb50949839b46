"""Fault-tolerant distributed training with Ray Train's TorchTrainer: the driver, a run's life.

`train` holds the run, checks what it needs before any worker starts (pipeline.train.preflight),
runs `fit()` and writes the run's reports; Ray's failures become the bundle's exit codes
(pipeline.train.failures). The workers run `pipeline.train.worker`; the run's record (best
checkpoint, reports) is `pipeline.model.runs`.
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

from pipeline.core.errors import ClusterError
from pipeline.core.job_table import this_job_id
from pipeline.core.logs import RAY_TRAIN_LOG_LEVEL
from pipeline.core.ray_internals import WORKER_GROUP_START_TIMEOUT_S_ENV_VAR
from pipeline.core.storage import Location
from pipeline.core.tracking import EpochSink, TrainingTracker
from pipeline.data.dataset import Manifest
from pipeline.model.checkpoint import CheckpointMeta, ModelInput, Score, config_score
from pipeline.model.resume import resume_changes
from pipeline.model.run_status import mark_training
from pipeline.model.runs import RUN_SUMMARY, DivergedRun, write_reports
from pipeline.train.config import TrainConfig
from pipeline.train.failures import (
    ElasticWaitLimit,
    InputErrorsEndTheRun,
    failure_config,
    startup_attempts,
    training_error,
)
from pipeline.train.preflight import (
    check_hooks,
    check_inputs,
    newest_meta,
    pick_dataset_version,
    ranked_why,
    recorded_latest,
    recorded_mode,
    with_partitions,
)
from pipeline.train.run_lock import hold_run
from pipeline.train.stall_watch import StallWatch

log = logging.getLogger(__name__)


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
    """The held run's life: what it resumes from, the checks, then fit and its reports (or,
    for a run that has trained all its epochs, its reports alone)."""
    started = time.monotonic()
    run_dir = runs.child(cfg.name)
    latest, meta = recorded_latest(run_dir)
    if meta is not None:
        cfg = recorded_mode(cfg, meta.config)  # a resume keeps the run's: resume_changes checks
    newest = newest_meta(run_dir, meta)
    cfg = with_partitions(cfg, newest)
    changes = resume_changes(meta.config, cfg) if meta is not None else []
    for change in changes:
        log.info("changed since the run's last epoch, applied from here on: %s", change)
    if meta is not None and meta.epoch + 1 >= cfg.epochs:
        return _complete(cfg, run_dir, meta, changes, tracking=tracking, started=started)
    version = pick_dataset_version(cfg, dataset, newest, run=run_dir.uri)
    manifest, inputs = check_inputs(
        cfg, dataset, version, run_dir=run_dir, latest=latest, meta=meta
    )
    cfg = check_hooks(cfg, manifest)
    score = config_score(cfg.model_dump())
    log.info("checkpoints ranked by %s%s", score, ranked_why(cfg))

    # Before the workers start: a tracking server that cannot take the run fails the job now.
    sink = tracking.start(run_dir, cfg, version=version, changes=changes) if tracking else None
    fit_args = {"dataset": dataset, "runs": runs, "tracking": sink, "callbacks": callbacks}
    return _fit_and_report(
        cfg, manifest, inputs, score, fit_args=fit_args, tracking=tracking, started=started
    )


def _complete(
    cfg: TrainConfig,
    run_dir: Location,
    meta: CheckpointMeta,
    changes: list[str],
    *,
    tracking: TrainingTracker | None,
    started: float,
) -> dict:
    """A run that has trained all its epochs: nothing to train, its reports written again."""
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


def _fit_and_report(
    cfg: TrainConfig,
    manifest: Manifest,
    inputs: ModelInput,
    score: Score,
    *,
    fit_args: dict,
    tracking: TrainingTracker | None,
    started: float,
) -> dict:
    """fit(), then the run's reports (returned, and finished in `tracking`). A run trained again
    is marked as training until its reports are written, and put back as it last finished if
    this fails or stops."""
    run_dir = fit_args["runs"].child(cfg.name)
    # Until write_reports: inference must not take a run trained again as finished.
    mark = mark_training(run_dir) if run_dir.child(RUN_SUMMARY).exists() else None
    try:
        with sigterm_raises():
            fit(cfg, manifest, inputs, **fit_args)
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
    """Ray Train's TorchTrainer over the checked inputs, run to its end; its failures raised
    as the bundle's errors (pipeline.train.failures)."""
    s, per_worker = cfg.scaling, worker_resources(cfg)
    os.environ[WORKER_GROUP_START_TIMEOUT_S_ENV_VAR] = str(s.startup_timeout_s)
    workers = f"{s.min_workers} to {s.max_workers}" if s.elastic else str(s.max_workers)
    data = ray_data_inputs(cfg, manifest, dataset) if cfg.ingest == "ray_data" else {}
    trainer = ray.train.torch.TorchTrainer(
        train_loop_per_worker,
        train_loop_config=loop_config(
            cfg, manifest, inputs, dataset=dataset, runs=runs, tracking=tracking
        ),
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
        run_config=run_config(cfg, runs, callbacks),
    )
    log.info(
        "starting %s workers with %s each; waiting up to %.0f s for them (startup_timeout_s)",
        *(workers, per_worker, s.startup_timeout_s),
    )
    try:
        trainer.fit()
    except ray.train.TrainingFailedError as e:
        raise training_error(e, cfg, runs.child(cfg.name), per_worker) from None


def worker_resources(cfg: TrainConfig) -> dict[str, float]:
    """What each training worker asks of its node."""
    s = cfg.scaling
    return {"CPU": s.cpus_per_worker} | ({"GPU": 1} if s.use_gpu else {})


def loop_config(
    cfg: TrainConfig,
    manifest: Manifest,
    inputs: ModelInput,
    *,
    dataset: Location,
    runs: Location,
    tracking: EpochSink | None,
) -> dict:
    """What each worker's loop is given (Ray Train's train_loop_config)."""
    return {
        "config": cfg.model_dump(mode="json"),
        "dataset": dataset,
        "dataset_version": manifest.version,
        "model_input": inputs,
        "run_dir": runs.child(cfg.name),
        "tracking": tracking,  # rank 0 logs each epoch there
        "job_id": this_job_id(),  # what the workers' metrics and progress name
    }


def ray_data_inputs(cfg: TrainConfig, manifest: Manifest, dataset: Location) -> dict:
    """ingest=ray_data: the TorchTrainer's datasets, decoded by Ray Data on the cluster's
    spare CPUs."""
    from pipeline.train.augment import transform_options
    from pipeline.train.input.ray_data import ExactValConfig, datasets

    s = cfg.scaling
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
    return data


def run_config(
    cfg: TrainConfig, runs: Location, callbacks: Sequence[UserCallback]
) -> ray.train.RunConfig:
    """Where the run lives, how it fails and retries, which checkpoints it keeps, and the
    callbacks on Ray Train's controller (the caller's, then the driver's own)."""
    s, score = cfg.scaling, config_score(cfg.model_dump())
    # The same bound as for a fixed count: startup_attempts placements of startup_timeout_s each.
    limit_s = startup_attempts(cfg) * s.startup_timeout_s
    waits = [ElasticWaitLimit(limit_s, s.min_workers)] if s.elastic else []
    watch = StallWatch(runs.child(cfg.name), multiple=cfg.stall.multiple, min_s=cfg.stall.min_s)
    return ray.train.RunConfig(
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
    )
