"""Elastic training (`scaling.num_workers=[min, max]`) across nodes: a head and two one-CPU
nodes of a cluster in this process (`ray.cluster_utils.Cluster`), the train job's driver function
called here. A node lost for good leaves the run to finish on the worker that fits; a node that
joins grows it back. Each change restarts the workers from the latest checkpoint, with the same
global batch."""

from __future__ import annotations

import math
import re
import time

import pytest
import ray
from helpers import held_worker, history, in_background, latest_recorded, wait_for
from in_process import WorkerLogs, connect, connect_armed, train_here, train_worker_nodes_here

from pipeline.core import faults
from pipeline.core.errors import ClusterError, failure
from pipeline.core.storage import Location
from pipeline.data.dataset import read_manifest
from pipeline.model.runs import STEPS

ELASTIC = ("scaling.num_workers=[1,2]", "scaling.resize_interval_s=5", "max_failures=1")
# An attempt at placing the workers that counted a node just lost times out after this.
STARTUP = "scaling.startup_timeout_s=15"


def test_elastic_run_shrinks_on_a_lost_node(two_node_cluster, tiny_dataset, tmp_path):
    # Two workers, one per node, with checkpoints inside the epoch: the node of one dies for
    # good once the first of them is on storage (epoch 0, step 4). The run goes on with one
    # worker at the next step, trains the global steps two workers would have, and finishes.
    cluster, run = two_node_cluster, tmp_path / "elastic"
    logs = WorkerLogs(cluster)
    marker = connect_armed(cluster, tmp_path, faults.STEP_CHECKPOINTED)
    args = ("name=elastic", "epochs=2", "checkpoint.every_steps=4", *ELASTIC, STARTUP)
    job = in_background(train_here, tiny_dataset, tmp_path, *args)
    held_worker(marker, job)
    assert len(set(train_worker_nodes_here())) == 2, "the two workers are not on two nodes"
    cluster.remove_node(next(iter(cluster.worker_nodes)), allow_graceful=False)
    lost_at = time.monotonic()
    wait_for(lambda: latest_recorded(run) == "epoch_0000" or job.done(), "epoch 0 in the record")
    recovered_s = time.monotonic() - lost_at
    assert job.result()["epochs"] == 2
    said = logs.text()
    resumed = "epoch 0, continuing after its step 4"
    assert re.search(rf"resumed from checkpoint \S+/elastic/steps/\S+: {re.escape(resumed)}", said)
    assert re.search(
        r"epoch 0 goes on after its step 4 on 1 workers of 32 images, 0 loader processes each "
        r"\(taken with 2 workers of 16 images, 0 loader processes each\)",
        said,
    ), said
    rows = history(run)
    assert [(r["epoch"], r["workers"]) for r in rows] == [(0, 1), (1, 1)]
    # Every row of epoch 0 once, in whole global batches of 32 (the last step filled with the
    # epoch's last rows again), as two workers would have trained them.
    train = read_manifest(Location.parse(str(tiny_dataset))).splits["train"].rows
    assert int(rows[0]["train_images"]) == math.ceil(train / 32) * 32
    # Exact on any count: every val image once, with one worker as with two.
    assert {r["val_images"] for r in rows} == {119}
    assert not list((run / STEPS).iterdir())  # the epochs' own checkpoints replaced them
    print(f"node lost for good mid-epoch -> epoch 1 on 1 worker: {recovered_s:.0f} s")


def test_elastic_run_grows_back_when_a_node_joins(two_node_cluster, tiny_dataset, tmp_path):
    # A run on the one node left (the other lost before it started), held after its first
    # epoch; a node joins: within resize_interval_s the run restarts on two workers from that
    # checkpoint, with the same global batch.
    cluster, run = two_node_cluster, tmp_path / "elastic"
    cluster.remove_node(next(iter(cluster.worker_nodes)), allow_graceful=False)
    logs = WorkerLogs(cluster)
    marker = connect_armed(cluster, tmp_path, faults.CHECKPOINT_REPORTED)
    wait_for(lambda: ray.cluster_resources().get("CPU") == 1, "the lost node out of the count", 60)
    args = ("name=elastic", "epochs=2", *ELASTIC, STARTUP)
    job = in_background(train_here, tiny_dataset, tmp_path, *args)
    held_worker(marker, job)
    wait_for(lambda: latest_recorded(run) == "epoch_0000", "epoch 0 in Ray's record", 60)
    assert len(train_worker_nodes_here()) == 1
    cluster.add_node(num_cpus=1)
    joined_at = time.monotonic()
    wait_for(lambda: len(train_worker_nodes_here()) == 2 or job.done(), "two workers again")
    grew_s = time.monotonic() - joined_at
    assert job.result()["epochs"] == 2
    said = logs.text()
    grown = "resumed with more workers: 2, was 1; the global batch stays 32 (16 per worker)"
    assert grown in said, said
    rows = history(run)
    assert [(r["epoch"], r["workers"]) for r in rows] == [(0, 1), (1, 2)]
    print(f"node joined -> two workers: {grew_s:.0f} s")


def test_elastic_run_with_no_room_for_its_minimum_fails_after_the_placement_attempts(
    two_node_cluster, tiny_dataset, tmp_path
):
    # Room for fewer workers than the minimum: Ray Train would wait for it with no limit; the
    # run fails once it has waited as long as a fixed count's placement attempts may take.
    connect(two_node_cluster)
    args = ("name=starved", "scaling.num_workers=[3,4]", "global_batch_size=12")
    started = time.monotonic()
    with pytest.raises(ClusterError) as failed:
        train_here(tiny_dataset, tmp_path, *args, *ELASTIC[1:], "scaling.startup_timeout_s=5")
    waited = time.monotonic() - started
    assert failure(failed.value)[0] == 3  # the train job's exit code: the cluster's failure
    said = "the cluster had no room for 3 training workers (the least of scaling.num_workers="
    assert said + "[3, 4]) with {'CPU': 1} each for 15 s (3 times startup_timeout_s=5)" in str(
        failed.value
    )
    assert waited < 90, f"the run took {waited:.0f} s to give up"
    print(f"no room for the minimum -> run failed after {waited:.0f} s")
