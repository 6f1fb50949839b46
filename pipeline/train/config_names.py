"""What the train config's settings may name: the user's own code (module:function), the
metrics by name, the scores that rank checkpoints, the augmentations; and the checks of the
fields that name them."""

from __future__ import annotations

import re
from typing import Any

# The user's own code, as model.name names it: module:function, the module a .py file that ships
# with the job (dots for folders).
HOOK = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


# The metrics by name: top-k accuracy (top3_accuracy), macro F1, and each class's recall.
TOP_K = re.compile(r"^top([1-9]\d*)_accuracy$")


NAMED_METRICS = ("macro_f1", "per_class_recall")


PER_CLASS = "per_class_recall"  # a value per class: no score to rank checkpoints by


PER_CLASS_NAME = "recall"  # what per_class_recall reports as: val_recall/<class>


# The job's own val_images, val_loss and val_accuracy: no `metrics` entry reports as these.
RESERVED_NAMES = ("images", "loss", "accuracy")


# checkpoint.metric's own choices, beside val_<name> of a `metrics` entry.
FIXED_SCORES = ("val_loss", "val_accuracy", "last")

AUGMENTS = ("random_resized_crop", "crop_flip", "none")


def is_hook(name: str) -> bool:
    """Whether a setting names the user's own module:function."""
    return bool(HOOK.match(name))


def metric_name(entry: str) -> str:
    """The name a `metrics` entry reports under (val_<name>): its own, a hook's function, or
    recall for per_class_recall."""
    if entry == PER_CLASS:
        return PER_CLASS_NAME
    return entry.partition(":")[2] if is_hook(entry) else entry


def check_loss(value: str | None) -> str | None:
    """`loss`: module:function, or null for cross-entropy."""
    if value is not None and not is_hook(value):
        raise ValueError(
            "not module:function: give your module and its function, e.g. my_loss:focal (or "
            "null for cross-entropy)"
        )
    return value


def check_augment(value: str) -> str:
    """`augment`: a built-in augmentation, or module:function."""
    if value in AUGMENTS or is_hook(value):
        return value
    raise ValueError(
        f"use {', '.join(AUGMENTS)}, or module:function returning a torchvision v2 transform "
        "(e.g. my_augment:build)"
    )


def check_metric(value: str) -> str:
    """A `metrics` entry: top<k>_accuracy, a named metric, or module:function."""
    if TOP_K.match(value) or value in NAMED_METRICS or is_hook(value):
        return value
    raise ValueError(
        f"unknown metric {value!r}: use top<k>_accuracy (top3_accuracy), macro_f1, "
        "per_class_recall, or module:function returning a torchmetrics Metric (my_metrics:f1)"
    )


def check_class_weights(value: Any) -> Any:
    """`class_weights`: balanced, one weight > 0 per class, or null."""
    if value is None or value == "balanced":
        return value
    if (
        isinstance(value, list | tuple)
        and value
        and all(isinstance(w, int | float) and not isinstance(w, bool) and w > 0 for w in value)
    ):
        return [float(w) for w in value]
    raise ValueError("give balanced (from the train split's counts) or one weight > 0 per class")
