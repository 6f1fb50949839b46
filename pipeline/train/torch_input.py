"""The training and validation loader: a preprocessed Parquet split streamed a row group at a time.

`RowGroupStream` is a torch `IterableDataset` that yields whole batches. Each epoch it lays the
split's row groups end to end (train: in an order shuffled by seed + epoch; val: manifest
order), gives each rank a contiguous slice of that row sequence, and each DataLoader process one
contiguous run of the rank's batches. So a process reads every row group it needs once, in a
background thread while it decodes the rows before, and holds only a few groups: memory does not
grow with the dataset, and the bytes read per epoch stay close to the split's size (only a group
that straddles two processes' runs is read by both). Train rows then pass through a shuffle
buffer of a few groups, so each batch mixes rows of several groups; preprocessing writes shards
in hash order, so every group already mixes the classes. Augmentation draws differ per rank,
DataLoader process, epoch and batch, and repeat for the same seed (`Augment`).

An epoch can start at any batch (`set_epoch(epoch, start_batch)`, a resume from a checkpoint
taken inside the epoch) and yield exactly the batches the uninterrupted epoch would have yielded
from there: each process skips the batches of its run already trained on (reading their rows,
which the shuffle buffer needs, without decoding them), and the DataLoader's round robin starts
at the process whose batch came next.
"""

from __future__ import annotations

import bisect
import copy
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
from pipeline.train.order import batched, process_key, shuffled, taken
from pipeline.train.rest import Segment, cut, not_trained, rest_run, steps_of

COLUMNS = ["image", "label"]
Place = tuple[int, int]  # (index into RowGroupStream.groups, row in that group)
Row = tuple[bytes, int, Place]  # an encoded image, its label, where it is stored


@dataclass(frozen=True)
class RowGroup:
    file: int  # index into RowGroupStream.files
    index: int  # row group within the file
    rows: int


class RowGroupStream(IterableDataset):
    """Rank `rank`'s batches of one split for one epoch: (uint8 (B, 3, S, S), int64 (B,)); the
    images channels-last in memory where decoding and augmentation leave them so (`stacked`).

    train (`shuffle=True`): the row sequence is padded to a multiple of `world` by repeating
    its first rows, as DistributedSampler does, so every rank gets the same rows and batches
    (DDP steps in lockstep); with `drop_last`, a rank's last partial batch is dropped when it
    has more than one batch. val (`shuffle=False`): no padding, so over all ranks each row
    counts exactly once; ranks may then differ by a batch.

    Use with `DataLoader(stream, batch_size=None, persistent_workers=False)`: each epoch's
    iteration forks fresh processes that copy the epoch `set_epoch` gave this object; persistent
    ones would keep the copy of the epoch they were forked with.

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
        drop_last: bool = False,
        transform=None,
        shuffle_groups: int = 4,
        prefetch_groups: int = 2,
        encoded: bool = False,
    ):
        assert 0 <= rank < world and batch_size > 0
        self.root, self.batch_size, self.rank, self.world = root, batch_size, rank, world
        self.shuffle, self.seed, self.drop_last, self.transform = (
            shuffle,
            seed,
            drop_last,
            transform,
        )
        self.prefetch_groups = prefetch_groups
        self.encoded = encoded  # yield EncodedBatch, for the worker to decode (decode=gpu)
        self.ring = None  # in a DataLoader process of ring.RingLoader: where batches go
        self.image_size = manifest.image_size
        self.epoch = 0
        self.start_batch = 0  # batches of the epoch trained on before a resume
        # The epoch's rest after steps trained in other layouts (set_epoch's segments): the
        # positions in its row sequence not trained yet; None: the epoch's own layout.
        self.rest: list[int] | None = None
        self.segments: list[Segment] = []
        self._sequence = None
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
        largest = max((g.rows for g in self.groups), default=0)
        self.shuffle_rows = shuffle_groups * largest if shuffle else 0

    def set_epoch(self, epoch: int, start_batch: int = 0, segments=()) -> None:
        """The epoch the next iteration yields, from its batch `start_batch` on; after
        `segments` (rest.Segment), steps of it trained in other layouts, only its rest."""
        self.epoch, self.segments = epoch, list(segments)
        self.rest = not_trained(self, self.segments) if self.segments else None
        assert 0 <= start_batch <= len(self)
        self.start_batch = start_batch

    def relaid(self, *, rank: int, world: int, batch_size: int) -> RowGroupStream:
        """This stream's epoch in another layout (its own, not a rest)."""
        other = copy.copy(self)
        other.rank, other.world, other.batch_size = rank, world, batch_size
        other.rest, other.segments = None, []
        return other

    # --- which rows, in which order: a pure function of (epoch, rank, process) --------------

    def order(self, epoch: int) -> list[int]:
        """Indices into `groups`, in the order the epoch lays their rows end to end."""
        if not self.shuffle:
            return list(range(len(self.groups)))
        g = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(len(self.groups), generator=g).tolist()

    def rank_rows(self) -> tuple[int, int]:
        """[begin, end) of this rank's slice of the epoch's row sequence; train's may run past
        its end, into the padding."""
        per = math.ceil(self.rows / self.world)
        begin, end = self.rank * per, (self.rank + 1) * per
        if self.shuffle:
            return begin, end
        return min(self.rows, begin), min(self.rows, end)

    def served_rows(self) -> int:
        begin, end = self.rank_rows()
        return min(end - begin, self.batches() * self.batch_size)

    def __len__(self) -> int:
        """Batches this rank yields this epoch (the same on every rank for train)."""
        if self.rest is not None:
            return steps_of(len(self.rest), self.layout())
        return self.batches()

    def layout(self, processes: int = 1) -> Segment:
        """This stream's layout, as a segment of no steps yet."""
        return Segment(self.world, self.batch_size, processes, 0)

    def rest_run(self, process: int, processes: int):
        """In the rest of the epoch, process `process`'s part (rest.rest_run)."""
        index, seg = len(self.segments), self.layout(processes)
        return rest_run(self, self.rest, index, seg, self.rank, process)

    def batches(self) -> int:
        """Batches this rank yields in the epoch's own layout."""
        begin, end = self.rank_rows()
        if self.drop_last and end - begin > self.batch_size:
            return (end - begin) // self.batch_size
        return math.ceil((end - begin) / self.batch_size)

    def process_batches(self, process: int, processes: int) -> tuple[int, int]:
        """[first, last) of this rank's n batches that DataLoader process `process` yields."""
        n = len(self)
        return process * n // processes, (process + 1) * n // processes

    def resume_point(self, processes: int, start_batch: int) -> tuple[list[int], int]:
        """After the DataLoader yielded `start_batch` batches: how many of each process's
        batches it had taken, and the process it takes the next one from."""
        if self.rest is not None:
            counts = [len(self.rest_run(p, processes)[1]) for p in range(processes)]
        else:
            counts = [last - first for first, last in self.all_process_batches(processes)]
        return taken(counts, start_batch)

    def all_process_batches(self, processes: int) -> list[tuple[int, int]]:
        return [self.process_batches(p, processes) for p in range(processes)]

    def process_positions(self, process: int, processes: int) -> tuple[int, int]:
        """[start, end) in the epoch's row sequence of what process `process` reads (past its
        end: the padding, the sequence's first rows again)."""
        first, last = self.process_batches(process, processes)
        begin = self.rank_rows()[0]
        return begin + first * self.batch_size, begin + min(
            last * self.batch_size, self.served_rows()
        )

    def runs(self, epoch: int, process: int = 0, processes: int = 1) -> list[tuple[int, int, int]]:
        """(group, first row, end row) runs of what DataLoader process `process` reads: batches
        [process * n // processes, (process + 1) * n // processes) of this rank's n."""
        start, end = self.process_positions(process, processes)
        order = self.sequence(epoch)[0]
        out, pos = [], start
        while pos < end:
            i, lo = self.place(pos % self.rows, epoch)
            g = order[i]
            take = min(self.groups[g].rows - lo, end - pos)
            out.append((g, lo, lo + take))
            pos += take
        return out

    def place(self, position: int, epoch: int) -> tuple[int, int]:
        """(index into the epoch's group order, row in that group) of a position in the
        epoch's row sequence."""
        starts = self.sequence(epoch)[1]
        i = bisect.bisect_right(starts, position) - 1
        return i, position - starts[i]

    def sequence(self, epoch: int) -> tuple[list[int], list[int]]:
        """The epoch's group order, and where each of its groups starts in the row sequence."""
        if self._sequence is None or self._sequence[0] != epoch:
            order, starts = self.order(epoch), [0]
            for g in order:
                starts.append(starts[-1] + self.groups[g].rows)
            self._sequence = (epoch, order, starts)
        return self._sequence[1:]

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
        worker, processes = (info.id, info.num_workers) if info else (0, 1)
        # The DataLoader takes its first batch from worker 0: worker 0 plays the process whose
        # batch the uninterrupted epoch took next, and the others follow it in turn.
        done, first = self.resume_point(processes, self.start_batch)
        process = (first + worker) % processes
        skip = done[process]
        key = process_key(self.seed, self.epoch, self.rank, process)
        if self.rest is not None:
            reads, sizes, rng = self.rest_run(process, processes)
            fetched = self._fetched(self.pieces(reads), self.read_rows)
            batches = cut(shuffled(fetched, self.shuffle_rows, rng), sizes)
            key = process_key(self.seed, self.epoch, self.rank, process, len(self.segments))
        else:
            fetched = rows = self._fetched(self.runs(self.epoch, process, processes), self.read)
            if self.shuffle:
                rows = shuffled(rows, self.shuffle_rows, random.Random(key))
            batches = batched(rows, self.batch_size)
        try:
            for b, batch in enumerate(batches):
                if b < skip:
                    continue  # trained on before the resume: its rows read, not decoded
                if self.encoded:  # decoded and augmented by the worker, on its device
                    yield EncodedBatch.of(batch, f"{key}/{b}")
                elif self.ring is not None:  # stacked into memory the trainer's process maps
                    slot, out = self.ring.claim(len(batch))
                    self.decoded(batch, f"{key}/{b}", out)
                    yield self.ring.handed(slot, [label for _, label, _ in batch])
                else:
                    yield self.decoded(batch, f"{key}/{b}")
        finally:  # its reading thread ends now, not once an error's traceback is dropped
            fetched.close()

    def decoded(
        self, rows: list[Row], key: str, out: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One batch: its rows decoded, augmented with the draws of `key`, stacked (into
        `out`, if given)."""
        images = [self.image(data, place) for data, _, place in rows]
        labels = torch.tensor([label for _, label, _ in rows], dtype=torch.int64)
        return stacked(Augment(self.transform, key)(images), out), labels

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

    def read(self, group: int, lo: int, hi: int) -> tuple[list[bytes], list[int], list[Place]]:
        """Rows [lo, hi) of one row group: encoded images, labels, and where each is stored."""
        g = self.groups[group]
        table = read_row_group(self.files[g.file], g.index, COLUMNS, classes=self.classes)
        table = table.slice(lo, hi - lo)
        places = [(group, row) for row in range(lo, hi)]
        return table.column("image").to_pylist(), table.column("label").to_pylist(), places

    def pieces(self, positions: list[int]) -> list[tuple[int, list[int]]]:
        """(group, its rows) of positions of the epoch's row sequence, in sequence order."""
        order, out = self.sequence(self.epoch)[0], []
        for position in positions:
            i, row = self.place(position, self.epoch)
            if out and out[-1][0] == order[i]:
                out[-1][1].append(row)
            else:
                out.append((order[i], [row]))
        return out

    def read_rows(self, group: int, rows: list[int]) -> tuple[list, list, list]:
        """Rows `rows` (ascending) of one row group, as `read` gives them."""
        columns = self.read(group, rows[0], rows[-1] + 1)
        return tuple([column[r - rows[0]] for r in rows] for column in columns)

    def _fetched(self, runs: list[tuple], read) -> Iterator[Row]:
        """The rows of `runs`, each `read(*run)`, read `prefetch_groups` ahead by a thread while
        the caller decodes. Started here, in the process that iterates: threads do not survive
        a fork."""
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
                for run in runs:
                    if not put(read(*run)):
                        return
            except BaseException as e:  # handed to the consumer, which raises it
                put(Failed(e))
                return
            put(DONE)

        thread = threading.Thread(target=fetch, name="row-group-prefetch", daemon=True)
        thread.start()
        try:
            while (item := ready.get()) is not DONE:
                if isinstance(item, Failed):
                    raise item.error
                yield from zip(*item, strict=True)
        finally:
            stop.set()


DONE = object()


class EncodedBatch(NamedTuple):
    """A batch's encoded images, end to end in one tensor: one shared-memory transfer from a
    DataLoader process rather than one per image (each holds a file descriptor in transit)."""

    data: torch.Tensor  # uint8 (total bytes,)
    sizes: list[int]  # bytes of each image, in order
    key: str  # its augmentation's key: the draws `Augment` makes for the decoded batch
    places: list[Place]  # where each image is stored, to name one that does not decode

    @classmethod
    def of(cls, rows: list[Row], key: str) -> tuple[EncodedBatch, torch.Tensor]:
        """(EncodedBatch, labels) of rows."""
        data = bytearray(b"".join(image for image, _, _ in rows))
        labels = torch.tensor([label for _, label, _ in rows], dtype=torch.int64)
        sizes = [len(image) for image, _, _ in rows]
        places = [place for _, _, place in rows]
        return cls(torch.frombuffer(data, dtype=torch.uint8), sizes, key, places), labels

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


class Augment:
    """`transform` (or none) on a list of images, with random draws of its own, from `key`.

    torchvision's transforms draw from torch's global generator. Every rank seeds that alike,
    for the model's initial weights that DDP needs equal, and a DataLoader seeds its processes
    from it: each rank would crop and flip its images as every other rank does. A generator
    state per (seed, epoch, rank, process) makes the draws differ between them, and repeat for
    the same run, without moving the global generator that training draws from."""

    def __init__(self, transform, key: str):
        self.transform = transform
        seed = random.Random(f"augment/{key}").getrandbits(63)
        self.state = torch.Generator().manual_seed(seed).get_state()

    def __call__(self, images: list[torch.Tensor]) -> list[torch.Tensor]:
        if self.transform is None:
            return images
        return self._drawing(lambda: [self.transform(image) for image in images])

    def draw(self, *inputs):
        """`transform(*inputs)` once, on a whole batch (MixUp, CutMix: `images, labels`)."""
        return self._drawing(lambda: self.transform(*inputs))

    def _drawing(self, fn):
        # CPU draws only: MixUp's and CutMix's come from the CPU generator whatever the device.
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(self.state)
            out = fn()
            self.state = torch.get_rng_state()
        return out
