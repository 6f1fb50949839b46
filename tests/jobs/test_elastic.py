"""Elastic training (`scaling.num_workers=[min, max]`) across nodes: a head and two one-CPU
worker nodes on this machine. A node lost for good leaves the run to finish on the worker that
fits; a node that joins grows it back. Each change restarts the workers from the latest
checkpoint, with the same global batch."""

from __future__ import annotations

import math
import re
import time

import pytest
from helpers import (
    armed_runtime_env,
    held_worker,
    history,
    in_background,
    latest_recorded,
    train_job,
    training_worker_nodes,
    wait_for,
)

from pipeline.core import faults
from pipeline.core.storage import Location
from pipeline.data.dataset import read_manifest
from pipeline.model.runs import STEPS

pytestmark = pytest.mark.xdist_group("head_and_two_nodes")  # its costly fixture, made once

ELASTIC = ("scaling.num_workers=[1,2]", "scaling.resize_interval_s=5", "max_failures=1")
# An attempt at placing the workers that counted a node just lost times out after this.
STARTUP = "scaling.startup_timeout_s=15"


def test_elastic_run_shrinks_on_a_lost_node_and_grows_back(
    head_and_two_nodes, tiny_dataset, tmp_path
):
    # 1. Two workers, one per node, with checkpoints inside the epoch: the node of one dies for
    # good once the first of them is on storage (epoch 0, step 4). The run goes on with one
    # worker at the next step, trains the global steps two workers would have, and finishes.
    run = tmp_path / "elastic"
    env, marker = armed_runtime_env(tmp_path, faults.STEP_CHECKPOINTED)
    args = ("name=elastic", "epochs=2", "checkpoint.every_steps=4", *ELASTIC, STARTUP)
    job = in_background(
        train_job, head_and_two_nodes, tiny_dataset, tmp_path, *args, runtime_env=env
    )
    held_worker(marker, job)
    assert len(set(training_worker_nodes(head_and_two_nodes))) == 2, (
        "the two workers are not on two nodes"
    )
    head_and_two_nodes.nodes[-1].kill()
    killed_at = time.monotonic()
    wait_for(lambda: latest_recorded(run) == "epoch_0000" or job.done(), "epoch 0 in the record")
    recovered_s = time.monotonic() - killed_at
    proc = job.result()
    assert proc.returncode == 0, proc.stdout
    said = "epoch 0, continuing after its step 4"
    assert re.search(
        rf"resumed from checkpoint \S+/elastic/steps/\S+: {re.escape(said)}", proc.stdout
    )
    assert re.search(
        r"epoch 0 goes on after its step 4 on 1 workers of 32 images, 0 loader processes each "
        r"\(taken with 2 workers of 16 images, 0 loader processes each\)",
        proc.stdout,
    ), proc.stdout
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

    # 2. The run trained on (epochs=4) on the one node left, held after its first epoch; a node
    # joins: within resize_interval_s the run restarts on two workers from that checkpoint.
    fault = tmp_path / "grow"
    fault.mkdir()
    env, marker = armed_runtime_env(fault, faults.CHECKPOINT_REPORTED)
    args = ("name=elastic", "epochs=4", *ELASTIC, STARTUP)
    job = in_background(
        train_job, head_and_two_nodes, tiny_dataset, tmp_path, *args, runtime_env=env
    )
    held_worker(marker, job)
    wait_for(lambda: latest_recorded(run) == "epoch_0002", "epoch 2 in Ray's record", 60)
    head_and_two_nodes.add_node(num_cpus=1)
    joined_at = time.monotonic()
    wait_for(
        lambda: len(training_worker_nodes(head_and_two_nodes)) == 2 or job.done(),
        "two workers again",
    )
    grew_s = time.monotonic() - joined_at
    proc = job.result()
    assert proc.returncode == 0, proc.stdout
    said = "resumed with more workers: 2, was 1; the global batch stays 32 (16 per worker)"
    assert said in proc.stdout, proc.stdout
    rows = history(run)
    assert [(r["epoch"], r["workers"]) for r in rows] == [(0, 1), (1, 1), (2, 1), (3, 2)]
    print(f"node joined -> two workers: {grew_s:.0f} s")

    # 3. Room for fewer workers than the minimum: Ray Train would wait for it with no limit; the
    # job fails once it has waited as long as a fixed count's placement attempts may take.
    args = ("name=starved", "scaling.num_workers=[3,4]", "global_batch_size=12")
    started = time.monotonic()
    proc = train_job(
        head_and_two_nodes,
        tiny_dataset,
        tmp_path,
        *args,
        *ELASTIC[1:],
        "scaling.startup_timeout_s=5",
    )
    waited = time.monotonic() - started
    assert "failed with exit code 3" in proc.stdout, proc.stdout  # the job's: cluster error
    said = "the cluster had no room for 3 training workers (the least of scaling.num_workers="
    assert (
        said + "[3, 4]) with {'CPU': 1} each for 15 s (3 times startup_timeout_s=5)" in proc.stdout
    )
    assert waited < 90, f"the job took {waited:.0f} s to give up"
    print(f"no room for the minimum -> job failed after {waited:.0f} s")
