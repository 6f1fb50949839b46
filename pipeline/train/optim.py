"""The optimizer and its per-epoch learning-rate schedule, built fresh or restored on resume."""

from __future__ import annotations

import math

import torch

from pipeline.train.config import TrainConfig


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig):
    """Optimizer and a per-epoch LR schedule (linear warm-up, then cosine or constant)."""
    o = cfg.optimizer
    if o.name == "sgd":
        opt = torch.optim.SGD(
            model.parameters(),
            lr=o.lr,
            momentum=o.momentum,
            weight_decay=o.weight_decay,
            nesterov=o.momentum > 0,
        )
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=o.lr, weight_decay=o.weight_decay)
    warmup, rest = o.warmup_epochs, max(cfg.epochs - o.warmup_epochs, 1)

    def factor(epoch: int) -> float:
        if epoch < warmup:
            return (epoch + 1) / (warmup + 1)
        if o.schedule == "constant":
            return 1.0
        return 0.5 * (1 + math.cos(math.pi * (epoch - warmup) / rest))

    return opt, torch.optim.lr_scheduler.LambdaLR(opt, factor)


def restore_optimizer(optimizer, scheduler, train_state: dict, cfg: TrainConfig) -> None:
    """The checkpoint's optimizer and schedule state (momentum, Adam moments, epochs done), with
    this config's settings on top: a resume with a new learning rate, weight decay or momentum
    trains with them. The schedule is a function of the epoch and `cfg.epochs`, so a resume
    with more epochs continues from this epoch along the curve for the new length."""
    optimizer.load_state_dict(train_state["optimizer"])
    scheduler.load_state_dict(train_state["scheduler"])  # its lambda stays this config's
    o = cfg.optimizer
    scheduler.base_lrs = [o.lr] * len(optimizer.param_groups)
    factor = scheduler.lr_lambdas[0](scheduler.last_epoch)
    for group in optimizer.param_groups:
        group.update(initial_lr=o.lr, lr=o.lr * factor, weight_decay=o.weight_decay)
        if "momentum" in group:
            group["momentum"] = o.momentum
