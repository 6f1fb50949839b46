"""`decode=gpu`: the train worker decodes each batch's JPEGs on its device and augments them there.

The DataLoader processes then only read rows (`Encoded`): a batch leaves them as its encoded
images and the seeds of their augmentation draws (`EncodedBatch`).
`DeviceDecoded` decodes it with torchvision's `decode_jpeg` on the worker's device (nvJPEG on
CUDA; on a CPU device the same call decodes with libjpeg-turbo, in the training process) and
applies the CPU path's transform image by image, with the same draws: torchvision's
transforms draw their parameters from the CPU generator, which `augmented` seeds per row,
and apply them to the image where it lies. So the same seeds give the same crops, flips and
policy ops on either path; on a CPU device the pixels are equal too (PIL decodes with the same
libjpeg-turbo), on CUDA nvJPEG's decode may differ from it by a few levels.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

import torch
from torchvision.io import ImageReadMode, decode_jpeg

from pipeline.train.input.decoding import augmented, stored_image
from pipeline.train.input.rows import Batches, Place, RowBatch, RowGroupStream


def pick_decode(decode: str, device: torch.device, image_format: str) -> str:
    """Where a worker on `device` decodes `image_format` images for `decode`: cpu or gpu.
    auto: gpu on a CUDA device with JPEG images (what nvJPEG decodes), else cpu."""
    if decode != "auto":
        return decode
    return "gpu" if device.type == "cuda" and image_format == "jpeg" else "cpu"


class EncodedBatch(NamedTuple):
    """A batch's encoded images, end to end in one tensor: one shared-memory transfer from a
    DataLoader process rather than one per image (each holds a file descriptor in transit)."""

    data: torch.Tensor  # uint8 (total bytes,)
    sizes: list[int]  # bytes of each image, in order
    seeds: list[int] | None  # each image's augmentation draws (`augmented`)
    places: list[Place]  # where each image is stored, to name one that does not decode

    @classmethod
    def of(cls, batch: RowBatch) -> tuple[EncodedBatch, torch.Tensor]:
        """(EncodedBatch, labels) of a batch's rows."""
        rows = batch.rows
        data = bytearray(b"".join(image for image, _, _ in rows))
        sizes = [len(image) for image, _, _ in rows]
        places = [place for _, _, place in rows]
        encoded = cls(torch.frombuffer(data, dtype=torch.uint8), sizes, batch.seeds, places)
        return encoded, batch.labels()

    @classmethod
    def joined(cls, parts: list[tuple[EncodedBatch, torch.Tensor]]):
        """One batch of the parts of it that DataLoader processes yielded, in order."""
        batches, labels = zip(*parts, strict=True)
        seeds = None if batches[0].seeds is None else [s for b in batches for s in b.seeds]
        return cls(
            torch.cat([b.data for b in batches]),
            [n for b in batches for n in b.sizes],
            seeds,
            [p for b in batches for p in b.places],
        ), torch.cat(labels)

    def tensors(self) -> list[torch.Tensor]:
        """One uint8 (bytes,) view per image, as `decode_jpeg` takes a batch."""
        return list(self.data.split(self.sizes))


class Encoded(Batches):
    """`rows`' batches as read, for `DeviceDecoded`: (EncodedBatch, int64 (B,))."""

    def batch(self, batch: RowBatch, out: torch.Tensor | None = None):
        assert out is None, "encoded batches are not stacked into a ring"
        return EncodedBatch.of(batch)


def decode_batch(batch: EncodedBatch, device: torch.device, transform=None) -> torch.Tensor:
    """uint8 (B, 3, S, S) on `device`: the batch decoded there, then `transform` on each image
    with its own draws."""
    images = decode_jpeg(batch.tensors(), mode=ImageReadMode.RGB, device=device)
    return torch.stack(augmented(transform, images, batch.seeds))


class DeviceDecoded:
    """A loader of (EncodedBatch, labels) batches as (uint8 (B, 3, S, S) on `device`, labels).
    `rows`: the RowGroupStream the batches come from, which names a stored image that does not
    decode."""

    def __init__(self, loader, device: torch.device, transform=None, *, rows: RowGroupStream):
        self.loader, self.device, self.transform, self.rows = loader, device, transform, rows
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for batch, labels in self.loader:
            try:
                images = self.decode(batch)
            except RuntimeError:  # decode_jpeg's, naming no image: the CPU path's names it
                for data, place in zip(batch.tensors(), batch.places, strict=True):
                    stored_image(self.rows, data.numpy().tobytes(), place)
                raise  # each decodes on the CPU: the device's decoder failed on its own
            yield images, labels

    def decode(self, batch: EncodedBatch) -> torch.Tensor:
        if self.stream is None:
            return decode_batch(batch, self.device, self.transform)
        # decode_jpeg allocates its outputs on the current stream, then writes them from a
        # stream of its own that does not wait for that one: on the training stream it could be
        # handed memory that the step's queued kernels still read (pytorch/vision PR 9606).
        # On this stream, drained first, every block it can be handed is idle: the allocator
        # keeps blocks per stream, and the batch below is recorded on the training stream.
        with torch.cuda.stream(self.stream):
            self.stream.synchronize()
            images = decode_batch(batch, self.device, self.transform)
        current = torch.cuda.current_stream(self.device)
        current.wait_stream(self.stream)
        images.record_stream(current)
        return images
