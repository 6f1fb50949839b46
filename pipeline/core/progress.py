"""A running job's progress file: `progress.json` in its run directory (train) or output
(infer), rewritten every few seconds by the job and once when it ends, so that `status`
(jobs.submit) answers from storage alone, wherever the job runs.

A record: `kind` (train or infer), `state`, `job_id`, `updated_at` (Unix time), and the job's
own fields: a run's epoch, step, images/s, input wait, ETA, last checkpoint and best score; an
inference run's images done of the input's (docs/metrics.md shows one).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the chain's `status` imports this module, and no pyarrow
    from pipeline.core.storage import Location

log = logging.getLogger(__name__)

PROGRESS = "progress.json"
FORMAT = 1


def read_progress(where: Location) -> dict | None:
    """The progress record in `where` (a run directory or an inference output), if any."""
    f = where.child(PROGRESS)
    if not f.exists():
        return None
    return json.loads(f.read_bytes())


class ProgressWriter:
    """Writes the newest record given to `where`/progress.json from a thread of its own, so a
    slow or failing store never holds the caller: a record given while one is being written
    replaces any not yet written. `flush` waits (bounded) until the newest is written."""

    def __init__(self, where: Location):
        self.file = where.child(PROGRESS)
        self._next: dict | None = None
        self._writing = False
        self._cond = threading.Condition()
        self._failing = False
        self._thread = threading.Thread(target=self._run, name="progress", daemon=True)
        self._thread.start()

    def put(self, record: dict) -> None:
        record = {"format": FORMAT, **record, "updated_at": time.time()}
        with self._cond:
            self._next = record
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._next is None:
                    self._cond.wait()
                record, self._next, self._writing = self._next, None, True
            try:
                self._write(record)
            finally:
                with self._cond:
                    self._writing = False
                    self._cond.notify_all()

    def _write(self, record: dict) -> None:
        try:
            self.file.write_bytes(json.dumps(record, indent=1).encode())
        except OSError as e:
            if not self._failing:
                log.warning("cannot write %s (%s); status shows older progress", self.file.uri, e)
            self._failing = True
        else:
            self._failing = False

    def flush(self, timeout_s: float = 30) -> None:
        """Until the records given so far are written, or `timeout_s` has passed."""
        with self._cond:
            self._cond.wait_for(lambda: self._next is None and not self._writing, timeout_s)


def duration_text(seconds: float | None) -> str:
    """`seconds` as people read it: 45s, 3m20s, 2h05m; '?' when unknown."""
    if seconds is None:
        return "?"
    s = max(round(seconds), 0)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"
