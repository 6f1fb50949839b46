"""ResNet-18 and its checkpoint: a directory that carries everything needed to use the model.

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
import torchvision
from pydantic import BaseModel, ConfigDict

from pipeline.errors import InputError
from pipeline.storage import Location

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
    metrics: dict[str, int | float]  # this epoch's
    history: list[dict[str, int | float]]  # every epoch up to and including this one
    config: dict[str, Any]


def build_model(num_classes: int, *, pretrained: str | None = None) -> torch.nn.Module:
    """ResNet-18 with a fresh `num_classes` head; the backbone optionally pre-trained."""
    if pretrained is None:
        return torchvision.models.resnet18(num_classes=num_classes)
    if "/" in pretrained:  # a state_dict file, local or on storage
        model = torchvision.models.resnet18()
        state = _read_state_dict(Location.parse(pretrained))
    else:  # a torchvision weights name, e.g. IMAGENET1K_V1 (downloads once per node)
        try:
            weights = torchvision.models.ResNet18_Weights[pretrained]
        except KeyError:
            names = ", ".join(w.name for w in torchvision.models.ResNet18_Weights)
            raise InputError(f"pretrained={pretrained!r} is not a resnet18 weights name ({names}) "
                             "nor an absolute path to a state_dict file") from None  # fmt: skip
        model = torchvision.models.resnet18()
        state = weights.get_state_dict(progress=False)
    # The head is always new: the classes are ours.
    backbone = {k: v for k, v in state.items() if not k.startswith("fc.")}
    missing, unexpected = model.load_state_dict(backbone, strict=False)
    if unexpected or set(missing) != {"fc.weight", "fc.bias"}:
        raise InputError(
            f"pretrained={pretrained!r} is not a resnet18 state_dict (missing "
            f"{sorted(set(missing) - {'fc.weight', 'fc.bias'})[:3]}, unexpected {unexpected[:3]})"
        )
    model.fc = torch.nn.Linear(model.fc.in_features, num_classes)
    return model


def _read_state_dict(loc: Location) -> dict[str, torch.Tensor]:
    if not loc.exists():
        raise InputError(f"pretrained weights {loc.uri} do not exist")
    state = _load_tensors(loc)
    if isinstance(state, dict) and "model" in state and isinstance(state["model"], dict):
        state = state["model"]
    return state


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The bare model inside DDP (or torch.compile), whose state_dict has no 'module.' prefix."""
    while hasattr(model, "module") or hasattr(model, "_orig_mod"):
        model = getattr(model, "module", None) or model._orig_mod
    return model


def save_checkpoint(
    directory: str | Path, model: torch.nn.Module, meta: CheckpointMeta, train_state: dict
) -> None:
    d = Path(directory)
    torch.save(unwrap(model).state_dict(), d / WEIGHTS)
    torch.save(train_state, d / TRAIN_STATE)
    (d / METADATA).write_text(meta.model_dump_json(indent=2))


def _location(checkpoint: str | Path | Location) -> Location:
    return checkpoint if isinstance(checkpoint, Location) else Location.parse(str(checkpoint))


def read_meta(checkpoint: str | Path | Location) -> CheckpointMeta:
    """A checkpoint's metadata.json (local or on storage), checked to be ours."""
    loc = _location(checkpoint)
    path = loc.child(METADATA)
    if not path.exists():
        raise InputError(
            f"{loc.uri} has no {METADATA}: not a checkpoint written by this bundle's train job"
        )
    try:
        meta = CheckpointMeta.model_validate_json(path.read_bytes())
    except ValueError as e:
        raise InputError(f"{path.uri} is not valid checkpoint metadata: {e}") from None
    if meta.format != CHECKPOINT_FORMAT or meta.model != MODEL_NAME:
        raise InputError(
            f"{loc.uri} holds a {meta.model} checkpoint of format {meta.format}; this code "
            f"reads {MODEL_NAME} format {CHECKPOINT_FORMAT}"
        )
    return meta


def load_weights(checkpoint: str | Path | Location) -> dict[str, torch.Tensor]:
    return _load_tensors(_location(checkpoint).child(WEIGHTS))


def _load_tensors(file: Location):
    """torch.load of a local or remote file, tensors only (weights_only), onto the CPU."""
    return torch.load(io.BytesIO(file.read_bytes()), map_location="cpu", weights_only=True)


def load_train_state(directory: str | Path) -> dict:
    return torch.load(Path(directory) / TRAIN_STATE, map_location="cpu", weights_only=True)


def load_model(checkpoint: str | Path | Location) -> tuple[torch.nn.Module, CheckpointMeta]:
    """The checkpoint's model (local or on storage) on the CPU in eval mode, and its metadata."""
    meta = read_meta(checkpoint)
    model = build_model(len(meta.classes))
    model.load_state_dict(load_weights(checkpoint))
    return model.eval(), meta
