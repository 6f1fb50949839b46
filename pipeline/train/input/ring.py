"""Batches from DataLoader processes through a ring of shared memory, made once.

A DataLoader process hands each batch tensor over in shared memory of its own: a new file per
batch, whose pages the process faults in and zeroes as it stacks the batch, and which the
trainer's process maps and faults in again as it reads it, about a sixth of the loader's CPU
time at 224 px. Here each process stacks its batches into a few slots of one shared buffer,
mapped before the processes start (the same pages every epoch), and sends only the slot's
number and the labels; the trainer's process copies the batch out (into pinned memory where the
batches go to a GPU: the copy the DataLoader's pinning made anyway; else into memory of its
own, used again once no tensor holds it) and frees the slot. A process waits for a free slot,
so a batch is never overwritten before it was copied.
"""

from __future__ import annotations

import itertools
import math
import multiprocessing
import os
import sys
import weakref
from contextlib import closing
from dataclasses import dataclass
from typing import NamedTuple

import numpy
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from pipeline.core.errors import InputError
from pipeline.train.input.device_decode import EncodedBatch
from pipeline.train.input.rows import Batches

PREFETCH = 2  # batches each process decodes ahead: the DataLoader's default prefetch_factor
_rings: weakref.WeakValueDictionary[int, BatchRing] = weakref.WeakValueDictionary()
_ids = itertools.count()


class Slot(NamedTuple):
    """A batch a DataLoader process left in its ring: what the trainer's process receives."""

    ring: int
    process: int
    slot: int
    images: int
    labels: list[int]

    def take(self, pin: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        return _rings[self.ring].take([self], pin)


class BatchRing:
    """`slots` batches of (batch, size, size, 3) uint8 for each of `processes` processes, and a
    count of free slots per process. Made in the trainer's process, before the DataLoader's
    processes start (its `attach` runs in each of them: `Handed`). With `batch` 0 it holds no
    images: the stream's batches (encoded ones) go as they are, and only its errors through it."""

    def __init__(
        self,
        processes: int,
        *,
        batch: int,
        size: int,
        slots: int = PREFETCH + 1,
        memory: torch.Tensor | None = None,
    ):
        self.id, self.slots = next(_ids), slots
        shape = (processes, slots, batch, size, size, 3)
        if batch and (memory is None or memory.shape != shape):  # else unused since: reused
            storage = torch.UntypedStorage._new_shared(torch.Size(shape).numel())
            memory = torch.empty(0, dtype=torch.uint8).set_(storage).view(shape)
        self.memory = memory if batch else None
        self.free = [multiprocessing.Semaphore(slots) for _ in range(processes if batch else 0)]
        self.process: int | None = None  # in a DataLoader process: its index
        self.filled = 0  # batches this process wrote
        _rings[self.id] = self

    def attach(self, process: int) -> None:
        """In DataLoader process `process`, before its first batch: the slots it fills are
        its own."""
        self.process, self.parent = process, os.getppid()

    def claim(self, images: int) -> tuple[int, torch.Tensor]:
        """In a DataLoader process: its next slot, once free, and that slot's first `images`
        images as (images, 3, size, size) channels-last, to stack a batch into."""
        while not self.free[self.process].acquire(timeout=1.0):
            if os.getppid() != self.parent:
                raise RuntimeError("the trainer's process is gone")
        slot = self.filled % self.slots
        self.filled += 1
        return slot, self.memory[self.process, slot, :images].permute(0, 3, 1, 2)

    def handed(self, slot: int, labels: list[int]) -> Slot:
        """In a DataLoader process: what it sends for the batch it stacked into `slot`."""
        return Slot(self.id, self.process, slot, len(labels), labels)

    def release_all(self) -> None:
        """Frees every slot: processes waiting for one go on to their end, unread."""
        for free in self.free:
            for _ in range(self.slots):
                free.release()

    def take(
        self, parts: list[Slot], pin: bool, memory: Reused | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """In the trainer's process: the batch in the slots of `parts` (one from each process
        that yielded a part of it, in order), copied out (into `memory`'s, unless pinned); the
        slots freed."""
        images = sum(part.images for part in parts)
        shape = (images, *self.memory.shape[3:])
        if pin or memory is None:
            out = torch.empty(shape, dtype=torch.uint8, pin_memory=pin)
        else:
            out = memory.empty(shape)
        at = 0
        for part in parts:
            out[at : at + part.images].copy_(self.memory[part.process, part.slot, : part.images])
            at += part.images
            self.free[part.process].release()
        labels = torch.tensor([label for part in parts for label in part.labels])
        return out.permute(0, 3, 1, 2), labels.pin_memory() if pin else labels


@dataclass
class Failed:
    """A DataLoader process's InputError, handed over as a batch would be."""

    error: BaseException


class Handed(IterableDataset):
    """What each DataLoader process of a RingLoader runs: `batches`' rows made into batches in
    the process's slots of `ring` (stacked into them; encoded batches, small, go as they are),
    and an InputError handed over as it is (`Failed`): a DataLoader raises a process's error
    again with the process's traceback for its message."""

    def __init__(self, batches: Batches, ring: BatchRing):
        self.batches, self.ring = batches, ring

    def __iter__(self):
        self.ring.attach(get_worker_info().id)
        try:
            yield from self.handed() if self.batches.stacks else self.batches
        except InputError as e:
            yield Failed(e)

    def handed(self):
        """Each batch stacked into the process's next free slot: the slot's number goes."""
        with closing(iter(self.batches.rows)) as batches:  # its reading thread ends now
            for batch in batches:
                slot, out = self.ring.claim(len(batch.rows))
                self.batches.batch(batch, out)
                yield self.ring.handed(slot, [label for _, label, _ in batch.rows])


class Reused:
    """Memory for the batches copied out of a ring, used again once no tensor holds it: a new
    batch's own memory would have its pages faulted in and zeroed again, batch after batch.
    (Pinned memory, for a GPU, is CUDA's caching allocator's to reuse.)"""

    KEEP = 4  # batches' memory kept: a step holds one or two batches at once

    def __init__(self):
        self.buffers: list[numpy.ndarray] = []

    def empty(self, shape: tuple[int, ...]) -> torch.Tensor:
        """An uninitialised uint8 tensor of `shape`, in memory no tensor holds any more."""
        size = math.prod(shape)
        for buffer in self.buffers:
            # Held only here (the list, the loop, the call): any tensor on it holds it too.
            if buffer.size >= size and sys.getrefcount(buffer) == 3:
                return torch.from_numpy(buffer[:size]).view(shape)
        buffer = numpy.empty(size, dtype=numpy.uint8)
        if len(self.buffers) < self.KEEP:
            self.buffers.append(buffer)
        return torch.from_numpy(buffer).view(shape)


class RingLoader:
    """`batches` made in `processes` DataLoader processes (in this one with 0), handed over
    through a `BatchRing`: decoded ones (decoding.Decoded) as uint8 (B, 3, S, S) channels-last
    and int64 labels, pinned with `pin_memory`. A train batch comes as one part from each
    process, joined here in process order (RowGroupStream). Batches of encoded images
    (`decode=gpu`) are small and go as they are. An InputError in a process (a damaged row, a
    missing shard) is raised here as it was raised there, one line, where a DataLoader's own
    would carry the process's traceback."""

    def __init__(self, batches: Batches, *, processes: int, pin_memory: bool = False):
        self.batches, self.processes, self.pin_memory = batches, processes, pin_memory
        self.spare: torch.Tensor | None = None  # the last epoch's ring memory, once unused
        self.reused = Reused()

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self):
        ring, stream = None, self.batches.rows
        processes = stream.processes(self.processes)
        # A train batch comes as a part from each process: each runs as many batches ahead
        # as a process making whole batches would, in parts.
        parts = processes if stream.order is not None and processes > 1 else 1
        prefetch = PREFETCH * parts
        if processes:
            rows = stream.part_rows(processes) if self.batches.stacks else 0
            ring = BatchRing(
                processes, batch=rows, size=stream.image_size, slots=prefetch + 1, memory=self.spare
            )
            self.spare = None
        loader = DataLoader(
            Handed(self.batches, ring) if ring is not None else self.batches,
            batch_size=None,  # `batches` are whole batches, or parts of them
            num_workers=processes,
            # Fresh processes each epoch, forked with the epoch set_epoch gave the stream:
            # persistent ones would keep the copy of the stream (and its epoch) they started with.
            persistent_workers=False,
            # Parts from processes are copied out of the ring (into pinned memory) as joined.
            pin_memory=self.pin_memory and not processes,
            prefetch_factor=prefetch if processes else None,
            # The stream seeds its own draws; a DataLoader otherwise takes a seed from the global
            # generator at each iteration, which a resume inside an epoch takes at another step.
            generator=torch.Generator(),
        )
        batches = iter(loader)
        try:
            for first in batches:
                batch = [first, *itertools.islice(batches, parts - 1)]
                for part in batch:
                    if isinstance(part, Failed):
                        raise part.error
                yield self.joined(batch)
        finally:  # also when the consumer stopped early: no process left waiting for a slot
            if ring is not None:
                ring.release_all()
                # Joined now (already, after the last batch), none of them writes to the ring
                # any more: the next epoch's processes reuse its pages, which a new ring's would
                # each fault in and zero again, in them and in this process.
                batches._shutdown_workers()
                self.spare = ring.memory

    def joined(self, parts: list):
        """The batch of the parts the processes yielded: copied out of the ring's slots
        (into pinned memory for a GPU), or encoded ones put end to end."""
        if isinstance(parts[0], Slot):
            return _rings[parts[0].ring].take(parts, self.pin_memory, self.reused)
        if isinstance(parts[0][0], EncodedBatch):
            return EncodedBatch.joined(parts)
        (batch,) = parts  # decoded in this process: whole, in its own memory
        return batch
