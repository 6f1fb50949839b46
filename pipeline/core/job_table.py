"""Ray jobs as the GCS's job table names them: a job's start, which tells it from a job of the
same id on a cluster started again, and whether it still runs. A run's lock
(pipeline.train.run_lock) and inference's resume (pipeline.infer.batch) record the job that
writes, and ask here whether it has ended."""

from __future__ import annotations

from pipeline.core.ray_internals import gcs_state


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
