"""A checkpoint: a directory that carries everything needed to use the model or resume its run.

<checkpoint>/model.pt        state_dict of the bare model (never DDP-wrapped)
<checkpoint>/train_state.pt  optimizer, LR scheduler and grad scaler state, for resuming
<checkpoint>/metadata.json   epoch, classes, image size, normalisation, metrics, history,
                             and the resolved training config
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict

from pipeline.core.errors import InputError
from pipeline.core.storage import Location

MODEL_NAME = "resnet18"
CHECKPOINT_FORMAT = 1
WEIGHTS, TRAIN_STATE, METADATA = "model.pt", "train_state.pt", "metadata.json"


class CheckpointMeta(BaseModel):
    """metadata.json: how to rebuild the model and feed it, and how it got here."""

    model_config = ConfigDict(extra="forbid")

    format: int = CHECKPOINT_FORMAT
    model: str = MODEL_NAME
    epoch: int  # the last completed epoch, 0-based
    classes: list[str]
    image_size: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    dataset_fingerprint: str
    dataset_version: str  # the version of the dataset it was trained on (pipeline.data.dataset)
    metrics: dict[str, int | float | str]  # this epoch's
    history: list[dict[str, int | float | str]]  # every epoch up to and including this one
    config: dict[str, Any]


def save_checkpoint(
    directory: str | Path, weights: dict, meta: CheckpointMeta, train_state: dict
) -> None:
    """Write a checkpoint into a local directory; `weights` is the bare model's state_dict."""
    d = Path(directory)
    torch.save(weights, d / WEIGHTS)
    torch.save(train_state, d / TRAIN_STATE)
    (d / METADATA).write_text(meta.model_dump_json(indent=2))


def read_meta(checkpoint: Location) -> CheckpointMeta:
    """A checkpoint's metadata.json (local or on storage), checked to be ours."""
    path = checkpoint.child(METADATA)
    if not path.exists():
        raise InputError(
            f"{checkpoint.uri} has no {METADATA}: not a checkpoint written by this bundle's "
            "train job"
        )
    try:
        meta = CheckpointMeta.model_validate_json(path.read_bytes())
    except ValueError as e:
        raise InputError(f"{path.uri} is not valid checkpoint metadata: {e}") from None
    if meta.format != CHECKPOINT_FORMAT or meta.model != MODEL_NAME:
        raise InputError(
            f"{checkpoint.uri} holds a {meta.model} checkpoint of format {meta.format}; this "
            f"code reads {MODEL_NAME} format {CHECKPOINT_FORMAT}"
        )
    return meta


def load_weights(checkpoint: Location) -> dict[str, torch.Tensor]:
    return load_tensors(checkpoint.child(WEIGHTS))


def load_train_state(checkpoint: Location) -> dict:
    return load_tensors(checkpoint.child(TRAIN_STATE))


def load_tensors(file: Location):
    """torch.load of a local or remote file, tensors only (weights_only), onto the CPU."""
    return torch.load(io.BytesIO(file.read_bytes()), map_location="cpu", weights_only=True)
