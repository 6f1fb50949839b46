"""An epoch of training, free of Ray: the step loop and exact evaluation. Each Ray Train worker
runs these per epoch (pipeline.train.worker); the benchmarks run them in one process, where Ray
may not be installed (bench.gpu_device, on a GPU machine). The loaders that feed them:
pipeline.train.input.loaders.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torchmetrics import Metric
from torchmetrics.classification import MulticlassAccuracy

from pipeline.model.device import DevicePolicy
from pipeline.model.networks import unwrap
from pipeline.train.ema import ModelEMA
from pipeline.train.hooks import epoch_values
from pipeline.train.optim import grad_scaler

log = logging.getLogger(__name__)


@dataclass
class StepRecipe:
    """What a training step does beyond forward, backward and step; all off by default."""

    # (images, labels, step) -> mixed images, soft labels (MixUp/CutMix); its draws are the
    # step's own, so that a resume inside an epoch draws what the uninterrupted epoch drew.
    mix: Callable | None = None
    micro_batch: int | None = None  # images per forward pass; the step accumulates them
    clip_grad_norm: float | None = None  # the gradients' total norm, at most
    ema: ModelEMA | None = None  # updated after each step


def train_one_epoch(
    model,
    loader,
    optimizer,
    criterion,
    *,
    policy: DevicePolicy,
    scaler: torch.amp.GradScaler | None = None,
    progress=None,
    recipe: StepRecipe | None = None,
    start: int = 0,
    after_step: Callable | None = None,
) -> dict:
    """One pass over this worker's shard, or its batches after the first `start` (a resume
    inside the epoch: the loader yields the rest); returns the summed loss, images, seconds and
    seconds waited for input of the batches it trained on. `progress(batches_done,
    images_done, waited_s)` is called after each batch (the images and seconds waited for input
    of this pass so far), `after_step(step, totals)` after each step,
    `totals()` giving the loss and images summed so far. With a mix, the loss is against the
    mixed (soft) labels. `scaler`: the run's grad scaler (None: a new one for `policy`'s
    precision)."""
    recipe = recipe or StepRecipe()
    scaler = scaler if scaler is not None else grad_scaler(policy.device, policy.precision)
    model.train()
    loss_sum = torch.zeros((), dtype=torch.float64, device=policy.device)
    images = 0
    began = time.perf_counter()
    batches = WaitTimed(loader)
    for i, (batch, labels) in enumerate(batches, start=start + 1):
        x, y = policy.inputs(batch), labels.to(policy.device, non_blocking=True)
        if recipe.mix is not None:
            x, y = recipe.mix(x, y, i)
        optimizer.zero_grad(set_to_none=True)
        loss = backward(
            model, x, y, criterion, policy=policy, scaler=scaler, micro_batch=recipe.micro_batch
        )
        if recipe.clip_grad_norm is not None:
            scaler.unscale_(optimizer)  # clip the true gradients, not fp16's scaled ones
            torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.clip_grad_norm)
        scaler.step(optimizer)
        scaler.update()
        if recipe.ema is not None:
            recipe.ema.step(unwrap(model))
        loss_sum += loss.double() * len(y)
        images += len(y)
        if progress is not None:
            progress(i, images, batches.waited_s)
        if after_step is not None:
            after_step(i, lambda total=loss_sum, n=images: (total.item(), n))
    return {
        "loss_sum": loss_sum.item(),
        "images": images,
        "seconds": time.perf_counter() - began,
        "input_wait_s": batches.waited_s,
    }


class WaitTimed:
    """`loader`'s batches, timing how long the step loop waits for each: the input's share of
    an epoch (on a GPU the loop runs ahead of the device, so a wait here is the input's)."""

    def __init__(self, loader):
        self.loader, self.waited_s = loader, 0.0

    def __iter__(self):
        batches = iter(self.loader)
        while True:
            asked = time.perf_counter()
            try:
                batch = next(batches)
            except StopIteration:
                return
            finally:
                self.waited_s += time.perf_counter() - asked
            yield batch


def backward(
    model,
    x,
    y,
    criterion,
    *,
    policy: DevicePolicy,
    scaler: torch.amp.GradScaler,
    micro_batch: int | None = None,
):
    """Gradients of the mean loss over the batch `x`, `y`, in micro-batches of `micro_batch`
    images (all at once without): each micro-batch's mean loss is weighted by its share of the
    batch, so the summed gradient is the whole batch's. Under DDP only the last micro-batch's
    backward all-reduces (`no_sync` on the others). Returns the batch's mean loss, detached."""
    size = micro_batch or len(y)
    chunks = list(zip(x.split(size), y.split(size), strict=True))
    total = torch.zeros((), device=policy.device)
    for j, (xc, yc) in enumerate(chunks, start=1):
        last = j == len(chunks)
        sync = (
            contextlib.nullcontext() if last or not hasattr(model, "no_sync") else model.no_sync()
        )
        with sync:
            with policy.autocast():
                loss = criterion(model(xc), yc) * (len(yc) / len(y))
            scaler.scale(loss).backward()
        total += loss.detach().float()
    return total


@torch.no_grad()
def evaluate(
    model,
    loader,
    *,
    policy: DevicePolicy,
    num_classes: int,
    ema=None,
    metrics: Callable[[], dict[str, Metric]] | None = None,
    classes: list[str] = (),
    on_batch: Callable[[], None] | None = None,
) -> dict:
    """Loss and accuracy over the samples of every rank, each counted once; with `metrics`
    (a new set of torchmetrics Metrics by name per call), each of them as val_<name> (one per
    class, val_<name>/<class>, for a value per class: `classes`); with `ema` (the averaged
    model) all of them for it too (`ema_val_loss`, `ema_val_accuracy`, ...), from the same
    pass over the batches. `on_batch()` is called after each batch.

    `model` must be the bare model: DDP's forward would sync buffers, and ranks may hold
    different numbers of val batches (no padding, so that the scores are exact: each Metric
    sums its state over the ranks at `compute`)."""
    models = {"": model} | ({"ema_": ema} if ema is not None else {})
    accuracy, loss_sum, others = {}, {}, {}
    for prefix, m in models.items():
        m.eval()
        metric = MulticlassAccuracy(num_classes, average="micro", sync_on_compute=True)
        accuracy[prefix] = metric.to(policy.device)
        loss_sum[prefix] = torch.zeros((), dtype=torch.float64, device=policy.device)
        own = metrics() if metrics is not None else {}
        others[prefix] = {name: o.to(policy.device) for name, o in own.items()}
    count = 0
    for batch, labels in loader:
        x, y = policy.inputs(batch), labels.to(policy.device, non_blocking=True)
        for prefix, m in models.items():
            with policy.autocast():
                logits = m(x).float()
            loss_sum[prefix] += F.cross_entropy(logits, y, reduction="sum").double()
            accuracy[prefix].update(logits.argmax(dim=1), y)
            for other in others[prefix].values():
                other.update(logits, y)
        count += len(y)
        if on_batch is not None:
            on_batch()
    total, *losses = all_reduce(
        [count, *(s.item() for s in loss_sum.values())], device=policy.device
    )
    out = {"val_images": total}
    for prefix, loss in zip(models, losses, strict=True):
        out[f"{prefix}val_loss"] = loss / max(total, 1)
        out[f"{prefix}val_accuracy"] = accuracy[prefix].compute().item()
        for name, other in others[prefix].items():
            values = epoch_values(name, other.compute().detach().cpu(), list(classes))
            out |= {prefix + key: value for key, value in values.items()}
    return out


def all_reduce(values: list[float], *, device: torch.device, op=None) -> list[float]:
    """Sum (or `op`) of `values` over all ranks; the values themselves outside a process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op or dist.ReduceOp.SUM)
    return t.tolist()


def broadcast_buffers(model: torch.nn.Module) -> None:
    """Give every rank rank 0's buffers (BatchNorm running stats).

    DDP broadcasts them at the start of each training forward, but each rank's last forward
    then updates its own copy: without this, the ranks would evaluate slightly different
    models, none of them exactly the one rank 0 checkpoints."""
    if dist.is_available() and dist.is_initialized():
        for buffer in model.buffers():
            dist.broadcast(buffer, src=0)
