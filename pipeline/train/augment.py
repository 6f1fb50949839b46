"""Training augmentation: per image on uint8 (3, H, W) images already cropped to `image_size`
squares, and per batch (MixUp, CutMix) on the normalised batch in the worker's loop."""

from __future__ import annotations

import random

import torch
from torchvision.transforms import v2

AUTO_AUGMENT = {
    "trivial_augment_wide": v2.TrivialAugmentWide,
    "rand_augment": v2.RandAugment,  # torchvision's defaults: 2 ops of magnitude 9
}


def train_transform(
    augment: str,
    *,
    image_size: int,
    auto_augment: str = "none",
    scale: tuple[float, float] = (0.25, 1.0),
    ratio: tuple[float, float] = (3 / 4, 4 / 3),
    flip: bool = True,
) -> v2.Transform:
    """Augmentation on uint8 (3, H, W); the images are already `image_size` squares. `augment`: a
    preset, or the user's module:function(image_size=) returning a v2 transform. The
    `auto_augment` policy comes after the crop and flip, as in torchvision's presets."""
    kind = augment
    flips = [v2.RandomHorizontalFlip()] if flip else []
    if kind == "random_resized_crop":
        steps = [RandomResizedCrop(image_size, scale=tuple(scale), ratio=tuple(ratio)), *flips]
    elif kind == "crop_flip":
        pad = max(1, image_size // 8)
        steps = [v2.RandomCrop(image_size, padding=pad), *flips]
    elif kind == "none":
        steps = []
    elif ":" in kind:
        from pipeline.train.hooks import own_augment

        steps = [own_augment(kind, image_size=image_size)]
    else:
        raise ValueError(f"unknown augment {kind!r}: use random_resized_crop, crop_flip or none")
    if auto_augment != "none":
        if auto_augment not in AUTO_AUGMENT:
            raise ValueError(
                f"unknown auto_augment {auto_augment!r}: use none, {', '.join(AUTO_AUGMENT)}"
            )
        steps.append(AUTO_AUGMENT[auto_augment]())
    return v2.Compose(steps) if steps else v2.Identity()


class RandomResizedCrop(v2.RandomResizedCrop):
    """torchvision's, with its draws and pixels, faster on an image tensor in channels-last
    memory (height, width, then a pixel's 3 channels: what decoding gives). A crop of one is a
    view in neither layout, which torch's uint8 resize packs into channels-last and returns
    contiguous; copied into channels-last memory first, the crop is resized as it is, at about
    two thirds of the CPU time, and stays channels-last, which the batch stacks with plain
    copies (`input/decoding.stacked`)."""

    def transform(self, inpt, params):
        if type(inpt) is not torch.Tensor or inpt.ndim != 3:
            return super().transform(inpt, params)
        crop = v2.functional.crop(inpt, **params)[None]
        out = v2.functional.resize(
            crop.contiguous(memory_format=torch.channels_last),
            self.size,
            interpolation=self.interpolation,
            antialias=self.antialias,
        )
        return out[0]


def transform_options(cfg) -> dict:
    """`train_transform`'s keyword arguments, less image_size, from a TrainConfig."""
    return {
        "augment": cfg.augment,
        "auto_augment": cfg.auto_augment,
        "scale": tuple(cfg.crop_scale),
        "ratio": tuple(cfg.crop_ratio),
        "flip": cfg.flip,
    }


def batch_mix(*, mixup_alpha: float, cutmix_alpha: float, num_classes: int) -> v2.Transform | None:
    """MixUp and/or CutMix, one of the enabled ones per batch (torchvision references'
    `get_mixup_cutmix`): `(images, labels)` -> mixed images and soft labels (N, num_classes).
    None when both are off."""
    mixes = []
    if mixup_alpha > 0:
        mixes.append(v2.MixUp(alpha=mixup_alpha, num_classes=num_classes))
    if cutmix_alpha > 0:
        mixes.append(v2.CutMix(alpha=cutmix_alpha, num_classes=num_classes))
    return v2.RandomChoice(mixes) if mixes else None


class Augment:
    """`transform` on a whole batch, with random draws of its own, from `key` (MixUp, CutMix).

    torchvision's transforms draw from torch's global generator. Every rank seeds that alike,
    for the model's initial weights that DDP needs equal: each rank would mix its batch as every
    other rank does. A generator state per key (the worker's: seed, epoch, rank and step) makes
    the draws differ between them, and repeat for the same run, without moving the global
    generator that training draws from."""

    def __init__(self, transform, key: str):
        self.transform = transform
        seed = random.Random(f"augment/{key}").getrandbits(63)
        self.state = torch.Generator().manual_seed(seed).get_state()

    def draw(self, *inputs):
        """`transform(*inputs)` once, on a whole batch (MixUp, CutMix: `images, labels`)."""
        # CPU draws only: MixUp's and CutMix's come from the CPU generator whatever the device.
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(self.state)
            out = self.transform(*inputs)
            self.state = torch.get_rng_state()
        return out
