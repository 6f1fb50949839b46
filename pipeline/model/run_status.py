"""Whether a run has finished or a train job trains it again: its summary.json, read through
the training marker (`TrainingMark`) that such a job writes there, with a heartbeat, keeping
the summary of the run's last finish."""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable

from pipeline.core.errors import InputError
from pipeline.core.job_table import submission_id
from pipeline.core.storage import Location
from pipeline.model.runs import RUN_FORMAT, RUN_SUMMARY

log = logging.getLogger(__name__)

TRAINING = "training"  # the status of a run's summary while a train job trains it
FINISHED = "finished"  # the training marker's key for the summary of the run's last finish
# The train job refreshes its training marker's heartbeat every HEARTBEAT_S. A reader takes a
# marker not refreshed for STALE_BEATS of them as left by a job that ended without putting the
# finished summary back (killed, its node lost), and goes by that summary, which it keeps.
HEARTBEAT_S = 30.0
STALE_BEATS = 3


def job_holder() -> dict:
    """Who this process is, for a training marker: the Ray job's submission id (None where the
    process runs outside a Ray job), the host and the pid."""
    return {
        "submission_id": submission_id(),
        "host": socket.gethostname(),
        "pid": os.getpid(),
    }


class TrainingMark:
    """A finished run's summary.json while a train job trains the run again: it says
    "training", names the job (`holder`), carries a heartbeat and keeps the finished summary.

    Inference takes a run with a summary as finished and loads its best checkpoint; a run that
    trains on (a resume with more epochs) may delete that checkpoint as better ones come, and
    its old summary would name the checkpoints of before. `hold` writes the marker and starts a
    daemon thread that refreshes its heartbeat every `interval_s`; `release` stops the thread
    and, for a resume that failed or was stopped, puts the finished summary back. A job killed
    before that leaves the marker, whose heartbeat goes stale: readers (`run_summary`) then go
    by the finished summary it keeps. `clock` stands in for time.time in tests."""

    def __init__(
        self,
        run_dir: Location,
        finished: dict | None,
        *,
        interval_s: float = HEARTBEAT_S,
        clock: Callable[[], float] = time.time,
    ):
        self.run_dir, self.finished = run_dir, finished
        self.interval_s, self.clock = interval_s, clock
        self.holder = job_holder()
        self.since = clock()
        self._lock = threading.Lock()
        self._released = threading.Event()

    @classmethod
    def hold(cls, run_dir: Location, **options) -> TrainingMark:
        """Mark the run as training, heartbeat and all, keeping its finished summary (that of a
        marker left by a job that did not finish, if the summary is one)."""
        path = run_dir.child(RUN_SUMMARY)
        try:
            summary = json.loads(path.read_bytes()) if path.exists() else None
        except ValueError as e:  # damaged: write_reports replaces it once the run finishes
            log.warning("run %s: %s is not JSON (%s); it is not kept", run_dir.uri, path.uri, e)
            summary = None
        if summary is not None and summary.get("status") == TRAINING:
            log.warning(
                "run %s: its summary says that %s has trained it again since %s, and it did "
                "not finish: this job goes on from there",
                *(run_dir.uri, _holder(summary), _when(summary["since"])),
            )
            summary = summary.get(FINISHED)
        mark = cls(run_dir, summary, **options)
        mark._write()
        threading.Thread(target=mark._beat, name="training-heartbeat", daemon=True).start()
        return mark

    def _write(self) -> None:
        marker = {
            "run": self.run_dir.uri,
            "status": TRAINING,
            "since": self.since,
            "holder": self.holder,
            "heartbeat": self.clock(),
            "heartbeat_s": self.interval_s,
            FINISHED: self.finished,
        }
        self.run_dir.child(RUN_SUMMARY).write_bytes(json.dumps(marker, indent=2).encode())

    def _beat(self) -> None:
        while not self._released.wait(self.interval_s):
            with self._lock:
                if self._released.is_set():
                    return
                try:
                    self._write()
                except OSError as e:  # storage down for a while: the next beat tries again
                    log.warning("refreshing the training marker of %s: %s", self.run_dir.uri, e)

    def release(self, *, restore: bool) -> None:
        """Stop the heartbeat; with `restore` (the resume failed or was stopped), put the
        finished summary back. Without it the marker stays until write_reports replaces it."""
        with self._lock:
            self._released.set()
            if restore and self.finished is not None:
                data = json.dumps(self.finished, indent=2).encode()
                self.run_dir.child(RUN_SUMMARY).write_bytes(data)
                log.warning(
                    "run %s: the resume did not finish; the summary of the run's last finish is "
                    "back in place, and inference takes the run as finished again. Submitting "
                    "the train job again resumes it",
                    self.run_dir.uri,
                )


def mark_training(run_dir: Location, **options) -> TrainingMark:
    """TrainingMark.hold: the run's summary says it is training, until released."""
    return TrainingMark.hold(run_dir, **options)


def run_summary(run_dir: Location, *, now: float | None = None) -> dict:
    """The summary to go by for a run that has one: summary.json, but for the marker of a
    train job that stopped refreshing it (STALE_BEATS heartbeats missed), the finished summary
    that marker keeps. `now` defaults to time.time()."""
    summary = json.loads(run_dir.child(RUN_SUMMARY).read_bytes())
    check_run_format(run_dir, summary.get(FINISHED) or summary)
    if summary.get("status") != TRAINING:
        return summary
    now = time.time() if now is None else now
    beat = summary.get("heartbeat", summary["since"])  # a marker of before heartbeats: since
    interval = summary.get("heartbeat_s", HEARTBEAT_S)
    if now - beat <= STALE_BEATS * interval:
        return summary
    finished = summary.get(FINISHED)
    if finished is None:
        raise InputError(
            f"run {run_dir.uri} has been trained again since {describe_marker(summary, now=now)}"
            "; that job has ended without finishing it, and the summary keeps no finished state "
            "to go by: submit the train job again to finish the run, or pass one checkpoint "
            f"directory as model={run_dir.uri}/epoch_NNNN"
        )
    log.warning(
        "run %s: %s, training it again since %s, last refreshed its summary %.0f s ago (every "
        "%.0f s while it runs): it has ended without finishing, so the run goes as it last "
        "finished. Submitting the train job again resumes it",
        *(run_dir.uri, _holder(summary), _when(summary["since"]), now - beat, interval),
    )
    return finished


def check_run_format(run_dir: Location, summary: dict) -> None:
    """Raise InputError for a run summary of a format newer than this code's."""
    found = summary.get("format", 1)
    if not isinstance(found, int) or found > RUN_FORMAT:
        raise InputError(
            f"run {run_dir.uri} is of run format {found}, newer than this code reads (up to "
            f"{RUN_FORMAT}): update the bundle where this job runs"
        )


def training_since(run_dir: Location, *, now: float | None = None) -> float | None:
    """When a train job began to train the run again, if one still does (run_summary)."""
    summary = run_summary(run_dir, now=now)
    return summary["since"] if summary.get("status") == TRAINING else None


def describe_marker(marker: dict, *, now: float | None = None) -> str:
    """A training marker for a message: since when, by which job, its last heartbeat."""
    now = time.time() if now is None else now
    said = f"{_when(marker['since'])} by {_holder(marker)}"
    if "heartbeat" not in marker:  # a marker of before heartbeats
        return said
    return f"{said}, last heartbeat {now - marker['heartbeat']:.0f} s ago"


def _holder(marker: dict) -> str:
    """The job a training marker names: its submission id, host and pid."""
    holder = marker.get("holder")
    if not holder:
        return "a train job it does not name"
    job = holder["submission_id"] or "outside a Ray job"
    return f"train job {job} on {holder['host']} (pid {holder['pid']})"


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))
