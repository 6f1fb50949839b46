"""The training job on a real local Ray cluster, each test a run of its own (the tests of the
shared run, test_train_jobs): a worker kill between a checkpoint's upload and Ray's record of it,
max_failures=0, input errors that fail once, an image damaged in storage, and the Ray Data
ingest resumed after a kill on its dataset version."""

from __future__ import annotations

import re
import shutil
import uuid
from pathlib import Path

from corpus import damage_stored_image
from helpers import (
    armed_runtime_env,
    held_worker,
    history,
    in_background,
    kill_worker,
    latest_recorded,
    train_job,
    wait_for,
)

from harness.cluster import LocalCluster
from pipeline.core import faults
from pipeline.core.storage import Location
from pipeline.data.dataset import committed_versions, read_manifest
from pipeline.model.checkpoint import METADATA, read_meta
from pipeline.model.runs import SNAPSHOT, STEPS, latest_step_checkpoint, load_result

# One worker where what a test proves is not about several: each worker is a process that
# imports torch and joins the group (a 2-epoch job costs about 31 CPU-s more with two).
ONE_WORKER = "scaling.num_workers=1"
# A preprocess job of other images (3 classes, 40 px) for an output given by the caller.
PREPROCESS_OTHER = [
    "python",
    "-m",
    "jobs.preprocess",
    "source.kind=synthetic",
    "source.synthetic.num_classes=3",
    "source.synthetic.images_per_class=10",
    "source.synthetic.raw_size=48",
    "image_size=40",
    "shard_size=10",
]


# 481 train images at 16 a step: a checkpoint every 10 steps of an epoch's 30.
STEPS_OF_TEN = ("epochs=2", "global_batch_size=16", "checkpoint.every_steps=10", ONE_WORKER)


def held_upload_and_two_step_checkpoints(cluster, tiny_dataset, tmp_path, name: str, **submit):
    """A run whose epoch 0 checkpoint is whole on storage and its upload held (Ray not yet told:
    the `checkpoint_uploaded` point), while rank 0 trains on and writes epoch 1's step-10 and
    step-20 checkpoints: returns the job, the held worker's pid and the run directory."""
    env, marker = armed_runtime_env(tmp_path, faults.CHECKPOINT_UPLOADED)
    args = (f"name={name}", *STEPS_OF_TEN)
    job = in_background(
        train_job, cluster, tiny_dataset, tmp_path, *args, runtime_env=env, **submit
    )
    pid = held_worker(marker, job)
    run = tmp_path / name
    newest = run / STEPS / "epoch_0001_step_000020"
    wait_for(lambda: (newest / METADATA).exists() or job.done(), "epoch 1's step-20 checkpoint")
    assert read_meta(Location.parse(str(run / "epoch_0000"))).epoch == 0
    assert not (run / SNAPSHOT).exists()  # Ray has recorded nothing
    return job, pid, run


def newest_step_checkpoint(run: Path) -> Path:
    """The newest whole checkpoint inside an epoch of a run no process of which is training:
    epoch 1's step-20 checkpoint, or a later one where the loop went on while it was stopped."""
    newest = latest_step_checkpoint(Location.parse(str(run)))
    assert newest is not None and newest.name >= "epoch_0001_step_000020", newest
    return Path(newest.path)


def goes_on_from(newest: Path, proc, run: Path) -> None:
    """The job resumed from `newest`, the newest checkpoint on storage, recorded epoch 0's, and
    trained each epoch once."""
    assert proc.returncode == 0, proc.stdout
    step = int(newest.name.rsplit("_", 1)[1])
    resumed = f"resumed from checkpoint {newest}: epoch 1, continuing after its step {step}"
    assert resumed in proc.stdout, proc.stdout
    assert f"checkpoint {run / 'epoch_0000'} is on storage and not in Ray's record" in proc.stdout
    assert [r["epoch"] for r in history(run)] == [0, 1]
    recorded = load_result(Location.parse(str(run)))
    assert sorted(Path(c.path).name for c, _ in recorded.best_checkpoints) == [
        "epoch_0000",
        "epoch_0001",
    ]
    assert [m["epoch"] for _, m in recorded.best_checkpoints] == [0, 1]
    assert list((run / STEPS).iterdir()) == []  # gone once their epochs' checkpoints were in


def test_a_kill_while_an_upload_is_unrecorded_goes_on_from_the_newest_checkpoint_on_storage(
    cluster_2cpu, tiny_dataset, tmp_path
):
    job, pid, run = held_upload_and_two_step_checkpoints(cluster_2cpu, tiny_dataset, tmp_path, "r")
    kill_worker(cluster_2cpu, pid)
    newest = newest_step_checkpoint(run)  # before the new workers write one
    goes_on_from(newest, job.result(), run)


def test_a_job_stopped_while_an_upload_is_unrecorded_goes_on_from_it_when_submitted_again(
    cluster_2cpu, tiny_dataset, tmp_path
):
    submission_id = f"train-{uuid.uuid4().hex[:8]}"
    job, _, run = held_upload_and_two_step_checkpoints(
        cluster_2cpu, tiny_dataset, tmp_path, "r", submission_id=submission_id
    )
    assert cluster_2cpu.stop_job(submission_id) == "STOPPED"
    job.result()
    newest = newest_step_checkpoint(run)
    goes_on_from(
        newest, train_job(cluster_2cpu, tiny_dataset, tmp_path, "name=r", *STEPS_OF_TEN), run
    )


def test_a_kill_with_max_failures_0_fails_the_job(cluster_2cpu, tiny_dataset, tmp_path):
    run = tmp_path / "fragile"
    env, marker = armed_runtime_env(tmp_path, faults.CHECKPOINT_REPORTED)
    args = ("name=fragile", "epochs=2", "max_failures=0", ONE_WORKER)
    job = in_background(train_job, cluster_2cpu, tiny_dataset, tmp_path, *args, runtime_env=env)
    pid = held_worker(marker, job)
    # The point main_run kills at: epoch 0 in Ray's record, nothing later.
    wait_for(lambda: latest_recorded(run) == "epoch_0000", "epoch 0 in Ray's record", 60)
    kill_worker(cluster_2cpu, pid)
    proc = job.result()
    assert proc.returncode != 0, proc.stdout
    assert "training failed and max_failures=0 retries are used up" in proc.stdout
    assert str(pid) in proc.stdout  # the last error names the worker that died
    # What was recorded stays, for a resubmission to resume from.
    assert latest_recorded(run) == "epoch_0000"


def test_deterministic_input_errors_fail_once_before_any_worker(
    cluster_2cpu, tiny_dataset, tmp_path
):
    # Every worker would fail the same way, max_failures times: the driver checks first.
    missing = tmp_path / "missing.pt"
    proc = train_job(cluster_2cpu, tiny_dataset, tmp_path, "name=bad", f"model.weights={missing}")
    assert proc.returncode != 0
    assert f"error: model.weights {missing} do not exist" in proc.stdout, proc.stdout
    assert "RayTrainWorker" not in proc.stdout and not (tmp_path / "bad").exists()


def test_a_stored_image_damaged_in_place_ends_the_job_at_once_naming_its_row_group(
    cluster_2cpu, tiny_dataset, tmp_path
):
    # Bytes of one stored image overwritten, the shard's size unchanged: the driver's checks of
    # the files pass and a loader process fails on its page's checksum. Every retry would fail
    # on it again.
    copy = tmp_path / "damaged"
    shutil.copytree(tiny_dataset, copy)
    shard = sorted(copy.glob("data/*/train/*.parquet"))[0]
    damage_stored_image(shard, group=0, row=0)
    proc = train_job(cluster_2cpu, copy, tmp_path, "name=damaged", "max_failures=3", ONE_WORKER)
    assert "failed with exit code 1" in proc.stdout, proc.stdout  # the job's: bad input
    assert re.search(
        rf"error: dataset {copy}\S* is damaged: row group 0 of \S+/{shard.name}: it does not",
        proc.stdout,
    ), proc.stdout
    assert (
        ": it does not read as Parquet (could not verify page integrity, CRC checksum "
        "verification failed for page_ordinal 0); re-run preprocessing with overwrite=true\n"
    ) in proc.stdout, proc.stdout
    # Its workers started once (rank 0 says so as it starts): not again for max_failures.
    assert len(re.findall(r"\d+ workers on cpu, precision", proc.stdout)) == 1, proc.stdout


def test_ray_data_ingest_evaluates_exactly_and_resumes_after_a_kill_on_its_dataset_version(
    tiny_dataset, tmp_path
):
    # While the run holds epoch 0's checkpoint, a preprocess job commits a new version of other
    # images to the dataset it reads; then a worker dies. The restarted workers read the
    # version the run started on: Ray Data's reads were planned from its manifest.
    dataset = tmp_path / "dataset"
    shutil.copytree(tiny_dataset, dataset)
    (started_on,) = committed_versions(Location.parse(str(dataset)))
    run = tmp_path / "rd"
    env, marker = armed_runtime_env(tmp_path, faults.CHECKPOINT_REPORTED)
    # Two 1-CPU training workers, and a CPU beside them for Ray Data to decode on.
    with LocalCluster(num_cpus=3) as cluster:
        args = ("name=rd", "epochs=2", "ingest=ray_data")
        job = in_background(train_job, cluster, dataset, tmp_path, *args, runtime_env=env)
        pid = held_worker(marker, job)
        wait_for(lambda: latest_recorded(run) == "epoch_0000", "epoch 0 in Ray's record", 60)
        new = cluster.run_job([*PREPROCESS_OTHER, f"output={dataset}"], capture=True, timeout_s=300)
        assert new.returncode == 0, new.stdout
        assert read_manifest(Location.parse(str(dataset))).image_size == 40
        kill_worker(cluster, pid)
        proc = job.result()
    assert proc.returncode == 0, proc.stdout
    assert "training epochs 0 to 1: 481 train images, 119 val (ingest=ray_data)" in proc.stdout
    assert re.search(r"resumed from checkpoint \S+/rd/epoch_0000 \(epoch 0 done\)", proc.stdout)
    h = history(run)
    assert [(r["epoch"], r["dataset_version"]) for r in h] == [(0, started_on), (1, started_on)]
    # Every val image counted once in every epoch: val is split over the ranks with equal=False.
    assert [r["val_images"] for r in h] == [119, 119]
