"""Ray's fake multi-node provider, each node with a runtime-env directory of its own.

The fake provider starts every node on this machine in the head's session directory. Each
node's runtime-env agent unpacks a job's working_dir there the first time the node runs one of
its tasks, and it unpacks over whatever is there (`overwrite=True`): a node that joins while
another runs the job's tasks deletes the files those tasks are importing. Machines of a real
cluster each have their own disk; so does each node here, for its runtime envs.

This file's directory is on the autoscaler's PYTHONPATH (harness.cluster.LocalCluster), so the
cluster config names the provider as `{"type": "external", "module": "local_nodes.Provider"}`.
"""

from __future__ import annotations

from unittest import mock

import ray._private.parameter
from ray.autoscaler._private.fake_multi_node.node_provider import FakeMultiNodeProvider

RayParams = ray._private.parameter.RayParams


class _NodeParams(RayParams):
    def __init__(self, **kwargs):
        node_id = kwargs["env_vars"]["RAY_OVERRIDE_NODE_ID_FOR_TESTING"]
        # The provider numbers its nodes in the last digits of their ids.
        super().__init__(runtime_env_dir_name=f"runtime_resources_{node_id[-5:]}", **kwargs)


class Provider(FakeMultiNodeProvider):
    def _create_node_with_resources_and_labels(self, *args, **kwargs):
        # The parent builds the node's RayParams inline; give them a directory of their own.
        with mock.patch.object(ray._private.parameter, "RayParams", _NodeParams):
            super()._create_node_with_resources_and_labels(*args, **kwargs)
