"""Training augmentation, on uint8 (3, H, W) images already cropped to `image_size` squares."""

from __future__ import annotations

from torchvision.transforms import v2


def train_transform(kind: str, *, image_size: int) -> v2.Transform:
    """Augmentation on uint8 (3, H, W); the images are already `image_size` squares."""
    if kind == "random_resized_crop":
        return v2.Compose(
            [v2.RandomResizedCrop(image_size, scale=(0.25, 1.0)), v2.RandomHorizontalFlip()]
        )
    if kind == "crop_flip":
        pad = max(1, image_size // 8)
        return v2.Compose([v2.RandomCrop(image_size, padding=pad), v2.RandomHorizontalFlip()])
    if kind == "none":
        return v2.Identity()
    raise ValueError(f"unknown augment {kind!r}: use random_resized_crop, crop_flip or none")
