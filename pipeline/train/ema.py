"""An exponential moving average (EMA) of the weights, as torchvision's classification
references keep one (`--model-ema`): updated every `every_steps` optimizer steps, evaluated each
epoch beside the raw weights, checkpointed beside them, restored on resume."""

from __future__ import annotations

import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn


class ModelEMA:
    """The EMA of `model` (the bare model, on its device): parameters and buffers (BatchNorm's
    running statistics) alike, so that it evaluates as a model of its own."""

    def __init__(self, model: torch.nn.Module, *, decay: float, every_steps: int):
        self.averaged = AveragedModel(
            model, multi_avg_fn=get_ema_multi_avg_fn(decay), use_buffers=True
        )
        self.every_steps = every_steps
        self.steps = 0  # optimizer steps seen, over the whole run
        # During the LR warm-up the weights move fast and the average would hold the early
        # ones: it follows the weights instead, as torchvision's references do.
        self.following = False

    @property
    def module(self) -> torch.nn.Module:
        """The averaged model, a bare one: evaluate it, save its state_dict."""
        return self.averaged.module

    @property
    def updates(self) -> int:
        """Updates averaged since the last copy of the weights."""
        return int(self.averaged.n_averaged)

    def step(self, model: torch.nn.Module) -> None:
        """After each optimizer step of `model` (the bare model)."""
        self.steps += 1
        if self.steps % self.every_steps:
            return
        if self.following:
            self.averaged.n_averaged.fill_(0)  # an update with none before copies the weights
        self.averaged.update_parameters(model)

    def state_dict(self) -> dict:
        """What a resume needs beside the averaged weights (saved as a model's)."""
        return {"n_averaged": self.updates, "steps": self.steps}

    def load(self, weights: dict, state: dict) -> None:
        """Restore from a checkpoint: its EMA weights and `state_dict()`."""
        self.module.load_state_dict(weights)
        self.averaged.n_averaged.fill_(state["n_averaged"])
        self.steps = state["steps"]
