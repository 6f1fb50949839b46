"""The test side of the fault points in pipeline.core.faults: arm one for a job, release it."""

from __future__ import annotations

from pathlib import Path

from pipeline.core import faults


def arm(point: str, directory: str | Path) -> dict[str, str]:
    """The environment that arms `point`, with its marker file in `directory`."""
    assert point in faults.POINTS, point
    return {faults.ENV: f"{point}:{directory}"}


def release(marker: Path) -> None:
    """Let the process held at `marker` (the file its point wrote) go on."""
    marker.with_name(marker.name + faults.RELEASE).touch()
