"""What a training run trains, the same on every rank: its config, the dataset version it reads,
the run's directory and what the network takes."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.core.storage import Location
from pipeline.data.dataset import Manifest
from pipeline.model.checkpoint import ModelInput
from pipeline.train.config import TrainConfig


@dataclass
class TrainRun:
    """The run every rank trains: the config, the dataset (its root and the manifest of the
    version the driver pinned), the run's directory, and what the network takes."""

    cfg: TrainConfig
    dataset: Location
    run_dir: Location
    manifest: Manifest
    inputs: ModelInput  # what the network takes: its size and normalisation (the driver's)
