"""The capacity wait on a real in-process cluster: its request to the autoscaler stands beside
other callers' and leaves theirs when it ends; a bundle no node type holds is refused."""

from __future__ import annotations

import time

import pytest
from helpers import in_background, wait_for
from ray._raylet import GCS_AUTOSCALER_CLUSTER_CONFIG_KEY, GCS_AUTOSCALER_STATE_NAMESPACE
from ray.autoscaler.sdk import request_resources
from ray.core.generated.autoscaler_pb2 import ClusterConfig, NodeGroupConfig

from pipeline.core import ray_internals
from pipeline.core.capacity import standing_requests, wait_for_capacity
from pipeline.core.errors import ClusterError


def bundles() -> list[dict]:
    return [bundle for bundle, _ in standing_requests()]


@pytest.fixture
def requests_cleared(ray_in_process):
    request_resources(bundles=[])
    yield
    request_resources(bundles=[])


def test_the_request_stands_beside_others_and_only_ours_is_withdrawn(requests_cleared):
    request_resources(bundles=[{"CPU": 1}])  # another job's, standing before ours
    # 3 CPUs: more than the cluster's 2, so it waits, asking the autoscaler.
    waiting = in_background(
        wait_for_capacity, {"CPU": 3}, 6, asked="cpus_per_actor=3", fix="lower cpus_per_actor"
    )
    wait_for(lambda: {"CPU": 3} in bundles() or waiting.done(), "our request standing", 5)
    assert sorted(bundles(), key=str) == [{"CPU": 1}, {"CPU": 3}]
    # Another caller replaces the cluster-wide request, as Ray Data's autoscaling coordinator
    # does every 20 s: ours comes back beside the new one.
    request_resources(bundles=[{"GPU": 1}])
    wait_for(lambda: {"CPU": 3} in bundles() or waiting.done(), "our request put back", 3)
    assert sorted(bundles(), key=str) == [{"CPU": 3}, {"GPU": 1}]
    with pytest.raises(ClusterError, match=r"cpus_per_actor=3, but the cluster has 2 CPUs"):
        waiting.result()
    assert bundles() == [{"GPU": 1}]


@pytest.fixture
def reported_node_types(ray_in_process):
    """What an autoscaler that reports its node types (KubeRay's) tells the cluster: it can add
    up to 4 nodes of 1 CPU."""
    config = ClusterConfig(node_group_configs=[NodeGroupConfig(resources={"CPU": 1}, max_count=4)])
    put = ray_internals._internal_kv_put
    put(
        GCS_AUTOSCALER_CLUSTER_CONFIG_KEY,
        config.SerializeToString(),
        True,
        namespace=GCS_AUTOSCALER_STATE_NAMESPACE,
    )
    yield
    put(GCS_AUTOSCALER_CLUSTER_CONFIG_KEY, b"", True, namespace=GCS_AUTOSCALER_STATE_NAMESPACE)


def test_a_bundle_no_node_type_holds_is_refused_at_once(reported_node_types, requests_cleared):
    started = time.monotonic()
    with pytest.raises(ClusterError) as refused:
        wait_for_capacity({"CPU": 4}, 60, asked="cpus_per_actor=4", fix="lower cpus_per_actor")
    assert time.monotonic() - started < 5
    assert str(refused.value) == (
        "cpus_per_actor=4 asks for "
        "4 CPU(s) on one node, but the largest node the cluster has or can add has 2 CPU(s): "
        "lower cpus_per_actor, or give the cluster a node type with at least 4 CPU(s)"
    )
    assert bundles() == []
    # One that the node there holds goes ahead: 2 of 1 CPU on its 2 CPUs.
    assert wait_for_capacity({"CPU": 1}, 60, asked="-", fix="-") == 2
