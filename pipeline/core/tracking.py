"""What the training driver and its workers ask of an experiment tracker (pipeline.tracking).

The training wing calls a tracker through these two interfaces only, and imports no tracking
code: jobs/train.py opens the tracker (or passes None: tracking off) and hands it to the driver,
which hands the workers the EpochSink it returns, as part of their config. Neither may stop
training: a tracker that cannot log says so and keeps what it could not log for later.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from pipeline.core.storage import Location
    from pipeline.train.config import TrainConfig


class EpochSink(Protocol):
    """Rank 0's side: picklable, sent to the workers inside their config."""

    def log_epochs(self, history: list[dict]) -> None:
        """Log each epoch of `history` (a checkpoint's, every epoch so far) not logged yet."""


class TrainingTracker(Protocol):
    """The driver's side, one per train job."""

    def start(
        self, run_dir: Location, cfg: TrainConfig, *, version: str, changes: list[str]
    ) -> EpochSink:
        """Open the run's tracked run (the one it already has, or a new one) before the
        workers start; `changes`: the settings this submission changes, as 'key: old -> new'."""

    def finish(self, run_dir: Location, summary: dict) -> None:
        """Once the run's reports are written: log what is still missing (epochs, reports, the
        best checkpoint as a model), or say exactly what could not be logged."""

    def fail(self, run_dir: Location, error: str) -> None:
        """Mark the tracked run failed (a submission of the same run continues it)."""
