"""Pure functions of an epoch's order, shared by the training loader (torch_input) and the
layout of an epoch's rest (rest): batches, the shuffle buffer, the DataLoader's round robin."""

from __future__ import annotations

import itertools
import random


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


def taken(counts: list[int], steps: int) -> tuple[list[int], int]:
    """After a DataLoader yielded `steps` batches of processes that yield `counts` batches,
    taking one from each process in turn and passing over those that are done: how many of
    each process's batches it had taken, and the process it takes the next one from."""
    done, process = [0] * len(counts), 0
    for _ in range(steps):
        while done[process] == counts[process]:
            process = (process + 1) % len(counts)
        done[process] += 1
        process = (process + 1) % len(counts)
    return done, process


def process_key(seed: int, epoch: int, rank: int, process: int, segment: int = 0) -> str:
    """The key of a DataLoader process's draws in an epoch: its shuffle buffer's, and with
    `/<batch>` added, each batch's augmentation. `segment`: the layout of the epoch's rest
    after a resize inside it (rest.py); 0, the epoch's own."""
    rest = f"rest{segment}/" if segment else ""
    return f"{seed}/{epoch}/{rest}{rank}/{process}"
