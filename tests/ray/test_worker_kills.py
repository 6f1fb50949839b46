"""Training with a worker killed, or failing on its input, on a one-node cluster of this process
(`ray.cluster_utils.Cluster`), the train job's driver function called here: a kill between a
checkpoint's upload and Ray's record of it, a kill with max_failures=0, input errors that fail
once, an image damaged in storage, and the Ray Data ingest resumed after a kill on its dataset
version. What the workers print is read from their logs; the job's exit code and `error:` line
are `failure` of what the driver raised. (A job stopped and submitted again:
tests/jobs/test_train_faults.py.)"""

from __future__ import annotations

import re
import shutil

import pytest
from corpus import damage_stored_image
from helpers import (
    held_worker,
    history,
    in_background,
    latest_recorded,
    newest_step_checkpoint,
    wait_for,
    went_on_from,
)
from in_process import (
    WorkerLogs,
    connect,
    connect_armed,
    kill_worker_here,
    preprocess_here,
    train_here,
    train_workers_of_this_job,
)

from pipeline.core import faults
from pipeline.core.errors import ClusterError, InputError, failure
from pipeline.core.storage import Location
from pipeline.data.dataset import committed_versions, read_manifest
from pipeline.model.checkpoint import METADATA, read_meta
from pipeline.model.runs import SNAPSHOT, STEPS

# One worker where what a test proves is not about several: each worker is a process that
# imports torch and joins the group.
ONE_WORKER = "scaling.num_workers=1"
# 481 train images at 16 a step: a checkpoint every 10 steps of an epoch's 30.
STEPS_OF_TEN = ("epochs=2", "global_batch_size=16", "checkpoint.every_steps=10", ONE_WORKER)
# A preprocess run of other images (3 classes, 40 px), for an output given by the caller.
PREPROCESS_OTHER = (
    "source.kind=synthetic",
    "source.synthetic.num_classes=3",
    "source.synthetic.images_per_class=10",
    "source.synthetic.raw_size=48",
    "image_size=40",
    "shard_size=10",
)


def test_a_kill_while_an_upload_is_unrecorded_goes_on_from_the_newest_checkpoint_on_storage(
    one_node_of_three_cpus, tiny_dataset, tmp_path
):
    # Epoch 0's checkpoint is whole on storage and its upload held (Ray not yet told: the
    # `checkpoint_uploaded` point), while rank 0 trains on and writes epoch 1's step-10 and
    # step-20 checkpoints; then the held worker dies.
    cluster, run = one_node_of_three_cpus, tmp_path / "r"
    logs = WorkerLogs(cluster)
    marker = connect_armed(cluster, tmp_path, faults.CHECKPOINT_UPLOADED)
    job = in_background(train_here, tiny_dataset, tmp_path, "name=r", *STEPS_OF_TEN)
    pid = held_worker(marker, job)
    step_20 = run / STEPS / "epoch_0001_step_000020"
    wait_for(lambda: (step_20 / METADATA).exists() or job.done(), "epoch 1's step-20 checkpoint")
    assert read_meta(Location.parse(str(run / "epoch_0000"))).epoch == 0
    assert not (run / SNAPSHOT).exists()  # Ray has recorded nothing
    kill_worker_here(pid)
    newest = newest_step_checkpoint(run)
    summary = job.result()
    assert summary["epochs"] == 2, summary
    went_on_from(newest, logs.text(), run)


def test_a_kill_with_max_failures_0_fails_the_job(one_node_of_three_cpus, tiny_dataset, tmp_path):
    run = tmp_path / "fragile"
    marker = connect_armed(one_node_of_three_cpus, tmp_path, faults.CHECKPOINT_REPORTED)
    args = ("name=fragile", "epochs=2", "max_failures=0")
    job = in_background(train_here, tiny_dataset, tmp_path, *args)
    pid = held_worker(marker, job)
    # The point main_run kills at: epoch 0 in Ray's record, nothing later.
    wait_for(lambda: latest_recorded(run) == "epoch_0000", "epoch 0 in Ray's record", 60)
    kill_worker_here(pid)
    with pytest.raises(ClusterError) as failed:
        job.result()
    code, line = failure(failed.value)
    assert code == 3  # the train job's exit code: training failed
    assert line.startswith("training failed and max_failures=0 retries are used up"), line
    assert str(pid) in line  # the last error names the worker that died
    # What was recorded stays, for a resubmission to resume from.
    assert latest_recorded(run) == "epoch_0000"


def test_deterministic_input_errors_fail_once_before_any_worker(
    one_node_of_three_cpus, tiny_dataset, tmp_path
):
    # Every worker would fail the same way, max_failures times: the driver checks first.
    connect(one_node_of_three_cpus)
    missing = tmp_path / "missing.pt"
    with pytest.raises(InputError) as failed:
        train_here(tiny_dataset, tmp_path, "name=bad", f"model.weights={missing}")
    assert failure(failed.value) == (1, f"model.weights {missing} do not exist")
    assert train_workers_of_this_job() == [] and not (tmp_path / "bad").exists()


def test_a_stored_image_damaged_in_place_ends_the_job_at_once_naming_its_row_group(
    one_node_of_three_cpus, tiny_dataset, tmp_path
):
    # Bytes of one stored image overwritten, the shard's size unchanged: the driver's checks of
    # the files pass and a loader process fails on its page's checksum. Every retry would fail
    # on it again.
    copy = tmp_path / "damaged"
    shutil.copytree(tiny_dataset, copy)
    shard = sorted(copy.glob("data/*/train/*.parquet"))[0]
    damage_stored_image(shard, group=0, row=0)
    logs = WorkerLogs(one_node_of_three_cpus)
    connect(one_node_of_three_cpus)
    with pytest.raises(InputError) as failed:
        train_here(copy, tmp_path, "name=damaged", "max_failures=3", ONE_WORKER)
    code, line = failure(failed.value)
    assert code == 1, line  # the job's: bad input
    assert re.match(
        rf"dataset {copy}\S* is damaged: row group 0 of \S+/{shard.name}: it does not", line
    ), line
    assert line.endswith(
        ": it does not read as Parquet (could not verify page integrity, CRC checksum "
        "verification failed for page_ordinal 0); re-run preprocessing with overwrite=true"
    ), line
    # Its workers started once (rank 0 says so as it starts): not again for max_failures.
    said = logs.text()
    assert len(re.findall(r"\d+ workers on cpu, precision", said)) == 1, said
    assert len(train_workers_of_this_job()) == 1


def test_ray_data_ingest_evaluates_exactly_and_resumes_after_a_kill_on_its_dataset_version(
    one_node_of_three_cpus, tiny_dataset, tmp_path
):
    # While the run holds epoch 0's checkpoint, a preprocess run commits a new version of other
    # images to the dataset it reads; then a worker dies. The restarted workers read the
    # version the run started on: Ray Data's reads were planned from its manifest. Two 1-CPU
    # training workers, and a CPU beside them for Ray Data to decode on.
    cluster, run = one_node_of_three_cpus, tmp_path / "rd"
    dataset = tmp_path / "dataset"
    shutil.copytree(tiny_dataset, dataset)
    (started_on,) = committed_versions(Location.parse(str(dataset)))
    logs = WorkerLogs(cluster)
    marker = connect_armed(cluster, tmp_path, faults.CHECKPOINT_REPORTED)
    job = in_background(train_here, dataset, tmp_path, "name=rd", "epochs=2", "ingest=ray_data")
    pid = held_worker(marker, job)
    wait_for(lambda: latest_recorded(run) == "epoch_0000", "epoch 0 in Ray's record", 60)
    preprocess_here(*PREPROCESS_OTHER, f"output={dataset}")
    assert read_manifest(Location.parse(str(dataset))).image_size == 40
    kill_worker_here(pid)
    assert job.result()["epochs"] == 2
    said = logs.text()
    assert "training epochs 0 to 1: 481 train images, 119 val (ingest=ray_data)" in said, said
    assert re.search(r"resumed from checkpoint \S+/rd/epoch_0000 \(epoch 0 done\)", said), said
    h = history(run)
    assert [(r["epoch"], r["dataset_version"]) for r in h] == [(0, started_on), (1, started_on)]
    # Every val image counted once in every epoch: val is split over the ranks with equal=False.
    assert [r["val_images"] for r in h] == [119, 119]
