"""Fixtures of the Ray tier: clusters of several nodes on this machine, started in the test
process (`ray.cluster_utils.Cluster`, as Ray's own Train tests start theirs), with nodes added and
removed by the test."""

from __future__ import annotations

import pytest
import ray
from in_process import started
from ray.cluster_utils import Cluster

# The GCS declares a lost node dead within about 2 s, not Ray's default of about 17 s: with
# placement attempts of seconds, a test would otherwise race the detection.
FAST_NODE_DEATH = {
    "health_check_period_ms": 1000,
    "health_check_timeout_ms": 1000,
    "health_check_failure_threshold": 2,
}


def cluster(head_cpus: int, nodes: int):
    """A cluster of a head with `head_cpus` CPUs and `nodes` one-CPU nodes, each with its own
    raylet and object store; the test's driver connects with `in_process.connect`. Shut down
    after the test, whatever it left."""
    head = {"num_cpus": head_cpus, "include_dashboard": False, "_system_config": FAST_NODE_DEATH}
    made = started(lambda: Cluster(initialize_head=True, head_node_args=head))
    try:
        for _ in range(nodes):
            started(lambda: made.add_node(num_cpus=1))
        made.wait_for_nodes()
        yield made
    finally:
        ray.shutdown()
        made.shutdown()


@pytest.fixture
def two_node_cluster():
    """A head with no CPUs (it runs the driver, never training, as in cluster.yaml) and two
    one-CPU nodes."""
    yield from cluster(0, 2)


@pytest.fixture(scope="module")
def one_node_of_three_cpus():
    """A head of 3 CPUs and no other node, for the tests of a module in turn: two one-CPU
    training workers and a CPU beside them (where Ray Data decodes). Each test connects as a
    job of its own (`in_process.connect`), which ends the last test's."""
    yield from cluster(3, 0)
