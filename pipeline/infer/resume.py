"""Resuming inference: a run's key (what its predictions depend on), the job that writes a
version, and the whole parts that uncommitted versions of the same key hold, carried into the new
version rather than inferred again."""

from __future__ import annotations

import hashlib
import json
import logging
import posixpath
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import ray

from pipeline.core.errors import InputError
from pipeline.core.job_table import job_running, job_started_ms
from pipeline.core.storage import Location, is_marked, retry
from pipeline.infer.config import InferConfig
from pipeline.infer.inputs import Input
from pipeline.infer.predictions import PREDICTIONS, PROGRESS, VERSIONS, read_summary
from pipeline.infer.sink import Tally

log = logging.getLogger(__name__)


def prediction_key(cfg: InferConfig, checkpoint: Location, inp: Input) -> dict:
    """What this run's predictions depend on: a partial run's work is resumed only by a run of
    the same key. The checkpoint's files by name, size and time (one rewritten in place is
    another), the input's images (Input.identity), and the settings that change a prediction."""
    files = hashlib.sha256()
    for f in checkpoint.list_files():
        files.update(
            f"{posixpath.relpath(f.path, checkpoint.path)}\0{f.size}\0{f.mtime_ns}\n".encode()
        )
    return {
        "checkpoint": checkpoint.uri,
        "checkpoint_files": files.hexdigest(),
        **inp.identity,
        "top_k": cfg.top_k,
        "precision": cfg.precision,
        "use_gpu": cfg.use_gpu,
    }


def this_job() -> dict:
    """The running job, as Ray's job table names it: its id, and its start to tell it from a job
    of the same id on another cluster."""
    job_id = ray.get_runtime_context().get_job_id()
    return {"id": job_id, "started_ms": job_started_ms(job_id)}


def job_alive(job: dict) -> bool:
    """Whether `job` (this_job's record) still runs on this cluster. A job of another cluster
    counts as ended: one inference job per output at a time (docs/infer.md)."""
    return job_running(job.get("id"), job.get("started_ms"))


@dataclass
class Partial:
    """What uncommitted versions of one key hold: the versions, and their whole parts with no
    image twice, counted as a Tally whose `parts` are those parts' paths."""

    versions: list[str]
    tally: Tally
    ids: pa.Array  # source_id of every image in those parts


def find_partial(
    output: Location, key: dict, *, num_classes: int, alive: Callable[[dict], bool]
) -> Partial | None:
    """The partial work at `output` that a run of `key` may resume: the uncommitted versions
    (PROGRESS) of the same key whose job has ended (`alive(job)` is false), None if there is
    none. Versions of another key, or of a job still writing, are left as they are, logged."""
    try:
        current = read_summary(output) or {}
    except InputError:
        current = {}
    keep = {current.get("version"), current.get("previous_version")}
    versions, tally, ids, seen = [], Tally.empty(num_classes), [], set()
    for info in reversed(output.child(VERSIONS).list_dirs()):  # the newest first
        name, directory = info.base_name, output.child(VERSIONS, info.base_name)
        if name in keep or not is_marked(directory) or not directory.child(PROGRESS).exists():
            continue
        try:
            progress = json.loads(directory.child(PROGRESS).read_bytes())
        except ValueError:
            continue  # a write cut short: no key to match
        other = sorted(
            k for k in key.keys() | progress["key"].keys() if key.get(k) != progress["key"].get(k)
        )
        if other:
            log.warning(
                "not resuming version %s: its %s differ from this run's; this run starts over",
                name,
                ", ".join(other),
            )
            continue
        if alive(progress.get("job") or {}):
            log.warning(
                "not resuming version %s: its job %s is still running", name, progress["job"]
            )
            continue
        versions.append(name)
        for path, part in _whole_parts(directory.child(PREDICTIONS)):
            part_ids = part["source_id"]
            if any(i in seen for i in part_ids.to_pylist()):
                continue  # the same rows from another attempt of its write task, or carried
            seen.update(part_ids.to_pylist())
            ids.append(part_ids)
            labelled = part.filter(pc.is_valid(part["label"]))
            np.add.at(
                tally.confusion, (labelled["label"].to_numpy(), labelled["pred"].to_numpy()), 1
            )
            tally.images += part.num_rows
            tally.parts.append((path, part.num_rows))
    if not versions:
        return None
    ids = pa.concat_arrays([a.combine_chunks() for a in ids]) if ids else pa.array([], pa.string())
    return Partial(versions=versions, tally=tally, ids=ids)


def _whole_parts(directory: Location) -> Iterator[tuple[str, pa.Table]]:
    """(path, its source_id, label and pred) of each part in `directory` that a write task
    finished: a part cut short has no footer and does not read."""
    for info in directory.list_files() if directory.exists() else []:
        try:
            table = pq.read_table(
                info.path, filesystem=directory.fs, columns=["source_id", "label", "pred"]
            )
        except (OSError, pa.ArrowInvalid):
            continue
        yield info.path, table


def carry(output: Location, partial: Partial, version: str) -> Tally:
    """Copy the whole parts of `partial` into `version`'s predictions: their Tally, whose parts
    are the copies. Copies, not moves: a move on an object store is a copy and a delete."""
    target = output.child(VERSIONS, version, PREDICTIONS)
    target.create_parent()
    tally = Tally.empty(len(partial.tally.confusion))
    tally.merge(partial.tally)
    tally.parts = []
    for path, rows in partial.tally.parts:
        # The version in its name keeps a copy apart from this run's own parts.
        from_version = posixpath.basename(posixpath.dirname(posixpath.dirname(path)))
        copy = target.child(f"{posixpath.basename(path)[:-8]}-of-{from_version}.parquet")
        copy.create_parent()
        retry(lambda p=path, c=copy: target.fs.copy_file(p, c.path), f"copying {path}")
        tally.parts.append((copy.path, rows))
    return tally
