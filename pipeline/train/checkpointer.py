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
import threading
import time
from collections.abc import Callable, Iterator

from pipeline.core import faults
from pipeline.core.errors import InputError
from pipeline.core.storage import Location
from pipeline.core.tracking import EpochSink
from pipeline.model.checkpoint import (
    EMA,
    CheckpointMeta,
    DamagedCheckpoint,
    ModelSpec,
    checkpoint_meta,
    load_train_state,
    load_weights,
    read_meta,
    save_checkpoint,
)
from pipeline.model.resume import check_resumable
from pipeline.model.runs import (
    checkpoint_dir_name,
    epoch_of,
    remove_partial_writes,
    run_checkpoints,
)
from pipeline.train.context import RunContext
from pipeline.train.epoch import all_reduce
from pipeline.train.run import TrainRun
from pipeline.train.saving import Snapshot, StepWriter, publish_checkpoint
from pipeline.train.state import State
from pipeline.train.telemetry import Telemetry

log = logging.getLogger(__name__)


class Checkpointer:
    """Saves `State` at each epoch's end (every rank reports the epoch's metrics; rank 0
    attaches the checkpoint, which Ray uploads with `checkpoint_upload_mode=ASYNC`) and inside
    epochs (`after_step`); restores it from the run's newest checkpoint (`restore`).

    The step loop only copies the state (pipeline.train.saving.Snapshot); a thread serializes
    the copy and writes it to the run directory, whole or without metadata.json. An epoch's
    checkpoint is queued for Ray's controller only once written: a worker killed mid-upload
    leaves nothing Ray records, and the next attempt resumes from Ray's latest checkpoint as
    before. One checkpoint of a kind is in flight at a time: the next one's copy waits for it."""

    def __init__(
        self,
        run: TrainRun,
        context: RunContext,
        *,
        telemetry: Telemetry | None = None,
        tracking: EpochSink | None = None,
    ):
        self.run, self.context = run, context
        self.recorded = recorded(run)  # what each of its checkpoints records of the run
        self.telemetry, self.tracking = telemetry, tracking  # rank 0's, told of each checkpoint
        self.every = run.cfg.checkpoint.every_steps
        rank0 = context.rank == 0
        self.writer = StepWriter(run.run_dir, telemetry) if self.every and rank0 else None
        self.noticed = False  # a preemption notice came
        self.snapshot = Snapshot()
        self.uploaded = threading.Event()
        self.uploaded.set()
        self.state: State | None = None

    @functools.cached_property
    def stored(self) -> list[tuple[int, int | None, Location]]:
        """The run's whole checkpoints on storage (runs.run_checkpoints), listed once: as an
        attempt starts, no writer of the run is alive to add one."""
        return run_checkpoints(self.run.run_dir)

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
        if self.context.rank == 0:
            remove_partial_writes(self.run.run_dir)
        damaged: list[str] = []
        for where in self.candidates():
            try:
                meta = read_meta(where)
                self._load(where, meta)
            except DamagedCheckpoint as e:
                damaged.append(where.uri)
                if self.context.rank == 0:
                    log.warning("%s: resuming from the run's checkpoint before it", e)
                continue
            self.record_stored(resumed=meta)
            return
        if damaged:
            raise InputError(
                f"run {self.run.run_dir.uri} has checkpoints, and none of them reads "
                f"({', '.join(damaged)}): pass a new name= to train a new run, or remove the "
                "damaged ones once their damage is understood"
            )

    def fits(self, found: Location) -> bool:
        """Whether this attempt can go on from `found`, a checkpoint inside an epoch: taken with
        this seed and global batch on this dataset version. One that does not read fits: the
        restore that tries it says what is wrong with it."""
        cfg, rank0 = self.run.cfg, self.context.rank == 0
        try:
            meta = read_meta(found)
        except DamagedCheckpoint:
            return True
        said = f"the checkpoint of epoch {meta.epoch} step {meta.step} was taken"
        for key in ("seed", "global_batch_size"):  # what the epoch's order is a function of
            if meta.config[key] != getattr(cfg, key):
                if rank0:
                    log.warning(
                        "%s with %s=%s, this attempt has %s=%s: it is passed over, and epoch %d "
                        "starts over from its start (the %s orders its rows)",
                        *(said, key, meta.config[key], key, getattr(cfg, key), meta.epoch, key),
                    )
                return False
        version = self.run.manifest.version
        if meta.dataset_version != version:
            if rank0:
                log.warning(
                    "%s on dataset version %s, this attempt trains on version %s "
                    "(switch_dataset=true): it is passed over, and epoch %d starts over from its "
                    "start (its rows are another version's)",
                    *(said, meta.dataset_version, version, meta.epoch),
                )
            return False
        return True

    def record_stored(self, *, resumed: CheckpointMeta) -> None:
        """Report to the runner's record the epoch checkpoints on storage that it lacks, up to
        the one `resumed` from (or the epoch before the one it is inside), oldest first, each
        with its own metrics: their uploads returned after the worker that wrote them was lost,
        or never did. Ray then ranks and keeps them as if recorded when written. Every rank
        reports each one, as `save_epoch` does; rank 0 names the checkpoint, already in place."""
        done = resumed.epoch if resumed.step is None else resumed.epoch - 1
        recorded = self.context.recorded_checkpoint()
        last = epoch_of(recorded) if recorded is not None else -1
        stored = [
            where for epoch, step, where in self.stored if step is None and last < epoch <= done
        ]
        for where in reversed(stored):
            metrics = read_meta(where).metrics
            if self.context.rank != 0:
                self.context.report(metrics)
                continue
            log.info(
                "checkpoint %s is on storage and not in Ray's record (its upload did not "
                "return): recorded now",
                where.uri,
            )
            self.context.report(metrics, where)
        if self.writer is not None and done >= 0:
            self.writer.on_storage(done)

    def _load(self, where: Location, meta: CheckpointMeta) -> None:
        run, uri = self.run, where.uri
        check_resumable(meta, run.manifest, checkpoint=uri, dataset=run.dataset.uri)
        ema = load_weights(where, meta, EMA) if meta.ema_weights else None
        state = load_train_state(where)
        notes = self.state.load_state_dict(state, weights=load_weights(where), ema_weights=ema)
        if self.context.rank != 0:
            return
        if meta.step is not None:
            log.info(
                "resumed from checkpoint %s: epoch %d, continuing after its step %d",
                *(uri, meta.epoch, meta.step),
            )
        else:
            log.info(
                "resumed from checkpoint %s (epoch %d done): continuing at epoch %d of %d",
                *(uri, meta.epoch, meta.epoch + 1, run.cfg.epochs),
            )
            before, world = meta.metrics.get("workers"), self.context.world
            if before is not None and before != world:
                log.info(
                    "resumed with %s workers: %d, was %d; the global batch stays %d (%d per "
                    "worker), so the learning rate is unchanged",
                    *("fewer" if world < before else "more", world, before),
                    *(run.cfg.global_batch_size, run.cfg.batch_size_per_worker(world)),
                )
        for note in notes:
            log.info("%s", note)

    def after_step(self, step: int, totals: Callable[[], tuple[float, int]]) -> None:
        """After each step, on every rank (`totals()`: this attempt's loss and images of the
        epoch on this rank): a checkpoint every `every_steps` steps and at the first preemption
        notice. Every rank asks for a notice the same number of times (under Ray the call is a
        barrier) and sums the epoch so far; rank 0 writes."""
        if self.every is None:
            return
        notice = self.context.preemption()
        first_notice = notice is not None and not self.noticed
        self.noticed = self.noticed or notice is not None
        loop = self.state.loop
        # At the epoch's last step its own checkpoint follows.
        if not first_notice and (step % self.every or step == loop.steps):
            return
        loss_sum, images = all_reduce(list(totals()), device=self.context.device)
        loop.reached(step, loss_sum, images)
        if self.writer is None:
            return
        metrics = {"epoch": loop.epoch, "step": step, "workers": self.context.world}
        meta = checkpoint_meta(self.recorded, metrics, history=loop.history, step=step)
        self.writer.save(
            loop.epoch,
            step,
            self.state.files(),
            lambda d, copied: save_checkpoint(d, copied[0], meta, copied[1], ema=copied[2]),
        )
        if first_notice:
            self.writer.wait()  # on storage before the deadline
            log.warning(
                "preemption notice for ranks %s, deadline %s: saved a checkpoint at epoch %d "
                "step %d, training on until Ray stops the workers",
                *(notice.preempted_ranks, notice.deadline_ms, loop.epoch, step),
            )
            faults.point(faults.PREEMPTION_CHECKPOINTED)
        elif faults.armed_at(faults.STEP_CHECKPOINTED):
            self.writer.wait()  # on storage before the fault test's kill
            faults.point(faults.STEP_CHECKPOINTED)

    def save_epoch(self, metrics: dict) -> None:
        """The checkpoint of the epoch `metrics["epoch"]` just ended (`State.end_epoch`), reported
        with its metrics; rank 0's is written off the loop (Ray's upload thread)."""
        if self.context.rank != 0:
            self.context.report(metrics)
            return
        epoch = metrics["epoch"]
        history = list(self.state.loop.history)
        meta = checkpoint_meta(self.recorded, metrics, history=history)
        began = time.perf_counter()
        self.uploaded.wait()
        self.uploaded.clear()
        copied = self.snapshot.take(self.state.files())
        target = self.run.run_dir.child(checkpoint_dir_name(epoch))

        def write() -> None:
            started = time.perf_counter()
            publish_checkpoint(
                target, lambda d: save_checkpoint(d, copied[0], meta, copied[1], ema=copied[2])
            )
            log.info("checkpoint saved: %s", target.uri)
            if self.telemetry is not None:
                took = time.perf_counter() - started
                self.telemetry.checkpointed(
                    "epoch", target.uri, epoch=epoch, step=None, upload_s=took
                )
            faults.point(faults.CHECKPOINT_UPLOADED)
            if self.writer is not None:
                self.writer.epoch_done(epoch)
            if self.tracking is not None:
                # Once the checkpoint is on storage: with it, every epoch up to this one (those
                # an outage or a restart left out too), never one twice.
                self.tracking.log_epochs(history)
            # Only now may the copy be reused: Ray retries a failed upload (on the same copy),
            # then fails the worker, and the worker group is stopped with the loop waiting.
            self.uploaded.set()

        self.context.report(metrics, target, write=write)
        if self.telemetry is not None:
            self.telemetry.held("epoch", time.perf_counter() - began)
        faults.point(faults.CHECKPOINT_REPORTED)

    def close(self) -> None:
        """Once the last epoch is saved: the last checkpoint inside an epoch on storage too (Ray
        waits for the epochs' uploads)."""
        if self.writer is not None:
            self.writer.wait()


def recorded(run: TrainRun) -> dict:
    """What every checkpoint of the run records of it (pipeline.model.checkpoint's
    checkpoint_meta): the network, what it takes, the dataset version, the resolved config."""
    m, inputs, manifest = run.cfg.model, run.inputs, run.manifest
    return {
        "model": ModelSpec(
            name=m.name, kwargs=m.kwargs, bn_momentum=m.bn_momentum, bn_eps=m.bn_eps
        ),
        "classes": manifest.classes,
        "image_size": manifest.image_size,
        "input_size": inputs.image_size,
        "interpolation": inputs.interpolation,
        "mean": inputs.mean,
        "std": inputs.std,
        "dataset_fingerprint": manifest.fingerprint,
        "dataset_version": manifest.version,
        "config": run.cfg.model_dump(mode="json"),
    }
