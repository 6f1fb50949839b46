"""Checkpoints inside an epoch: every `checkpoint.every_steps` steps and at a preemption notice,
written beside Ray's epoch checkpoints (`<run>/steps/`), resumed from exactly their step.

They are not reported to Ray: its checkpoint manager ranks every reported checkpoint by the
run's score (val loss, ...), which a checkpoint inside an epoch does not have. Rank 0 writes one
to local disk, which is all the step loop waits for, and a thread publishes it to storage while
training goes on. A restarted worker takes the newest whole one, if it is newer than Ray's
latest checkpoint; they go once their epoch's own checkpoint is in.
"""

from __future__ import annotations

import logging
import re
import shutil
import tempfile
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from pipeline.core.storage import Location, publish_directory
from pipeline.model.checkpoint import METADATA

log = logging.getLogger(__name__)

STEPS = "steps"
KEEP = 2  # of the epoch in progress: the newest, and one more should the newest be unreadable
NAME = re.compile(r"epoch_(\d{4,})_step_(\d{6,})")


def step_dir_name(epoch: int, step: int) -> str:
    return f"epoch_{epoch:04d}_step_{step:06d}"


def step_checkpoints(run_dir: Location) -> list[tuple[int, int, Location]]:
    """(epoch, step, directory) of the run's whole checkpoints inside an epoch, oldest first."""
    found = []
    for info in run_dir.child(STEPS).list_dirs():
        if match := NAME.fullmatch(info.base_name):
            found.append((int(match[1]), int(match[2]), run_dir.child(STEPS, info.base_name)))
    return sorted(found, key=lambda f: f[:2])


def latest_step_checkpoint(run_dir: Location) -> Location | None:
    """The newest checkpoint inside an epoch that is whole (its metadata, written last, is
    there), if any."""
    for *_, directory in reversed(step_checkpoints(run_dir)):
        if directory.child(METADATA).exists():
            return directory
    return None


class StepWriter:
    """Rank 0's writer: one checkpoint published at a time, in a thread of its own."""

    def __init__(self, run_dir: Location):
        self.run_dir = run_dir
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="step-checkpoint")
        self.pending: Future | None = None

    def save(self, epoch: int, step: int, write: Callable[[Path], None]) -> None:
        """`write(directory)` fills a local directory now; it is published in the background,
        after the one before it."""
        self.wait()
        staged = Path(tempfile.mkdtemp(prefix="step-checkpoint-"))
        try:
            write(staged)
        except BaseException:
            shutil.rmtree(staged, ignore_errors=True)
            raise
        self.pending = self.pool.submit(self._publish, staged, epoch, step)

    def _publish(self, staged: Path, epoch: int, step: int) -> None:
        target = self.run_dir.child(STEPS, step_dir_name(epoch, step))
        try:
            publish_directory(staged, target, last=METADATA)
        finally:
            shutil.rmtree(staged, ignore_errors=True)
        log.info("checkpoint of epoch %d step %d saved: %s", epoch, step, target.uri)
        self.prune(keep=KEEP)

    def wait(self) -> None:
        """Until the checkpoint being published is on storage; its error, if it failed."""
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.result()

    def prune(self, *, keep: int | None = None, done_epoch: int | None = None) -> None:
        """Remove the checkpoints of epochs up to `done_epoch` (their epoch checkpoints are in),
        and with `keep`, all but the newest `keep` of the rest."""
        found = step_checkpoints(self.run_dir)
        stale = [f for f in found if done_epoch is not None and f[0] <= done_epoch]
        rest = [f for f in found if f not in stale]
        if keep is not None:
            stale += rest[: max(len(rest) - keep, 0)]
        for *_, directory in stale:
            directory.delete()
