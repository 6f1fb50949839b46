"""The training loop's progress: its position (the epoch in progress, its steps done, the steps
since the run began), every finished epoch's metrics, and what the epoch's steps so far added
up to over all ranks; saved and restored whole (`LoopState.state_dict`), beside the
optimisation state and the loader's position (pipeline.train.state). The loop moves it; the
telemetry and the checkpointer read it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

NOTHING_YET = {"loss_sum": 0.0, "images": 0, "seconds": 0.0}


@dataclass
class LoopState:
    """Where the loop is. `totals`: the loss summed over the images of the epoch's steps up to
    the last checkpoint inside it, those images, and the seconds they took, over all ranks."""

    epoch: int = 0  # the epoch in progress (or the next to start)
    step: int = 0  # its steps done
    steps: int = 0  # its steps in all
    global_step: int | None = 0  # the steps done since the run began; None: not yet known
    history: list[dict] = field(default_factory=list)  # every finished epoch's metrics
    totals: dict = field(default_factory=lambda: dict(NOTHING_YET))
    # What this attempt found done of the epoch (a resume inside it), and when it went on.
    carried: dict = field(default_factory=lambda: dict(NOTHING_YET), repr=False)
    began: float = field(default=0.0, repr=False)

    def start_epoch(self, epoch: int, steps: int) -> None:
        """Epoch `epoch`, of `steps` steps, starts, or goes on where a restored state left it."""
        if epoch != self.epoch:
            self.epoch, self.step, self.totals = epoch, 0, dict(NOTHING_YET)
        self.steps = steps
        if self.global_step is None:  # a checkpoint from before it was kept: every epoch alike
            self.global_step = epoch * steps + self.step
        self.carried, self.began = dict(self.totals), time.perf_counter()

    def advance(self, step: int) -> None:
        """Step `step` of the epoch is done."""
        self.global_step += step - self.step
        self.step = step

    def reached(self, step: int, loss_sum: float, images: int) -> None:
        """At `step`, a checkpoint inside the epoch: this attempt's steps of the epoch summed to
        `loss_sum` over `images` (over all ranks)."""
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
            "global_step": self.global_step,
            "history": list(self.history),
            "totals": dict(self.totals),
        }

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.step = state["epoch"], state["step"]
        self.global_step = state.get("global_step")
        self.history, self.totals = list(state["history"]), dict(state["totals"])
