"""Predictions on storage: every run writes a version of its own, and summary.json commits one.

Layout of `<output>/`:
    summary.json                              the commit point: the run's summary, and where its
                                              predictions are (`version`, `predictions`, `files`,
                                              `confusion_matrix_png`: paths relative to output)
    versions/<version>/_version.json          written first: marks the directory as the bundle's
                                              (core.storage.mark_version)
    versions/<version>/predictions.parquet/part-*.parquet    PREDICTION_SCHEMA
    versions/<version>/confusion_matrix.png   with labels

A reader reads summary.json, then exactly the files it names (`read_predictions`): beside them
may lie the versions of earlier runs, of a run that failed, or of one still writing.

Writing. A run names its version by its start time (UTC) and a short uuid, so names sort by
start. It writes the marker, then its write tasks write the parts straight into place: no moves,
which on an object store are a copy and a delete, neither atomic nor safe to retry. The driver
commits by writing summary.json, one atomic write (a rename on local disk, a single PUT on an
object store). A run that fails at any moment before that write leaves the previous output as it
was, whole; its own directory is left to retention.

Two runs on one output. Each writes only below its own version; the newest start wins. Just
before its commit a run reads summary.json, and if that names a newer version, the run removes
its own directory instead of committing. Between that read and its write (milliseconds) another
run can commit, and then whichever writes last stands: whole, but perhaps the older. Closing
that window needs a conditional write, which pyarrow's filesystems do not offer.

Retention, after each commit: a version directory goes only if it holds the marker, is neither
the committed version nor the one it replaced (`previous_version`), started before the
committed version (a newer one may still be writing) and more than KEEP_HOURS ago (a reader may
still be reading it). Without the marker nothing is touched: a user's files in output stay. A
run that started more than KEEP_HOURS before a newer one committed could not win anyway: its
directory may go while it writes, and it then fails at its commit.

The predictor actors hand each batch on as a table; write tasks append it to a part and return
a `Tally`: the part's path and rows, a confusion matrix of counts and the files skipped. The
driver sums the tallies, so no prediction passes through it and its memory does not grow with
the input. This module imports no torch: the write tasks take no CPU and must start in a moment,
like the reads (pipeline.infer.inputs).
"""

from __future__ import annotations

import datetime
import json
import logging
import math
import posixpath
import uuid
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from ray.data.block import Block, BlockAccessor
from ray.data.datasource import Datasink, WriteResult

from pipeline.core import faults
from pipeline.core.errors import InputError
from pipeline.core.progress import PROGRESS as PROGRESS_FILE
from pipeline.core.storage import (
    Location,
    foreign_entries,
    is_marked,
    mark_version,
    new_version,
    retry,
    version_started,
)

log = logging.getLogger(__name__)

SUMMARY, VERSIONS = "summary.json", "versions"
PREDICTIONS, CONFUSION_PNG = "predictions.parquet", "confusion_matrix.png"
# What a run that could read no image writes: still a table to read, of no rows.
EMPTY_PART = "part-empty.parquet"
# The summary's keys that make two runs' predictions the same: a run that finds the same
# committed by a newer one has nothing to add.
SAME = ("checkpoint", "input", "split", "dataset_version")
# What inference wrote at the top of output before it wrote versions: the bundle's, left there.
EARLIER_LAYOUT = (PREDICTIONS, CONFUSION_PNG, "_staging")
# Retention keeps every version younger than this: a reader that read summary.json before a
# commit or two may still be reading the version it named.
KEEP_HOURS = 24

# Written beside the marker when a run starts, removed just before its commit: what the run's
# predictions depend on ("key") and which job writes them ("job"). A version that holds it is
# partial work, which a later run of the same key resumes (find_partial).
PROGRESS = "_resume.json"

# Write tasks at a time: each appends small tables to one file, so two keep up with any pool of
# predictor actors, and more would only add idle worker processes.
WRITE_TASKS = 2

PREDICTION_SCHEMA = pa.schema(
    [
        ("source_id", pa.string()),
        ("label", pa.int64()),  # index into the checkpoint's classes; null if none of them
        ("label_name", pa.string()),  # the input's own label, a checkpoint class or not; null: none
        ("pred", pa.int64()),
        ("pred_name", pa.string()),
        ("top_k", pa.list_(pa.int64())),  # class indices, most likely first
        ("top_k_prob", pa.list_(pa.float32())),
    ]
)
# What the predictor actors hand the write tasks: each row also says why its image was skipped
# ("" if it was not) and when its batch was predicted (time.time(), to time the first batch).
BATCH_SCHEMA = PREDICTION_SCHEMA.append(pa.field("error", pa.string())).append(
    pa.field("predicted_at", pa.float64())
)


def batch_table(
    *,
    source_id: np.ndarray,
    label: np.ndarray,
    label_name: np.ndarray,
    top_k: np.ndarray,
    top_k_prob: np.ndarray,
    error: np.ndarray,
    classes: list[str],
    predicted_at: float,
) -> pa.Table:
    """One predicted batch as BATCH_SCHEMA. label: (N,) class index, -1 where the input's
    label is none of `classes`; label_name: (N,) the input's labels, "" where it has none;
    top_k, top_k_prob: (N, k), most likely first."""
    n, k = top_k.shape
    pred = top_k[:, 0]
    return pa.table(
        {
            "source_id": pa.array(source_id, pa.string()),
            "label": pa.array(label, pa.int64(), mask=label < 0),
            "label_name": pa.array([name or None for name in label_name], pa.string()),
            "pred": pa.array(pred, pa.int64()),
            "pred_name": pa.array([classes[i] for i in pred], pa.string()),
            "top_k": pa.FixedSizeListArray.from_arrays(pa.array(top_k.ravel(), pa.int64()), k).cast(
                pa.list_(pa.int64())
            ),
            "top_k_prob": pa.FixedSizeListArray.from_arrays(
                pa.array(top_k_prob.ravel(), pa.float32()), k
            ).cast(pa.list_(pa.float32())),
            "error": pa.array(error, pa.string()),
            "predicted_at": pa.array(np.full(n, predicted_at), pa.float64()),
        },
        schema=BATCH_SCHEMA,
    )


@dataclass
class Tally:
    """What the driver needs to know of some predictions: counts and written parts, not rows."""

    confusion: np.ndarray  # (C, C) int64, rows: true class, columns: predicted; labelled only
    images: int = 0  # predicted, labelled or not
    skipped: list[dict] = field(default_factory=list)  # {"source_id", "reason"}
    parts: list[tuple[str, int]] = field(default_factory=list)  # (path, rows)
    first_at: float = math.inf  # time.time() of the earliest predicted batch
    first_images: int = 0  # images predicted in that batch

    @classmethod
    def empty(cls, num_classes: int) -> Tally:
        return cls(confusion=np.zeros((num_classes, num_classes), dtype=np.int64))

    def add(self, batch: pa.Table) -> pa.Table:
        """Count a table of BATCH_SCHEMA rows; return its predicted rows as PREDICTION_SCHEMA."""
        ok = pc.equal(batch["error"], "")
        bad = batch.filter(pc.invert(ok))
        reasons = zip(bad["source_id"].to_pylist(), bad["error"].to_pylist(), strict=True)
        self.skipped += [{"source_id": s, "reason": r} for s, r in reasons]
        good = batch.filter(ok)
        self.images += good.num_rows
        labelled = good.filter(pc.is_valid(good["label"]))
        true, pred = labelled["label"].to_numpy(), labelled["pred"].to_numpy()
        np.add.at(self.confusion, (true, pred), 1)
        if batch.num_rows:
            at = batch["predicted_at"].to_numpy()
            first = float(at.min())
            images = int((good["predicted_at"].to_numpy() == first).sum())
            self._first(first, images)
        return good.select(PREDICTION_SCHEMA.names)

    def merge(self, other: Tally) -> None:
        self.confusion += other.confusion
        self.images += other.images
        self.skipped += other.skipped
        self.parts += other.parts
        self._first(other.first_at, other.first_images)

    def _first(self, at: float, images: int) -> None:
        if at < self.first_at:
            self.first_at, self.first_images = at, images
        elif at == self.first_at:  # batches of two actors stamped alike: both were first
            self.first_images += images


class PredictionSink(Datasink[Tally]):
    """`ds.write_datasink(sink)`: write tasks write Parquet parts of `rows_per_file` rows into
    `directory`, a version's predictions.parquet/ (each task's last part holds the rest); once
    every one has succeeded, `sink.tally` holds their sum. No reader sees them until `publish`."""

    def __init__(self, directory: Location, *, num_classes: int, rows_per_file: int):
        self.directory = directory
        self.num_classes = num_classes
        self.rows_per_file = rows_per_file
        self.tally: Tally | None = None

    @property
    def min_rows_per_write(self) -> int:
        return self.rows_per_file

    def write(self, blocks: Iterable[Block], ctx) -> Tally:
        tally = Tally.empty(self.num_classes)
        # A unique name per attempt: a retried task writes files of its own, and only the
        # parts whose tallies reach the driver are published; `publish` removes the others.
        stem = f"part-{ctx.task_idx:06d}-{uuid.uuid4().hex[:8]}"
        writer, rows_in_file = None, 0
        try:
            for block in blocks:
                table = BlockAccessor.for_block(block).to_arrow()
                if not table.num_rows:
                    # A read of images inferred before (resumed) yields none, and Ray Data
                    # hands an empty block on without calling the predictor on it.
                    continue
                rows = tally.add(table)
                while rows.num_rows:
                    if writer is None:
                        part = self.directory.child(f"{stem}-{len(tally.parts):04d}.parquet")
                        part.create_parent()
                        writer = pq.ParquetWriter(part.path, PREDICTION_SCHEMA, filesystem=part.fs)
                        tally.parts.append((part.path, 0))
                    head = rows.slice(0, self.rows_per_file - rows_in_file)
                    writer.write_table(head)
                    rows, rows_in_file = rows.slice(head.num_rows), rows_in_file + head.num_rows
                    tally.parts[-1] = (part.path, rows_in_file)
                    if rows_in_file == self.rows_per_file:
                        writer.close()
                        writer, rows_in_file = None, 0
                        faults.point(faults.PREDICTIONS_PART_WRITTEN)
        finally:
            if writer is not None:
                writer.close()
        return tally

    def on_write_complete(self, write_result: WriteResult[Tally]) -> None:
        # On the driver, once every write task has returned: a few small arrays per task.
        self.tally = Tally.empty(self.num_classes)
        for t in write_result.write_returns:
            self.tally.merge(t)


def check_output(output: Location) -> None:
    """Refuse an `output` that holds anything but inference runs' outputs: a commit there would
    replace its summary.json, which may be another record (a training run's)."""
    if not output.exists():
        return
    if not output.is_dir():
        raise InputError(f"output {output.uri} is a file: point output at a directory")
    foreign = foreign_entries(
        output, (SUMMARY, VERSIONS, PROGRESS_FILE, *EARLIER_LAYOUT), versions=VERSIONS
    )
    if foreign:
        raise InputError(
            f"output {output.uri} holds files this bundle did not write "
            f"({', '.join(foreign[:5])}), so it is not an inference output. Choose an empty or "
            "new directory for output=, or one that inference wrote"
        )


def check_input(output: Location, input: str, split: str | None) -> None:
    """Refuse an `output` whose committed predictions are of another input than `input` (a
    dataset's `split`; None for a folder): a commit would replace them, and retention would in
    time remove them. Each input's predictions go to an output of their own."""
    try:
        current = read_summary(output)
    except InputError:
        return  # not a summary: check_output's to refuse, or this run's to replace
    if current is not None and not same_input(current, input, split):
        raise InputError(f"{other_input(output, current, input)}, or remove it to replace them")


def same_input(summary: dict, input: str | None, split: str | None) -> bool:
    """Whether the committed `summary` is of `input` (and `split`), however either is spelled;
    a summary written before summaries named the split counts as of any."""
    if summary.get("split", split) != split:
        return False
    committed = summary.get("input")
    if committed is None or input is None:
        return committed == input
    return Location.parse(input).same_place(committed)


def other_input(output: Location, current: dict, input: str | None) -> str:
    """What is wrong where `output` holds the predictions (`current`) of another input."""
    split = f" (split {current['split']})" if current.get("split") else ""
    return (
        f"output {output.uri} holds the predictions of input={current.get('input')}{split}, "
        f"which those of input={input} would replace: give each input an output= of its own "
        "(the chain's default is)"
    )


def start_version(output: Location, progress: dict | None = None) -> str:
    """A new version at `output`: its name, its directory marked as the bundle's before anything
    else is written in it, then given `progress` (PROGRESS: the run's key and job)."""
    version = new_version()
    directory = output.child(VERSIONS, version)
    mark_version(directory)
    if progress is not None:
        directory.child(PROGRESS).write_bytes(json.dumps(progress, indent=2).encode())
    return version


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


def publish(
    output: Location,
    version: str,
    tally: Tally,
    summary: dict,
    confusion_png: bytes | None,
    *,
    resumed: Collection[str] = (),
) -> dict:
    """Complete `version`, whose parts the write tasks put in place, and commit it by writing
    summary.json; then remove the partial versions it `resumed` and the versions that retention
    lets go. If a newer version is committed, remove this one instead, and fail unless the newer
    holds the same predictions (SAME); so too if the committed one, of any age, is of another
    input (check_input). Returns the summary in place."""
    directory = output.child(VERSIONS, version)
    target = directory.child(PREDICTIONS)
    rows = dict(tally.parts)
    if not rows:
        empty = target.child(EMPTY_PART)
        buffer = pa.BufferOutputStream()
        pq.write_table(PREDICTION_SCHEMA.empty_table(), buffer)
        empty.write_bytes(buffer.getvalue().to_pybytes())
        rows = {empty.path: 0}
    listed = {info.path for info in target.list_files()}
    missing = sorted(rows.keys() - listed)
    if missing:
        raise FileNotFoundError(
            f"{len(missing)} of the {len(rows)} parts the write tasks reported are missing from "
            f"{target.uri}, {missing[0]} the first: nothing was committed"
        )
    for path in sorted(listed - rows.keys()):
        target.child(posixpath.basename(path)).delete()  # an attempt's part that Ray retried
    if confusion_png is not None:
        directory.child(CONFUSION_PNG).write_bytes(confusion_png)
    faults.point(faults.PREDICTIONS_WRITTEN)

    try:
        current = read_summary(output) or {}
    except InputError as e:
        log.warning("%s; this run replaces it", e)
        current = {}
    standing = current.get("version") or ""
    if standing > version:
        directory.delete()
        if any(current.get(k) != summary.get(k) for k in SAME):
            raise InputError(
                f"{output.uri} was replaced while this run was writing: version {standing}, "
                f"started after this one ({version}), committed the predictions of "
                f"{current.get('checkpoint')} on {current.get('input')} first, and stands. Run "
                "one inference job per output at a time, or submit this one again to replace it"
            )
        log.warning("version %s of the same predictions, started later, stands", standing)
        return current
    if current and not same_input(current, summary.get("input"), summary.get("split")):
        directory.delete()  # another input's predictions stand: this run commits nothing
        said = other_input(output, current, summary.get("input"))
        raise InputError(f"{said}; committed while this run was writing, they stand")
    summary = summary | {
        "version": version,
        "predictions": _relative(output, target.path),
        "files": [{"path": _relative(output, p), "rows": rows[p]} for p in sorted(rows)],
        "previous_version": standing or None,
    }
    if confusion_png is not None:
        summary["confusion_matrix_png"] = _relative(output, directory.child(CONFUSION_PNG).path)
    # Whole now: no run may resume it. A job that dies between the two writes leaves a version
    # nobody resumes, which retention removes.
    if directory.child(PROGRESS).exists():
        directory.child(PROGRESS).delete()
    output.child(SUMMARY).write_bytes(json.dumps(summary, indent=2).encode())
    faults.point(faults.PREDICTIONS_COMMITTED)
    try:
        for name in resumed:
            # Never committed, so no reader reads it, and its job has ended (find_partial).
            output.child(VERSIONS, name).delete()
        if resumed:
            log.info("removed the partial version(s) this run resumed: %s", ", ".join(resumed))
        remove_old_versions(output)
    except OSError as e:
        # The predictions are committed: a failed clean-up is the next run's to finish.
        log.warning("removing old versions below %s failed: %s", output.uri, e)
    return summary


def _relative(output: Location, path: str) -> str:
    assert path.startswith(output.path + "/"), (path, output.path)
    return path[len(output.path) + 1 :]


def read_summary(output: Location) -> dict | None:
    """The summary committed at `output`; None where no run has committed."""
    path = output.child(SUMMARY)
    if not path.exists():
        return None
    try:
        summary = json.loads(path.read_bytes())
    except ValueError as e:  # not JSON, or not text at all
        raise InputError(f"{path.uri} is not a summary this bundle wrote: {e}") from None
    if not isinstance(summary, dict):
        raise InputError(f"{path.uri} is not a summary this bundle wrote: not a JSON object")
    return summary


def read_predictions(output: Location | str) -> pa.Table:
    """The predictions committed at `output` (a path or URI): the files its summary.json names,
    in order, whatever else lies beside them."""
    if isinstance(output, str):
        output = Location.parse(output)
    summary = read_summary(output)
    if summary is None:
        raise InputError(f"no predictions at {output.uri}: no inference run has committed there")
    if "files" not in summary:
        raise InputError(
            f"{output.child(SUMMARY).uri} names no prediction files: an earlier version of the "
            "bundle wrote it. Run inference again to replace it"
        )
    tables = []
    for f in summary["files"]:
        part = output.child(f["path"])
        tables.append(
            retry(lambda p=part: pq.read_table(p.path, filesystem=p.fs), f"reading {part.uri}")
        )
    return pa.concat_tables(tables)


def remove_old_versions(output: Location, *, now: datetime.datetime | None = None) -> list[str]:
    """Remove the version directories that retention lets go (the module's docstring says
    which); return their names. `now` defaults to the current time."""
    current = read_summary(output)
    if current is None:
        return []  # nothing committed: any version may be one still writing
    committed = current.get("version") or ""
    keep = {committed, current.get("previous_version")}
    cutoff = (now or datetime.datetime.now(datetime.timezone.utc)) - datetime.timedelta(
        hours=KEEP_HOURS
    )
    removed = []
    for info in output.child(VERSIONS).list_dirs():
        name = info.base_name
        started = version_started(name)
        if name in keep or name > committed or started is None or started > cutoff:
            continue
        directory = output.child(VERSIONS, name)
        if not is_marked(directory):
            continue  # not the bundle's
        directory.delete()
        removed.append(name)
    if removed:
        log.info("removed %d old version(s) below %s", len(removed), output.child(VERSIONS).uri)
    return removed
