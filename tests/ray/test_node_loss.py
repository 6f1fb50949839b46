"""Training across nodes, one lost mid-run: a head and two one-CPU nodes of a cluster in this
process (`ray.cluster_utils.Cluster`), each node its own raylet, object store and CPUs, the train
job's driver function called here. Storage is a directory all of them see, as a shared
filesystem would be. A lost node is `remove_node`: its raylet, object store and the training
worker on it die at once."""

from __future__ import annotations

import re
import time

import pytest
from helpers import history, wait_for
from in_process import WorkerLogs, held_on_two_nodes_here, node_of

from pipeline.core.errors import ClusterError, failure


def test_a_lost_node_is_recovered_from_the_last_checkpoint_and_one_never_replaced_fails_the_run(
    two_node_cluster, tiny_dataset, tmp_path
):
    # 1. A node dies after the first checkpoint; a node rejoins 5 s later, as an autoscaler
    # would bring one: the run recovers and finishes with every epoch once.
    cluster, run = two_node_cluster, tmp_path / "multi"
    logs = WorkerLogs(cluster)
    # Rank 0 is held once Ray records epoch 0, so the loss lands after it, before epoch 1.
    args = ("scaling.startup_timeout_s=60", "epochs=2")
    job, _ = held_on_two_nodes_here(cluster, tiny_dataset, tmp_path, "multi", *args, epoch=0)
    cluster.remove_node(next(iter(cluster.worker_nodes)), allow_graceful=False)
    lost_at = time.monotonic()
    time.sleep(5)
    cluster.add_node(num_cpus=1)
    wait_for(lambda: (run / "epoch_0001").exists() or job.done(), "a checkpoint after the loss")
    recovered_s = time.monotonic() - lost_at
    summary = job.result()
    assert summary["epochs"] == 2, summary
    said = logs.text()
    assert re.search(r"resumed from checkpoint \S+/multi/epoch_0000", said), said
    assert [r["epoch"] for r in history(run)] == [0, 1]
    print(f"node lost -> next checkpoint: {recovered_s:.0f} s")  # for the record (-s)

    # 2. The same run trained on (epochs=4), held once rank 0 has reported epoch 2, while the
    # other worker goes on into epoch 3; that worker's node dies and no capacity comes back: the
    # run fails after max_failures + 1 attempts of startup_timeout_s, clearly, instead of Ray
    # Train's endless retry. Its checkpoints stay, for a resubmit once the cluster has room.
    args = ("scaling.startup_timeout_s=5", "max_failures=2", "epochs=4")
    job, held = held_on_two_nodes_here(cluster, tiny_dataset, tmp_path, "multi", *args, epoch=2)
    (other,) = [n for n in cluster.worker_nodes if n is not node_of(cluster, held)]
    cluster.remove_node(other, allow_graceful=False)
    lost_at = time.monotonic()
    with pytest.raises(ClusterError) as failed:
        job.result()
    waited = time.monotonic() - lost_at
    message = str(failed.value)
    expected = "the cluster could not place 2 training workers with {'CPU': 1} each within 5 s"
    assert f"{expected} (startup_timeout_s), 3 times (max_failures=2); " in message, message
    assert "it has {'CPU': 1.0} in total" in message, message  # what is left: one node
    assert failure(failed.value)[0] == 3  # the train job's exit code: the cluster's failure
    assert waited < 90, f"the run took {waited:.0f} s to give up"
    assert (run / "epoch_0002" / "model.pt").exists()
    print(f"node lost, no capacity -> run failed after {waited:.0f} s")
