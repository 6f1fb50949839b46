"""One checkpointer for the run's whole state (`State`: the model's weights, the optimisation
state, the loop's progress and the train loader's position), at the end of each epoch and inside
it, and one restore of it from the newest checkpoint of either kind.

An epoch's checkpoint is reported to Ray (`<run>/epoch_NNNN/`), which keeps the best.
Checkpoints inside an epoch, every `checkpoint.every_steps` steps and at a preemption notice, are
written beside them (`<run>/steps/`) and resumed from exactly their step. They are not reported
to Ray: its checkpoint manager ranks every reported checkpoint by the run's score (val loss,
...), which a checkpoint inside an epoch does not have. Rank 0 copies the state into host
memory, which is all the step loop waits for, and a thread writes it to storage while training
goes on (pipeline.train.saving). A restarted worker takes the newest whole one of the epoch it
starts at, if it is newer than Ray's latest checkpoint; they go once their epoch's own
checkpoint is on storage.
"""

from __future__ import annotations

import functools
import logging
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import ray.train
import torch

from pipeline.core import faults
from pipeline.core.errors import InputError
from pipeline.core.storage import Location
from pipeline.model.checkpoint import (
    EMA,
    CheckpointMeta,
    DamagedCheckpoint,
    ModelSpec,
    load_train_state,
    load_weights,
    read_meta,
    save_checkpoint,
)
from pipeline.model.networks import unwrap
from pipeline.model.resume import check_resumable
from pipeline.model.runs import (
    STEPS,
    checkpoint_dir_name,
    epoch_of,
    remove_partial_writes,
    run_checkpoints,
    step_checkpoints,
    step_dir_name,
)
from pipeline.train.epoch import all_reduce
from pipeline.train.input.loaders import EpochLoader
from pipeline.train.optim import OptimState
from pipeline.train.progress import LoopState
from pipeline.train.saving import Background, Snapshot, publish_checkpoint

if TYPE_CHECKING:
    from pipeline.train.telemetry import Telemetry
    from pipeline.train.worker import Worker

log = logging.getLogger(__name__)

KEEP = 2  # step checkpoints per epoch: the newest, and one more should the newest be unreadable


class StepWriter:
    """Rank 0's writer: the state copied in the step loop, written by a thread of its own, one
    checkpoint at a time."""

    def __init__(self, run_dir: Location, telemetry: Telemetry | None = None):
        self.run_dir, self.telemetry = run_dir, telemetry
        self.background = Background("step-checkpoint")
        self.snapshot = Snapshot()
        # The epochs whose own checkpoints are on storage, told by Ray's upload thread.
        self.lock = threading.Lock()
        self.done_epoch: int | None = None

    def save(self, epoch: int, step: int, state, write: Callable[[Path, object], None]) -> None:
        """Copy `state` now (after the checkpoint before it is written: its copy is reused);
        `write(directory, copy)` fills the checkpoint's directory in the background."""
        began = time.perf_counter()
        self.background.wait()
        copied = self.snapshot.take(state)
        if self.telemetry is not None:
            self.telemetry.held("step", time.perf_counter() - began)
        self.background.submit(lambda: self._publish(epoch, step, lambda d: write(d, copied)))

    def _publish(self, epoch: int, step: int, write: Callable[[Path], None]) -> None:
        began = time.perf_counter()
        target = self.run_dir.child(STEPS, step_dir_name(epoch, step))
        publish_checkpoint(target, write)
        log.info("checkpoint of epoch %d step %d saved: %s", epoch, step, target.uri)
        if self.telemetry is not None:
            took = time.perf_counter() - began
            self.telemetry.checkpointed("step", target.uri, epoch=epoch, step=step, upload_s=took)
        self.prune(keep=KEEP)

    def wait(self) -> None:
        """Until the checkpoint being written is on storage; its error, if it failed."""
        self.background.wait()

    def epoch_done(self, epoch: int) -> None:
        """Epoch `epoch`'s own checkpoint is on storage: its checkpoints inside it can go (and
        any of them written later, as they are written)."""
        with self.lock:
            self.done_epoch = max(epoch, self.done_epoch if self.done_epoch is not None else -1)
        self.prune()

    def on_storage(self, epoch: int) -> None:
        """A restored run's epochs up to `epoch` are done: their checkpoints inside them go with
        the next prune (not now: the other ranks may be reading the run's checkpoints)."""
        with self.lock:
            self.done_epoch = max(epoch, self.done_epoch if self.done_epoch is not None else -1)

    def prune(self, *, keep: int | None = None) -> None:
        """Remove the checkpoints of epochs whose epoch checkpoints are on storage, and with
        `keep`, all but the newest `keep` of each other epoch: an epoch whose own checkpoint is
        still being uploaded keeps its newest beside the next epoch's."""
        with self.lock:
            done_epoch = self.done_epoch
            found = step_checkpoints(self.run_dir)
            stale = [f for f in found if done_epoch is not None and f[0] <= done_epoch]
            if keep is not None:
                for epoch in {f[0] for f in found}:
                    of_epoch = [f for f in found if f[0] == epoch and f not in stale]
                    stale += of_epoch[: max(len(of_epoch) - keep, 0)]
            for *_, directory in stale:
                directory.delete()


# --- the run's state, and its one checkpointer -------------------------------------------------


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
        self.loop.start_epoch(epoch)
        self.loader.set_epoch(epoch)
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


class Checkpointer:
    """Saves `State` at each epoch's end (every rank reports the epoch's metrics; rank 0
    attaches the checkpoint, which Ray uploads with `checkpoint_upload_mode=ASYNC`) and inside
    epochs (`after_step`); restores it from the run's newest checkpoint (`restore`).

    The step loop only copies the state (pipeline.train.saving.Snapshot); a thread serializes
    the copy and writes it to the run directory, whole or without metadata.json. An epoch's
    checkpoint is queued for Ray's controller only once written: a worker killed mid-upload
    leaves nothing Ray records, and the next attempt resumes from Ray's latest checkpoint as
    before. One checkpoint of a kind is in flight at a time: the next one's copy waits for it."""

    def __init__(self, w: Worker):
        self.w = w
        self.every = w.cfg.checkpoint.every_steps
        self.writer = (
            StepWriter(w.run_dir, w.telemetry) if self.every is not None and w.rank == 0 else None
        )
        self.noticed = False  # a preemption notice came
        self.snapshot = Snapshot()
        self.uploaded = threading.Event()
        self.uploaded.set()
        self.state: State | None = None

    @functools.cached_property
    def stored(self) -> list[tuple[int, int | None, Location]]:
        """The run's whole checkpoints on storage (runs.run_checkpoints), listed once: as an
        attempt starts, no writer of the run is alive to add one."""
        return run_checkpoints(self.w.run_dir)

    def resuming(self) -> bool:
        """Whether the run has a checkpoint this attempt goes on from: its weights need not be
        fetched."""
        return next(self.candidates(), None) is not None

    def candidates(self) -> Iterator[Location]:
        """The run's whole checkpoints on storage that this attempt can go on from, newest
        first, whether Ray's record names them yet or not: epoch checkpoints, and checkpoints
        inside an epoch taken with this seed, global batch and dataset version (what the
        epoch's order is a function of). Read lazily: a restore reads the newest alone."""
        for _, step, where in self.stored:
            if step is None or self.fits(where):
                yield where

    def restore(self, state: State) -> None:
        """Load into `state` the run's newest checkpoint (`candidates`); one that is damaged
        gives way to the one before it, logged. With none, `state` stays as built. Ray's record
        is then brought in line with the epoch checkpoints on storage (`record_stored`), and
        `after_step` and `save_epoch` save the state from here on."""
        self.state = state
        if self.w.rank == 0:
            remove_partial_writes(self.w.run_dir)
        damaged: list[str] = []
        for where in self.candidates():
            try:
                meta = read_meta(where)
                self._load(where, meta)
            except DamagedCheckpoint as e:
                damaged.append(where.uri)
                if self.w.rank == 0:
                    log.warning("%s: resuming from the run's checkpoint before it", e)
                continue
            self.record_stored(resumed=meta)
            return
        if damaged:
            raise InputError(
                f"run {self.w.run_dir.uri} has checkpoints, and none of them reads "
                f"({', '.join(damaged)}): pass a new name= to train a new run, or remove the "
                "damaged ones once their damage is understood"
            )

    def fits(self, found: Location) -> bool:
        """Whether this attempt can go on from `found`, a checkpoint inside an epoch: taken with
        this seed and global batch on this dataset version. One that does not read fits: the
        restore that tries it says what is wrong with it."""
        w = self.w
        try:
            meta = read_meta(found)
        except DamagedCheckpoint:
            return True
        said = f"the checkpoint of epoch {meta.epoch} step {meta.step} was taken"
        for key in ("seed", "global_batch_size"):  # what the epoch's order is a function of
            if meta.config[key] != getattr(w.cfg, key):
                if w.rank == 0:
                    log.warning(
                        "%s with %s=%s, this attempt has %s=%s: it is passed over, and epoch %d "
                        "starts over from its start (the %s orders its rows)",
                        *(said, key, meta.config[key], key, getattr(w.cfg, key), meta.epoch, key),
                    )
                return False
        if meta.dataset_version != w.manifest.version:
            if w.rank == 0:
                log.warning(
                    "%s on dataset version %s, this attempt trains on version %s "
                    "(switch_dataset=true): it is passed over, and epoch %d starts over from its "
                    "start (its rows are another version's)",
                    *(said, meta.dataset_version, w.manifest.version, meta.epoch),
                )
            return False
        return True

    def record_stored(self, *, resumed: CheckpointMeta) -> None:
        """Report to Ray the epoch checkpoints on storage that its record lacks, up to the one
        `resumed` from (or the epoch before the one it is inside), oldest first, each with its
        own metrics: their uploads returned after the worker that wrote them was lost, or never
        did. Ray then ranks and keeps them as if recorded when written. Every rank reports each
        one, as `save_epoch` does; rank 0 names the checkpoint, which is already in place."""
        w = self.w
        done = resumed.epoch if resumed.step is None else resumed.epoch - 1
        recorded = ray.train.get_checkpoint()
        last = epoch_of(recorded.path) if recorded is not None else -1
        stored = [
            where for epoch, step, where in self.stored if step is None and last < epoch <= done
        ]
        for where in reversed(stored):
            metrics = read_meta(where).metrics
            if w.rank != 0:
                ray.train.report(metrics)
                continue
            log.info(
                "checkpoint %s is on storage and not in Ray's record (its upload did not "
                "return): recorded now",
                where.uri,
            )
            storage = ray.train.get_context().get_storage()
            path = storage.build_checkpoint_path_from_name(where.name)
            in_place = ray.train.Checkpoint(path, filesystem=storage.storage_filesystem)
            ray.train.report(
                metrics,
                checkpoint=ray.train.Checkpoint.from_directory(tempfile.mkdtemp(prefix="epoch-")),
                checkpoint_dir_name=where.name,
                checkpoint_upload_fn=lambda _c, _n, found=in_place: found,
                delete_local_checkpoint_after_upload=True,  # the (empty) directory given here
            )
        if self.writer is not None and done >= 0:
            self.writer.on_storage(done)

    def _load(self, where: Location, meta: CheckpointMeta, *, uri: str | None = None) -> None:
        w, uri = self.w, uri or where.uri
        check_resumable(meta, w.manifest, checkpoint=uri, dataset=w.dataset.uri)
        ema = load_weights(where, meta, EMA) if meta.ema_weights else None
        state = load_train_state(where)
        notes = self.state.load_state_dict(state, weights=load_weights(where), ema_weights=ema)
        if w.rank != 0:
            return
        if meta.step is not None:
            log.info(
                "resumed from checkpoint %s: epoch %d, continuing after its step %d",
                *(uri, meta.epoch, meta.step),
            )
        else:
            log.info(
                "resumed from checkpoint %s (epoch %d done): continuing at epoch %d of %d",
                *(uri, meta.epoch, meta.epoch + 1, w.cfg.epochs),
            )
            before = meta.metrics.get("workers")
            if before is not None and before != w.world:
                log.info(
                    "resumed with %s workers: %d, was %d; the global batch stays %d (%d per "
                    "worker), so the learning rate is unchanged",
                    *("fewer" if w.world < before else "more", w.world, before),
                    *(w.cfg.global_batch_size, w.cfg.batch_size_per_worker(w.world)),
                )
        for note in notes:
            log.info("%s", note)

    def after_step(self, step: int, totals: Callable[[], tuple[float, int]]) -> None:
        """After each step, on every rank (`totals()`: this attempt's loss and images of the
        epoch on this rank): a checkpoint every `every_steps` steps and at the first preemption
        notice. Every rank asks Ray for a notice the same number of times (the call is a
        barrier) and sums the epoch so far; rank 0 writes."""
        if self.every is None:
            return
        notice = ray.train.get_preemption_info()
        first_notice = notice is not None and not self.noticed
        self.noticed = self.noticed or notice is not None
        state, w = self.state, self.w
        # At the epoch's last step its own checkpoint follows.
        if not first_notice and (step % self.every or step == len(state.loader)):
            return
        loss_sum, images = all_reduce(list(totals()), device=w.device)
        state.loop.reached(step, loss_sum, images)
        if self.writer is None:
            return
        epoch = state.loop.epoch
        metrics = {"epoch": epoch, "step": step, "workers": w.world}
        meta = checkpoint_meta(w, metrics, history=state.loop.history, step=step)
        self.writer.save(
            epoch,
            step,
            state.files(),
            lambda d, copied: save_checkpoint(d, copied[0], meta, copied[1], ema=copied[2]),
        )
        if first_notice:
            self.writer.wait()  # on storage before the deadline
            log.warning(
                "preemption notice for ranks %s, deadline %s: saved a checkpoint at epoch %d "
                "step %d, training on until Ray stops the workers",
                *(notice.preempted_ranks, notice.deadline_ms, epoch, step),
            )
            faults.point(faults.PREEMPTION_CHECKPOINTED)
        elif faults.armed_at(faults.STEP_CHECKPOINTED):
            self.writer.wait()  # on storage before the fault test's kill
            faults.point(faults.STEP_CHECKPOINTED)

    def save_epoch(self, metrics: dict) -> None:
        """The checkpoint of the epoch `metrics["epoch"]` just ended (`State.end_epoch`), reported
        with its metrics."""
        w = self.w
        if w.rank != 0:
            ray.train.report(metrics)
            return
        epoch = metrics["epoch"]
        history = list(self.state.loop.history)
        meta = checkpoint_meta(w, metrics, history=history)
        began = time.perf_counter()
        self.uploaded.wait()
        self.uploaded.clear()
        copied = self.snapshot.take(self.state.files())
        storage = ray.train.get_context().get_storage()

        def upload(_: ray.train.Checkpoint, name: str) -> ray.train.Checkpoint:
            target, started = w.run_dir.child(name), time.perf_counter()
            publish_checkpoint(
                target, lambda d: save_checkpoint(d, copied[0], meta, copied[1], ema=copied[2])
            )
            log.info("checkpoint saved: %s", target.uri)
            if w.telemetry is not None:
                took = time.perf_counter() - started
                w.telemetry.checkpointed("epoch", target.uri, epoch=epoch, step=None, upload_s=took)
            faults.point(faults.CHECKPOINT_UPLOADED)
            if self.writer is not None:
                self.writer.epoch_done(epoch)
            if w.tracking is not None:
                # Once the checkpoint is on storage: with it, every epoch up to this one (those
                # an outage or a restart left out too), never one twice.
                w.tracking.log_epochs(history)
            # Only now may the copy be reused: Ray retries a failed upload (on the same copy),
            # then fails the worker, and the worker group is stopped with the loop waiting.
            self.uploaded.set()
            path = storage.build_checkpoint_path_from_name(name)
            return ray.train.Checkpoint(path, filesystem=storage.storage_filesystem)

        ray.train.report(
            metrics,
            checkpoint=ray.train.Checkpoint.from_directory(tempfile.mkdtemp(prefix="epoch-")),
            checkpoint_dir_name=checkpoint_dir_name(epoch),
            checkpoint_upload_mode=ray.train.CheckpointUploadMode.ASYNC,
            checkpoint_upload_fn=upload,
            delete_local_checkpoint_after_upload=True,  # the (empty) directory given here
        )
        if w.telemetry is not None:
            w.telemetry.held("epoch", time.perf_counter() - began)
        faults.point(faults.CHECKPOINT_REPORTED)

    def close(self) -> None:
        """Once the last epoch is saved: the last checkpoint inside an epoch on storage too (Ray
        waits for the epochs' uploads)."""
        if self.writer is not None:
            self.writer.wait()


def checkpoint_meta(
    w: Worker, metrics: dict, *, history: list[dict], step: int | None = None
) -> CheckpointMeta:
    """metadata.json of a checkpoint at the end of epoch `metrics["epoch"]`, or inside it after
    `step` steps."""
    m = w.cfg.model
    return CheckpointMeta(
        model=ModelSpec(name=m.name, kwargs=m.kwargs, bn_momentum=m.bn_momentum, bn_eps=m.bn_eps),
        epoch=metrics["epoch"],
        step=step,
        classes=w.manifest.classes,
        image_size=w.manifest.image_size,
        input_size=w.inputs.image_size,
        interpolation=w.inputs.interpolation,
        mean=w.inputs.mean,
        std=w.inputs.std,
        dataset_fingerprint=w.manifest.fingerprint,
        dataset_version=w.manifest.version,
        metrics=metrics,
        history=history,
        config=w.cfg.model_dump(mode="json"),
    )
