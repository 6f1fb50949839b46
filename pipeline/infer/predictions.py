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

The parts themselves, and the Tally that counts them: pipeline.infer.sink. Resuming the partial
versions of an earlier run: pipeline.infer.resume.
"""

from __future__ import annotations

import datetime
import json
import logging
import posixpath
from collections.abc import Collection

import pyarrow as pa
import pyarrow.parquet as pq

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
from pipeline.infer.sink import PREDICTION_SCHEMA, Tally

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
    rows = _complete(directory, tally, confusion_png)
    faults.point(faults.PREDICTIONS_WRITTEN)
    current = _committed(output)
    standing = current.get("version") or ""
    if standing > version:
        return _newer_stands(output, directory, current, summary, version)
    if current and not same_input(current, summary.get("input"), summary.get("split")):
        directory.delete()  # another input's predictions stand: this run commits nothing
        said = other_input(output, current, summary.get("input"))
        raise InputError(f"{said}; committed while this run was writing, they stand")
    summary = summary | {
        "version": version,
        "predictions": _relative(output, directory.child(PREDICTIONS).path),
        "files": [{"path": _relative(output, p), "rows": rows[p]} for p in sorted(rows)],
        "previous_version": standing or None,
    }
    if confusion_png is not None:
        summary["confusion_matrix_png"] = _relative(output, directory.child(CONFUSION_PNG).path)
    _commit(output, directory, summary)
    _remove_replaced(output, resumed)
    return summary


def _complete(directory: Location, tally: Tally, confusion_png: bytes | None) -> dict[str, int]:
    """Make the version `directory`'s predictions exactly the parts that `tally` reports (one
    empty part where it reports none; an attempt's part that Ray retried removed), with the
    confusion matrix beside them; return each part's rows by path."""
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
    return rows


def _committed(output: Location) -> dict:
    """The summary committed at `output`, {} where there is none or it does not read (which
    this run's commit replaces)."""
    try:
        return read_summary(output) or {}
    except InputError as e:
        log.warning("%s; this run replaces it", e)
        return {}


def _newer_stands(
    output: Location, directory: Location, current: dict, summary: dict, version: str
) -> dict:
    """Remove this run's version `directory`, as the newer version of the `current` summary is
    committed: return that summary if it holds the same predictions, else raise InputError."""
    standing = current["version"]
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


def _commit(output: Location, directory: Location, summary: dict) -> None:
    """The version `directory` made whole, then committed by writing summary.json."""
    # Whole now: no run may resume it. A job that dies between the two writes leaves a version
    # nobody resumes, which retention removes.
    if directory.child(PROGRESS).exists():
        directory.child(PROGRESS).delete()
    output.child(SUMMARY).write_bytes(json.dumps(summary, indent=2).encode())
    faults.point(faults.PREDICTIONS_COMMITTED)


def _remove_replaced(output: Location, resumed: Collection[str]) -> None:
    """After a commit: remove the partial versions it `resumed`, and those retention lets go."""
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
