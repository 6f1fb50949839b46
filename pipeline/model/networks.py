"""ResNet-18: built fresh, from pretrained weights, or from one of our checkpoints."""

from __future__ import annotations

import torch
import torchvision

from pipeline.core.errors import InputError
from pipeline.core.storage import Location
from pipeline.model.checkpoint import (
    CheckpointMeta,
    load_tensors,
    load_weights,
    read_meta,
    served_weights,
)


def build_model(num_classes: int, *, pretrained: str | None = None) -> torch.nn.Module:
    """ResNet-18 with a fresh `num_classes` head; the backbone optionally pre-trained."""
    if pretrained is None:
        return torchvision.models.resnet18(num_classes=num_classes)
    model = torchvision.models.resnet18()
    if "/" in pretrained:  # a state_dict file, local or on storage
        state = _read_state_dict(Location.parse(pretrained))
    else:  # a torchvision weights name, e.g. IMAGENET1K_V1 (downloads once per node)
        try:
            weights = torchvision.models.ResNet18_Weights[pretrained]
        except KeyError:
            names = ", ".join(w.name for w in torchvision.models.ResNet18_Weights)
            raise InputError(
                f"pretrained={pretrained!r} is not a resnet18 weights name ({names}) "
                "nor an absolute path to a state_dict file"
            ) from None
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


def check_pretrained(pretrained: str) -> None:
    """Fail on the driver, once, on `pretrained` weights that every worker would fail on (a file
    that is missing or not a resnet18 state_dict, an unknown name); names download on the
    workers."""
    if "/" in pretrained or pretrained not in torchvision.models.ResNet18_Weights.__members__:
        build_model(2, pretrained=pretrained)


def _read_state_dict(loc: Location) -> dict[str, torch.Tensor]:
    if not loc.exists():
        raise InputError(f"pretrained weights {loc.uri} do not exist")
    state = load_tensors(loc)
    if isinstance(state, dict) and "model" in state and isinstance(state["model"], dict):
        state = state["model"]
    return state


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The bare model inside DDP (or torch.compile), whose state_dict has no 'module.' prefix."""
    while hasattr(model, "module") or hasattr(model, "_orig_mod"):
        model = getattr(model, "module", None) or model._orig_mod
    return model


def load_model(
    checkpoint: Location, *, weights: str | None = None
) -> tuple[torch.nn.Module, CheckpointMeta]:
    """The checkpoint's model (local or on storage) on the CPU in eval mode, and its metadata.
    `weights`: "raw" or "ema"; by default the better on val of those it holds
    (`served_weights`)."""
    meta = read_meta(checkpoint)
    model = build_model(len(meta.classes))
    model.load_state_dict(load_weights(checkpoint, meta, weights or served_weights(meta)))
    return model.eval(), meta
