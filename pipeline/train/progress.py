"""The training loop's progress: the epoch in progress and its steps done, every finished
epoch's metrics, and what the epoch's steps so far added up to over all ranks; saved and
restored whole (`LoopState.state_dict`), beside the optimisation state and the loader's
position (pipeline.train.checkpointer)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

NOTHING_YET = {"loss_sum": 0.0, "images": 0, "seconds": 0.0}


@dataclass
class LoopState:
    """Where the loop is. `totals`: the loss summed over the images of the epoch's first `step`
    steps, those images, and the seconds they took, over all ranks."""

    epoch: int = 0  # the epoch in progress (or the next to start)
    step: int = 0  # its steps done
    history: list[dict] = field(default_factory=list)  # every finished epoch's metrics
    totals: dict = field(default_factory=lambda: dict(NOTHING_YET))
    # What this attempt found done of the epoch (a resume inside it), and when it went on.
    carried: dict = field(default_factory=lambda: dict(NOTHING_YET), repr=False)
    began: float = field(default=0.0, repr=False)

    def start_epoch(self, epoch: int) -> None:
        """Epoch `epoch` starts, or goes on where a restored state left it."""
        if epoch != self.epoch:
            self.epoch, self.step, self.totals = epoch, 0, dict(NOTHING_YET)
        self.carried, self.began = dict(self.totals), time.perf_counter()

    def reached(self, step: int, loss_sum: float, images: int) -> None:
        """After `step`: this attempt's steps of the epoch summed to `loss_sum` over `images`
        (over all ranks)."""
        self.step = step
        self.totals = {
            "loss_sum": self.carried["loss_sum"] + loss_sum,
            "images": self.carried["images"] + int(images),
            "seconds": self.carried["seconds"] + time.perf_counter() - self.began,
        }

    def end_epoch(self, metrics: dict) -> None:
        self.history.append(metrics)
        self.epoch, self.step, self.totals = self.epoch + 1, 0, dict(NOTHING_YET)

    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "step": self.step,
            "history": list(self.history),
            "totals": dict(self.totals),
        }

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.step = state["epoch"], state["step"]
        self.history, self.totals = list(state["history"]), dict(state["totals"])
