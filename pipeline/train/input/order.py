"""An epoch's order: which rows each global step trains, and with which augmentation draws.

The order belongs to the data, not to the layout that trains it. It is a pure function of the
seed, the epoch, the split's row groups (its dataset version), the global batch and a partition
count fixed when the run starts (`EpochOrder`):

1. The split's row groups, in an order shuffled by seed + epoch, lay their rows end to end. The
   sequence is padded to whole global batches by repeating its last rows (DistributedSampler
   repeats its first), so every row is trained once an epoch and a few twice.
2. The padded sequence is cut into `partitions` contiguous stretches of equal length. Each one
   passes through a shuffle buffer of its own, seeded by seed + epoch + partition.
3. Global step `s` trains, from each partition in turn, its next `global_batch / partitions`
   rows. Each row's augmentation is drawn from a seed of its slot in the epoch (`row_seed`).

A layout only decides who reads and decodes what (`share`, `cut`). Rank `r` of `R` takes the
`r`-th of `R` equal slices of each global batch: whole partitions where `R` divides the
partition count, each read by one rank alone. A rank's DataLoader processes split its slice the
same way, each reading its own partitions, so every process reads its row groups once. The
number of ranks, loader processes or their batches never changes which rows step `s` trains, in
which order, with which draws; a resume at step `s` on any layout is a position, not a replay.
"""

from __future__ import annotations

import bisect
import math
import random
from dataclasses import dataclass
from functools import cached_property

MASK = (1 << 64) - 1
# The default partition count's cap: 8 workers' 8 loader processes each read partitions of
# their own, and one worker's 2 hold about 230 row groups each (7 a partition: docs/train.md).
MOST_PARTITIONS = 64


def row_seed(seed: int, epoch: int, slot: int) -> int:
    """The seed of the augmentation draws for slot `slot` of an epoch (splitmix64 of the three):
    the same in whichever process, rank or layout decodes the row."""
    x = (seed * 0x9E3779B97F4A7C15 + epoch * 0xD1B54A32D192ED03 + slot + 1) & MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK
    return (x ^ (x >> 31)) >> 1  # 63 bits: what torch's manual_seed takes


def shuffled(items: list[int], capacity: int, rng: random.Random) -> list[int]:
    """`items` through a shuffle buffer of `capacity`: each item out is a random pick of the
    buffer, replaced by the next item in."""
    out, buffer = [], []
    for item in items:
        if len(buffer) < capacity:
            buffer.append(item)
            continue
        i = rng.randrange(capacity)
        out.append(buffer[i])
        buffer[i] = item
    rng.shuffle(buffer)
    return out + buffer


def default_partitions(global_batch: int) -> int:
    """The partition count a new run starts with unless told: of its global batch alone, never
    of the layout it starts on (docs/train.md weighs the count's memory against its reads)."""
    most = min(global_batch, MOST_PARTITIONS)
    return max(d for d in range(1, most + 1) if global_batch % d == 0)


@dataclass(frozen=True)
class EpochOrder:
    """The train split's order in every epoch of a run (module docstring)."""

    group_rows: tuple[int, ...]  # rows of each of the split's row groups, in manifest order
    global_batch: int
    partitions: int
    seed: int
    shuffle_rows: int  # the shuffle buffers' capacity over all partitions, a group each at least

    def __post_init__(self):
        if self.global_batch % self.partitions:
            raise ValueError(
                f"{self.partitions} partitions do not split a global batch of "
                f"{self.global_batch} evenly"
            )

    @cached_property
    def rows(self) -> int:
        return sum(self.group_rows)

    @property
    def steps(self) -> int:
        """Global steps an epoch: every row once, the last step filled with repeated rows."""
        return math.ceil(self.rows / self.global_batch)

    @property
    def chunk(self) -> int:
        """Rows each partition gives each step."""
        return self.global_batch // self.partitions

    @property
    def length(self) -> int:
        """Rows of each partition."""
        return self.steps * self.chunk

    def groups(self, epoch: int) -> list[int]:
        """The row groups (indices into `group_rows`) in the order the epoch lays them out."""
        order = list(range(len(self.group_rows)))
        random.Random(f"groups/{self.seed}/{epoch}").shuffle(order)
        return order

    def partition(self, epoch: int, p: int) -> list[int]:
        """Partition `p`'s rows in the order it gives them: positions in the epoch's row
        sequence (`places` says where each is stored)."""
        begin, pad = p * self.length, self.steps * self.global_batch - self.rows
        # The padding repeats the sequence's last rows: read already by the last partition.
        stretch = [
            i if i < self.rows else (i - pad) % self.rows for i in range(begin, begin + self.length)
        ]
        # At least a row group's worth each: no two rows of a group keep their order.
        capacity = max(max(self.group_rows), math.ceil(self.shuffle_rows / self.partitions))
        return shuffled(stretch, capacity, random.Random(f"rows/{self.seed}/{epoch}/{p}"))

    def places(self, epoch: int, positions: list[int]) -> list[tuple[int, int]]:
        """(row group, row in it) of each position in the epoch's row sequence."""
        starts, group_of = [], []
        at = 0
        for g in self.groups(epoch):
            starts.append(at)
            group_of.append(g)
            at += self.group_rows[g]
        out = []
        for position in positions:
            i = bisect.bisect_right(starts, position) - 1
            out.append((group_of[i], position - starts[i]))
        return out


def share(global_batch: int, chunk: int, part: int, parts: int) -> list[tuple[int, int, int]]:
    """Part `part` of `parts` equal slices of a global batch laid out partition by partition
    (`chunk` rows each): (partition, first, end) of its rows within each partition's chunk."""
    begin, end = part * global_batch // parts, (part + 1) * global_batch // parts
    out = []
    for p in range(begin // chunk, math.ceil(end / chunk)):
        lo, hi = max(begin, p * chunk) - p * chunk, min(end, (p + 1) * chunk) - p * chunk
        out.append((p, lo, hi))
    return out


def cut(ranges: list[tuple[int, int, int]], part: int, parts: int) -> list[tuple[int, int, int]]:
    """Part `part` of `parts` slices of `ranges` (share's): whole ranges, as many to each
    part, so that each partition is read by one process; cut by rows only where there are
    fewer ranges than parts."""
    n = len(ranges)
    if n >= parts:
        return ranges[part * n // parts : (part + 1) * n // parts]
    rows = sum(hi - lo for _, lo, hi in ranges)
    begin, end = part * rows // parts, (part + 1) * rows // parts
    out, at = [], 0
    for p, lo, hi in ranges:
        a, b = max(begin, at), min(end, at + hi - lo)
        if a < b:
            out.append((p, lo + a - at, lo + b - at))
        at += hi - lo
    return out
