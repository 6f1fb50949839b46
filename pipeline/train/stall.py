"""Where each training worker is: a cheap record of its progress (steps, val batches,
checkpoints, epochs) that Ray Train's controller reads to tell a stalled run from a slow one
(pipeline.train.stall_watch), and the rule that names the rank that holds the others up.

Free of Ray, as pipeline.train.epoch, which reports its steps here. The record is the
process's: a worker process runs one rank for one attempt, so it starts with the attempt.
"""

from __future__ import annotations

import os
import statistics
import sys
import threading
import time
from collections import deque

from pipeline.core import faults

KINDS = ("step", "val_batch", "checkpoint", "epoch")
# Steps of this attempt before its limit is armed: an attempt's first steps are slow (the
# loaders' processes start, the allocator warms up, torch.compile compiles).
ARM_AFTER_STEPS = 3
# The recent step times whose median is the step time.
RECENT_STEPS = 50
# Frames of a training thread that waits for the other ranks: a collective, DDP's gradient
# all-reduce inside backward (autograd waits for it), Ray Train's barriers and report.
WAITING_IN = (
    "torch/distributed/",
    "torch/autograd/",
    "torch/nn/parallel/",
    "ray/train/collective/",
    "execution/collective_impl.py",
    "execution/checkpoint/sync_actor.py",
)
# The fault test's rank: it stops after its second step of its second epoch (STEP_STALLED).
STALLED_RANK = 1


class Record:
    """One worker's progress: units done by kind, when the last was, recent step times."""

    def __init__(self) -> None:
        self.units = dict.fromkeys(KINDS, 0)
        self.last = time.monotonic()
        self.kind: str | None = None  # the last unit's
        self.step_s: deque[float] = deque(maxlen=RECENT_STEPS)
        self.epoch: int | None = None  # the epoch the loop is in (at_epoch), if told
        self.epoch_steps = 0  # steps of that epoch done, resumed ones included
        self.thread: int | None = None  # the training thread: the one that reports


RECORD = Record()


def at_epoch(epoch: int, step: int) -> None:
    """The loop starts epoch `epoch` after its first `step` steps (a resume inside it)."""
    RECORD.epoch, RECORD.epoch_steps = epoch, step


def progressed(kind: str) -> None:
    """One unit of progress of `kind` (step, val_batch, checkpoint or epoch) on this worker's
    training thread: a counter and the clock, no I/O."""
    r, now = RECORD, time.monotonic()
    if kind == "step":
        if r.kind == "step":  # a step right after a step: its time is the step's
            r.step_s.append(now - r.last)
        r.epoch_steps += 1
    elif kind == "epoch":
        r.epoch = None if r.epoch is None else r.epoch + 1
        r.epoch_steps = 0
    r.units[kind] += 1
    r.last, r.kind, r.thread = now, kind, threading.get_ident()
    if kind == "step" and r.units["epoch"] == 1 and r.epoch_steps == 2:
        hold_for_fault_test()


def hold_for_fault_test() -> None:
    """Where STEP_STALLED is armed, rank STALLED_RANK stops here, between two steps: the other
    ranks wait for it in the next step's first collective."""
    if faults.armed_at(faults.STEP_STALLED):
        import torch.distributed as dist

        if dist.is_initialized() and dist.get_rank() == STALLED_RANK:
            faults.point(faults.STEP_STALLED)


def report() -> dict:
    """This worker's record, as Ray Train's controller reads it (on the worker's actor thread,
    while the training thread runs or is blocked): units done, seconds since the last, the
    median step time, where the loop is, and where its training thread is."""
    r = RECORD
    at, waiting = where_waiting(r.thread)
    median = statistics.median(r.step_s) if r.step_s else None
    return {
        "pid": os.getpid(),
        "units": sum(r.units.values()),
        "steps": r.units["step"],
        "since_s": time.monotonic() - r.last,
        "median_step_s": median,
        "phase": phase(r),
        "at": at,
        "waiting": waiting,
    }


def phase(r: Record) -> str:
    """Where the loop is, in words: the step it is in, or what it did last."""
    epoch = f"epoch {r.epoch} " if r.epoch is not None else ""
    if r.kind in (None, "step", "epoch"):
        return f"{epoch}step {r.epoch_steps + 1}"
    done = {"val_batch": "a val batch", "checkpoint": "a checkpoint"}[r.kind]
    return f"{epoch}after {done}"


def where_waiting(thread: int | None) -> tuple[str, bool]:
    """The innermost Python frame of thread `thread` (file:function), and whether the thread
    waits in a collective for the other ranks."""
    frame = sys._current_frames().get(thread) if thread is not None else None
    if frame is None:
        return "no training thread", False
    at = f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_code.co_name}"
    waiting = False
    while frame is not None:
        name = frame.f_code.co_filename.replace(os.sep, "/")
        waiting = waiting or any(mark in name for mark in WAITING_IN)
        frame = frame.f_back
    return at, waiting


def limit_s(median_step_s: float | None, *, multiple: float, min_s: float) -> float:
    """How long a run may make no progress: `multiple` times its median step, at least
    `min_s`."""
    return max(min_s, multiple * (median_step_s or 0.0))


def stalled_for(records: dict[int, dict | None], *, multiple: float, min_s: float) -> float | None:
    """Seconds the run has made no progress, where that is past its limit (limit_s of the
    ranks' median step); None while it is within it, or not armed (a rank has done fewer than
    ARM_AFTER_STEPS steps this attempt), or no rank answered."""
    answered = [r for r in records.values() if r is not None]
    if not answered or any(r["steps"] < ARM_AFTER_STEPS for r in answered):
        return None
    since = min(r["since_s"] for r in answered)
    limit = limit_s(median_step_s(records), multiple=multiple, min_s=min_s)
    return since if since > limit else None


def median_step_s(records: dict[int, dict | None]) -> float:
    """The run's step time: the median of the ranks' median steps (0 before any)."""
    medians = [r["median_step_s"] or 0.0 for r in records.values() if r is not None]
    return statistics.median(medians) if medians else 0.0


def stalled_rank(records: dict[int, dict | None]) -> tuple[int, str]:
    """The rank that holds the run up, and why: one that did not answer (its process stopped),
    else one whose training thread does not wait in a collective while others do, else the one
    that did the fewest units of work."""
    silent = sorted(rank for rank, r in records.items() if r is None)
    if silent:
        return silent[0], "it did not answer (its process is stopped or hung)"
    working = sorted(rank for rank, r in records.items() if not r["waiting"])
    if working and len(working) < len(records):
        rank = min(working, key=lambda k: (records[k]["units"], k))
        return rank, "the other ranks waited for it in a collective"
    rank = min(records, key=lambda k: (records[k]["units"], k))
    return rank, f"it did the fewest units of work ({records[rank]['units']})"
