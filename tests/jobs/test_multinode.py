"""Training across nodes: a head and two worker nodes on this machine, one killed mid-run.

Each node is its own `ray start` (its own raylet, object store, temp dir and CPUs), joined to
the head over 127.0.0.1, as machines join a real cluster; storage is a directory all of them
see, as a shared filesystem would be.
"""

from __future__ import annotations

import re
import time

import pytest
from helpers import (
    held_on_two_nodes,
    history,
    wait_for,
)

pytestmark = pytest.mark.xdist_group("head_and_two_nodes")  # its costly fixture, made once


def test_node_lost_mid_training(head_and_two_nodes, tiny_dataset, tmp_path):
    # 1. A node dies after the first checkpoint; a node rejoins 5 s later, as an autoscaler
    # would bring one: the run recovers and finishes with every epoch once.
    run = tmp_path / "multi"
    # Rank 0 is held once Ray records epoch 0, so the loss lands after it, before epoch 1.
    args = ("scaling.startup_timeout_s=60", "epochs=2")
    job = held_on_two_nodes(head_and_two_nodes, tiny_dataset, tmp_path, "multi", *args, epoch=0)
    # The machine dies: raylet, object store, the training worker on it.
    head_and_two_nodes.nodes[-1].kill()
    killed_at = time.monotonic()
    time.sleep(5)
    head_and_two_nodes.add_node(num_cpus=1)
    wait_for(lambda: (run / "epoch_0001").exists() or job.done(), "a checkpoint after the loss")
    recovered_s = time.monotonic() - killed_at
    proc = job.result()
    assert proc.returncode == 0, proc.stdout
    assert re.search(r"resumed from checkpoint \S+/multi/epoch_0000", proc.stdout), proc.stdout
    assert [r["epoch"] for r in history(run)] == [0, 1]
    print(f"node lost -> next checkpoint: {recovered_s:.0f} s")  # for the record (-s)

    # 2. The same run trained on (epochs=4), held once rank 0 has reported epoch 2, while the
    # other worker goes on into epoch 3; that worker's node dies and no capacity comes back: the
    # job fails after max_failures + 1 attempts of startup_timeout_s, clearly, instead of Ray
    # Train's endless retry. Its checkpoints stay, for a resubmit once the cluster has room.
    args = ("scaling.startup_timeout_s=5", "max_failures=2", "epochs=4")
    job = held_on_two_nodes(head_and_two_nodes, tiny_dataset, tmp_path, "multi", *args, epoch=2)
    head_and_two_nodes.nodes[-1].kill()
    killed_at = time.monotonic()
    proc = job.result()
    waited = time.monotonic() - killed_at
    assert proc.returncode != 0, proc.stdout
    expected = "the cluster could not place 2 training workers with {'CPU': 1} each within 5 s"
    assert f"{expected} (startup_timeout_s), 3 times (max_failures=2)" in proc.stdout, proc.stdout
    left = re.findall(r"it has \{.*?\} in total", proc.stdout)
    assert "it has {'CPU': 1.0} in total" in left, left  # what is left: one node
    assert waited < 90, f"the job took {waited:.0f} s to give up"
    assert (run / "epoch_0002" / "model.pt").exists()
    print(f"node lost, no capacity -> job failed after {waited:.0f} s")
