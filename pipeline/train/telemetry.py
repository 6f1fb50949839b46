"""What a training run tells while it runs: each rank's pace (images/s, input wait, step time)
as Ray metrics, and rank 0's progress, ETA, checkpoints, val scores and cost as Ray metrics, in
its progress lines and in the run's progress.json, which `status` reads (docs/metrics.md).

`Pace` and `eta_s` are plain arithmetic; `Telemetry` is one rank's, fed by the training loop;
where the loop is (epoch, step, history) it reads from the loop's own LoopState.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections import deque
from dataclasses import dataclass, field

from pipeline.core.metrics import TRAIN, Gauges
from pipeline.core.progress import ProgressWriter, duration_text
from pipeline.core.storage import Location
from pipeline.model.checkpoint import config_score
from pipeline.train import stall
from pipeline.train.config import TrainConfig
from pipeline.train.progress import LoopState

log = logging.getLogger(__name__)

# Steps the pace is taken over: recent enough to follow a change (a node lost, a slower
# input), long enough to smooth out a step that waited on a checkpoint.
WINDOW = 64
# The most seconds between two writes of progress.json (fewer with log_every_s).
STATUS_EVERY_S = 10.0
# Before an epoch has been evaluated in this attempt: an image of evaluation (forward only)
# taken to cost this share of a training image (forward and backward).
EVAL_SHARE = 1 / 3


class Pace:
    """The recent steps of one rank: their wall time (input waits included), waits and
    images."""

    def __init__(self, window: int = WINDOW):
        self.steps: deque[tuple[float, float, int]] = deque(maxlen=window)

    def add(self, seconds: float, waited_s: float, images: int) -> None:
        self.steps.append((seconds, waited_s, images))

    def __bool__(self) -> bool:
        return bool(self.steps)

    @property
    def step_s(self) -> float:
        """Mean step time: what the steps left will take, each."""
        return sum(s for s, _, _ in self.steps) / len(self.steps)

    @property
    def median_step_s(self) -> float:
        return statistics.median(s for s, _, _ in self.steps)

    @property
    def images_per_s(self) -> float:
        return sum(n for *_, n in self.steps) / max(sum(s for s, _, _ in self.steps), 1e-9)

    @property
    def wait_share(self) -> float:
        return sum(w for _, w, _ in self.steps) / max(sum(s for s, _, _ in self.steps), 1e-9)


@dataclass
class EpochCost:
    """What an epoch other than its steps takes: evaluation, and the rest (the checkpoint's
    hold, the loader's start), measured on the last epoch of this attempt; and the mean wall
    time, start to start, of the epochs that ran whole in this attempt."""

    eval_s: float | None = None
    other_s: float = 0.0
    epochs_s: list[float] = field(default_factory=list)

    @property
    def epoch_s(self) -> float | None:
        return sum(self.epochs_s) / len(self.epochs_s) if self.epochs_s else None


def eta_s(
    *,
    epoch: int,
    epochs: int,
    step: int,
    steps: int,
    step_s: float,
    cost: EpochCost,
    eval_estimate_s: float,
) -> float:
    """Seconds a run at `step` of `steps` in epoch `epoch` (0-based) of `epochs` has left, at
    `step_s` a step: the epoch's steps left, its evaluation and the rest, then for each epoch
    after it the mean wall time of the whole epochs (or its steps, evaluation and the rest, until
    one is measured). `eval_estimate_s`: an evaluation's, until one is measured."""
    per_eval = cost.eval_s if cost.eval_s is not None else eval_estimate_s
    tail = per_eval + cost.other_s
    later = epochs - epoch - 1
    per_epoch = cost.epoch_s if cost.epoch_s is not None else steps * step_s + tail
    return max(steps - step, 0) * step_s + tail + later * per_epoch


def worker_hours(seconds: float, workers: int) -> float:
    return workers * seconds / 3600


class Telemetry:
    """One rank's. Every rank publishes its pace; rank 0 the run's progress, ETA, checkpoints,
    scores and cost, its progress lines every log_every_s, and progress.json."""

    def __init__(
        self,
        cfg: TrainConfig,
        *,
        rank: int,
        world: int,
        run_dir: Location,
        job_id: str,
        gpus_per_worker: int,
        rows: dict[str, int],
    ):
        self.cfg, self.rank, self.world, self.run_dir = cfg, rank, world, run_dir
        self.job_id, self.gpus = job_id, gpus_per_worker
        self.rows = rows  # the train and val split's images
        self.score = config_score(cfg.model_dump())
        self.gauges = Gauges(TRAIN, {"run": cfg.name, "job_id": job_id})
        self.status = ProgressWriter(run_dir) if rank == 0 else None
        self.pace = Pace()
        self.cost = EpochCost()
        self.loop = LoopState()  # the loop's position and history, once it starts an epoch
        self.state = "starting"
        self.whole = False  # whether the epoch in progress started at its first step here
        self.checkpoint: dict | None = None
        self.last = self.epoch_began = self.logged = self.written = time.perf_counter()
        self.waited, self.images = 0.0, 0  # this attempt's of the epoch so far
        self.eval_began: float | None = None
        self.started_at = time.time()

    # -- fed by the training loop ---------------------------------------------------------------

    def start_epoch(self, loop: LoopState) -> None:
        """The loop's epoch starts, or goes on after the steps a resume found done; `loop`: its
        position and history, read as they move."""
        now = time.perf_counter()
        if self.state != "starting" and self.whole:  # the last epoch ran whole in this attempt
            self.cost.epochs_s.append(now - self.epoch_began)
        self.whole = loop.step == 0
        self.loop = loop
        self.last = self.epoch_began = self.logged = now
        self.waited, self.images, self.state = 0.0, 0, "training"
        self._publish_progress()

    def stepped(self, images: int, waited_s: float) -> None:
        """After each step (the loop's position moved on); `images` and `waited_s` this
        attempt's of the epoch so far on this rank."""
        now = time.perf_counter()
        seconds, self.last = now - self.last, now
        self.pace.add(seconds, waited_s - self.waited, images - self.images)
        self.waited, self.images = waited_s, images
        rank = str(self.rank)
        self.gauges.set("cv_train_images_per_second", self.pace.images_per_s, rank=rank)
        self.gauges.set("cv_train_input_wait_share", self.pace.wait_share, rank=rank)
        self.gauges.set("cv_train_step_seconds", self.pace.median_step_s, rank=rank)
        if self.rank != 0:
            return
        self._publish_progress()
        loop = self.loop
        if now - self.logged >= self.cfg.log_every_s and loop.step < loop.steps:
            self.logged = now
            log.info(
                "epoch %d/%d: batch %d/%d, %.1f images/s on this worker, %.0f%% waiting for "
                "input, ETA %s",
                *(loop.epoch, self.cfg.epochs - 1, loop.step, loop.steps, self.pace.images_per_s),
                100 * self.pace.wait_share,
                duration_text(self.eta_s()),
            )

    def evaluating(self) -> None:
        self.eval_began, self.state = time.perf_counter(), "evaluating"
        self._publish_progress(force=True)

    def val_batch(self) -> None:
        """After each val batch: progress, for the stall watch."""
        stall.progressed("val_batch")

    def evaluated(self) -> None:
        if self.eval_began is not None:
            self.cost.eval_s = time.perf_counter() - self.eval_began
        self.state = "checkpointing"

    def held(self, kind: str, seconds: float) -> None:
        """A checkpoint (`kind` epoch or step) held the training loop `seconds`: copying the
        state, after waiting for the one before it to be written."""
        self.gauges.set("cv_train_checkpoint_hold_seconds", seconds, kind=kind)

    def checkpointed(
        self, kind: str, uri: str, *, epoch: int, step: int | None, upload_s: float
    ) -> None:
        """A checkpoint is on storage at `uri`, written in `upload_s`. Rank 0's, called from
        the thread that wrote it."""
        self.gauges.set("cv_train_checkpoint_upload_seconds", upload_s, kind=kind)
        self.checkpoint = {
            "uri": uri,
            "kind": kind,
            "epoch": epoch,
            "step": step,
            "at": time.time(),
            "upload_s": round(upload_s, 3),
        }
        if self.state == "finished":  # the last epoch's, written after the loop ended
            self._publish_progress(force=True)
            self.status.flush()

    def end_epoch(self, metrics: dict, carried_s: float) -> dict:
        """The epoch's cost, to add to its `metrics` (every rank computes the same): its
        worker-hours (and GPU-hours, and cost at a price) over all workers, `carried_s` of it
        spent by an earlier attempt."""
        took = time.perf_counter() - self.epoch_began
        if self.cost.eval_s is not None:
            self.cost.other_s = max(took - metrics.get("train_s", 0.0) - self.cost.eval_s, 0.0)
        hours = worker_hours(took + carried_s, self.world)
        cost = {"worker_hours": hours, "gpu_hours": hours * self.gpus}
        price = self.cfg.cost.price_per_worker_hour
        if price is not None:
            cost["cost"] = hours * price
        return cost

    def ended_epoch(self, metrics: dict) -> None:
        """Epoch `metrics` (with its cost) is in the loop's history now (LoopState.end_epoch):
        its scores and the run's cost so far are published."""
        if self.rank != 0:
            return
        for key, value in metrics.items():
            if key.startswith(("val_", "ema_val_")) and "/" not in key and key != "val_images":
                self.gauges.set("cv_train_val", value, metric=key)
        for key in ("worker_hours", "gpu_hours", "cost"):
            self.gauges.set(f"cv_train_{key}", _sum(self.loop.history, key))
        self._publish_progress(force=True)

    def close(self, state: str) -> None:
        """The loop has ended (`state`: finished); rank 0 writes its last progress."""
        self.state = state
        if self.status is not None:
            self._publish_progress(force=True)
            self.status.flush()
        self.gauges.close()

    # -- what it tells ---------------------------------------------------------------------------

    def eta_s(self) -> float | None:
        loop = self.loop
        if not self.pace or not loop.steps:
            return None
        if loop.epoch >= self.cfg.epochs:
            return 0.0
        train, val = self.rows.get("train", 0), self.rows.get("val", 0)
        estimate = val / max(train, 1) * loop.steps * self.pace.step_s * EVAL_SHARE
        left = eta_s(
            epoch=loop.epoch,
            epochs=self.cfg.epochs,
            step=loop.step,
            steps=loop.steps,
            step_s=self.pace.step_s,
            cost=self.cost,
            eval_estimate_s=estimate,
        )
        if self.state == "evaluating" and self.eval_began is not None and loop.step >= loop.steps:
            left -= min(time.perf_counter() - self.eval_began, self.cost.eval_s or estimate)
        return max(left, 0.0)

    def progress(self) -> float:
        loop = self.loop
        total = self.cfg.epochs * max(loop.steps, 1)
        done = min(loop.epoch, self.cfg.epochs) * max(loop.steps, 1) + loop.step
        return min(done / total, 1.0)

    def record(self) -> dict:
        """Rank 0's progress record (progress.json)."""
        loop, history = self.loop, self.loop.history
        best = _best(history, self.score)
        pace = self.pace
        return {
            "kind": "train",
            "run": self.run_dir.uri,
            "name": self.cfg.name,
            "job_id": self.job_id,
            "state": self.state,
            "epoch": min(loop.epoch, self.cfg.epochs - 1),
            "epochs": self.cfg.epochs,
            "step": loop.step if loop.epoch < self.cfg.epochs else loop.steps,
            "steps": loop.steps,
            "progress": round(self.progress(), 4),
            "workers": self.world,
            # All workers' together: each takes the same share of every step.
            "images_per_s": round(pace.images_per_s * self.world, 2) if pace else None,
            "input_wait_share": round(pace.wait_share, 4) if pace else None,
            "step_s": round(pace.median_step_s, 4) if pace else None,
            "eta_s": None if (eta := self.eta_s()) is None else round(eta, 1),
            "last_checkpoint": self.checkpoint,
            "best": best,
            "worker_hours": _sum(history, "worker_hours"),
            "gpu_hours": _sum(history, "gpu_hours"),
            "cost": _sum(history, "cost") if self.cfg.cost.price_per_worker_hour else None,
            "currency": self.cfg.cost.currency,
            "started_at": self.started_at,
        }

    def _publish_progress(self, *, force: bool = False) -> None:
        if self.rank != 0:
            return
        g, loop = self.gauges, self.loop
        g.set("cv_train_epoch", min(loop.epoch, self.cfg.epochs - 1))
        g.set("cv_train_epochs", self.cfg.epochs)
        g.set("cv_train_step", loop.step)
        g.set("cv_train_steps", loop.steps)
        g.set("cv_train_progress", self.progress())
        g.set("cv_train_eta_seconds", self.eta_s())
        now = time.perf_counter()
        every = min(STATUS_EVERY_S, self.cfg.log_every_s)
        if self.status is not None and (force or now - self.written >= every):
            self.written = now
            self.status.put(self.record())


def _sum(history: list[dict], key: str) -> float | None:
    values = [h[key] for h in history if h.get(key) is not None]
    return round(sum(values), 6) if values else None


def _best(history: list[dict], score) -> dict | None:
    """The best epoch so far by the run's checkpoint score."""
    scored = [h for h in history if isinstance(h.get(score.key), int | float)]
    if not scored:
        return None
    pick = min if score.mode == "min" else max
    best = pick(scored, key=lambda h: h[score.key])
    return {"metric": score.key, "value": best[score.key], "epoch": best["epoch"]}
