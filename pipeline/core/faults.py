"""Fault points: where a fault test holds a process, to kill it at a state it checked.

A test arms one point for one job with `RAY_CV_FAULT=<point>:<directory>` in the job's runtime
env (harness.faults.arm), which the job's driver and Ray Train's workers inherit. The first
process to reach the armed point writes its pid to `<directory>/<point>` and blocks until it is
killed, or until the test releases it (to let a held writer go on when it chooses). The file
stays, so the workers that replace a killed one pass the point: a fresh directory per job. The
checkpoint points are on rank 0's path only, as rank 0 alone attaches checkpoints; the dataset
points are in the preprocess job's driver, the predictions points in the infer job's (the part
point in its write tasks). Unarmed, a point is one environment lookup.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

log = logging.getLogger(__name__)

ENV = "RAY_CV_FAULT"
# In Ray's upload thread, once rank 0's epoch checkpoint is on storage: Ray has not recorded
# it yet, since it queues it for the controller only once the upload returns.
CHECKPOINT_UPLOADED = "checkpoint_uploaded"
# Right after `ray.train.report` returns: the checkpoint's state is copied, and Ray's upload
# thread writes it and queues it for the controller without the training loop.
CHECKPOINT_REPORTED = "checkpoint_reported"
# Rank 0, once a checkpoint inside an epoch (checkpoint.every_steps) is on storage: the first
# one the run takes.
STEP_CHECKPOINTED = "step_checkpointed"
# Rank 0, once the checkpoint it took at a preemption notice is on storage.
PREEMPTION_CHECKPOINTED = "preemption_checkpointed"
# A preprocess run's shards and config are written, its manifest not yet: the commit point.
DATASET_WRITTEN = "dataset_written"
# The new manifest is in place, the datasets it replaced not yet removed.
DATASET_COMMITTED = "dataset_committed"
# An inference run's version directory is whole (parts, confusion matrix), the summary.json that
# would name it not yet written: the commit point.
PREDICTIONS_WRITTEN = "predictions_written"
# summary.json names the new version; the versions that retention lets go are not yet removed.
PREDICTIONS_COMMITTED = "predictions_committed"
# An inference write task has closed a whole part (rows_per_file predictions), the first of the
# job's to: some predictions are on storage, the rest not yet.
PREDICTIONS_PART_WRITTEN = "predictions_part_written"
# Training rank 1, after its second step of the attempt's second epoch (pipeline.train.stall):
# the other ranks wait for it in the next step's first collective (DDP's).
STEP_STALLED = "step_stalled"
# A predictor actor, at the start of its fourth batch (pipeline.infer.batch): the batch is held.
BATCH_STALLED = "batch_stalled"
POINTS = (
    CHECKPOINT_UPLOADED,
    CHECKPOINT_REPORTED,
    STEP_CHECKPOINTED,
    PREEMPTION_CHECKPOINTED,
    DATASET_WRITTEN,
    DATASET_COMMITTED,
    PREDICTIONS_WRITTEN,
    PREDICTIONS_COMMITTED,
    PREDICTIONS_PART_WRITTEN,
    STEP_STALLED,
    BATCH_STALLED,
)
# A held process goes on once `<marker>` + RELEASE exists (harness.faults.release writes it).
RELEASE = ".release"


def armed() -> tuple[str, Path] | None:
    """The armed point and its marker directory, if any."""
    value = os.environ.get(ENV)
    if not value:
        return None
    name, _, directory = value.partition(":")
    if name not in POINTS or not directory:
        raise ValueError(
            f"{ENV}={value!r}: expected <point>:<directory>, with the point one of "
            f"{', '.join(POINTS)}"
        )
    return name, Path(directory)


def armed_at(name: str) -> bool:
    """Whether point `name` is the one armed."""
    arming = armed()
    return arming is not None and arming[0] == name


def point(name: str) -> None:
    """If `name` is armed and has not fired in this run yet: block here until killed or
    released."""
    arming = armed()
    if arming is None or arming[0] != name:
        return
    marker = arming[1] / name
    if marker.exists():
        return  # fired already: this worker replaces the one killed here
    partial = marker.with_name(f".{name}.tmp")
    partial.write_text(str(os.getpid()))
    partial.replace(marker)  # the test reads a whole pid or no file
    log.warning("fault point %s: holding this process (pid %d)", name, os.getpid())
    released = marker.with_name(name + RELEASE)
    while not released.exists():
        time.sleep(0.1)
    log.warning("fault point %s: released", name)
