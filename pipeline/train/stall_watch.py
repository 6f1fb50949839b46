"""A stalled training run ends with a diagnosis instead of waiting for ever (gloo's collectives
time out after 30 minutes, NCCL's may never).

`StallWatch` runs on Ray Train's controller, as Ray's own NCCL hang detector does: on its polls
of the worker group it reads each worker's progress record (pipeline.train.stall) every few
seconds. A run that made no progress for `stall.multiple` times its median step, and at least
`stall.min_s`, gets every rank's stacks logged and written to `<run>/stalls/<UTC time>/`, and
ends with TrainingStalled naming the rank that holds the others up; the driver ends the job
with it (exit 3). Checkpoints are left as they are: a resubmission resumes from the last.
"""

from __future__ import annotations

import datetime
import logging
import time

import ray

from pipeline.core.logs import setup_logging
from pipeline.core.ray_internals import WorkerGroupCallback, dump_stack_trace
from pipeline.core.storage import Location
from pipeline.train import stall

log = logging.getLogger(__name__)

STALLS = "stalls"
# Seconds between two reads of the records, at most (a quarter of stall.min_s where less).
CHECK_EVERY_S = 10.0
# Seconds a worker has to answer a read of its record or dump its stacks; py-spy's share.
ANSWER_S = 30.0
PYSPY_S = 20.0


class TrainingStalled(RuntimeError):
    """Raised on Ray Train's controller when the run made no progress past its limit."""


class StallWatch(WorkerGroupCallback):
    """Reads the workers' progress records on the controller's polls, without waiting for
    them: a read is sent, and its answers are taken on a later poll."""

    def __init__(self, run_dir: Location, *, multiple: float, min_s: float):
        self.run_dir, self.multiple, self.min_s = run_dir, multiple, min_s
        self.every_s = min(CHECK_EVERY_S, min_s / 4)
        self.group = None
        self.asked: dict[int, ray.ObjectRef] = {}
        self.asked_at = self.next_at = 0.0

    def after_worker_group_start(self, worker_group) -> None:
        setup_logging()  # the controller's lines reach the job's log
        self.group, self.asked = worker_group, {}
        self.next_at = time.monotonic() + self.every_s

    def before_worker_group_shutdown(self, worker_group) -> None:
        self.group, self.asked = None, {}

    def after_worker_group_poll_status(self, worker_group_status) -> None:
        if self.group is None or worker_group_status.errors:
            return  # a failed worker is Ray Train's to handle
        now = time.monotonic()
        if not self.asked:
            if now >= self.next_at:
                self.asked = {rank: w.execute_async(stall.report) for rank, w in self.ranks()}
                self.asked_at = now
            return
        refs = list(self.asked.values())
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        if len(ready) < len(refs) and now - self.asked_at < ANSWER_S:
            return
        records = {rank: answer(ref) for rank, ref in self.asked.items()}
        self.asked, self.next_at = {}, now + self.every_s
        since = stall.stalled_for(records, multiple=self.multiple, min_s=self.min_s)
        if since is not None:
            self.end(records, since)

    def ranks(self) -> list[tuple[int, object]]:
        """(world rank, Ray Train's Worker) of each worker of the group."""
        return [(w.distributed_context.world_rank, w) for w in self.group.get_workers()]

    def end(self, records: dict[int, dict | None], since: float) -> None:
        """Log and store every rank's stacks, then raise TrainingStalled naming the rank."""
        workers = dict(self.ranks())
        folder = self.run_dir.child(STALLS, f"{datetime.datetime.now(datetime.UTC):%Y%m%dT%H%M%SZ}")
        stored = f"Stacks: {folder.uri}/"
        stacks = dump_stacks(workers)
        for rank, text in sorted(stacks.items()):
            meta = workers[rank].metadata
            log.warning(
                "rank %d (pid %d, node %s), stacks:\n%s", rank, meta.pid, meta.node_ip, text
            )
        try:
            for rank, text in stacks.items():
                folder.child(f"rank-{rank}.txt").write_bytes(text.encode())
        except OSError as e:
            log.warning("the stacks could not be written to %s: %s", folder.uri, e)
            stored = "Stacks: in the log above"
        rank, why = stall.stalled_rank(records)
        meta, record = workers[rank].metadata, records[rank]
        where = f" at {record['phase']}, in {record['at']}" if record else ""
        raise TrainingStalled(
            f"training stalled: rank {rank} (pid {meta.pid}, node {meta.node_ip}) made no "
            f"progress for {since:.0f} s ({self.limit_text(records)}){where}; {why}. {stored}. "
            "Resubmit to resume from the last checkpoint"
        )

    def limit_text(self, records: dict[int, dict | None]) -> str:
        """What the limit was, in words: the multiple of the median step, or the floor."""
        median = stall.median_step_s(records)
        if self.multiple * median >= self.min_s:
            return f"{self.multiple:g} times its median step of {median:.2g} s, stall.multiple"
        return f"over stall.min_s={self.min_s:g} s; its median step is {median:.2g} s"


def answer(ref: ray.ObjectRef) -> dict | None:
    """A worker's record, None where it did not answer (or its process is gone)."""
    try:
        return ray.get(ref, timeout=0)
    except Exception:  # any failure to answer is the answer: none
        return None


def dump_stacks(workers: dict[int, object]) -> dict[int, str]:
    """Each rank's stacks (py-spy's, native frames included, else every Python thread's), or
    a line saying why there are none."""
    refs = {rank: w.execute_async(dump_stack_trace, PYSPY_S) for rank, w in workers.items()}
    ray.wait(list(refs.values()), num_returns=len(refs), timeout=ANSWER_S)
    stacks = {}
    for rank, ref in refs.items():
        try:
            stacks[rank] = ray.get(ref, timeout=0)
        except Exception as e:  # the other ranks' stacks are still worth keeping
            stacks[rank] = f"no stacks: the worker did not dump them within {ANSWER_S:.0f} s ({e})"
    return stacks
