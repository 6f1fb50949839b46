"""What an inference run tells while it runs, and its stall watch: images classified of the
input's, images/s and ETA, as Ray metrics (docs/metrics.md), in a line every `LOG_EVERY_S` and
in the output's progress.json, which `status` reads; and a batch held past `stall.multiple`
times the median batch (at least `stall.min_s`) ends the job with exit 3 and one line naming
the predictor actor, every actor's stacks in the log.

The predictor actors tell a `Tally` actor when each batch starts and ends (fire and forget: a
count never holds a batch); the driver reads it from a thread of its own. Each predictor's own
thread answers the driver's request for its stacks, since its batch may hold the actor.
"""

from __future__ import annotations

import logging
import os
import posixpath
import statistics
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable

import ray

from pipeline.core.config import StallConfig
from pipeline.core.errors import ClusterError
from pipeline.core.job_table import this_job_id
from pipeline.core.metrics import INFER, Gauges
from pipeline.core.progress import ProgressWriter, duration_text
from pipeline.core.storage import Location

log = logging.getLogger(__name__)

POLL_S = 2.0
STATUS_EVERY_S = 10.0
LOG_EVERY_S = 30.0
RATE_WINDOW_S = 60.0  # images/s over the last minute: it follows actors that join or leave
ARMED_AFTER = 3  # batches done before a stall can be called: the median needs a few
STACKS_WAIT_S = 20.0  # for the actors' stacks, once a stall is called


@ray.remote(num_cpus=0)
class Tally:
    """The predictor actors' batches: when each actor's current batch started, the images
    done, the recent batch times; and the stacks the driver asks of them."""

    def __init__(self):
        self.images = 0
        self.actors: dict[str, dict] = {}
        self.batch_s: deque[float] = deque(maxlen=64)
        self.asked = False
        self.stacks: dict[str, dict] = {}

    def started(self, actor: str, pid: int, node: str) -> None:
        a = self.actors.setdefault(actor, {"pid": pid, "node": node, "batches": 0})
        a["busy_since"] = time.time()

    def finished(self, actor: str, images: int) -> None:
        a = self.actors[actor]
        if a.get("busy_since") is not None:
            self.batch_s.append(time.time() - a["busy_since"])
        a["busy_since"] = None
        a["batches"] += 1
        self.images += images

    def snapshot(self) -> dict:
        return {
            "images": self.images,
            "now": time.time(),
            "actors": {k: dict(v) for k, v in self.actors.items()},
            "batches": sum(a["batches"] for a in self.actors.values()),
            "median_batch_s": statistics.median(self.batch_s) if self.batch_s else None,
        }

    def ask_stacks(self) -> None:
        self.asked = True

    def asks(self, actor: str) -> bool:
        return self.asked and actor not in self.stacks

    def give_stacks(self, actor: str, stacks: dict) -> None:
        self.stacks[actor] = stacks

    def given(self) -> dict[str, dict]:
        return dict(self.stacks)


class BatchCounter:
    """A predictor actor's side: tells the Tally of each batch (`batch`), and answers the
    driver's request for its stacks from a thread of its own."""

    def __init__(self, tally):
        self.tally, self.pid = tally, os.getpid()
        self.node = ray.util.get_node_ip_address()
        self.key = f"{self.node}:{self.pid}"
        self.batch_thread: int | None = None
        threading.Thread(target=self._answer, name="stall-stacks", daemon=True).start()

    def started(self) -> None:
        self.batch_thread = threading.get_ident()
        self.tally.started.remote(self.key, self.pid, self.node)

    def finished(self, images: int) -> None:
        self.tally.finished.remote(self.key, images)

    def _answer(self) -> None:
        while True:
            time.sleep(POLL_S)
            try:
                if ray.get(self.tally.asks.remote(self.key), timeout=30):
                    self.tally.give_stacks.remote(self.key, thread_stacks(self.batch_thread))
            except ray.exceptions.RayError:
                return  # the job is ending: its Tally is gone


def thread_stacks(batch_thread: int | None) -> dict:
    """Every thread's stack as text, the batch's thread first, and where that one is."""
    names = {t.ident: t.name for t in threading.enumerate()}
    frames = sys._current_frames()
    order = sorted(frames, key=lambda ident: ident != batch_thread)
    text, where = [], "?"
    for ident in order:
        stack = traceback.extract_stack(frames[ident])
        text.append(f"Thread {names.get(ident, ident)}:\n" + "".join(traceback.format_list(stack)))
        if ident == batch_thread and stack:
            last = stack[-1]
            where = f"{posixpath.basename(last.filename)}:{last.name}"
    return {"text": "\n".join(text), "where": where}


def stall_limit_s(median_s: float | None, stall: StallConfig) -> float:
    """Seconds a batch may take before it counts as stalled."""
    return max(stall.min_s, stall.multiple * (median_s or 0.0))


def held_batch(snapshot: dict, stall: StallConfig) -> tuple[str, float] | None:
    """The actor holding a batch past the limit, and for how long, if any (armed once
    ARMED_AFTER batches are done)."""
    if snapshot["batches"] < ARMED_AFTER:
        return None
    limit = stall_limit_s(snapshot["median_batch_s"], stall)
    held = [
        (snapshot["now"] - a["busy_since"], key)
        for key, a in snapshot["actors"].items()
        if a.get("busy_since") is not None
    ]
    if not held:
        return None
    age, key = max(held)
    return (key, age) if age > limit else None


class InferTelemetry:
    """The driver's, for an inference run into `output` of `images` images of which `carried`
    were classified by an earlier run (a resume). `tally` goes to the predictor actors.
    `run` runs the work, and ends it at a stall with the line `stalled` holds."""

    def __init__(self, output: Location, *, images: int, carried: int, stall: StallConfig):
        self.output, self.images, self.carried, self.stall = output, images, carried, stall
        self.job_id = this_job_id()
        self.tally = Tally.remote()
        name = posixpath.basename(output.path.rstrip("/"))
        self.gauges = Gauges(INFER, {"output": name, "job_id": self.job_id})
        self.status = ProgressWriter(output)
        self.samples: deque[tuple[float, int]] = deque()
        self.done, self.state = 0, "inferring"
        self.stalled: str | None = None
        self.started_at = time.time()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="infer-progress", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        logged = written = time.monotonic()
        while not self._stop.wait(POLL_S):
            try:
                snapshot = ray.get(self.tally.snapshot.remote(), timeout=30)
            except (ray.exceptions.RayError, TimeoutError) as e:
                log.debug("inference progress: %s", e)
                continue
            self.done = snapshot["images"]
            now = time.monotonic()
            self.samples.append((now, self.done))
            while now - self.samples[0][0] > RATE_WINDOW_S:
                self.samples.popleft()
            self._publish()
            if now - written >= STATUS_EVERY_S:
                written = now
                self.status.put(self.record())
            if now - logged >= LOG_EVERY_S:
                logged = now
                r = self.record()
                log.info(
                    "inferred %d of %d images (%.0f%%), %.1f images/s, ETA %s",
                    *(r["images_done"], r["images"], 100 * r["progress"], r["images_per_s"] or 0),
                    duration_text(r["eta_s"]),
                )
            if (held := held_batch(snapshot, self.stall)) is not None:
                self._end_stalled(snapshot, *held)
                return

    def _end_stalled(self, snapshot: dict, key: str, age: float) -> None:
        """Log every actor's stacks, then say the job's line: `run` raises it."""
        self.tally.ask_stacks.remote()
        actors = snapshot["actors"]
        deadline = time.monotonic() + STACKS_WAIT_S
        stacks: dict[str, dict] = {}
        while time.monotonic() < deadline and len(stacks) < len(actors):
            time.sleep(1)
            stacks = ray.get(self.tally.given.remote(), timeout=30)
        for actor, a in actors.items():
            text = stacks.get(actor, {}).get("text", "(no answer: its process is stopped or hung)")
            log.error("predictor actor pid %d on node %s, stacks:\n%s", a["pid"], a["node"], text)
        a, median = actors[key], snapshot["median_batch_s"]
        where = stacks.get(key, {}).get("where", "? (it did not answer)")
        self.stalled = (
            f"inference stalled: predictor actor pid {a['pid']} on node {a['node']} has held "
            f"a batch for {age:.0f} s (over stall.min_s={self.stall.min_s:g} s and "
            f"stall.multiple={self.stall.multiple:g} times the median batch of {median:.2g} s), "
            f"in {where}; every actor's stacks are in the log above. Submit the job again: it "
            "infers only what is not written yet"
        )

    def run(self, work: Callable[[], None]) -> None:
        """`work()` in a thread of its own, watched: its error is raised here, and a stall
        raises ClusterError with its line while the work is still held."""
        error: list[BaseException] = []

        def target() -> None:
            try:
                work()
            except BaseException as e:
                error.append(e)

        thread = threading.Thread(target=target, name="predict", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(timeout=1)
            if self.stalled is not None:
                raise ClusterError(self.stalled)
        if error:
            raise error[0]

    def rate(self) -> float | None:
        if len(self.samples) < 2:
            return None
        (t0, n0), (t1, n1) = self.samples[0], self.samples[-1]
        return (n1 - n0) / (t1 - t0) if t1 > t0 else None

    def record(self) -> dict:
        done = min(self.carried + self.done, self.images)
        rate = self.rate()
        left = self.images - done
        return {
            "kind": "infer",
            "output": self.output.uri,
            "job_id": self.job_id,
            "state": self.state,
            "images_done": done,
            "images": self.images,
            "progress": round(done / self.images, 4) if self.images else 1.0,
            "images_per_s": None if rate is None else round(rate, 2),
            "eta_s": 0.0 if left == 0 else (round(left / rate, 1) if rate else None),
            "started_at": self.started_at,
        }

    def _publish(self) -> None:
        r, g = self.record(), self.gauges
        g.set("cv_infer_images_done", r["images_done"])
        g.set("cv_infer_images", r["images"])
        g.set("cv_infer_progress", r["progress"])
        g.set("cv_infer_images_per_second", r["images_per_s"])
        g.set("cv_infer_eta_seconds", r["eta_s"])

    def close(self, state: str, *, images_done: int | None = None) -> None:
        """The run has ended (`state`: finished or failed), with `images_done` classified by
        this run where known."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=60)
        if images_done is not None:
            self.done = images_done
        self.state = state
        self._publish()
        self.status.put(self.record())
        self.status.flush()
        self.gauges.close()
        ray.kill(self.tally)
