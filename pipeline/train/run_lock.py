"""A run's lock: `<run>/train_job.json` names the one train job that trains the run, so that a
second train job of the same run refuses to start rather than both writing its checkpoints.

The lock names its job as Ray's job table does (its id, and its start, which tells it from a
job of the same id on a cluster started again), with the job's submission id, host and pid. A
lock whose job has ended (finished, failed, stopped, killed) or that this cluster does not know
is stale, and the next train job of the run takes it over: so a run stopped with `ray job
stop`, or whose driver was killed, resumes when the job is submitted again. The job removes its
lock as it ends. One cluster per run: a job of another cluster counts as ended.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable, Iterator

import ray

from pipeline.core.errors import ConfigError
from pipeline.core.job_table import job_running, job_started_ms
from pipeline.core.storage import Location
from pipeline.model.run_status import job_holder

log = logging.getLogger(__name__)

LOCK = "train_job.json"
# Between writing the lock and reading it back: of two jobs that found the run free at once,
# the one that wrote last holds it, and the other refuses.
SETTLE_S = 1.0
# A holder being stopped (`ray job stop`: SIGTERM, SIGKILL 3 s later) is given this long to end
# before a job refuses: a scheduler's retry of a stopped chain resumes the run.
ENDING_S = 10.0


def this_job() -> dict:
    """This process's Ray job, for the lock; its id None outside Ray (a test)."""
    job = {"job_id": None, "started_ms": None, **job_holder(), "since": time.time()}
    if ray.is_initialized():
        job_id = ray.get_runtime_context().get_job_id()
        job.update(job_id=job_id, started_ms=job_started_ms(job_id))
    return job


def job_alive(job: dict) -> bool:
    """Whether the job a lock names still runs on this cluster (none can be asked outside Ray)."""
    if job.get("job_id") is None or not ray.is_initialized():
        return False
    return job_running(job["job_id"], job.get("started_ms"))


def same_job(a: dict, b: dict) -> bool:
    """Whether two lock records name one Ray job (a Tune trial's train runs in its sweep's)."""
    return (a.get("job_id"), a.get("started_ms")) == (b.get("job_id"), b.get("started_ms"))


def read_lock(run_dir: Location) -> dict | None:
    """The job the run's lock names; None for no lock, or one that does not read (damaged)."""
    path = run_dir.child(LOCK)
    if not path.exists():
        return None
    try:
        holder = json.loads(path.read_bytes())
    except (ValueError, FileNotFoundError):  # damaged, or removed meanwhile: no holder
        return None
    return holder if isinstance(holder, dict) else None


@contextlib.contextmanager
def hold_run(
    run_dir: Location,
    *,
    me: dict | None = None,
    alive: Callable[[dict], bool] | None = None,
) -> Iterator[dict]:
    """Within: this job (`me`, default `this_job()`) holds the run. A run another live job
    (`alive`, default `job_alive`) holds raises ConfigError, naming that job and how to go on."""
    me, alive = me or this_job(), alive or job_alive
    new = not run_dir.exists()  # a job refused before it trains leaves no run behind
    take(run_dir, me, alive, ending_s=ENDING_S)
    if me["job_id"] is not None:  # outside Ray no other job can be told apart from this one
        time.sleep(SETTLE_S)
        holder = read_lock(run_dir)
        if holder is not None and not same_job(holder, me) and alive(holder):
            raise held(run_dir, holder)  # it wrote after us: its lock stays
    try:
        yield me
    finally:
        release(run_dir, me)
        if new and run_dir.is_dir() and not run_dir.list_dirs() and not run_dir.list_files():
            run_dir.delete()


def take(run_dir: Location, me: dict, alive: Callable[[dict], bool], *, ending_s: float) -> None:
    """Write this job's lock, unless another live job holds the run (ConfigError)."""
    holder = read_lock(run_dir)
    if holder is not None and not same_job(holder, me):
        deadline = time.monotonic() + ending_s
        while alive(holder):
            if time.monotonic() >= deadline:
                raise held(run_dir, holder)
            time.sleep(1.0)
            holder = read_lock(run_dir)
            if holder is None or same_job(holder, me):
                break
        else:
            log.warning(
                "run %s: %s, which held it, has ended: this job takes the run over",
                *(run_dir.uri, describe(holder)),
            )
    run_dir.child(LOCK).write_bytes(json.dumps(me, indent=2).encode())


def release(run_dir: Location, me: dict) -> None:
    """Remove the run's lock if it is still this job's."""
    holder = read_lock(run_dir)
    if holder is not None and same_job(holder, me) and holder.get("pid") == me.get("pid"):
        run_dir.child(LOCK).delete()


def held(run_dir: Location, holder: dict) -> ConfigError:
    """The refusal of a run that `holder` holds: which job, and how to go on."""
    name = holder.get("submission_id") or holder.get("job_id")
    return ConfigError(
        f"run {run_dir.uri} is being trained by {describe(holder)}: wait for that job to end, "
        f"or stop it (ray job stop {name}) and submit this job again to resume the run; or "
        "pick a new name= for a new run"
    )


def describe(holder: dict) -> str:
    """The job a lock names, for a message: its id, host and since when."""
    name = holder.get("submission_id") or holder.get("job_id")
    since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(holder.get("since", 0)))
    return f"train job {name} (on {holder.get('host')} since {since})"
