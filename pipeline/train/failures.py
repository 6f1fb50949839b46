"""Ray Train's failure handling for a run, and its failures as the bundle's errors.

What Ray Train is told (its retries, the bounded wait for room, a worker's InputError ending the
run rather than retried) and what its errors become: a ConfigError, InputError or ClusterError,
and so the job's exit code (pipeline.core.errors).
"""

from __future__ import annotations

import time

import ray
import ray.train

from pipeline.core.errors import ClusterError, InputError
from pipeline.core.ray_internals import (
    HANG_DETECTOR_DIRNAME,
    ControllerCallback,
    InitializingState,
    ReschedulingState,
    RestartingState,
    UserExceptionWithTraceback,
    WorkerGroupStartupTimeoutError,
)
from pipeline.core.storage import Location
from pipeline.train.config import TrainConfig
from pipeline.train.stall_watch import TrainingStalled

# Attempts at placing the workers when max_failures=-1 (recover from worker failures always):
# a cluster without room must still end the job, as with the default max_failures=3.
STARTUP_ATTEMPTS_UNLIMITED = 4


def startup_attempts(cfg: TrainConfig) -> int:
    """How many times the workers' start is tried before the job fails.

    An elastic run gets one more: right after a node is lost (or reaches its preemption
    deadline), Ray Train can size the new group by the cluster's resources from before the
    cluster declared the node dead, and that attempt times out; the next one counts right if
    startup_timeout_s outlasts that stale view: Ray Data's autoscaling coordinator, which Ray
    Train asks, refreshes it every 20 s, after the node's death is detected (about 17 s by
    default)."""
    attempts = cfg.max_failures + 1 if cfg.max_failures >= 0 else STARTUP_ATTEMPTS_UNLIMITED
    return attempts + 1 if cfg.scaling.elastic else attempts


def failure_config(cfg: TrainConfig) -> ray.train.FailureConfig:
    """Ray Train's failure handling for `cfg`.

    Ray Train waits startup_timeout_s for the workers' placement group, then retries forever
    unless controller failures are capped: capped so that a worker group that cannot be placed,
    or that fails to start (a node lost while its workers import torch), is retried like a
    worker failure, and a cluster without room ends the job after `startup_attempts` attempts.
    A preemption (a node drained as preempted, then lost) is retried apart from max_failures:
    Ray Train waits for the drain's deadline, then restarts from the latest checkpoint.
    """
    return ray.train.FailureConfig(
        max_failures=cfg.max_failures,
        controller_failure_limit=startup_attempts(cfg) - 1,
        # Ray's default too; set here so that the config says it, and can change it.
        max_preemption_failures=cfg.max_preemptions,
    )


class WorkersNotPlacedError(RuntimeError):
    """Raised on Ray Train's controller when an elastic run has waited its limit for room."""


class ElasticWaitLimit(ControllerCallback):
    """Ends an elastic run that waits longer than `limit_s` for room for its minimum workers.

    With a [min, max] worker range Ray Train starts a worker group only once the cluster has
    room for `min` workers, and until then waits with no time limit (the startup timeout counts
    only once a group is being placed). Runs on the controller, which calls it on every turn
    of its loop: a state that waits for a scaling decision starts the clock, any other stops it.
    """

    WAITING = (InitializingState, RestartingState, ReschedulingState)

    def __init__(self, limit_s: float, min_workers: int):
        self.limit_s, self.min_workers = limit_s, min_workers
        self.waiting_since: float | None = None

    def after_controller_state_update(self, previous_state, current_state) -> None:
        if not isinstance(current_state, self.WAITING):
            self.waiting_since = None
            return
        now = time.monotonic()
        if self.waiting_since is None:
            self.waiting_since = now
        elif now - self.waiting_since > self.limit_s:
            raise WorkersNotPlacedError(
                f"waited {self.limit_s:.0f} s for room for {self.min_workers} workers"
            )


class WorkerInputError(RuntimeError):
    """Raised on Ray Train's controller when a worker failed on its input (an InputError)."""


class InputErrorsEndTheRun(ControllerCallback):
    """Ends a run at a worker's InputError (a stored image damaged since it was written, a
    shard gone) instead of retrying it `max_failures` times: the same rows fail again. Runs on
    the controller, on the state its failure policy picked for a failed worker group."""

    def after_controller_state_update(self, previous_state, current_state) -> None:
        error = getattr(current_state, "training_failed_error", None)
        if (cause := worker_input_error(error)) is not None:
            raise WorkerInputError(str(cause))


def worker_input_error(error: BaseException | None) -> InputError | None:
    """The InputError a worker raised, where that is what failed its worker group."""
    for failure in getattr(error, "worker_failures", {}).values():
        if isinstance(failure, UserExceptionWithTraceback):
            failure = failure._base_exc
        if isinstance(failure, InputError):
            return failure
    return None


def nccl_hang(error: Exception, cfg: TrainConfig, run_dir: Location) -> str:
    """One line for Ray Train's NCCLHangError (its NCCL RAS hang detector, turned on with
    RAY_TRAIN_ENABLE_NCCL_HANG_DETECTOR=1): what Ray found, and where it put the stacks."""
    found = str(error).partition(":\n")[2] or str(error)
    found = found.strip().partition("\n")[0].partition(". ")[0]
    return (
        f"training hung in NCCL: Ray Train's hang detector found that {found}, through "
        f"max_failures={cfg.max_failures} retries. Stacks of every rank and the ncclras "
        f"reports: {run_dir.child(HANG_DETECTOR_DIRNAME).uri}/. Resubmit to resume from the "
        "last checkpoint"
    )


def training_error(
    error: ray.train.TrainingFailedError, cfg: TrainConfig, run_dir: Location, per_worker: dict
) -> Exception:
    """The bundle's error for Ray Train's `error` from fit(), which names what to do; the job
    raises it in place of Ray's (`per_worker`: the resources each worker asked for)."""
    from ray.train.v2.api.exceptions import ControllerError, NCCLHangError, PreemptionError

    if isinstance(error, ControllerError):
        return controller_error(error, cfg, per_worker)
    if isinstance(error, PreemptionError):
        return ClusterError(
            f"training failed: more than max_preemptions={cfg.max_preemptions} node "
            f"preemptions; the last: {error}"
        )
    if isinstance(error, NCCLHangError):
        return ClusterError(nccl_hang(error, cfg, run_dir))
    if (cause := worker_input_error(error)) is not None:  # max_failures=0: no retry to stop
        return InputError(str(cause))
    return ClusterError(
        f"training failed and max_failures={cfg.max_failures} retries are used up; "
        f"the last error: {error}"
    )


def controller_error(error, cfg: TrainConfig, per_worker: dict) -> Exception:
    """The bundle's error for a failure of Ray Train's controller (a ControllerError): workers
    that found no room, a worker's InputError, a stall, or Ray's own."""
    s, failure = cfg.scaling, error.controller_failure
    workers = f"{s.min_workers} to {s.max_workers}" if s.elastic else str(s.max_workers)
    have = {k: v for k, v in ray.cluster_resources().items() if k in ("CPU", "GPU")}
    advice = (
        f"it has {have} in total. Lower {'the minimum of ' if s.elastic else ''}"
        "scaling.num_workers or scaling.cpus_per_worker, add nodes (or GPUs), or raise "
        "scaling.startup_timeout_s if the cluster is autoscaling"
    )
    if isinstance(failure, WorkersNotPlacedError):
        return ClusterError(
            f"the cluster had no room for {s.min_workers} training workers (the least of "
            f"scaling.num_workers={list(s.num_workers)}) with {per_worker} each for "
            f"{startup_attempts(cfg) * s.startup_timeout_s:.0f} s ({startup_attempts(cfg)} "
            f"times startup_timeout_s={s.startup_timeout_s:.0f}); {advice}"
        )
    if isinstance(failure, WorkerGroupStartupTimeoutError):
        return ClusterError(
            f"the cluster could not place {workers} training workers with "
            f"{per_worker} each within {s.startup_timeout_s:.0f} s (startup_timeout_s), "
            f"{startup_attempts(cfg)} times (max_failures={cfg.max_failures}); {advice}"
        )
    if isinstance(failure, WorkerInputError):
        return InputError(str(failure))
    if isinstance(failure, TrainingStalled):
        return ClusterError(str(failure))
    return ClusterError(f"training failed: {error}")
