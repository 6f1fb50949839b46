"""Every name the bundle takes from Ray's private modules, in one place.

Checked against Ray 2.60.0, the version requirements/runtime.txt pins: a Ray upgrade starts here
(tests/unit/test_layout.py fails until this file is checked against the new version and says so).
Each import says what it is used for; nothing else in the bundle imports `ray.*._internal`.
"""

from __future__ import annotations

# The capacity wait (pipeline.core.capacity) reads the autoscaler's standing resource requests,
# which `ray.autoscaler.sdk.request_resources` replaces whole, so that a job adds its bundle
# beside them and takes out only its own: the v1 autoscaler keeps them under this key in the
# GCS's key-value store, the v2 autoscaler (`is_autoscaler_v2`) in the cluster resource state.
# It reads the node types an autoscaler reports it can add (KubeRay does; Ray's own launcher
# does not) from `gcs_state`, as Ray Train does to tell whether its workers can ever be placed.
from ray._private.ray_constants import AUTOSCALER_RESOURCE_REQUEST_CHANNEL

# A run's training marker (pipeline.model.run_status) names the job that trains it: a job's driver
# finds its submission id in the job config that Ray's job supervisor passes it in this
# variable, as metadata under JOB_ID_METADATA_KEY (below).
from ray._private.runtime_env.constants import RAY_JOB_CONFIG_JSON_ENV_VAR

# Where a node holds a runtime env's py_modules entry (pipeline.model.trust): the folder Ray
# unpacks a downloaded one into (its name from the URI), or a local:// one's own path.
from ray._private.runtime_env.packaging import get_local_dir_from_uri, get_local_dir_uri_path

# The capacity wait's, as above; and the job table's readers (pipeline.core.job_table), which
# ask the GCS whether the job that holds a run or wrote a partial version still runs.
from ray._private.state import state as gcs_state
from ray.autoscaler.v2.sdk import get_cluster_resource_state
from ray.autoscaler.v2.utils import is_autoscaler_v2

# The training marker's, as above.
from ray.dashboard.modules.job.common import JOB_ID_METADATA_KEY

# A Datasink's `write` argument (the prediction sink's tests call the sink directly).
from ray.data._internal.execution.interfaces import TaskContext

# The key-value store of those requests; its writer for the tests, which stand in for an
# autoscaler that reports its node types.
from ray.experimental.internal_kv import (
    _internal_kv_get,
    _internal_kv_put,
    internal_kv_get_gcs_client,
)

# The stall watch (pipeline.train.stall_watch), as Ray Train's own NCCL hang detector does: the
# stacks of a worker's threads (py-spy's, else Python's), and a callback on the controller's
# polls of the worker group, which runs a function on each worker while its loop is blocked.
from ray.train.v2._internal.callbacks.nccl_ras import dump_stack_trace

# The training driver: the time Ray Train gives a worker group to start, and its error past it;
# a worker's error as the controller holds it: what the worker raised (`_base_exc`) with its
# traceback's text (the driver ends a run at once on a worker's InputError). The folder of the
# run where Ray Train's NCCL hang detector uploads its stack dumps, which the driver names.
from ray.train.v2._internal.constants import (
    HANG_DETECTOR_DIRNAME,
    WORKER_GROUP_START_TIMEOUT_S_ENV_VAR,
)
from ray.train.v2._internal.exceptions import (
    UserExceptionWithTraceback,
    WorkerGroupStartupTimeoutError,
)

# Its logger is named by the module's file path: quieted in job logs (pipeline.core.logs).
from ray.train.v2._internal.execution import context as train_context

# The training driver's callback on the controller, and the states in which the controller
# waits for room for an elastic run's workers.
from ray.train.v2._internal.execution.callback import ControllerCallback, WorkerGroupCallback
from ray.train.v2._internal.execution.controller.state import (
    InitializingState,
    ReschedulingState,
    RestartingState,
    RunningState,
)

CHECKED_AGAINST = "2.60.0"

# Logs a notice for runs about to resume whenever a run's record is read (pipeline.model.runs).
CHECKPOINT_MANAGER_LOGGER = "ray.train.v2._internal.execution.checkpoint.checkpoint_manager"

__all__ = [
    "AUTOSCALER_RESOURCE_REQUEST_CHANNEL",
    "CHECKED_AGAINST",
    "CHECKPOINT_MANAGER_LOGGER",
    "HANG_DETECTOR_DIRNAME",
    "JOB_ID_METADATA_KEY",
    "RAY_JOB_CONFIG_JSON_ENV_VAR",
    "WORKER_GROUP_START_TIMEOUT_S_ENV_VAR",
    "ControllerCallback",
    "InitializingState",
    "ReschedulingState",
    "RestartingState",
    "RunningState",
    "TaskContext",
    "UserExceptionWithTraceback",
    "WorkerGroupCallback",
    "WorkerGroupStartupTimeoutError",
    "_internal_kv_get",
    "_internal_kv_put",
    "dump_stack_trace",
    "gcs_state",
    "get_cluster_resource_state",
    "get_local_dir_from_uri",
    "get_local_dir_uri_path",
    "internal_kv_get_gcs_client",
    "is_autoscaler_v2",
    "train_context",
]
