"""Reading a split's rows: a preprocessed Parquet split streamed a row group at a time, as batches
of rows in the epoch's order (`RowGroupStream`). What the rows become (decoded and augmented,
or left encoded) and how they leave a DataLoader process (the ring) is composed around the
stream by the loader assembly (loaders.py), not here.

- **train** follows the epoch's order (order.py): global step `s` trains the same rows with the
  same augmentation draws whatever the number of ranks, loader processes or their batches. Each
  rank takes its slice of every global batch, and each of its DataLoader processes a part of
  that slice (`order.cut`); a DataLoader takes one part from each process in turn, and the ring
  joins them into the rank's batch (ring.RingLoader). An epoch can start at any step
  (`set_epoch(epoch, start_step)`): the rows before it are neither read nor decoded.
- **val** is read in manifest order, each rank a contiguous slice (unpadded: over all ranks
  each row counts once), each process a contiguous run of the rank's batches.

A process computes which rows it needs before it reads any, reads each row group it needs once,
in a background thread, in the order it first needs them, while it decodes the rows before, and
holds a group only until its last row is decoded: memory does not grow with the dataset, and the
bytes read per epoch stay close to the split's size (only a group that two partitions share is
read by both where two processes own them).
"""

from __future__ import annotations

import math
import queue
import threading
from collections.abc import Iterator
from contextlib import closing
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch.utils.data import IterableDataset, get_worker_info

from pipeline.core.errors import InputError
from pipeline.core.storage import Location
from pipeline.data.dataset import Manifest
from pipeline.data.shards import ShardFooter, damaged, read_footer, read_row_group
from pipeline.train.input.order import EpochOrder, cut, default_partitions, row_seed, share

COLUMNS = ["image", "label"]
Place = tuple[int, int]  # (index into RowGroupStream.groups, row in that group)
Row = tuple[bytes, int, Place]  # an encoded image, its label, where it is stored


@dataclass(frozen=True)
class StreamSpec:
    """Which batches of a split a rank reads, in which order, and how far ahead."""

    batch_size: int  # rows of each of this rank's batches
    rank: int = 0
    world: int = 1  # ranks reading the split
    shuffle: bool = False  # train: the epoch's order (order.EpochOrder); val: manifest order
    seed: int = 0  # the order's, and each row's augmentation draws' (order.row_seed)
    partitions: int | None = None  # the order's; None: `default_partitions` of the global batch
    shuffle_groups: int = 4  # the shuffle buffers' capacity, in the largest row group's rows
    prefetch_groups: int = 2  # row groups read ahead of the rows being decoded

    def __post_init__(self):
        assert 0 <= self.rank < self.world and self.batch_size > 0


@dataclass(frozen=True)
class RowGroup:
    file: int  # index into RowGroupStream.files
    index: int  # row group within the file
    rows: int


@dataclass(frozen=True)
class Planned:
    """A batch (or a process's part of one) before anything is read: where its rows are stored,
    and the seeds of their augmentation draws (train)."""

    places: list[Place]
    seeds: list[int] | None


class RowBatch(NamedTuple):
    """A batch (or a process's part of one) as read: its rows, in order, and the seeds of
    their augmentation draws (train; None for val)."""

    rows: list[Row]
    seeds: list[int] | None

    def labels(self) -> torch.Tensor:
        """int64 (B,)."""
        return torch.tensor([label for _, label, _ in self.rows], dtype=torch.int64)


class RowGroupStream(IterableDataset):
    """Rank `spec.rank`'s batches of rows of one split for one epoch (`RowBatch`).

    train (`spec.shuffle`): `batch_size` rows of each global batch of `batch_size * world`, in
    the epoch's order (order.EpochOrder, over `spec.partitions`); every rank the same number of
    full batches (DDP steps in lockstep). val: no padding, so over all ranks each row counts
    exactly once; ranks may then differ by a batch.

    Iterated in a DataLoader process, it yields that process's share: with more than one
    process, a train batch comes as one part from each (`processes`), in process order. Each
    epoch's iteration forks fresh processes that copy the epoch `set_epoch` gave this object."""

    def __init__(self, root: Location, manifest: Manifest, split: str, spec: StreamSpec):
        self.root, self.spec = root, spec
        self.image_size = manifest.image_size
        self.version = manifest.version
        self.epoch = 0
        self.start_step = 0  # steps of the epoch trained before a resume
        self.files: list[ShardFooter] = []
        self.groups: list[RowGroup] = []
        self.classes = len(manifest.classes)
        for f in manifest.splits[split].files:
            shard = read_footer(root, f.path)
            for g in range(shard.metadata.num_row_groups):
                rows = shard.metadata.row_group(g).num_rows
                self.groups.append(RowGroup(len(self.files), g, rows))
            self.files.append(shard)
        self.rows = sum(g.rows for g in self.groups)
        if self.rows != manifest.splits[split].rows:
            raise InputError(
                f"split {split!r} of {root.uri} has {self.rows} rows on storage but the "
                f"manifest says {manifest.splits[split].rows}; re-run preprocessing"
            )
        self.order = self._order() if spec.shuffle else None

    def _order(self) -> EpochOrder:
        spec = self.spec
        global_batch = spec.batch_size * spec.world
        partitions = spec.partitions
        if partitions is None:
            partitions = default_partitions(global_batch)
        shuffle_rows = spec.shuffle_groups * max((g.rows for g in self.groups), default=0)
        rows = tuple(g.rows for g in self.groups)
        return EpochOrder(rows, global_batch, partitions, spec.seed, shuffle_rows)

    def set_epoch(self, epoch: int, start_step: int = 0) -> None:
        """The epoch the next iteration yields, from its step `start_step` on."""
        assert 0 <= start_step <= len(self)
        self.epoch, self.start_step = epoch, start_step

    def __len__(self) -> int:
        """Steps (batches of this rank) in the epoch: the same on every rank for train."""
        if self.order is not None:
            return self.order.steps
        begin, end = self.rank_rows()
        return math.ceil((end - begin) / self.spec.batch_size)

    def processes(self, loader_workers: int) -> int:
        """DataLoader processes the stream is read by: `loader_workers`, but no more than a
        train batch has rows (each process yields a part of every train batch)."""
        if self.order is None:
            return loader_workers
        return min(loader_workers, self.spec.batch_size)

    def part_rows(self, processes: int) -> int:
        """The most rows a process of `processes` yields at once: a part of a train batch
        (`plan`), or a whole batch."""
        if self.order is None or processes == 1:
            return self.spec.batch_size
        return max(
            sum(hi - lo for _, lo, hi in self._ranges(k, processes)) for k in range(processes)
        )

    def rank_rows(self) -> tuple[int, int]:
        """val: [begin, end) of this rank's slice of the split's rows."""
        rank, world = self.spec.rank, self.spec.world
        per = math.ceil(self.rows / world)
        return min(self.rows, rank * per), min(self.rows, (rank + 1) * per)

    # --- which rows: a pure function of the epoch and the layout -------------------------

    def plan(self, process: int = 0, processes: int = 1) -> list[Planned]:
        """What DataLoader process `process` of `processes` yields this epoch, in order."""
        if self.order is None:
            return self._val_plan(process, processes)
        o = self.order
        ranges = self._ranges(process, processes)
        parts = {p: o.partition(self.epoch, p) for p, _, _ in ranges}
        steps = range(self.start_step, o.steps)
        slots = [
            p * o.length + s * o.chunk + j
            for s in steps
            for p, lo, hi in ranges
            for j in range(lo, hi)
        ]
        positions = [parts[slot // o.length][slot % o.length] for slot in slots]
        places = o.places(self.epoch, positions)
        n = len(slots) // len(steps) if steps else 0
        seed = self.spec.seed
        return [
            Planned(
                places[i * n : (i + 1) * n],
                [row_seed(seed, self.epoch, slot) for slot in slots[i * n : (i + 1) * n]],
            )
            for i in range(len(steps))
        ]

    def _ranges(self, process: int, processes: int) -> list[tuple[int, int, int]]:
        """train: (partition, first, end) of the rows of each global batch that process
        `process` of `processes` yields: its share of this rank's slice (order.share, cut)."""
        o = self.order
        ranges = share(o.global_batch, o.chunk, self.spec.rank, self.spec.world)
        return cut(ranges, process, processes) if processes > 1 else ranges

    def _val_plan(self, process: int, processes: int) -> list[Planned]:
        begin, end = self.rank_rows()
        n, batch = len(self), self.spec.batch_size
        first, last = process * n // processes, (process + 1) * n // processes
        lo, hi = begin + first * batch, min(end, begin + last * batch)
        places, at = [], 0
        for g, group in enumerate(self.groups):
            a, b = max(lo, at), min(hi, at + group.rows)
            places += [(g, row - at) for row in range(a, b)]
            at += group.rows
        return [Planned(places[i : i + batch], None) for i in range(0, len(places), batch)]

    # --- reading ----------------------------------------------------------------------------

    def __iter__(self) -> Iterator[RowBatch]:
        info = get_worker_info()
        process, processes = (info.id, info.num_workers) if info else (0, 1)
        plan = self.plan(process, processes)
        rows = self._rows([b.places for b in plan])
        try:
            for planned, batch in zip(plan, rows, strict=True):
                yield RowBatch(batch, planned.seeds)
        finally:  # its reading thread ends now, not once an error's traceback is dropped
            rows.close()

    def damaged(self, group: int, what: str, *, row: int | None = None) -> str:
        """What an InputError says of row `row` of row group `group` (or of the whole group)."""
        g = self.groups[group]
        return str(damaged(self.root, self.files[g.file].uri, what, group=g.index, row=row))

    def read(self, group: int) -> tuple[list[bytes], list[int]]:
        """One row group's encoded images and labels."""
        g = self.groups[group]
        table = read_row_group(self.files[g.file], g.index, COLUMNS, classes=self.classes)
        return table.column("image").to_pylist(), table.column("label").to_pylist()

    def _rows(self, batches: list[list[Place]]) -> Iterator[list[Row]]:
        """The rows of each batch of places. Each row group is read once, `prefetch_groups`
        ahead by a thread in the order the batches first need them, and dropped after the
        last batch that needs it. Started here, in the process that iterates: threads do not
        survive a fork."""
        first_needed, last_use = [], {}
        for i, places in enumerate(batches):
            for g, _ in places:
                if g not in last_use:
                    first_needed.append(g)
                last_use[g] = i
        ready: queue.Queue = queue.Queue(maxsize=self.spec.prefetch_groups)
        stop = threading.Event()

        def put(item) -> bool:
            # Time out now and then: a consumer that stopped early never takes the next item.
            while not stop.is_set():
                try:
                    ready.put(item, timeout=0.1)
                    return True
                except queue.Full:
                    pass
            return False

        def fetch() -> None:
            try:
                for g in first_needed:
                    if not put((g, self.read(g))):
                        return
            except BaseException as e:  # handed to the consumer, which raises it
                put(ReadFailed(e))

        thread = threading.Thread(target=fetch, name="row-group-prefetch", daemon=True)
        thread.start()
        held: dict[int, tuple[list[bytes], list[int]]] = {}
        try:
            for i, places in enumerate(batches):
                for g, _ in places:
                    while g not in held:
                        item = ready.get()
                        if isinstance(item, ReadFailed):
                            raise item.error
                        held[item[0]] = item[1]
                yield [(held[g][0][row], held[g][1][row], (g, row)) for g, row in places]
                for g in {g for g, _ in places if last_use[g] == i}:
                    del held[g]
        finally:
            stop.set()


@dataclass
class ReadFailed:
    """The reading thread's error, handed to the process that iterates."""

    error: BaseException


class Batches(IterableDataset):
    """A batch made of each of a stream's row batches (`batch`), in the process that iterates:
    what is composed around a RowGroupStream to decode its rows (decoding.Decoded) or to keep
    them encoded (device_decode.Encoded), and what a DataLoader is given."""

    stacks = False  # whether `batch` stacks decoded images into `out` (a ring's slot)

    def __init__(self, rows: RowGroupStream):
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self) -> Iterator:
        with closing(iter(self.rows)) as batches:  # its reading thread ends with this one
            for batch in batches:
                yield self.batch(batch)

    def batch(self, batch: RowBatch, out: torch.Tensor | None = None):
        """The batch made of `batch`'s rows (into `out`, where `stacks`)."""
        raise NotImplementedError
