"""The training and validation loader: a preprocessed Parquet split streamed a row group at a time.

`RowGroupStream` is a torch `IterableDataset` that yields whole batches.

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

import logging
import math
import queue
import random
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch.utils.data import IterableDataset, default_collate, get_worker_info
from torchvision.io import ImageReadMode, decode_jpeg
from torchvision.transforms import v2

from pipeline.core.errors import InputError
from pipeline.core.storage import Location
from pipeline.data.dataset import (
    Manifest,
    ShardFooter,
    damaged,
    read_footer,
    read_row_group,
)
from pipeline.data.images import BadImageError, decode_image, jpeg_header
from pipeline.train.order import EpochOrder, cut, default_partitions, row_seed, share

log = logging.getLogger(__name__)

COLUMNS = ["image", "label"]
Place = tuple[int, int]  # (index into RowGroupStream.groups, row in that group)
Row = tuple[bytes, int, Place]  # an encoded image, its label, where it is stored


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


class RowGroupStream(IterableDataset):
    """Rank `rank`'s batches of one split for one epoch: (uint8 (B, 3, S, S), int64 (B,)); the
    images channels-last in memory where decoding and augmentation leave them so (`stacked`).

    train (`shuffle=True`): `batch_size` rows of each global batch of `batch_size * world`, in
    the epoch's order (order.EpochOrder, over `partitions`: by default `default_partitions` of
    the global batch); every rank the same number of full batches (DDP steps in lockstep). val: no
    padding, so over all ranks each row counts exactly once; ranks may then differ by a batch.

    Use with `DataLoader(stream, batch_size=None, persistent_workers=False)` (ring.RingLoader):
    each epoch's iteration forks fresh processes that copy the epoch `set_epoch` gave this
    object. With more than one process, a train batch comes as one part from each
    (`processes`), in process order.

    With `encoded`, batches are (EncodedBatch, int64 (B,)) instead: the rows as read, for
    `device_decode.DeviceDecoded` to decode and augment with the same draws."""

    def __init__(
        self,
        root: Location,
        manifest: Manifest,
        split: str,
        *,
        batch_size: int,
        rank: int = 0,
        world: int = 1,
        shuffle: bool = False,
        seed: int = 0,
        transform=None,
        shuffle_groups: int = 4,
        prefetch_groups: int = 2,
        encoded: bool = False,
        partitions: int | None = None,
    ):
        assert 0 <= rank < world and batch_size > 0
        self.root, self.batch_size, self.rank, self.world = root, batch_size, rank, world
        self.shuffle, self.seed, self.transform = shuffle, seed, transform
        self.prefetch_groups = prefetch_groups
        self.encoded = encoded  # yield EncodedBatch, for the worker to decode (decode=gpu)
        self.ring = None  # in a DataLoader process of ring.RingLoader: where batches go
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
        self.shuffle_rows = shuffle_groups * max((g.rows for g in self.groups), default=0)
        self.order: EpochOrder | None = None
        if shuffle:
            global_batch = batch_size * world
            if partitions is None:
                partitions = default_partitions(global_batch)
            rows = tuple(g.rows for g in self.groups)
            self.order = EpochOrder(rows, global_batch, partitions, seed, self.shuffle_rows)

    def set_epoch(self, epoch: int, start_step: int = 0) -> None:
        """The epoch the next iteration yields, from its step `start_step` on."""
        assert 0 <= start_step <= len(self)
        self.epoch, self.start_step = epoch, start_step

    def __len__(self) -> int:
        """Steps (batches of this rank) in the epoch: the same on every rank for train."""
        if self.order is not None:
            return self.order.steps
        begin, end = self.rank_rows()
        return math.ceil((end - begin) / self.batch_size)

    def processes(self, loader_workers: int) -> int:
        """DataLoader processes the stream is read by: `loader_workers`, but no more than a
        train batch has rows (each process yields a part of every train batch)."""
        if self.order is None:
            return loader_workers
        return min(loader_workers, self.batch_size)

    def part_rows(self, processes: int) -> int:
        """The most rows a process of `processes` yields at once: a part of a train batch
        (`plan`), or a whole batch."""
        if self.order is None or processes == 1:
            return self.batch_size
        return max(
            sum(hi - lo for _, lo, hi in self._ranges(k, processes)) for k in range(processes)
        )

    def rank_rows(self) -> tuple[int, int]:
        """val: [begin, end) of this rank's slice of the split's rows."""
        per = math.ceil(self.rows / self.world)
        return min(self.rows, self.rank * per), min(self.rows, (self.rank + 1) * per)

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
        return [
            Planned(
                places[i * n : (i + 1) * n],
                [row_seed(self.seed, self.epoch, slot) for slot in slots[i * n : (i + 1) * n]],
            )
            for i in range(len(steps))
        ]

    def _ranges(self, process: int, processes: int) -> list[tuple[int, int, int]]:
        """train: (partition, first, end) of the rows of each global batch that process
        `process` of `processes` yields: its share of this rank's slice (order.share, cut)."""
        o = self.order
        ranges = share(o.global_batch, o.chunk, self.rank, self.world)
        return cut(ranges, process, processes) if processes > 1 else ranges

    def _val_plan(self, process: int, processes: int) -> list[Planned]:
        begin, end = self.rank_rows()
        n = len(self)
        first, last = process * n // processes, (process + 1) * n // processes
        lo, hi = begin + first * self.batch_size, min(end, begin + last * self.batch_size)
        places, at = [], 0
        for g, group in enumerate(self.groups):
            a, b = max(lo, at), min(hi, at + group.rows)
            places += [(g, row - at) for row in range(a, b)]
            at += group.rows
        return [
            Planned(places[i : i + self.batch_size], None)
            for i in range(0, len(places), self.batch_size)
        ]

    # --- reading and decoding -------------------------------------------------------------

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        try:
            yield from self._batches()
        except InputError as e:
            if self.ring is None:
                raise
            # Handed over as it is: a DataLoader raises a process's error again with the
            # process's traceback for its message.
            yield Failed(e)

    def _batches(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        info = get_worker_info()
        process, processes = (info.id, info.num_workers) if info else (0, 1)
        plan = self.plan(process, processes)
        rows = self._rows([b.places for b in plan])
        try:
            for planned, batch in zip(plan, rows, strict=True):
                if self.encoded:  # decoded and augmented by the worker, on its device
                    yield EncodedBatch.of(batch, planned.seeds)
                elif self.ring is not None:  # stacked into memory the trainer's process maps
                    slot, out = self.ring.claim(len(batch))
                    self.decoded(batch, planned.seeds, out)
                    yield self.ring.handed(slot, [label for _, label, _ in batch])
                else:
                    yield self.decoded(batch, planned.seeds)
        finally:  # its reading thread ends now, not once an error's traceback is dropped
            rows.close()

    def decoded(
        self, rows: list[Row], seeds: list[int] | None, out: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One batch: its rows decoded, each augmented with the draws of its seed, stacked
        (into `out`, if given)."""
        images = [self.image(data, place) for data, _, place in rows]
        labels = torch.tensor([label for _, label, _ in rows], dtype=torch.int64)
        return stacked(augmented(self.transform, images, seeds), out), labels

    def image(self, data: bytes, place: Place) -> torch.Tensor:
        """The image stored at `place`, decoded; an InputError naming it if it is not the image
        that preprocessing wrote (bytes damaged in storage since: the files' sizes, which the
        driver checks, may not have changed)."""
        group, index = place
        try:
            image = decode(data, self.image_size)
        except BadImageError as e:
            raise InputError(self.damaged(group, str(e), row=index)) from None
        if image.shape[1:] != (self.image_size, self.image_size):
            (h, w), size = image.shape[1:], self.image_size
            what = f"a {w}x{h} px image, not {size}x{size} as the manifest says"
            raise InputError(self.damaged(group, what, row=index))
        return image

    def damaged(self, group: int, what: str, *, row: int | None = None) -> str:
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
        ready: queue.Queue = queue.Queue(maxsize=self.prefetch_groups)
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
                put(Failed(e))

        thread = threading.Thread(target=fetch, name="row-group-prefetch", daemon=True)
        thread.start()
        held: dict[int, tuple[list[bytes], list[int]]] = {}
        try:
            for i, places in enumerate(batches):
                for g, _ in places:
                    while g not in held:
                        item = ready.get()
                        if isinstance(item, Failed):
                            raise item.error
                        held[item[0]] = item[1]
                yield [(held[g][0][row], held[g][1][row], (g, row)) for g, row in places]
                for g in {g for g, _ in places if last_use[g] == i}:
                    del held[g]
        finally:
            stop.set()


DONE = object()


class EncodedBatch(NamedTuple):
    """A batch's encoded images, end to end in one tensor: one shared-memory transfer from a
    DataLoader process rather than one per image (each holds a file descriptor in transit)."""

    data: torch.Tensor  # uint8 (total bytes,)
    sizes: list[int]  # bytes of each image, in order
    seeds: list[int] | None  # each image's augmentation draws (`augmented`)
    places: list[Place]  # where each image is stored, to name one that does not decode

    @classmethod
    def of(cls, rows: list[Row], seeds: list[int] | None) -> tuple[EncodedBatch, torch.Tensor]:
        """(EncodedBatch, labels) of rows."""
        data = bytearray(b"".join(image for image, _, _ in rows))
        labels = torch.tensor([label for _, label, _ in rows], dtype=torch.int64)
        sizes = [len(image) for image, _, _ in rows]
        places = [place for _, _, place in rows]
        return cls(torch.frombuffer(data, dtype=torch.uint8), sizes, seeds, places), labels

    @classmethod
    def joined(cls, parts: list[tuple[EncodedBatch, torch.Tensor]]):
        """One batch of the parts of it that DataLoader processes yielded, in order."""
        batches, labels = zip(*parts, strict=True)
        seeds = None if batches[0].seeds is None else [s for b in batches for s in b.seeds]
        return cls(
            torch.cat([b.data for b in batches]),
            [n for b in batches for n in b.sizes],
            seeds,
            [p for b in batches for p in b.places],
        ), torch.cat(labels)

    def tensors(self) -> list[torch.Tensor]:
        """One uint8 (bytes,) view per image, as `decode_jpeg` takes a batch."""
        return list(self.data.split(self.sizes))


def stacked(images: list[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
    """uint8 (3, H, W) images -> (B, 3, H, W) in their own memory layout: channels-last where
    the first one is (decoded, or resized by the augmentation's crop: height, width, then a
    pixel's 3 channels), the layout a GPU step takes, else contiguous. Each image's copy is then
    a plain one, not a transposition. With `out`, into `out` (a ring's slot: ring.RingLoader),
    in its layout; in a plain DataLoader's process, default_collate stacks into shared memory
    of the batch's own."""
    if out is not None:
        for image, into in zip(images, out, strict=True):
            into.copy_(image)
        return out
    if images[0].permute(1, 2, 0).is_contiguous():
        return default_collate([image.permute(1, 2, 0) for image in images]).permute(0, 3, 1, 2)
    return default_collate(images)


def decode(data: bytes, size: int) -> torch.Tensor:
    """A stored image -> uint8 (3, H, W): `decode_image`'s pixels. A plain JPEG of `size` x
    `size` px (8-bit, 3 components, no segment Pillow acts on: `PLAIN_SEGMENTS`), what
    preprocessing writes, through torchvision's `decode_jpeg`, straight into a tensor: libjpeg-
    turbo as in Pillow, at about 0.65x the CPU time (no image object, no copy, none of
    decode_image's conversions, which a plain JPEG does not need). Anything else, and bytes it
    fails on, through `decode_image`, which decodes them or says what is wrong."""
    header = jpeg_header(data)
    if (
        header is not None
        and (header.width, header.height, header.components, header.precision) == (size, size, 3, 8)
        and header.plain
    ):
        try:
            return decode_jpeg(
                torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB
            )
        except RuntimeError:
            pass  # damaged: decode_image's error names the reason
    return v2.functional.pil_to_tensor(decode_image(data))


@dataclass
class Failed:
    error: BaseException


def augmented(transform, images: list[torch.Tensor], seeds: list[int] | None):
    """`transform` (or none) on each image, its random draws from its own seed (order.row_seed),
    without moving the global generator that training draws from: the same crops and flips
    for a row whichever process, rank or layout decodes it."""
    if transform is None:
        return images
    out = []
    with torch.random.fork_rng(devices=[]):
        for image, seed in zip(images, seeds, strict=True):
            torch.default_generator.manual_seed(seed)
            out.append(transform(image))
    return out


class Augment:
    """`transform` on a whole batch, with random draws of its own, from `key` (MixUp, CutMix).

    torchvision's transforms draw from torch's global generator. Every rank seeds that alike,
    for the model's initial weights that DDP needs equal: each rank would mix its batch as every
    other rank does. A generator state per key (the worker's: seed, epoch, rank and step) makes
    the draws differ between them, and repeat for the same run, without moving the global
    generator that training draws from."""

    def __init__(self, transform, key: str):
        self.transform = transform
        seed = random.Random(f"augment/{key}").getrandbits(63)
        self.state = torch.Generator().manual_seed(seed).get_state()

    def draw(self, *inputs):
        """`transform(*inputs)` once, on a whole batch (MixUp, CutMix: `images, labels`)."""
        # CPU draws only: MixUp's and CutMix's come from the CPU generator whatever the device.
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(self.state)
            out = self.transform(*inputs)
            self.state = torch.get_rng_state()
        return out
