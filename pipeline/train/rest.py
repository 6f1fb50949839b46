"""The rest of an epoch in another layout: a resume inside an epoch at another worker count.

An epoch's steps may be trained in several layouts one after another (`Segment`): an elastic
run that lost or regained a node between two checkpoints inside an epoch, or a run submitted
again with other loader processes or another global batch. Which rows a layout's first steps
trained is a pure function of the epoch's seeded order (RowGroupStream: each rank's slice of
the row sequence, each DataLoader process's run of batches through its shuffle buffer), so it
is computed here from positions in that sequence, without reading a row.

The rows not trained yet are then laid out over the new layout: in their order in the epoch's
sequence (a process reads row groups in order, each once), split evenly over the ranks and,
on every rank, into the same number of batches (DDP steps in lockstep; a batch may then be a
row or so short of the worker's share), each DataLoader process a contiguous run of its rank's
batches through a shuffle buffer. So every row is trained as often as in the epoch never
resized: once, or twice for the few rows that pad the sequence to a multiple of the workers.
"""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from pipeline.train.order import batched, process_key, shuffled, taken

if TYPE_CHECKING:
    from pipeline.train.torch_input import RowGroupStream


@dataclass(frozen=True)
class Segment:
    """Steps of an epoch trained in one layout."""

    workers: int
    batch: int  # images per worker batch
    processes: int  # DataLoader processes per worker; 1 when it decodes in-process
    steps: int

    def record(self) -> dict:
        return asdict(self)


def first_layout(stream: RowGroupStream, seg: Segment, rank: int, process: int) -> list[list]:
    """The batches (positions in the epoch's row sequence) that DataLoader process `process` of
    rank `rank` yields in the epoch's own layout: as RowGroupStream.__iter__ lays them out."""
    s = stream.relaid(rank=rank, world=seg.workers, batch_size=seg.batch)
    positions = [p % s.rows for p in range(*s.process_positions(process, seg.processes))]
    rng = random.Random(process_key(s.seed, s.epoch, rank, process))
    return list(batched(shuffled(positions, s.shuffle_rows, rng), seg.batch))


def rest_run(
    stream: RowGroupStream, rest: list[int], index: int, seg: Segment, rank: int, process: int
) -> tuple[list[int], list[int], random.Random]:
    """Layout `index` (1 on) of the positions `rest` not trained yet, for process `process` of
    rank `rank`: the positions it reads, in sequence order; the sizes of its batches; the
    generator of its shuffle buffer, through which it yields them."""
    (begin, _), sizes = rank_share(len(rest), seg, rank)
    n = len(sizes)
    first, last = process * n // seg.processes, (process + 1) * n // seg.processes
    begin += sum(sizes[:first])
    reads = rest[begin : begin + sum(sizes[first:last])]
    rng = random.Random(process_key(stream.seed, stream.epoch, rank, process, index))
    return reads, sizes[first:last], rng


def cut(items, sizes: list[int]):
    """`items` in lists of `sizes`."""
    items = iter(items)
    for size in sizes:
        yield list(itertools.islice(items, size))


def rank_share(rows: int, seg: Segment, rank: int) -> tuple[tuple[int, int], list[int]]:
    """Of `rows` rows laid out over `seg.workers` ranks: rank `rank`'s [begin, end) and the
    sizes of its batches, as many on every rank."""
    per, extra = divmod(rows, seg.workers)
    begin = rank * per + min(rank, extra)
    end = begin + per + (rank < extra)
    n = steps_of(rows, seg)
    if n == 0:
        return (begin, begin), []
    q, r = divmod(end - begin, n)
    return (begin, end), [q + (b < r) for b in range(n)]


def steps_of(rows: int, seg: Segment) -> int:
    """Batches every rank yields laying out `rows` rows. Fewer than two a rank are not
    trained: BatchNorm cannot train on a batch of one image."""
    if rows < 2 * seg.workers:
        return 0
    return math.ceil(math.ceil(rows / seg.workers) / seg.batch)


def not_trained(stream: RowGroupStream, segments: list[Segment]) -> list[int]:
    """The positions of the epoch's rows that `segments`, trained one after another, left,
    in sequence order (a position twice where padding repeats it)."""
    rest: list[int] | None = None
    for index, seg in enumerate(segments):
        left = []
        for rank in range(seg.workers):
            batches = []
            for p in range(seg.processes):
                if index == 0:
                    batches.append(first_layout(stream, seg, rank, p))
                    continue
                reads, sizes, rng = rest_run(stream, rest, index, seg, rank, p)
                batches.append(list(cut(shuffled(reads, stream.shuffle_rows, rng), sizes)))
            done, _ = taken([len(b) for b in batches], seg.steps)
            for b, d in zip(batches, done, strict=True):
                left += [p for batch in b[d:] for p in batch]
        rest = sorted(left)
    return rest or []
