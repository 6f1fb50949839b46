"""How a batch goes through the model on one device, for training and inference alike."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipeline.model.checkpoint import ModelInput

AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def pick_precision(requested: str, device: torch.device) -> str:
    """fp32 on CPU; on GPU bf16 where the hardware computes in it, else fp16 (grad scaler)."""
    if requested != "auto":
        return requested
    if device.type != "cuda":
        return "fp32"
    # Not torch.cuda.is_bf16_supported(): it says yes on T4 and V100 (compute capability 7.x),
    # which emulate bf16 slowly. Ampere (8.0) and later have bf16 tensor cores.
    return "bf16" if torch.cuda.get_device_capability(device) >= (8, 0) else "fp16"


def normalize(
    images: torch.Tensor, *, mean: tuple[float, ...], std: tuple[float, ...]
) -> torch.Tensor:
    """uint8 (N, 3, H, W) -> float (N, 3, H, W), normalised; done per batch, on the device."""
    m = torch.tensor(mean, device=images.device).view(1, 3, 1, 1)
    s = torch.tensor(std, device=images.device).view(1, 3, 1, 1)
    return (images.float().div_(255) - m) / s


def resize(images: torch.Tensor, *, size: int, interpolation: str) -> torch.Tensor:
    """float (N, 3, H, W) -> (N, 3, size, size), antialiased as torchvision's Resize on tensors."""
    if images.shape[-2:] == (size, size):
        return images
    return torch.nn.functional.interpolate(
        images, size=(size, size), mode=interpolation, antialias=True, align_corners=False
    )


@dataclass
class DevicePolicy:
    """A batch on this device: precision, normalisation, the network's input size, memory
    layout. (fp16's grad scaler is the optimisation state's: pipeline.train.optim.)"""

    device: torch.device
    precision: str
    mean: tuple[float, ...]
    std: tuple[float, ...]
    # The network's side, where the stored images are larger (None: as stored).
    input_size: int | None = None
    interpolation: str = "bilinear"

    @classmethod
    def for_input(cls, device: torch.device, precision: str, inputs: ModelInput) -> DevicePolicy:
        """The policy that feeds a network what it takes (`ModelInput`)."""
        return cls(
            device,
            precision,
            inputs.mean,
            inputs.std,
            input_size=inputs.image_size,
            interpolation=inputs.interpolation,
        )

    @property
    def channels_last(self) -> bool:
        return self.device.type == "cuda"

    def prepare(self, model: torch.nn.Module) -> torch.nn.Module:
        """The model in this policy's memory layout."""
        return model.to(memory_format=torch.channels_last) if self.channels_last else model

    def inputs(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 (N, 3, H, W) from the loader -> normalised float on the device, resized to the
        network's input size: the same for training, evaluation and inference."""
        x = normalize(images.to(self.device, non_blocking=True), mean=self.mean, std=self.std)
        if self.input_size is not None:
            x = resize(x, size=self.input_size, interpolation=self.interpolation)
        # The loader's batches are channels-last; off the GPU the network is not.
        layout = torch.channels_last if self.channels_last else torch.contiguous_format
        return x.contiguous(memory_format=layout)

    def autocast(self):
        dtype = AMP_DTYPES.get(self.precision, torch.float32)
        return torch.autocast(self.device.type, dtype=dtype, enabled=self.precision != "fp32")
