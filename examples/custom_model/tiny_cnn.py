"""A network of your own for the train job: `model.name: examples.custom_model.tiny_cnn:build`.

The train job calls `build(num_classes=<the dataset's number of classes>, **model.kwargs)` on
every worker, and inference calls it again to rebuild the checkpoint's network: this file ships
with each job inside the bundle's working_dir (runtime_env.yaml), as the bundle's own code does.
"""

from __future__ import annotations

from torch import nn


def build(num_classes: int, *, width: int = 32, dropout: float = 0.1) -> nn.Module:
    """Three blocks of conv, batch norm, ReLU and 2x2 max pooling, then global average pooling
    and a linear head of `num_classes` outputs: any input size of 8 px or more."""
    layers: list[nn.Module] = []
    channels = 3
    for out in (width, 2 * width, 4 * width):
        layers += [
            nn.Conv2d(channels, out, kernel_size=3, padding=1, bias=False),
            nn.BatchNorm2d(out),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
        ]
        channels = out
    head = [
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Dropout(dropout),
        nn.Linear(channels, num_classes),
    ]
    return nn.Sequential(*layers, *head)
