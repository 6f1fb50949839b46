"""The optimisation state: the optimizer and its per-epoch learning-rate schedule, the grad
scaler, the EMA of the weights and the global generators, built fresh or restored on resume."""

from __future__ import annotations

import math

import torch

from pipeline.model.networks import unwrap
from pipeline.train.config import TrainConfig
from pipeline.train.ema import ModelEMA


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


def grad_scaler(device: torch.device, precision: str) -> torch.amp.GradScaler:
    """fp16's grad scaler; disabled in any other precision, where it passes losses and steps
    through: one code path for every precision."""
    return torch.amp.GradScaler(device.type, enabled=precision == "fp16")


def rng_state(device: torch.device) -> dict:
    """The global generators' states: what dropout draws from."""
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


class OptimState:
    """What optimises `model` beside its weights: the optimizer, its LR schedule, the grad
    scaler, the EMA of the weights (where the config keeps one) and the global generators. One
    `state_dict()` holds them all but the EMA's weights, which a checkpoint keeps as a model's
    (`ema_weights()`)."""

    def __init__(self, model: torch.nn.Module, cfg: TrainConfig, *, precision: str, device):
        self.model, self.cfg, self.device = model, cfg, device
        self.optimizer, self.scheduler = build_optimizer(model, cfg)
        self.scaler = grad_scaler(device, precision)
        e = cfg.ema
        bare = unwrap(model)
        self.ema = ModelEMA(bare, decay=e.decay, every_steps=e.every_steps) if e.enabled else None

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def start_epoch(self, epoch: int) -> None:
        if self.ema is not None:
            # During the LR warm-up the average follows the weights (ModelEMA.following).
            self.ema.following = epoch < self.cfg.optimizer.warmup_epochs

    def end_epoch(self) -> None:
        self.scheduler.step()

    def ema_weights(self) -> dict | None:
        return self.ema.module.state_dict() if self.ema is not None else None

    def state_dict(self) -> dict:
        state = {
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "rng": rng_state(self.device),
        }
        if self.ema is not None:
            state["ema"] = self.ema.state_dict()
        return state

    def load_state_dict(self, state: dict, *, ema_weights: dict | None = None) -> list[str]:
        """Restore what `state_dict()` saved (`ema_weights`: the EMA's weights, if the
        checkpoint has them), with this config's optimizer settings on top (restore_optimizer);
        returns what differs from the run that saved it, in words, for the log."""
        notes = []
        restore_optimizer(self.optimizer, self.scheduler, state, self.cfg)
        set_rng_state(state["rng"], self.device)
        if self.scaler.is_enabled() and not state["scaler"]:
            # precision=auto picks by hardware: a run trained in bf16 or fp32 (an A100, a CPU)
            # resumes in fp16 on an older GPU from a disabled scaler, whose state is empty. A new
            # scaler is sound, as at the start of every fp16 run: it finds its scale in the
            # first steps, skipping those whose gradients overflow. A disabled scaler here (fp16
            # resumed in another precision) ignores the state.
            notes.append(
                f"the checkpoint trained without fp16 (precision={self.cfg.precision} picked "
                "another on its hardware): fp16 here starts with a new grad scaler"
            )
        else:
            self.scaler.load_state_dict(state["scaler"])
        if self.ema is None:
            return notes
        if ema_weights is not None and "ema" in state:
            self.ema.load(ema_weights, state["ema"])
            notes.append(f"resumed the EMA of the weights ({self.ema.updates} updates)")
        else:
            # A run that turns the EMA on at a resume: it starts from the restored weights.
            self.ema.module.load_state_dict(unwrap(self.model).state_dict())
            notes.append(
                "the checkpoint has no EMA of the weights: a new one starts from this epoch"
            )
        return notes
