"""Decoding and augmenting rows on the CPU: each stored image decoded and checked, augmented with
its row's own draws, and the batch stacked in the memory layout a step takes (`Decoded`)."""

from __future__ import annotations

import torch
from torch.utils.data import default_collate
from torchvision.io import ImageReadMode, decode_jpeg
from torchvision.transforms import v2

from pipeline.core.errors import InputError
from pipeline.data.images import BadImageError, decode_image, jpeg_header
from pipeline.train.input.rows import Batches, Place, RowBatch, RowGroupStream


class Decoded(Batches):
    """`rows`' batches decoded, each image augmented by `transform` with its row's draws:
    (uint8 (B, 3, S, S), int64 (B,)), the images channels-last in memory where decoding and
    augmentation leave them so (`stacked`)."""

    stacks = True

    def __init__(self, rows: RowGroupStream, transform=None):
        super().__init__(rows)
        self.transform = transform

    def batch(
        self, batch: RowBatch, out: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One batch: its rows decoded, each augmented with the draws of its seed, stacked
        (into `out`, if given)."""
        images = [stored_image(self.rows, data, place) for data, _, place in batch.rows]
        return stacked(augmented(self.transform, images, batch.seeds), out), batch.labels()


def stored_image(rows: RowGroupStream, data: bytes, place: Place) -> torch.Tensor:
    """The image `rows` stores at `place`, decoded; an InputError naming it if it is not the
    image that preprocessing wrote (bytes damaged in storage since: the files' sizes, which the
    driver checks, may not have changed)."""
    group, index = place
    size = rows.image_size
    try:
        image = decode(data, size)
    except BadImageError as e:
        raise InputError(rows.damaged(group, str(e), row=index)) from None
    if image.shape[1:] != (size, size):
        h, w = image.shape[1:]
        what = f"a {w}x{h} px image, not {size}x{size} as the manifest says"
        raise InputError(rows.damaged(group, what, row=index))
    return image


def stacked(images: list[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
    """uint8 (3, H, W) images -> (B, 3, H, W) in their own memory layout: channels-last where
    the first one is (decoded, or resized by the augmentation's crop: height, width, then a
    pixel's 3 channels), the layout a GPU step takes, else contiguous. Each image's copy is then
    a plain one, not a transposition. With `out`, into `out` (a ring's slot: ring.RingLoader),
    in its layout; in a plain DataLoader's process, default_collate stacks into shared memory
    of the batch's own."""
    if out is not None:
        for image, into in zip(images, out, strict=True):
            into.copy_(image)
        return out
    if images[0].permute(1, 2, 0).is_contiguous():
        return default_collate([image.permute(1, 2, 0) for image in images]).permute(0, 3, 1, 2)
    return default_collate(images)


def decode(data: bytes, size: int) -> torch.Tensor:
    """A stored image -> uint8 (3, H, W): `decode_image`'s pixels. A plain JPEG of `size` x
    `size` px (8-bit, 3 components, no segment Pillow acts on: `PLAIN_SEGMENTS`), what
    preprocessing writes, through torchvision's `decode_jpeg`, straight into a tensor: libjpeg-
    turbo as in Pillow, at about 0.65x the CPU time (no image object, no copy, none of
    decode_image's conversions, which a plain JPEG does not need). Anything else, and bytes it
    fails on, through `decode_image`, which decodes them or says what is wrong."""
    header = jpeg_header(data)
    if (
        header is not None
        and (header.width, header.height, header.components, header.precision) == (size, size, 3, 8)
        and header.plain
    ):
        try:
            return decode_jpeg(
                torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB
            )
        except RuntimeError:
            pass  # damaged: decode_image's error names the reason
    return v2.functional.pil_to_tensor(decode_image(data))


def augmented(transform, images: list[torch.Tensor], seeds: list[int] | None):
    """`transform` (or none) on each image, its random draws from its own seed (order.row_seed),
    without moving the global generator that training draws from: the same crops and flips
    for a row whichever process, rank or layout decodes it."""
    if transform is None:
        return images
    out = []
    with torch.random.fork_rng(devices=[]):
        for image, seed in zip(images, seeds, strict=True):
            torch.default_generator.manual_seed(seed)
            out.append(transform(image))
    return out
