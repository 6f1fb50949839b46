"""A user's own code, as source text the tests write into a package or a module: a network
builder, and hooks (a loss, metrics, an augmentation). The tiers share them."""

NETWORK = """
import torch


def build(num_classes, width=4):
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, width, 3),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(width, num_classes),
    )
"""

HOOKS = '''
"""A user's own focal loss, macro-F1 and augmentation."""

import torch
import torch.nn.functional as F
from torchmetrics.classification import MulticlassF1Score, MulticlassHammingDistance
from torchvision.transforms import v2

CALLS = {"loss": 0, "augment": 0}


def focal(num_classes, class_weights=None, gamma=2.0):
    def loss(logits, targets):
        CALLS["loss"] += 1
        ce = F.cross_entropy(logits, targets, weight=class_weights, reduction="none")
        return ((1 - torch.exp(-ce)) ** gamma * ce).mean()

    return loss


def macro_f1(num_classes):
    return MulticlassF1Score(num_classes, average="macro")


def errors(num_classes):
    return MulticlassHammingDistance(num_classes)  # the share wrong: the lowest is best


class Counted(v2.Transform):
    def transform(self, inpt, params):
        CALLS["augment"] += 1
        return inpt


def augment(image_size):
    return v2.Compose(
        [
            v2.RandomResizedCrop(image_size, scale=(0.5, 1.0)),
            v2.RandomRotation(15),
            v2.ColorJitter(brightness=0.3, contrast=0.3),
            v2.RandomErasing(p=0.5, value=0),
            Counted(),
        ]
    )
'''
