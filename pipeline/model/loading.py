"""A checkpoint's model, rebuilt from the checkpoint alone on the CPU in eval mode, running no
code but what the user chose (pipeline.model.trust)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from pipeline.core.storage import Location
from pipeline.model.checkpoint import CheckpointMeta, load_weights, read_meta, served_weights
from pipeline.model.networks import build_model
from pipeline.model.trust import check_model_code


def load_model(
    checkpoint: Location,
    *,
    weights: str | None = None,
    allow_modules: Sequence[str] = (),
    code_root: Path | None = None,
) -> tuple[torch.nn.Module, CheckpointMeta]:
    """The checkpoint's model (local or on storage) on the CPU in eval mode, and its metadata:
    rebuilt from the checkpoint alone, with no code but what the user chose
    (`check_model_code`). `weights`: "raw" or "ema"; by default the better on val of those it
    holds (`served_weights`)."""
    meta = read_meta(checkpoint)
    spec = meta.model
    check_model_code(spec, allow_modules=allow_modules, code_root=code_root)
    model = build_model(
        len(meta.classes),
        name=spec.name,
        kwargs=spec.kwargs,
        bn_momentum=spec.bn_momentum,
        bn_eps=spec.bn_eps,
    )
    model.load_state_dict(load_weights(checkpoint, meta, weights or served_weights(meta)))
    return model.eval(), meta
