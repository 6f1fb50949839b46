"""Checkpoints inside an epoch: every `checkpoint.every_steps` steps and at a preemption notice,
written beside Ray's epoch checkpoints (`<run>/steps/`), resumed from exactly their step.

They are not reported to Ray: its checkpoint manager ranks every reported checkpoint by the
run's score (val loss, ...), which a checkpoint inside an epoch does not have. Rank 0 copies the
state into host memory, which is all the step loop waits for, and a thread writes it to storage
while training goes on (pipeline.train.saving). A restarted worker takes the newest whole one of
the epoch it starts at, if it is newer than Ray's latest checkpoint; they go once their epoch's
own checkpoint is on storage.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable
from pathlib import Path

from pipeline.core.storage import Location
from pipeline.model.checkpoint import METADATA
from pipeline.train.saving import Background, Snapshot, publish_checkpoint

log = logging.getLogger(__name__)

STEPS = "steps"
KEEP = 2  # per epoch: the newest, and one more should the newest be unreadable
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


def latest_step_checkpoint(run_dir: Location, epoch: int | None = None) -> Location | None:
    """The newest checkpoint inside an epoch (inside `epoch`, if given) that is whole (its
    metadata, written last, is there), if any."""
    for found, _, directory in reversed(step_checkpoints(run_dir)):
        if epoch in (None, found) and directory.child(METADATA).exists():
            return directory
    return None


class StepWriter:
    """Rank 0's writer: the state copied in the step loop, written by a thread of its own, one
    checkpoint at a time."""

    def __init__(self, run_dir: Location):
        self.run_dir = run_dir
        self.background = Background("step-checkpoint")
        self.snapshot = Snapshot()
        # The epochs whose own checkpoints are on storage, told by Ray's upload thread.
        self.lock = threading.Lock()
        self.done_epoch: int | None = None

    def save(self, epoch: int, step: int, state, write: Callable[[Path, object], None]) -> None:
        """Copy `state` now (after the checkpoint before it is written: its copy is reused);
        `write(directory, copy)` fills the checkpoint's directory in the background."""
        self.background.wait()
        copied = self.snapshot.take(state)
        self.background.submit(lambda: self._publish(epoch, step, lambda d: write(d, copied)))

    def _publish(self, epoch: int, step: int, write: Callable[[Path], None]) -> None:
        target = self.run_dir.child(STEPS, step_dir_name(epoch, step))
        publish_checkpoint(target, write)
        log.info("checkpoint of epoch %d step %d saved: %s", epoch, step, target.uri)
        self.prune(keep=KEEP)

    def wait(self) -> None:
        """Until the checkpoint being written is on storage; its error, if it failed."""
        self.background.wait()

    def epoch_done(self, epoch: int) -> None:
        """Epoch `epoch`'s own checkpoint is on storage: its checkpoints inside it can go (and
        any of them written later, as they are written)."""
        with self.lock:
            self.done_epoch = max(epoch, self.done_epoch if self.done_epoch is not None else -1)
        self.prune()

    def prune(self, *, keep: int | None = None) -> None:
        """Remove the checkpoints of epochs whose epoch checkpoints are on storage, and with
        `keep`, all but the newest `keep` of each other epoch: an epoch whose own checkpoint is
        still being uploaded keeps its newest beside the next epoch's."""
        with self.lock:
            done_epoch = self.done_epoch
            found = step_checkpoints(self.run_dir)
            stale = [f for f in found if done_epoch is not None and f[0] <= done_epoch]
            if keep is not None:
                for epoch in {f[0] for f in found}:
                    of_epoch = [f for f in found if f[0] == epoch and f not in stale]
                    stale += of_epoch[: max(len(of_epoch) - keep, 0)]
            for *_, directory in stale:
                directory.delete()
