"""Every name the bundle takes from Ray's private modules, in one place.

Checked against Ray 2.60.0, the version requirements/runtime.txt pins: a Ray upgrade starts here
(tests/test_layout.py fails until this file is checked against the new version and says so).
Each import says what it is used for; nothing else in the bundle imports `ray.*._internal`.
"""

from __future__ import annotations

# A Datasink's `write` argument (the prediction sink's tests call the sink directly).
from ray.data._internal.execution.interfaces import TaskContext

# The training driver: the time Ray Train gives a worker group to start, and its error past it.
from ray.train.v2._internal.constants import WORKER_GROUP_START_TIMEOUT_S_ENV_VAR
from ray.train.v2._internal.exceptions import WorkerGroupStartupTimeoutError

# Its logger is named by the module's file path: quieted in job logs (pipeline.core.logs).
from ray.train.v2._internal.execution import context as train_context

# The training driver's callback on the controller, and the states in which the controller
# waits for room for an elastic run's workers.
from ray.train.v2._internal.execution.callback import ControllerCallback
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
    "CHECKED_AGAINST",
    "CHECKPOINT_MANAGER_LOGGER",
    "WORKER_GROUP_START_TIMEOUT_S_ENV_VAR",
    "ControllerCallback",
    "InitializingState",
    "ReschedulingState",
    "RestartingState",
    "RunningState",
    "TaskContext",
    "WorkerGroupStartupTimeoutError",
    "train_context",
]
