"""Checkpoints written off the step loop: the loop copies the state it saves (a snapshot in host
memory, reused from one checkpoint to the next), and a thread writes that copy to storage while
training goes on.

Copying is all the loop waits for: a tensor's bytes into a buffer it already holds (pinned
memory on a GPU, whose copies run on the copy engine). Serializing (`save_checkpoint`) and the
transfer to storage happen in the thread. One checkpoint of a kind is written at a time: the
next snapshot waits for the write before it, so host memory holds one copy of the state per
kind (checkpoints inside an epoch, and the epoch's own), and a store slower than the checkpoints
come holds the loop rather than letting copies pile up.

`StepWriter` is rank 0's writer of the checkpoints inside an epoch (`<run>/steps/`): two kept
per epoch, those of an epoch gone once its own checkpoint is on storage.
"""

from __future__ import annotations

import copy
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow.fs as pafs
import torch

from pipeline.core.storage import Location, new_version, publish_directory
from pipeline.model.checkpoint import METADATA
from pipeline.model.runs import STEPS, step_checkpoints, step_dir_name

if TYPE_CHECKING:
    from pipeline.train.telemetry import Telemetry

log = logging.getLogger(__name__)


class Snapshot:
    """Host copies of a nested state (dicts, lists and tuples of tensors and plain values),
    kept from one `take` to the next so that a copy reuses the memory of the one before."""

    def __init__(self):
        self.buffers: dict[tuple, torch.Tensor] = {}

    def take(self, state):
        """A copy of `state` whose tensors are on the CPU and share no memory with it: what a
        thread can serialize while the step loop changes the originals."""
        copies = self._copy(state, ())
        if any(t.device.type == "cuda" for t in _tensors(state)):
            torch.cuda.synchronize()  # the copies into pinned memory were asynchronous
        return copies

    def _copy(self, value, path: tuple):
        if isinstance(value, torch.Tensor):
            return self._copy_tensor(value.detach(), path)
        if isinstance(value, dict):
            copied = {k: self._copy(v, (*path, k)) for k, v in value.items()}
            if type(value) is dict:
                return copied
            copied = type(value)(copied)
            if hasattr(value, "_metadata"):  # a state_dict's: load_state_dict reads versions there
                copied._metadata = copy.deepcopy(value._metadata)
            return copied
        if isinstance(value, list | tuple):
            copied = [self._copy(v, (*path, i)) for i, v in enumerate(value)]
            return type(value)(copied) if type(value) is tuple else copied
        return copy.deepcopy(value)

    def _copy_tensor(self, tensor: torch.Tensor, path: tuple) -> torch.Tensor:
        held = self.buffers.get(path)
        if held is None or held.shape != tensor.shape or held.dtype != tensor.dtype:
            pin = tensor.device.type == "cuda"
            held = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pin)
            self.buffers[path] = held
        held.copy_(tensor, non_blocking=tensor.device.type == "cuda")
        return held


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, list | tuple):
        for v in value:
            yield from _tensors(v)


def publish_checkpoint(target: Location, write: Callable[[Path], None]) -> None:
    """`write(directory)` fills a directory that becomes the checkpoint `target`, which a reader
    finds whole (its METADATA, written last, is there) or without METADATA. On local disk it is
    written beside `target` and renamed into place: no copy. Elsewhere it is written to a local
    temporary directory and put on storage file by file, METADATA last. A `target` already
    there is a checkpoint of the same name that a killed attempt left and nothing recorded: it
    is replaced."""
    if isinstance(target.fs, pafs.LocalFileSystem):
        sibling = target.parent.child(f".{target.name}.tmp-{new_version()}")
        os.makedirs(sibling.path)
        try:
            write(Path(sibling.path))
            if os.path.exists(target.path):
                # Away from its name first, so that the name holds the old or the new one.
                old = target.parent.child(f".{target.name}.old-{new_version()}")
                os.rename(target.path, old.path)
                shutil.rmtree(old.path, ignore_errors=True)
            os.rename(sibling.path, target.path)
        finally:
            shutil.rmtree(sibling.path, ignore_errors=True)
        return
    target.child(METADATA).delete()  # a replaced one's: it would vouch for the files put below
    staged = Path(tempfile.mkdtemp(prefix="checkpoint-"))
    try:
        write(staged)
        publish_directory(staged, target, last=METADATA)
    finally:
        shutil.rmtree(staged, ignore_errors=True)


class Background:
    """One write at a time in a thread of its own; the next waits for the one before."""

    def __init__(self, name: str):
        self.pool = ThreadPoolExecutor(1, thread_name_prefix=name)
        self.pending: Future | None = None

    def submit(self, work: Callable[[], None]) -> None:
        self.wait()
        self.pending = self.pool.submit(work)

    def wait(self) -> None:
        """Until the write in progress is done; its error, if it failed."""
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.result()


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
