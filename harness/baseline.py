"""The training loader's previous per-batch path, kept to compare against: in
tests/unit/test_loader.py (the same pixels and draws) and bench/loader_cores.py (the CPU it
saves)."""

from __future__ import annotations

import torch
from torchvision.transforms import v2

from pipeline.data.images import decode_image
from pipeline.train.input.decoding import Decoded, augmented


class PillowDecoded(Decoded):
    """Pillow's decode (decode_image), pil_to_tensor, the transform (give it
    `torchvisions_crop`), torch.stack."""

    def batch(self, batch, out=None):
        images = [v2.functional.pil_to_tensor(decode_image(data)) for data, _, _ in batch.rows]
        return torch.stack(augmented(self.transform, images, batch.seeds), out=out), batch.labels()


def torchvisions_crop(image_size: int) -> v2.Transform:
    """train_transform("random_resized_crop") as torchvision gives it."""
    return v2.Compose(
        [v2.RandomResizedCrop(image_size, scale=(0.25, 1.0)), v2.RandomHorizontalFlip()]
    )
