"""The chain run: the planned jobs submitted one after another, each streamed here and its end
turned into the chain's exit code."""

from __future__ import annotations

import argparse
import contextlib
import datetime
import logging
import secrets
import shlex
import signal
import sys
import time

from pipeline.chain.follow import Patience, Submission, follow, stop, submit
from pipeline.chain.plan import (
    CHECK,
    STEPS,
    Job,
    check_py_modules,
    parse_env,
    plan,
    runtime_env,
)
from pipeline.chain.status import PROGRESS_KEY, progress_places
from pipeline.core.logs import CURRENT_DATASET_LINE

STOPPED_EXIT = 4
# Lines of Ray's own that the streamed logs leave out. Ray's core worker logs this once per
# driver that starts a Ray Data actor pool, whose actors take their arguments by reference
# (ray-project/ray#53727); the driver holds those for the job's life, so nothing is at risk
# and nothing is for the user to do. `ray job logs` still has them.
RAY_NOISE = ("has constructor arguments in the object store and max_restarts > 0",)


def run_chain(args: argparse.Namespace) -> int:
    """The steps `args` name, one job after another; the first failed job's exit code."""
    jobs = plan(args.root, profile=args.profile, sets=args.set, recipe=args.recipe)
    jobs.sort(key=lambda job: job.step != CHECK)  # the check, then the steps in their order
    env_vars = parse_env(args.env)
    py_modules = check_py_modules(args.py_module)
    patience = Patience(submit_s=args.submit_timeout_s, reconnect_s=args.reconnect_timeout_s)
    version = None
    for job in jobs:
        first = args.check and job.step == CHECK
        if first or args.step == job.step or (args.step == "all" and job.step in STEPS):
            if job.step == "train" and version is not None:
                job = pin_dataset(job, version)
            log: list[str] = []
            code = submit_and_wait(
                args.address, job, env_vars, log, patience, py_modules=py_modules
            )
            if code != 0:
                return code
            if job.step == "preprocess":
                # Training reads the version this chain made, even if another preprocess job
                # commits a newer one meanwhile; inference and export then read the version the
                # run was trained on, which its checkpoint records.
                version = committed_version("".join(log))
    return 0


def pin_dataset(job: Job, version: str) -> Job:
    """The train `job` reading dataset `version`, unless its config is told which already."""
    if any(arg.startswith("dataset_version=") for arg in job.entrypoint):
        return job
    return Job(job.step, [*job.entrypoint, f"dataset_version={version}"], job.config)


def committed_version(log_text: str) -> str | None:
    """The dataset version a preprocess job's log says it left current."""
    found = [line.partition(CURRENT_DATASET_LINE)[2].strip() for line in log_text.splitlines()]
    return next((v for v in reversed(found) if v), None)


def submit_and_wait(
    address: str,
    job: Job,
    env_vars: dict[str, str] | None = None,
    log: list[str] | None = None,
    patience: Patience | None = None,
    py_modules: list[str] = (),
) -> int:
    """Submit `job` (with `py_modules` in its runtime env), stream its log to stdout (and into
    `log`), return its exit code (0 only for SUCCEEDED). A cluster that cannot take it yet, or
    a connection lost while it runs, is waited for as `patience` says (pipeline/chain/follow.py)."""
    # The job client sets its own logger to INFO on import: "WebSocket closed ..." per job.
    logging.getLogger("ray.dashboard.modules.job.sdk").setLevel(logging.WARNING)
    log = [] if log is None else log
    patience = patience or Patience()

    def say(line: str, file=sys.stdout) -> None:
        print(f"[{job.step}] {line}", file=file, flush=True)

    def write(text: str) -> None:
        sys.stdout.write(without_noise(text))
        sys.stdout.flush()
        log.append(text)

    started = time.monotonic()
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%S")
    submission_id = f"ray-cv-{job.step}-{stamp}-{secrets.token_hex(3)}"
    submission = Submission(address, submission_id)
    try:
        # From the submission on: a scheduler killing its task (or Ctrl-C) must not leave the
        # job running unseen, nor a retry of the task a second job of the step beside it.
        with _sigterm_as_interrupt():
            client = submit(
                submission,
                patience,
                say,
                entrypoint=shlex.join(job.entrypoint),
                runtime_env=runtime_env(env_vars, py_modules),
                metadata=progress_metadata(job),
            )
            say(f"submitted {submission_id}: {shlex.join(job.entrypoint)}")
            info = follow(client, submission_id, address, patience, write, say)
    except KeyboardInterrupt:
        say(stop(submission), sys.stderr)
        return STOPPED_EXIT
    return _exit_code(info, submission_id, time.monotonic() - started, say)


def _exit_code(info, submission_id: str, took: float, say) -> int:
    """The chain's exit code for a job that ended as `info` says, and a line that says so."""
    from ray.job_submission import JobStatus

    if info.status == JobStatus.SUCCEEDED:
        say(f"{submission_id} succeeded in {took:.0f} s")
        return 0
    if info.status == JobStatus.STOPPED:
        say(f"{submission_id} was stopped", sys.stderr)
        return STOPPED_EXIT
    code = info.driver_exit_code or 1
    say(f"{submission_id} failed with exit code {code}: {info.message}", sys.stderr)
    return code


def progress_metadata(job: Job) -> dict[str, str]:
    """The job's metadata: where its progress.json is, for `status --job` (train and infer)."""
    places = progress_places([job])
    return {PROGRESS_KEY: places[job.step]} if job.step in places else {}


def without_noise(text: str) -> str:
    """`text` less its lines of RAY_NOISE."""
    lines = text.splitlines(keepends=True)
    return "".join(line for line in lines if not any(noise in line for noise in RAY_NOISE))


@contextlib.contextmanager
def _sigterm_as_interrupt():
    # Airflow, cron wrappers and CI runners end a task with SIGTERM.
    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
