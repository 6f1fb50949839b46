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
import itertools
import math
import queue
import random
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torch.utils.data import IterableDataset, default_collate, get_worker_info
from torchvision.io import ImageReadMode, decode_jpeg
from torchvision.transforms import v2

from pipeline.core.errors import InputError
from pipeline.core.storage import Location, retry
from pipeline.data.dataset import SCHEMA, Manifest
from pipeline.data.images import decode_image, jpeg_header

COLUMNS = ["image", "label"]


@dataclass(frozen=True)
class RowGroup:
    file: int  # index into RowGroupStream.files
    index: int  # row group within the file
    rows: int


@dataclass(frozen=True)
class ShardFooter:
    path: str
    uri: str
    metadata: pq.FileMetaData  # read once, so each row group read fetches only its columns


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
    ones would keep the copy of the epoch they were forked with."""

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
        self.image_size = manifest.image_size
        self.epoch = 0
        self.start_batch = 0  # batches of the epoch trained on before a resume
        self.files: list[ShardFooter] = []
        self.groups: list[RowGroup] = []
        for f in manifest.splits[split].files:
            loc = root.child(f.path)
            try:
                meta = retry(lambda loc=loc: footer(loc), f"reading {loc.uri}")
            except FileNotFoundError:
                raise InputError(missing(loc)) from None
            if not meta.schema.to_arrow_schema().equals(SCHEMA, check_metadata=False):
                raise InputError(
                    f"{loc.uri} does not have the schema this code reads "
                    f"({SCHEMA.names}); re-run preprocessing with overwrite=true"
                )
            for g in range(meta.num_row_groups):
                self.groups.append(RowGroup(len(self.files), g, meta.row_group(g).num_rows))
            self.files.append(ShardFooter(loc.path, loc.uri, meta))
        self.rows = sum(g.rows for g in self.groups)
        if self.rows != manifest.splits[split].rows:
            raise InputError(
                f"split {split!r} of {root.uri} has {self.rows} rows on storage but the "
                f"manifest says {manifest.splits[split].rows}; re-run preprocessing"
            )
        largest = max((g.rows for g in self.groups), default=0)
        self.shuffle_rows = shuffle_groups * largest if shuffle else 0

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        """The epoch the next iteration yields, from its batch `start_batch` on."""
        assert 0 <= start_batch <= len(self)
        self.epoch, self.start_batch = epoch, start_batch

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
        return min(end - begin, len(self) * self.batch_size)

    def __len__(self) -> int:
        """Batches this rank yields per epoch (the same on every rank for train)."""
        begin, end = self.rank_rows()
        if self.drop_last and end - begin > self.batch_size:
            return (end - begin) // self.batch_size
        return math.ceil((end - begin) / self.batch_size)

    def process_batches(self, process: int, processes: int) -> tuple[int, int]:
        """[first, last) of this rank's n batches that DataLoader process `process` yields."""
        n = len(self)
        return process * n // processes, (process + 1) * n // processes

    def resume_point(self, processes: int, start_batch: int) -> tuple[list[int], int]:
        """After the DataLoader yielded `start_batch` batches, taking one from each process in
        turn and passing over those that are done: how many of each process's batches it had
        taken, and the process it takes the next one from."""
        counts = [
            last - first
            for first, last in map(self.process_batches, range(processes), [processes] * processes)
        ]
        done, process = [0] * processes, 0
        for _ in range(start_batch):
            while done[process] == counts[process]:
                process = (process + 1) % processes
            done[process] += 1
            process = (process + 1) % processes
        return done, process

    def runs(self, epoch: int, process: int = 0, processes: int = 1) -> list[tuple[int, int, int]]:
        """(group, first row, end row) runs of what DataLoader process `process` reads: batches
        [process * n // processes, (process + 1) * n // processes) of this rank's n."""
        batch = self.batch_size
        first, last = self.process_batches(process, processes)
        begin = self.rank_rows()[0]
        start = begin + first * batch
        end = begin + min(last * batch, self.served_rows())
        order = self.order(epoch)
        starts = [0]
        for g in order:
            starts.append(starts[-1] + self.groups[g].rows)
        out, pos = [], start
        while pos < end:
            p = pos % self.rows  # past the end: the padding, the sequence's first rows again
            i = bisect.bisect_right(starts, p) - 1
            lo = p - starts[i]
            take = min(self.groups[order[i]].rows - lo, end - pos)
            out.append((order[i], lo, lo + take))
            pos += take
        return out

    # --- reading and decoding -------------------------------------------------------------

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        info = get_worker_info()
        worker, processes = (info.id, info.num_workers) if info else (0, 1)
        # The DataLoader takes its first batch from worker 0: worker 0 plays the process whose
        # batch the uninterrupted epoch took next, and the others follow it in turn.
        done, first = self.resume_point(processes, self.start_batch)
        process = (first + worker) % processes
        skip = done[process]
        rows = self._fetched(self.runs(self.epoch, process, processes))
        if self.shuffle:
            rng = random.Random(f"{self.seed}/{self.epoch}/{self.rank}/{process}")
            rows = shuffled(rows, self.shuffle_rows, rng)
        for b, batch in enumerate(batched(rows, self.batch_size)):
            if b < skip:
                continue  # trained on before the resume: its rows read, not decoded
            yield self.decoded(batch, f"{self.seed}/{self.epoch}/{self.rank}/{process}/{b}")

    def decoded(self, rows: list[tuple[bytes, int]], key: str) -> tuple[torch.Tensor, torch.Tensor]:
        """One batch: its rows decoded, augmented with the draws of `key`, stacked."""
        images = [decode(data, self.image_size) for data, _ in rows]
        labels = torch.tensor([label for _, label in rows], dtype=torch.int64)
        return stacked(Augment(self.transform, key)(images)), labels

    def read(self, group: int, lo: int, hi: int) -> tuple[list[bytes], list[int]]:
        """Rows [lo, hi) of one row group: encoded images and labels."""
        g = self.groups[group]
        f = self.files[g.file]

        def read() -> pa.Table:
            with self.root.fs.open_input_file(f.path) as fh:
                # pre_buffer: the two column chunks in one coalesced read (one GET on S3).
                parquet = pq.ParquetFile(fh, metadata=f.metadata, pre_buffer=True)
                return parquet.read_row_group(g.index, columns=COLUMNS)

        try:
            table = retry(read, f"reading {f.uri}").slice(lo, hi - lo)
        except FileNotFoundError:
            raise InputError(missing(Location(self.root.fs, f.path, f.uri))) from None
        return table.column("image").to_pylist(), table.column("label").to_pylist()

    def _fetched(self, runs: list[tuple[int, int, int]]) -> Iterator[tuple[bytes, int]]:
        """The rows of `runs`, read `prefetch_groups` ahead by a thread while the caller
        decodes. Started here, in the process that iterates: threads do not survive a fork."""
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
                    if not put(self.read(*run)):
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


def stacked(images: list[torch.Tensor]) -> torch.Tensor:
    """uint8 (3, H, W) images -> (B, 3, H, W) in their own memory layout: channels-last where
    the first one is (decoded, or resized by the augmentation's crop: height, width, then a
    pixel's 3 channels), the layout a GPU step takes, else contiguous. Each image's copy is then
    a plain one, not a transposition. In a DataLoader process, default_collate stacks into
    shared memory, which the trainer's process maps: handing the batch over copies nothing."""
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


def batched(rows, size: int):
    """Lists of `size` rows, the last one shorter (itertools.batched, from Python 3.12 on)."""
    rows = iter(rows)
    while batch := list(itertools.islice(rows, size)):
        yield batch


def shuffled(rows, capacity: int, rng: random.Random):
    """`rows` through a shuffle buffer of `capacity`: each row out is a random pick of the
    buffer, replaced by the next row in."""
    buffer = []
    for row in rows:
        if len(buffer) < capacity:
            buffer.append(row)
            continue
        i = rng.randrange(capacity)
        yield buffer[i]
        buffer[i] = row
    rng.shuffle(buffer)
    yield from buffer


def footer(loc: Location) -> pq.FileMetaData:
    with loc.fs.open_input_file(loc.path) as fh:
        return pq.ParquetFile(fh).metadata


def missing(loc: Location) -> str:
    return (
        f"{loc.uri} is listed in the manifest but missing: the dataset is damaged; "
        "re-run preprocessing with overwrite=true"
    )
