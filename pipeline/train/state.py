"""The run's whole state, as one object a checkpoint saves and a resume restores: the model, the
optimisation state, the loop's progress and the train loader's position."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipeline.model.networks import unwrap
from pipeline.train.input.loaders import EpochLoader
from pipeline.train.optim import OptimState
from pipeline.train.progress import LoopState


@dataclass
class State:
    """All a resume needs, as Composer's State holds it: the model (its bare weights go to
    model.pt), the optimisation state (the EMA's weights to model_ema.pt), the loop's progress
    and the train loader's position (train_state.pt, by their `state_dict()`s)."""

    model: torch.nn.Module
    optim: OptimState
    loop: LoopState
    loader: EpochLoader

    def start_epoch(self, epoch: int) -> None:
        """Epoch `epoch` starts, or goes on from the position a restore gave."""
        self.loader.set_epoch(epoch)
        self.loop.start_epoch(epoch, steps=len(self.loader))
        self.optim.start_epoch(epoch)

    def end_epoch(self, metrics: dict) -> None:
        self.loop.end_epoch(metrics)
        self.optim.end_epoch()

    def state_dict(self) -> dict:
        """train_state.pt's contents."""
        return {
            "optim": self.optim.state_dict(),
            "loop": self.loop.state_dict(),
            "loader": self.loader.state_dict(),
        }

    def files(self) -> tuple[dict, dict, dict | None]:
        """The weights, train_state.pt's contents and the EMA's weights, to save."""
        return unwrap(self.model).state_dict(), self.state_dict(), self.optim.ema_weights()

    def load_state_dict(self, state: dict, *, weights: dict, ema_weights: dict | None) -> list:
        """Restore from a checkpoint's files; returns what differs from the run that saved it,
        in words, for the log."""
        unwrap(self.model).load_state_dict(weights)  # first: a new EMA starts from them
        self.loop.load_state_dict(state["loop"])
        self.loader.load_state_dict(state["loader"])
        return self.optim.load_state_dict(state["optim"], ema_weights=ema_weights)
