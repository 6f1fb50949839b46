"""A node lost after a preemption notice (a spot instance reclaimed) costs none of max_failures;
the same loss with no notice costs one. A head and two one-CPU nodes of a cluster in this process
(`ray.cluster_utils.Cluster`), the train job's driver function called here, max_failures=0: the
notice is the GCS's drain of the node, as a cloud's reclaim gives it, and the loss is
`remove_node` at its deadline. With Ray Train's preemption watcher on, as on every cluster
outside the tests, the notice itself saves a checkpoint mid-epoch, which the restart resumes
exactly."""

from __future__ import annotations

import time

import pytest
import torch
from helpers import held_worker, history, in_background, slow_cnn, wait_for
from in_process import (
    WorkerLogs,
    connect,
    connect_armed,
    drain_as_preempted,
    held_on_two_nodes_here,
    started,
    train_here,
)

from pipeline.core import faults
from pipeline.core.errors import ClusterError, failure
from pipeline.core.storage import Location
from pipeline.model.checkpoint import WEIGHTS
from pipeline.model.runs import STEPS, step_checkpoints, step_dir_name

# startup_timeout_s: an attempt at placing the workers that counted a node just lost times out
# after it. Ray Train sizes an elastic group by what Ray Data's autoscaling coordinator reserved,
# refreshed every 20 s: with 15 s attempts, two in a row could count the lost node.
NO_FAILURES = ("epochs=2", "max_failures=0", "scaling.startup_timeout_s=30")
DEADLINE_S = 5


def test_a_preempted_node_costs_no_failure_and_a_node_lost_unannounced_does(
    two_node_cluster, tiny_dataset, tmp_path
):
    # 1. Elastic, [1, 2]: rank 0 held once Ray records epoch 0, then one node is drained as
    # preempted and taken at the deadline. The run resumes on the node left, with no failure.
    cluster = two_node_cluster
    logs = WorkerLogs(cluster)
    args = (*NO_FAILURES, "scaling.num_workers=[1,2]")
    job, _ = held_on_two_nodes_here(cluster, tiny_dataset, tmp_path, "spot", *args, epoch=0)
    node = next(iter(cluster.worker_nodes))
    drain_as_preempted(cluster, node, deadline_s=DEADLINE_S)
    time.sleep(DEADLINE_S)  # the cloud takes the machine at the deadline
    cluster.remove_node(node, allow_graceful=False)
    assert job.result()["epochs"] == 2
    assert "resumed with fewer workers: 1, was 2" in logs.text()
    assert [(r["epoch"], r["workers"]) for r in history(tmp_path / "spot")] == [(0, 2), (1, 1)]

    # 2. The same loss with no notice is a failure, and max_failures=0 allows none. A fixed
    # count of two: an elastic run could start on one worker, before Ray Train counts the node.
    started(lambda: cluster.add_node(num_cpus=1))
    cluster.wait_for_nodes()
    args = (*NO_FAILURES, "scaling.num_workers=2")
    job, _ = held_on_two_nodes_here(cluster, tiny_dataset, tmp_path, "plain", *args, epoch=0)
    cluster.remove_node(next(iter(cluster.worker_nodes)), allow_graceful=False)
    with pytest.raises(ClusterError) as failed:
        job.result()
    assert "training failed and max_failures=0 retries are used up" in str(failed.value)
    assert failure(failed.value)[0] == 3  # the train job's exit code: the cluster's failure


# Checkpoints inside an epoch: a notice saves one at once; the restart resumes at its step. Three
# epochs of 16 steps of a network slowed to 0.4 s a forward pass: the notice, sent after step 4,
# must land before the last.
STEPS_RUN = ("epochs=3", "checkpoint.every_steps=4", "scaling.num_workers=2", "max_failures=0")
# The restart waits for the replacement node, as on a cloud.
REPLACEMENT_STARTUP = "scaling.startup_timeout_s=120"
# Ray Train's watcher on, looking for drains every second rather than 5 (the tests turn it off
# elsewhere: tests/conftest.py). Ray Train gives its controller these two from the driver's
# environment, which is this process's.
WATCHER = {"RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "1", "RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S": "1"}


def test_a_preemption_notice_mid_epoch_saves_a_checkpoint_that_the_restart_resumes_exactly(
    two_node_cluster, tiny_dataset, tmp_path, monkeypatch
):
    cluster = two_node_cluster
    package, network = slow_cnn(tmp_path / "code")
    monkeypatch.syspath_prepend(str(package.parent))  # the driver checks the model it names
    steps_run = (*STEPS_RUN, f"model.name={network}")
    # The reference, unhurried: the sleep changes no weight.
    connect(cluster, py_modules=[package])
    train_here(tiny_dataset, tmp_path, "name=calm", *steps_run, "model.kwargs.seconds=0")

    logs = WorkerLogs(cluster)
    point = faults.PREEMPTION_CHECKPOINTED
    for name, value in WATCHER.items():
        monkeypatch.setenv(name, value)
    marker = connect_armed(cluster, tmp_path, point, py_modules=[package])
    run = tmp_path / "spot"
    job = in_background(
        train_here, tiny_dataset, tmp_path, "name=spot", *steps_run, REPLACEMENT_STARTUP
    )
    # Training is under way (its first checkpoint inside epoch 0 is in): the cloud gives notice.
    wait_for(lambda: (run / STEPS).is_dir() and any((run / STEPS).iterdir()), "a step checkpoint")
    node = next(iter(cluster.worker_nodes))
    drain_as_preempted(cluster, node, deadline_s=2 * DEADLINE_S)
    deadline = time.monotonic() + 2 * DEADLINE_S
    # Rank 0 is held once the checkpoint it took at the notice is on storage: none comes after.
    held_worker(marker, job)
    epoch, step = newest_step(run)
    time.sleep(max(0.0, deadline - time.monotonic()) + 1)
    cluster.remove_node(node, allow_graceful=False)  # taken at the deadline; a replacement joins
    started(lambda: cluster.add_node(num_cpus=1))
    assert job.result()["epochs"] == 3
    said = logs.text()
    assert f"saved a checkpoint at epoch {epoch} step {step}, training on until Ray stops" in said
    resumed = f"{run / STEPS / step_dir_name(epoch, step)}: epoch {epoch}, continuing after"
    assert f"resumed from checkpoint {resumed} its step {step}" in said, said
    assert [r["epoch"] for r in history(run)] == [0, 1, 2]  # each once
    final = "epoch_0002"
    calm = torch.load(tmp_path / "calm" / final / WEIGHTS, weights_only=True)
    for name, weights in torch.load(run / final / WEIGHTS, weights_only=True).items():
        assert torch.equal(weights, calm[name]), name


def newest_step(run) -> tuple[int, int]:
    *_, (epoch, step, _) = step_checkpoints(Location.parse(str(run)))
    return epoch, step
