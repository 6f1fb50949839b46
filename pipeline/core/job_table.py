"""Ray jobs as the GCS's job table names them: a job's start, which tells it from a job of the
same id on a cluster started again, and whether it still runs. A run's lock
(pipeline.train.run_lock) and inference's resume (pipeline.infer.resume) record the job that
writes, and ask here whether it has ended."""

from __future__ import annotations

import json
import os

import ray

from pipeline.core.ray_internals import JOB_ID_METADATA_KEY, RAY_JOB_CONFIG_JSON_ENV_VAR, gcs_state


def submission_id() -> str | None:
    """This driver's job submission id (what `ray job` and `status` name it), from the job
    config Ray's job supervisor gives the driver; None outside a submitted job."""
    job_config = json.loads(os.environ.get(RAY_JOB_CONFIG_JSON_ENV_VAR) or "{}")
    return job_config.get("metadata", {}).get(JOB_ID_METADATA_KEY)


def this_job_id() -> str:
    """The job's submission id; Ray's job id for a driver not submitted as a job (none where
    this process is not connected to Ray: asking would start a Ray instance here)."""
    if (submitted := submission_id()) is not None:
        return submitted
    return ray.get_runtime_context().get_job_id() if ray.is_initialized() else ""


def job_started_ms(job_id: str) -> int | None:
    """When job `job_id` of this cluster started (ms); None where the table has no such job."""
    return next((j["StartTime"] for j in gcs_state.job_table() if j["JobID"] == job_id), None)


def job_running(job_id: str | None, started_ms: int | None) -> bool:
    """Whether the job `job_id` that started at `started_ms` still runs on this cluster. A job
    of another cluster counts as ended."""
    return any(
        j["JobID"] == job_id and j["StartTime"] == started_ms and not j["IsDead"]
        for j in gcs_state.job_table()
    )
