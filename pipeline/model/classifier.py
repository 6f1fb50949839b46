"""A checkpoint's model fed as it was trained: encoded image -> pixels (the preprocessing
functions), pixels -> class probabilities (the device policy), probabilities -> the top classes.
Batch inference and serving both classify through this module, so the two cannot drift."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from pipeline.core.storage import Location
from pipeline.data.images import decode_image, resize_center_crop
from pipeline.model.device import DevicePolicy, pick_precision
from pipeline.model.loading import load_model


def prepare_image(data: bytes, *, image_size: int) -> np.ndarray:
    """Encoded image -> uint8 (3, S, S), exactly as preprocessing shaped the training images
    (the model's `DevicePolicy` then resizes them to the network's input, as in training)."""
    img = resize_center_crop(decode_image(data), size=image_size)
    return np.asarray(img, dtype=np.uint8).transpose(2, 0, 1)


class Classifier:
    """A checkpoint's model on one device: uint8 pixels in, class probabilities out. Batches go
    through the model as in training (`DevicePolicy`): same normalisation, precision and memory
    layout."""

    def __init__(
        self,
        checkpoint: Location,
        *,
        use_gpu: bool,
        precision: str,
        allow_modules: Sequence[str] = (),
        code_root: Path | None = None,
    ):
        """`allow_modules`, `code_root`: the code the checkpoint may name (load_model)."""
        device = torch.device("cuda" if use_gpu else "cpu")
        model, self.meta = load_model(checkpoint, allow_modules=allow_modules, code_root=code_root)
        self.policy = DevicePolicy.for_input(
            device, pick_precision(precision, device), self.meta.model_input
        )
        self.model = self.policy.prepare(model).to(device).eval()

    @property
    def precision(self) -> str:
        return self.policy.precision

    @torch.inference_mode()
    def probabilities(self, pixels: np.ndarray) -> torch.Tensor:
        with self.policy.autocast():
            logits = self.model(self.policy.inputs(torch.from_numpy(pixels)))
        return logits.float().softmax(dim=1).cpu()


def top_classes(probs: torch.Tensor, classes: list[str], k: int) -> list[dict]:
    """One image's probabilities (C,) -> its `k` most likely classes, most likely first."""
    values, indices = probs.topk(min(k, len(classes)))
    return [
        {"class": classes[i], "index": int(i), "probability": float(p)}
        for p, i in zip(values, indices, strict=True)
    ]
