"""Preemption across nodes: a node drained as preempted (a spot instance reclaimed) and then
lost costs none of max_failures; the same loss without the drain does. A head and two one-CPU
worker nodes on this machine, training with scaling.num_workers=[1,2] and max_failures=0."""

from __future__ import annotations

import time

import pytest
import torch
from helpers import (
    FAST_NODE_DEATH,
    armed_runtime_env,
    held_on_two_nodes,
    held_worker,
    history,
    in_background,
    job_runtime_env,
    slow_cnn,
    train_job,
    wait_for,
    with_worker_nodes,
)

from harness.cluster import NODE_JOIN_TIMEOUT_S, LocalCluster
from pipeline.core import faults
from pipeline.core.storage import Location
from pipeline.model.checkpoint import WEIGHTS
from pipeline.model.runs import STEPS, step_checkpoints, step_dir_name

pytestmark = pytest.mark.xdist_group("head_and_two_nodes")  # its costly fixture, made once

# startup_timeout_s: an attempt at placing the workers that counted a node just lost times out
# after it. Ray Train sizes an elastic group by what Ray Data's autoscaling coordinator reserved,
# refreshed every 20 s: with 15 s attempts, two in a row could count the lost node (1 of 5 runs).
NO_FAILURES = (
    "epochs=2",
    "scaling.num_workers=[1,2]",
    "max_failures=0",
    "scaling.startup_timeout_s=30",
)
DEADLINE_S = 10


def lose_a_node_after_epoch_0(
    head_and_two_nodes, tiny_dataset, tmp_path, name: str, *args, preempted: bool
):
    """Train `name`, hold rank 0 once Ray has recorded epoch 0, then lose the last node: drained
    as preempted and killed at the drain's deadline, or killed with no warning. Returns the
    job's output and the seconds from the loss to the job's end."""
    job = held_on_two_nodes(
        head_and_two_nodes, tiny_dataset, tmp_path, name, *NO_FAILURES, *args, epoch=0
    )
    node = head_and_two_nodes.nodes[-1]
    if preempted:
        reason, message = "DRAIN_NODE_REASON_PREEMPTION", "spot instance reclaimed (test)"
        node.drain(head_and_two_nodes, reason=reason, message=message, deadline_s=DEADLINE_S)
        time.sleep(DEADLINE_S)  # the cloud takes the machine at the deadline
    node.kill()
    lost_at = time.monotonic()
    proc = job.result()
    return proc, time.monotonic() - lost_at


def test_a_preempted_node_costs_no_failure(head_and_two_nodes, tiny_dataset, tmp_path):
    proc, took_s = lose_a_node_after_epoch_0(
        head_and_two_nodes, tiny_dataset, tmp_path, "spot", preempted=True
    )
    assert proc.returncode == 0, proc.stdout
    assert "resumed with fewer workers: 1, was 2" in proc.stdout, proc.stdout
    assert [(r["epoch"], r["workers"]) for r in history(tmp_path / "spot")] == [(0, 2), (1, 1)]
    print(f"preempted node lost -> job done: {took_s:.0f} s")

    # The same loss with no drain is a failure, and max_failures=0 allows none. A fixed count
    # of two: an elastic run could start on one worker, before Ray Train counts the new node.
    head_and_two_nodes.add_node(num_cpus=1)
    proc, took_s = lose_a_node_after_epoch_0(
        head_and_two_nodes,
        tiny_dataset,
        tmp_path,
        "plain",
        "scaling.num_workers=2",
        preempted=False,
    )
    assert "failed with exit code 3" in proc.stdout, proc.stdout  # the job's: cluster error
    assert "training failed and max_failures=0 retries are used up" in proc.stdout, proc.stdout
    print(f"node lost with no drain -> job failed: {took_s:.0f} s")


# Checkpoints inside an epoch: a notice saves one at once; the restart resumes at its step. Three
# epochs of 16 steps of a network slowed to 0.4 s a forward pass: the notice, sent after step 4,
# must land before the last.
STEPS_RUN = ("epochs=3", "checkpoint.every_steps=4", "scaling.num_workers=2", "max_failures=0")
REPLACEMENT_STARTUP = f"scaling.startup_timeout_s={NODE_JOIN_TIMEOUT_S}"


@pytest.fixture
def fresh_head_and_two_nodes():
    """A head with no CPUs and two one-CPU nodes of this test's own. On the cluster that the
    other tests of its unit share, the worker started after the drained node's loss died loading
    torch ("Intel oneMKL FATAL ERROR: Cannot load libtorch_cpu.so") in both runs where
    test_multinode had killed and added nodes there first; on a fresh cluster it never has."""
    # Ray Train's preemption watcher on, as on every cluster outside the tests: it gives the
    # notice (conftest.py turns it off elsewhere).
    env = {**FAST_NODE_DEATH, "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "1"}
    with LocalCluster(num_cpus=0, env=env) as cluster:
        yield with_worker_nodes(cluster, 2)


def test_a_preemption_notice_mid_epoch_saves_a_checkpoint_that_the_restart_resumes_exactly(
    fresh_head_and_two_nodes, tiny_dataset, tmp_path
):
    head_and_two_nodes = fresh_head_and_two_nodes
    package, network = slow_cnn(tmp_path)
    steps_run = (*STEPS_RUN, f"model.name={network}")
    (tmp_path / "unarmed").mkdir()
    calm_env = job_runtime_env(tmp_path / "unarmed", py_modules=[package])
    # The reference, unhurried: the sleep changes no weight.
    unhurried = "model.kwargs.seconds=0"
    proc = train_job(
        head_and_two_nodes,
        tiny_dataset,
        tmp_path,
        "name=calm",
        *steps_run,
        unhurried,
        runtime_env=calm_env,
    )
    assert proc.returncode == 0, proc.stdout

    # Ray Train's controller looks for drains every second, not 5: the notice lands within a few
    # steps of the drain, well before the run's 48 steps are done.
    poll = {"RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S": "1"}
    point = faults.PREEMPTION_CHECKPOINTED
    env, marker = armed_runtime_env(tmp_path, point, py_modules=[package], **poll)
    run = tmp_path / "spot"
    job = in_background(
        train_job,
        head_and_two_nodes,
        tiny_dataset,
        tmp_path,
        "name=spot",
        *steps_run,
        # The restart waits for the replacement node, as on a cloud. Started on a loaded
        # machine, one took over 30 s, the default: its raylet gave up on its agent's ports
        # and `add_node` started it again, while the restart timed out with max_failures=0.
        REPLACEMENT_STARTUP,
        runtime_env=env,
    )
    # Training is under way (its first checkpoint inside epoch 0 is in): the cloud gives notice.
    wait_for(lambda: (run / STEPS).is_dir() and any((run / STEPS).iterdir()), "a step checkpoint")
    node = head_and_two_nodes.nodes[-1]
    reason, message = "DRAIN_NODE_REASON_PREEMPTION", "spot instance reclaimed (test)"
    node.drain(head_and_two_nodes, reason=reason, message=message, deadline_s=2 * DEADLINE_S)
    deadline = time.monotonic() + 2 * DEADLINE_S
    # Rank 0 is held once the checkpoint it took at the notice is on storage: none comes after.
    held_worker(marker, job)
    epoch, step = newest_step(run)
    print(f"drained after epoch 0 step 4 -> checkpoint at the notice: epoch {epoch} step {step}")
    time.sleep(max(0.0, deadline - time.monotonic()) + 1)
    node.kill()  # the cloud takes the machine at the deadline; a replacement joins

    head_and_two_nodes.add_node(num_cpus=1)
    proc = job.result()
    assert proc.returncode == 0, proc.stdout
    saved = f"saved a checkpoint at epoch {epoch} step {step}, training on until Ray stops"
    assert saved in proc.stdout
    resumed = f"{run / STEPS / step_dir_name(epoch, step)}: epoch {epoch}, continuing after"
    assert f"resumed from checkpoint {resumed} its step {step}" in proc.stdout, proc.stdout
    assert [r["epoch"] for r in history(run)] == [0, 1, 2]  # each once
    final = "epoch_0002"
    for name, weights in torch.load(run / final / WEIGHTS, weights_only=True).items():
        calm = torch.load(tmp_path / "calm" / final / WEIGHTS, weights_only=True)[name]
        assert torch.equal(weights, calm), name


def newest_step(run) -> tuple[int, int]:
    *_, (epoch, step, _) = step_checkpoints(Location.parse(str(run)))
    return epoch, step
