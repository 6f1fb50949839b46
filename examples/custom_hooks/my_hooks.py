"""A loss, a metric and an augmentation of your own, named in the train config as
`module:function` (examples/custom_hooks/train.yaml; docs/hooks.md)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torchmetrics import Metric
from torchmetrics.classification import MulticlassF1Score
from torchvision.transforms import v2


def focal(num_classes: int, class_weights: torch.Tensor | None = None, gamma: float = 2.0):
    """Focal loss (Lin et al. 2017): cross-entropy scaled down on the images already right.
    Returns (logits (N, C), targets (N,) class indices) -> the batch's mean loss."""

    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        ce = F.cross_entropy(logits, targets, weight=class_weights, reduction="none")
        return ((1 - torch.exp(-ce)) ** gamma * ce).mean()

    return loss


def macro_f1(num_classes: int) -> Metric:
    """F1 of each class, averaged with equal weights: reported as val_macro_f1."""
    return MulticlassF1Score(num_classes, average="macro")


def augment(image_size: int) -> v2.Transform:
    """The training augmentation of a uint8 (3, image_size, image_size) image; it returns one
    of the same size and dtype (normalisation comes later, on the device)."""
    return v2.Compose(
        [
            v2.RandomResizedCrop(image_size, scale=(0.5, 1.0), antialias=True),
            v2.RandomHorizontalFlip(),
            v2.RandomRotation(15),
            v2.ColorJitter(brightness=0.3, contrast=0.3, saturation=0.3),
            v2.RandomErasing(p=0.25, value=0),
        ]
    )
