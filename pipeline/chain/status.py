"""`python -m jobs.submit ... status`: where the chain's training run and inference are, or
one job: its state, the epoch and step of all, images/s, input wait, ETA, the last checkpoint
and its age, the best score so far; `--json` for schedulers.

    python -m jobs.submit --address http://HOST:8265 --root s3://bucket/ray-cv status
    python -m jobs.submit --address ... --root ... --set train.name=big status --json
    python -m jobs.submit --address ... --root ... status --job ray-cv-train-20261129T2100-ab12cd

It reads the progress.json the jobs keep in their run directory and output (pipeline.core.
progress), so it answers from storage alone; the cluster, where it answers, adds each job's
own state (a job that died says FAILED where its progress still says training). A job the
chain submitted names its progress file in its metadata; `--job` finds it there, and a job
submitted otherwise by its id in the progress files of the chain's paths.
Exit codes: 0 found; 2 nothing found (no such job, no progress yet) or a bad argument.
"""

from __future__ import annotations

import json
import shlex
import sys
import time

from pipeline.chain.follow import job_client, not_yet
from pipeline.core.errors import EXIT_CODES, ConfigError, first_line
from pipeline.core.progress import PROGRESS, duration_text, read_progress
from pipeline.core.uris import join_uri

# The metadata key under which the chain names a job's progress file.
PROGRESS_KEY = "ray_cv_progress"


def progress_places(jobs) -> dict[str, str]:
    """Where the chain's train and infer jobs (`jobs`, the plan's) keep progress.json:
    the run directory and the output their configs name."""
    places = {}
    for job in jobs:
        if job.step == "train":
            places["train"] = join_uri(job.config.storage_path, job.config.name, PROGRESS)
        elif job.step == "infer":
            places["infer"] = join_uri(job.config.output, PROGRESS)
    return places


def status(address: str, places: dict[str, str], *, job: str | None, as_json: bool) -> int:
    """Print the state of the chain's jobs at `places` (step -> progress.json), or of `job`."""
    client, unreachable = None, None
    try:
        client = job_client(address)
    except Exception as e:
        if not_yet(e) is None:
            raise
        unreachable = not_yet(e)
    found: dict[str, dict] = {}
    if job is not None:
        info = job_info(client, job) if client is not None else None
        if client is not None and info is None:
            raise ConfigError(
                f"--job {job}: the cluster at {address} has no such job (ray job list)"
            )
        place = (info.metadata or {}).get(PROGRESS_KEY) if info is not None else None
        candidates = {info_step(info): place} if place else places
        for step, uri in candidates.items():
            record = read_at(uri)
            if record is not None and (place or record.get("job_id") == job):
                found[step] = record
        if not found:
            found[info_step(info)] = {"job_id": job}
    else:
        newest = newest_jobs(client) if client is not None else {}
        for step, uri in places.items():
            record, job_now = read_at(uri), newest.get(uri)
            if record is None and job_now is None:
                continue
            if record is None:  # its job has not written any yet
                record = {"job_id": job_now.submission_id, "state": "starting"}
            elif job_now is not None and job_now.submission_id != record.get("job_id"):
                # A job submitted since the one that wrote it: it has not written yet.
                record["newer_job"] = {
                    "job_id": job_now.submission_id,
                    "job_status": _status_text(job_now.status),
                }
            found[step] = record
    if not found:
        shown = ", ".join(places.values())
        raise ConfigError(f"no progress yet at {shown}: has the job started writing? (--job ID)")
    now = time.time()
    for record in found.values():
        record["age_s"] = round(now - record["updated_at"], 1) if "updated_at" in record else None
        record["job_status"] = job_status(client, record.get("job_id"), unreachable)
    if as_json:
        print(json.dumps(found if job is None else next(iter(found.values())), indent=1))
    else:
        for step, record in found.items():
            print("\n".join(describe(step, record)))
    return 0


def job_info(client, job: str):
    try:
        return client.get_job_info(job)
    except RuntimeError as e:
        if "does not exist" in str(e) or "404" in str(e):
            return None
        raise


def info_step(info) -> str:
    """The step a job runs, from its entrypoint (python -m jobs.<step>)."""
    words = shlex.split(info.entrypoint) if info is not None else []
    step = next((w.removeprefix("jobs.") for w in words if w.startswith("jobs.")), "job")
    return "job" if step == "submit" else step


def newest_jobs(client) -> dict[str, object]:
    """The newest job the chain submitted for each progress file (by its metadata)."""
    newest = {}
    for info in sorted(client.list_jobs(), key=lambda j: j.start_time or 0):
        place = (info.metadata or {}).get(PROGRESS_KEY)
        if place:
            newest[place] = info
    return newest


def _status_text(status) -> str:
    return str(getattr(status, "value", status))


def read_at(uri: str) -> dict | None:
    from pipeline.core.storage import Location  # pyarrow: only where there is a file to read

    parent, _, _ = uri.rpartition("/")
    try:
        return read_progress(Location.parse(parent))
    except (OSError, ValueError):
        return None


def job_status(client, job_id: str | None, unreachable: str | None) -> str:
    """The job's state as the cluster has it (RUNNING, SUCCEEDED, FAILED, ...)."""
    if not job_id:
        return "UNKNOWN"
    if client is None:
        return f"UNKNOWN (the cluster does not answer: {unreachable})"
    try:
        info = client.get_job_info(job_id)
    except Exception as e:
        if not_yet(e) is not None:
            return f"UNKNOWN (the cluster does not answer: {not_yet(e)})"
        return "UNKNOWN (not a job of this cluster)"
    return _status_text(info.status)


def describe(step: str, r: dict) -> list[str]:
    """A progress record as lines for people."""
    lines = _describe(step, r)
    if (newer := r.get("newer_job")) is not None:
        lines.append(f"  a newer job {newer['job_id']} is {newer['job_status']}: no progress yet")
    return lines


def _describe(step: str, r: dict) -> list[str]:
    job = f"job {r.get('job_id')}: {r.get('job_status')}"
    age = f"updated {duration_text(r.get('age_s'))} ago" if r.get("age_s") is not None else ""
    if r.get("kind") == "train":
        lines = [
            f"train run {r['run']} ({job}; {r['state']}, {age})",
            f"  epoch {r['epoch']}/{r['epochs'] - 1}, step {r['step']}/{r['steps']} "
            f"({100 * r['progress']:.0f}% of the run), {_num(r['images_per_s'])} images/s, "
            f"{_pct(r['input_wait_share'])} waiting for input, ETA {duration_text(r['eta_s'])}",
        ]
        if (c := r.get("last_checkpoint")) is not None:
            where = f"epoch {c['epoch']}" + (f" step {c['step']}" if c.get("step") else "")
            ago = duration_text(time.time() - c["at"])
            lines.append(f"  last checkpoint {c['uri']} ({where}), {ago} ago")
        if (b := r.get("best")) is not None:
            lines.append(f"  best {b['metric']} {b['value']:.4g} (epoch {b['epoch']})")
        if r.get("worker_hours") is not None:
            cost = f", {r['cost']:.2f} {r['currency']}" if r.get("cost") is not None else ""
            lines.append(
                f"  {r['worker_hours']:.3g} worker-hours, {r['gpu_hours']:.3g} GPU-hours{cost}"
            )
        return lines
    if r.get("kind") == "infer":
        return [
            f"infer output {r['output']} ({job}; {r['state']}, {age})",
            f"  {r['images_done']} of {r['images']} images ({100 * r['progress']:.0f}%), "
            f"{_num(r['images_per_s'])} images/s, ETA {duration_text(r['eta_s'])}",
        ]
    return [f"{step}: {job}; {r.get('state', 'no progress written by it')}"]


def _num(x: float | None) -> str:
    return "?" if x is None else f"{x:.1f}"


def _pct(x: float | None) -> str:
    return "?" if x is None else f"{100 * x:.0f}%"


def main_status(args, jobs) -> int:
    """The chain's `status` step: the progress of `jobs` (the plan's), or of `args.job`."""
    try:
        places = progress_places(jobs)
        return status(args.address, places, job=args.job, as_json=args.json)
    except ConfigError as e:
        print(f"error: {first_line(e)}", file=sys.stderr)
        return EXIT_CODES[ConfigError]
