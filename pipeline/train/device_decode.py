"""`decode=gpu`: the train worker decodes each batch's JPEGs on its device and augments them there.

The DataLoader processes then only read rows (`RowGroupStream(encoded=True)`): a batch leaves
them as its encoded images and the seeds of their augmentation draws (`EncodedBatch`).
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

import torch
from torchvision.io import ImageReadMode, decode_jpeg

from pipeline.train.torch_input import EncodedBatch, RowGroupStream, augmented


def pick_decode(decode: str, device: torch.device, image_format: str) -> str:
    """Where a worker on `device` decodes `image_format` images for `decode`: cpu or gpu.
    auto: gpu on a CUDA device with JPEG images (what nvJPEG decodes), else cpu."""
    if decode != "auto":
        return decode
    return "gpu" if device.type == "cuda" and image_format == "jpeg" else "cpu"


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
                    self.rows.image(data.numpy().tobytes(), place)
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
