"""What the train config makes of the loss, the val metrics and the augmentation: the built-in
ones by name, or the user's own `module:function`, imported as `model.name` is
(`pipeline.model.networks.user_function`) and checked once on the driver (`check_hooks`).

A checkpoint records only their names (its config): inference, serving and export rebuild the
network alone, and never import these.

    loss     module:function(num_classes=, class_weights=) -> callable (logits, targets) -> loss
    metrics  module:function(num_classes=) -> torchmetrics Metric, updated with (logits, targets)
    augment  module:function(image_size=) -> torchvision v2 transform of a uint8 (3, S, S) image
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable

import torch
from torchmetrics import Metric
from torchmetrics.classification import MulticlassAccuracy, MulticlassF1Score, MulticlassRecall

from pipeline.core.errors import ConfigError, InputError
from pipeline.data.dataset import Manifest
from pipeline.model.networks import user_function
from pipeline.train.config import TrainConfig
from pipeline.train.config_names import PER_CLASS, TOP_K, is_hook, metric_name

log = logging.getLogger(__name__)


def class_weights(cfg: TrainConfig, manifest: Manifest) -> torch.Tensor | None:
    """One weight per class (the manifest's order) for the loss, or None: `balanced` is
    rows / (classes * the class's rows) of the train split, so that each class weighs as much
    in the loss as the others, whatever its count."""
    classes, given = manifest.classes, cfg.class_weights
    if given is None:
        return None
    if given == "balanced":
        counts = manifest.splits["train"].counts
        rows = [counts.get(c, 0) for c in classes]
        if empty := [c for c, n in zip(classes, rows, strict=True) if n == 0]:
            raise InputError(
                f"class_weights=balanced: the train split has no rows of class {empty[0]} (or "
                "its manifest no counts): give one weight per class, or preprocess again"
            )
        return torch.tensor([sum(rows) / (len(classes) * n) for n in rows])
    if len(given) != len(classes):
        shown = ", ".join(classes[:5]) + (", ..." if len(classes) > 5 else "")
        raise ConfigError(
            f"class_weights has {len(given)} weights and the dataset {len(classes)} classes "
            f"({shown}): give one per class in that order, or balanced"
        )
    return torch.tensor(given, dtype=torch.float32)


def build_loss(cfg: TrainConfig, manifest: Manifest, device: torch.device) -> Callable:
    """The training loss, (logits, targets) -> scalar: cross-entropy with `class_weights` and
    label smoothing, or the user's. Targets are class indices (N,), or soft labels
    (N, classes) under MixUp or CutMix."""
    weights = class_weights(cfg, manifest)
    weights = weights.to(device) if weights is not None else None
    if cfg.loss is None:
        smoothing = cfg.optimizer.label_smoothing
        return torch.nn.CrossEntropyLoss(weight=weights, label_smoothing=smoothing).to(device)
    loss = _called(cfg.loss, "loss", num_classes=len(manifest.classes), class_weights=weights)
    if not callable(loss):
        raise ConfigError(
            f"loss={cfg.loss} returned {type(loss).__name__}, not a callable "
            "(logits, targets) -> loss: return a function or an nn.Module"
        )
    return loss.to(device) if isinstance(loss, torch.nn.Module) else loss


def build_metrics(cfg: TrainConfig, num_classes: int) -> dict[str, Metric]:
    """The `metrics` entries as torchmetrics Metrics, by the name each reports (val_<name>),
    each computed over all ranks (`synced`)."""
    return {metric_name(e): synced(m)[0] for e, m in _built(cfg, num_classes).items()}


def _built(cfg: TrainConfig, num_classes: int) -> dict[str, Metric]:
    # Each `metrics` entry and its Metric, as built or returned.
    out = {}
    for entry in cfg.metrics:
        if top := TOP_K.match(entry):
            k = int(top[1])
            if k > num_classes:
                raise ConfigError(
                    f"metrics: {entry} needs at least {k} classes, and the dataset has "
                    f"{num_classes}: use top<k>_accuracy with k <= {num_classes}"
                )
            metric = MulticlassAccuracy(num_classes, top_k=k, average="micro")
        elif entry == "macro_f1":
            metric = MulticlassF1Score(num_classes, average="macro")
        elif entry == PER_CLASS:
            metric = MulticlassRecall(num_classes, average="none")
        else:
            metric = _called(entry, "metrics", num_classes=num_classes)
            if not isinstance(metric, Metric):
                raise ConfigError(
                    f"metrics: {entry} returned {type(metric).__name__}, not a torchmetrics "
                    "Metric: return one (e.g. MulticlassF1Score(num_classes, average='macro'))"
                )
        out[entry] = metric
    return out


def synced(metric: Metric) -> tuple[Metric, bool]:
    """`metric`, and whether it was made to sync: every Metric in it (a wrapper's own too) sums
    its state over the ranks when computed, as `sync_on_compute=True` (torchmetrics' default)
    does; with False, each rank would score its own share of val alone."""
    changed = False
    for m in metric.modules():
        if isinstance(m, Metric) and not m.sync_on_compute:
            # _to_sync is what compute() reads; torchmetrics sets it from sync_on_compute.
            m.sync_on_compute = m._to_sync = True
            changed = True
    return metric, changed


def epoch_values(name: str, value: torch.Tensor, classes: list[str]) -> dict[str, float]:
    """A metric's computed value as the epoch's numbers: val_<name>, or one per class
    (val_<name>/<class>) for a value per class."""
    if value.numel() == 1:
        return {f"val_{name}": value.item()}
    if value.numel() != len(classes):
        raise ConfigError(
            f"metrics: val_{name} computed {tuple(value.shape)} values: a metric gives one "
            f"number, or one per class ({len(classes)})"
        )
    return {f"val_{name}/{_key(c)}": v for c, v in zip(classes, value.tolist(), strict=True)}


def _key(class_name: str) -> str:
    # MLflow takes letters, digits, _ - . / and spaces in a metric's name.
    return re.sub(r"[^\w\-. ]", "_", class_name)


def own_augment(name: str, *, image_size: int) -> Callable:
    """The user's `augment=module:function`, called with `image_size`."""
    transform = _called(name, "augment", image_size=image_size)
    if not callable(transform):
        raise ConfigError(
            f"augment={name} returned {type(transform).__name__}, not a transform: return a "
            "torchvision v2 transform (v2.Compose([...]))"
        )
    return transform


def _called(name: str, key: str, **kwargs):
    function = user_function(name, key)
    try:
        return function(**kwargs)
    except (ConfigError, InputError):
        raise
    except Exception as e:  # the user's own words
        args = ", ".join(f"{k}=" for k in kwargs)
        raise ConfigError(
            f"{key}: {name}({args}) failed: {type(e).__name__}: {str(e).rstrip('.')}. It is "
            f"called with the keyword arguments {args}"
        ) from None


def check_hooks(cfg: TrainConfig, manifest: Manifest) -> TrainConfig:
    """On the driver, before any worker starts: the loss on two images' logits, each metric
    on them, the augmentation on an image of the stored size. Returns `cfg` with
    checkpoint.mode resolved (the order of a val_<name> the checkpoints are ranked by), which
    the run records."""
    classes = len(manifest.classes)
    logits = torch.randn(2, classes, requires_grad=True)
    targets = torch.tensor([0, 1 % classes])
    loss = build_loss(cfg, manifest, torch.device("cpu"))
    if cfg.loss is not None:
        soft = cfg.mixup_alpha > 0 or cfg.cutmix_alpha > 0
        given = torch.nn.functional.one_hot(targets, classes).float() if soft else targets
        try:
            value = loss(logits, given)
        except Exception as e:
            raise ConfigError(
                f"loss={cfg.loss} fails on logits (2, {classes}) and targets "
                f"{'(2, classes) soft labels (mixup/cutmix)' if soft else '(2,) class indices'}:"
                f" {type(e).__name__}: {e}"
            ) from None
        if not isinstance(value, torch.Tensor) or value.ndim != 0 or not value.requires_grad:
            raise ConfigError(
                f"loss={cfg.loss} must return a scalar tensor that backpropagates to the logits "
                f"(reduced: a mean), and returned {_shape(value)}"
            )
    for entry, metric in _built(cfg, classes).items():
        check_metric(cfg, entry, metric, logits.detach(), targets, manifest.classes)
    if is_hook(cfg.augment):
        size = manifest.image_size
        image = torch.zeros(3, size, size, dtype=torch.uint8)
        try:
            out = own_augment(cfg.augment, image_size=size)(image)
        except ConfigError:
            raise
        except Exception as e:
            raise ConfigError(
                f"augment={cfg.augment} fails on a uint8 (3, {size}, {size}) image tensor: "
                f"{type(e).__name__}: {e}"
            ) from None
        if (
            not isinstance(out, torch.Tensor)
            or out.dtype != torch.uint8
            or out.shape != (3, size, size)
        ):
            raise ConfigError(
                f"augment={cfg.augment} must return uint8 (3, {size}, {size}) images (the "
                f"stored size; normalisation comes later, on the device), and returned "
                f"{_shape(out)}"
            )
    return cfg.with_checkpoint_mode(score_mode(cfg, classes))


def check_metric(
    cfg: TrainConfig,
    entry: str,
    metric: Metric,
    logits: torch.Tensor,
    targets: torch.Tensor,
    classes: list[str],
) -> None:
    """A `metrics` entry's Metric on the driver: it updates on (logits, targets) and computes
    one number or one per class, one number where checkpoint.metric ranks by it; one that
    would not sync over the ranks is made to (logged)."""
    name = metric_name(entry)
    if synced(metric)[1]:
        log.info(
            "metrics: %s's Metric has sync_on_compute=False: computing val_%s over all ranks "
            "(the whole val split), as every val score is",
            entry,
            name,
        )
    try:
        metric.update(logits, targets)
        value = metric.compute()
        if not isinstance(value, torch.Tensor):
            raise ConfigError(
                f"metrics: val_{name} computes {_shape(value)}: return a Metric that computes "
                f"one number, or one per class ({len(classes)})"
            )
        epoch_values(name, value, classes)
    except ConfigError:
        raise
    except Exception as e:
        raise ConfigError(
            f"metrics: val_{name} fails on update(logits (2, {len(classes)}), class indices "
            f"(2,)): {type(e).__name__}: {e}"
        ) from None
    if cfg.checkpoint.metric == f"val_{name}" and value.numel() != 1:
        raise ConfigError(
            f"checkpoint.metric=val_{name}: {entry}'s Metric computes one value per class "
            f"(val_{name}/<class>), and checkpoints are ranked by one number: rank by another "
            "metric, or compute one (e.g. average='macro')"
        )


def score_mode(cfg: TrainConfig, num_classes: int) -> str | None:
    """checkpoint.mode as the run records it: None for val_loss, val_accuracy and last (their
    own), max for the built-in metrics, a hook's Metric's `higher_is_better`."""
    c = cfg.checkpoint
    if not c.metric.startswith("val_") or c.metric in ("val_loss", "val_accuracy"):
        return None
    hook = cfg.ranked_by_hook()
    if hook is None:
        return "max"  # the built-in metrics: accuracies, F1
    higher = build_metrics(cfg, num_classes)[metric_name(hook)].higher_is_better
    own = None if higher is None else ("max" if higher else "min")
    if c.mode is not None and own is not None and c.mode != own:
        raise ConfigError(
            f"checkpoint.mode={c.mode}, and {hook}'s Metric says the "
            f"{'highest' if higher else 'lowest'} {c.metric} is best (higher_is_better="
            f"{higher}): leave checkpoint.mode out"
        )
    if own is None and c.mode is None:
        raise ConfigError(
            f"checkpoint.metric={c.metric}: {hook}'s Metric has higher_is_better=None: set "
            "checkpoint.mode=max or min"
        )
    return own or c.mode


def _shape(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {list(value.shape)}"
    return type(value).__name__
