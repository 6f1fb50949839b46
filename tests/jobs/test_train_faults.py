"""The training job on a real local Ray cluster, stopped with `ray job stop` between a
checkpoint's upload and Ray's record of it, and submitted again. (The shared run's tests:
test_train_jobs. A worker killed at that point, max_failures=0, input errors that fail once, an
image damaged in storage and the Ray Data ingest resumed after a kill, with the driver function
called in the test process: tests/ray/test_worker_kills.py.)"""

from __future__ import annotations

import uuid

from helpers import (
    armed_runtime_env,
    held_worker,
    in_background,
    newest_step_checkpoint,
    train_job,
    wait_for,
    went_on_from,
)

from pipeline.core import faults
from pipeline.core.storage import Location
from pipeline.model.checkpoint import METADATA, read_meta
from pipeline.model.runs import SNAPSHOT, STEPS

# 481 train images at 16 a step: a checkpoint every 10 steps of an epoch's 30. One worker: what
# the test proves is not about several, and each worker is a process that imports torch and
# joins the group (a 2-epoch job costs about 31 CPU-s more with two).
STEPS_OF_TEN = (
    "epochs=2",
    "global_batch_size=16",
    "checkpoint.every_steps=10",
    "scaling.num_workers=1",
)


def held_upload_and_two_step_checkpoints(cluster, tiny_dataset, tmp_path, name: str, **submit):
    """A run whose epoch 0 checkpoint is whole on storage and its upload held (Ray not yet told:
    the `checkpoint_uploaded` point), while rank 0 trains on and writes epoch 1's step-10 and
    step-20 checkpoints: returns the job and the run directory."""
    env, marker = armed_runtime_env(tmp_path, faults.CHECKPOINT_UPLOADED)
    args = (f"name={name}", *STEPS_OF_TEN)
    job = in_background(
        train_job, cluster, tiny_dataset, tmp_path, *args, runtime_env=env, **submit
    )
    held_worker(marker, job)
    run = tmp_path / name
    newest = run / STEPS / "epoch_0001_step_000020"
    wait_for(lambda: (newest / METADATA).exists() or job.done(), "epoch 1's step-20 checkpoint")
    assert read_meta(Location.parse(str(run / "epoch_0000"))).epoch == 0
    assert not (run / SNAPSHOT).exists()  # Ray has recorded nothing
    return job, run


def test_a_job_stopped_while_an_upload_is_unrecorded_goes_on_from_it_when_submitted_again(
    cluster_2cpu, tiny_dataset, tmp_path
):
    submission_id = f"train-{uuid.uuid4().hex[:8]}"
    job, run = held_upload_and_two_step_checkpoints(
        cluster_2cpu, tiny_dataset, tmp_path, "r", submission_id=submission_id
    )
    assert cluster_2cpu.stop_job(submission_id) == "STOPPED"
    job.result()
    newest = newest_step_checkpoint(run)
    proc = train_job(cluster_2cpu, tiny_dataset, tmp_path, "name=r", *STEPS_OF_TEN)
    assert proc.returncode == 0, proc.stdout
    went_on_from(newest, proc.stdout, run)
