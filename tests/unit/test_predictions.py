"""The predictions' commit protocol, without a cluster, on local disk and on S3 (moto on
loopback): write tasks write parts into a version of their run's own and return counts; nothing
is visible until the driver commits that version with summary.json; a failure at any moment
leaves the previous output whole, two runs at once leave one whole output, and retention removes
only the old versions the bundle wrote."""

from __future__ import annotations

import contextlib
import datetime
import itertools
import json
import posixpath

import numpy as np
import pyarrow.parquet as pq
import pytest
from ray.data.datasource import WriteResult

from pipeline.core import faults
from pipeline.core.errors import InputError
from pipeline.core.ray_internals import TaskContext
from pipeline.core.storage import VERSION_MARKER, Location, new_version
from pipeline.infer.predictions import (
    CONFUSION_PNG,
    EMPTY_PART,
    PREDICTIONS,
    SUMMARY,
    VERSIONS,
    check_output,
    publish,
    read_predictions,
    read_summary,
    remove_old_versions,
    start_version,
)
from pipeline.infer.resume import carry, find_partial
from pipeline.infer.sink import PREDICTION_SCHEMA, PredictionSink, Tally, batch_table

CLASSES = ["a", "b", "c"]
BUCKET = "predictions-test"
PNG = b"\x89PNG confusion matrix"


@pytest.fixture(scope="module")
def s3(s3_server):
    s3_server.create_bucket(BUCKET)
    return s3_server


@pytest.fixture(params=["local", "s3"])
def output(request, tmp_path):
    """An inference output: a fresh directory on local disk or a fresh prefix on S3."""
    if request.param == "local":
        yield Location.parse(str(tmp_path / "out"))
        return
    s3 = request.getfixturevalue("s3")
    with s3.client_env():
        yield Location.parse(f"s3://{BUCKET}/{tmp_path.name}")


def batch(ids, labels, preds, *, at, errors=None):
    """A predictor's output for images `ids`: top-2 with `preds` first; label -1 = unknown."""
    labels, preds = np.array(labels), np.array(preds)
    top_k = np.stack([preds, (preds + 1) % len(CLASSES)], axis=1)
    return batch_table(
        source_id=np.array(ids, dtype=object),
        label=labels,
        label_name=np.array([CLASSES[i] if i >= 0 else "" for i in labels], dtype=object),
        top_k=top_k,
        top_k_prob=np.tile(np.array([0.75, 0.25], dtype=np.float32), (len(ids), 1)),
        error=np.array(errors or [""] * len(ids), dtype=object),
        classes=CLASSES,
        predicted_at=at,
    )


def of(ids):
    """The predictions of images `ids`: all labelled `a`, predicted `b`."""
    return batch(ids, [0] * len(ids), [1] * len(ids), at=1.0)


def ctx(task_idx: int) -> TaskContext:
    return TaskContext(task_idx=task_idx, op_name="Write")


def sink_of(output: Location, version: str, rows_per_file: int = 10) -> PredictionSink:
    directory = output.child(VERSIONS, version, PREDICTIONS)
    return PredictionSink(directory, num_classes=len(CLASSES), rows_per_file=rows_per_file)


def summed(sink: PredictionSink, *tallies: Tally) -> Tally:
    """What the driver holds once the write tasks that returned `tallies` are done."""
    sink.on_write_complete(WriteResult(num_rows=0, size_bytes=0, write_returns=list(tallies)))
    return sink.tally


def stage(output: Location, ids) -> tuple[str, Tally]:
    """A run up to its commit: its version marked, the parts of images `ids` written."""
    version = start_version(output)
    sink = sink_of(output, version)
    return version, summed(sink, sink.write([of(ids)], ctx(0)))


def run(output: Location, ids, png: bytes | None = PNG) -> dict:
    """A whole run over images `ids`; returns the summary in place."""
    version, tally = stage(output, ids)
    return publish(output, version, tally, {"images": tally.images}, png)


def visible(output: Location) -> tuple:
    """What a reader of `output` finds: summary.json's bytes, and the predictions and the PNG
    that it names."""
    summary = read_summary(output)
    png = summary.get("confusion_matrix_png")
    table = read_predictions(output)
    return (
        output.child(SUMMARY).read_bytes(),
        table.to_pylist(),
        output.child(png).read_bytes() if png else None,
    )


def versions(output: Location) -> list[str]:
    return [i.base_name for i in output.child(VERSIONS).list_dirs()]


def files_of(output: Location, version: str) -> dict[str, int]:
    """The files of one version: path -> size."""
    return {i.path: i.size for i in output.child(VERSIONS, version).list_files()}


def test_parts_stay_invisible_until_published_and_only_reported_ones_count(tmp_path):
    root = Location.parse(str(tmp_path / "out"))
    previous = run(root, ["old-0", "old-1"])
    before = visible(root)
    version = start_version(root)
    sink = sink_of(root, version)
    first = sink.write(
        [
            batch(["x/1", "x/2", "x/3"], [0, 1, -1], [0, 2, 1], at=100.0),
            batch(["x/4", "x/bad"], [2, 0], [2, 0], at=101.0, errors=["", "empty file"]),
        ],
        ctx(0),
    )
    # An attempt that failed after writing its part: Ray retried it, so no tally reports it.
    sink.write([batch(["x/1"], [0], [0], at=99.0)], ctx(1))
    second = sink.write([batch(["y/1", "y/2"], [1, 1], [1, 0], at=100.5)], ctx(1))
    parts = tmp_path / "out" / VERSIONS / version / PREDICTIONS
    assert len(list(parts.glob("*.parquet"))) == 3
    # Written, not committed: readers still see the previous run, whole.
    assert visible(root) == before

    tally = summed(sink, first, second)
    assert tally.images == 6
    assert tally.skipped == [{"source_id": "x/bad", "reason": "empty file"}]
    # Labelled images only (x/3 has no label); rows: true class, columns: predicted.
    assert tally.confusion.tolist() == [[1, 0, 0], [1, 1, 1], [0, 0, 1]]
    assert (tally.first_at, tally.first_images) == (100.0, 3)

    placed = publish(root, version, tally, {"images": tally.images}, None)
    table = read_predictions(root)
    assert table.schema == PREDICTION_SCHEMA
    assert sorted(table["source_id"].to_pylist()) == ["x/1", "x/2", "x/3", "x/4", "y/1", "y/2"]
    rows = {r["source_id"]: r for r in table.to_pylist()}
    assert rows["x/3"]["label"] is None and rows["x/3"]["label_name"] is None
    assert rows["x/2"] == {
        "source_id": "x/2",
        "label": 1,
        "label_name": "b",
        "pred": 2,
        "pred_name": "c",
        "top_k": [2, 0],
        "top_k_prob": [0.75, 0.25],
    }
    # summary.json names the version, its files (the retried attempt's part removed) and the
    # version it replaced, which stays.
    assert placed == read_summary(root)
    assert placed["images"] == 6 and placed["version"] == version
    assert placed["previous_version"] == previous["version"]
    assert "confusion_matrix_png" not in placed
    assert placed["predictions"] == f"{VERSIONS}/{version}/{PREDICTIONS}"
    names = sorted(p.name for p in parts.iterdir())
    assert [f["path"] for f in placed["files"]] == [f"{placed['predictions']}/{n}" for n in names]
    assert [n[:12] for n in names] == ["part-000000-", "part-000001-"]
    assert [f["rows"] for f in placed["files"]] == [4, 2]
    assert versions(root) == sorted([previous["version"], version])
    # Its own directory holds just those parts: read whole, it reads the same.
    assert pq.read_table(parts).to_pylist() == table.to_pylist()


def test_files_hold_rows_per_file_rows_however_the_blocks_come(tmp_path):
    root = Location.parse(str(tmp_path / "out"))
    version = start_version(root)
    sink = sink_of(root, version, rows_per_file=2)
    ids = [f"x/{i}" for i in range(7)]
    # One block of five, one of two: the files split them at every second row.
    blocks = [batch(ids[:5], [0] * 5, [0] * 5, at=1.0), batch(ids[5:], [1, 1], [1, 1], at=2.0)]
    tally = sink.write(blocks, ctx(0))
    assert [rows for _, rows in tally.parts] == [2, 2, 2, 1]
    placed = publish(root, version, summed(sink, tally), {"images": 7}, None)
    files = [tmp_path / "out" / f["path"] for f in placed["files"]]
    assert [pq.read_metadata(f).num_rows for f in files] == [2, 2, 2, 1]
    assert pq.read_table(files[0])["source_id"].to_pylist() == ["x/0", "x/1"]
    assert read_predictions(root)["source_id"].to_pylist() == ids
    assert read_predictions(str(tmp_path / "out")) == read_predictions(root)


def test_a_part_lost_before_the_commit_fails_the_run_and_commits_nothing(tmp_path):
    root = Location.parse(str(tmp_path / "out"))
    run(root, ["old-0", "old-1"])
    before = visible(root)
    version, tally = stage(root, ["x/1"])
    ((staged, _),) = tally.parts
    root.child(posixpath.relpath(staged, root.path)).delete()  # the storage loses it
    with pytest.raises(FileNotFoundError, match="1 of the 1 parts the write tasks reported"):
        publish(root, version, tally, {"images": 1}, None)
    assert visible(root) == before


def test_no_readable_image_still_gives_a_table(tmp_path):
    root = Location.parse(str(tmp_path / "out"))
    version = start_version(root)
    sink = sink_of(root, version)
    only_bad = batch(["x/bad"], [0], [0], at=1.0, errors=["not an image"])
    tally = sink.write([only_bad], ctx(0))
    assert tally.parts == [] and tally.images == 0
    placed = publish(root, version, summed(sink, tally), {"images": 0}, None)
    assert placed["files"] == [{"path": f"{placed['predictions']}/{EMPTY_PART}", "rows": 0}]
    table = read_predictions(root)
    assert table.num_rows == 0 and table.schema == PREDICTION_SCHEMA


def test_readers_are_told_what_is_missing(tmp_path):
    root = Location.parse(str(tmp_path / "out"))
    with pytest.raises(InputError, match="no inference run has committed there"):
        read_predictions(root)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / SUMMARY).write_text(json.dumps({"images": 2}))
    with pytest.raises(InputError, match="names no prediction files: an earlier version"):
        read_predictions(root)
    (tmp_path / "out" / SUMMARY).write_text("{not json")
    with pytest.raises(InputError, match="is not a summary this bundle wrote"):
        read_predictions(root)


# --- failures -----------------------------------------------------------------------------


class Injected(OSError):
    """A storage write that failed for good: what a test injects."""


class Crash(Exception):
    """The process dying at a fault point: nothing after it runs."""


def fail_write(monkeypatch, n: int) -> list[str]:
    """Make the `n`-th (from 0) write or delete through Location fail; returns the names of the
    files written or deleted so far, as the calls come."""
    tried: list[str] = []

    def failing(method):
        def call(self, *args):
            tried.append(posixpath.basename(self.path))
            if len(tried) == n + 1:
                raise Injected(f"injected: {method.__name__} {self.uri}")
            return method(self, *args)

        return call

    monkeypatch.setattr(Location, "write_bytes", failing(Location.write_bytes))
    monkeypatch.setattr(Location, "delete", failing(Location.delete))
    return tried


def crash_at(monkeypatch, name: str) -> None:
    def point(reached: str) -> None:
        if reached == name:
            raise Crash(name)

    monkeypatch.setattr(faults, "point", point)


def run_with_a_retried_part(output: Location, ids) -> dict:
    """A run over `ids` whose second write task failed once, after writing a part."""
    version = start_version(output)
    sink = sink_of(output, version)
    first = sink.write([of(ids[:1])], ctx(0))
    sink.write([of(ids[1:])], ctx(1))  # the attempt that Ray retried
    second = sink.write([of(ids[1:])], ctx(1))
    tally = summed(sink, first, second)
    return publish(output, version, tally, {"images": tally.images}, PNG)


def test_a_storage_failure_at_any_write_of_a_run_leaves_the_previous_output(output, monkeypatch):
    run(output, ["old-0", "old-1"])
    before = visible(output)
    # Each write of a run fails in turn, until one run has none left to fail.
    failed = []
    for n in itertools.count():
        with monkeypatch.context() as m, contextlib.suppress(Injected):
            tried = fail_write(m, n)
            placed = run_with_a_retried_part(output, ["x/1", "x/2"])
        if len(tried) <= n:
            break
        failed.append(tried[n])
        assert visible(output) == before, f"after a failure at {tried[n]}"
    # The marker, the retried attempt's part, the PNG, then the commit itself.
    assert len(failed) == 4
    assert failed[0] == VERSION_MARKER and failed[1].startswith("part-000001-")
    assert failed[2:] == [CONFUSION_PNG, SUMMARY]
    # The run let through commits; the failed runs' directories are left to retention.
    assert read_summary(output) == placed
    assert read_predictions(output)["source_id"].to_pylist() == ["x/1", "x/2"]
    assert len(versions(output)) == 1 + 3 + 1


def test_a_crash_between_parts_or_at_the_commit_point_leaves_the_previous_output(
    output, monkeypatch
):
    run(output, ["old-0", "old-1"])
    before = visible(output)

    def one_block_then_crash():
        yield of(["x/1", "x/2"])
        raise Crash("between parts")

    sink = sink_of(output, start_version(output), rows_per_file=1)
    with pytest.raises(Crash):
        sink.write(one_block_then_crash(), ctx(0))
    assert visible(output) == before

    crash_at(monkeypatch, faults.PREDICTIONS_WRITTEN)
    with pytest.raises(Crash):
        run(output, ["y/1"])
    assert visible(output) == before
    assert len(versions(output)) == 3  # the previous one, and each crashed run's own


def test_a_crash_right_after_the_commit_leaves_the_new_output_whole(output, monkeypatch):
    previous = run(output, ["old-0", "old-1"])
    crash_at(monkeypatch, faults.PREDICTIONS_COMMITTED)
    with pytest.raises(Crash):
        run(output, ["x/1"])
    summary, rows, png = visible(output)
    assert json.loads(summary)["previous_version"] == previous["version"]
    assert [r["source_id"] for r in rows] == ["x/1"] and png == PNG


# --- two runs at once ---------------------------------------------------------------------


@pytest.mark.parametrize("first", ["older", "newer"])
def test_two_runs_at_once_leave_the_newer_whole_and_keep_each_others_files(output, first):
    previous = run(output, ["old-0"])
    # The older run has written every part; the newer one, started after it, only some.
    older, older_tally = stage(output, ["a/1", "a/2"])
    newer = start_version(output)
    assert older < newer
    sink = sink_of(output, newer)
    newer_parts = [sink.write([of(["b/1"])], ctx(0))]

    def finish_newer() -> dict:
        newer_parts.append(sink.write([of(["b/2", "b/3"])], ctx(1)))
        tally = summed(sink, *newer_parts)
        return publish(output, newer, tally, {"images": tally.images}, None)

    if first == "older":
        untouched = files_of(output, newer)
        assert publish(output, older, older_tally, {"images": 2}, PNG)["version"] == older
        assert files_of(output, newer) == untouched
        assert read_predictions(output)["source_id"].to_pylist() == ["a/1", "a/2"]
        untouched = files_of(output, older)
        placed = finish_newer()
        assert placed["previous_version"] == older
        assert files_of(output, older) == untouched
        kept = [previous["version"], older, newer]
    else:
        placed = finish_newer()
        assert placed["previous_version"] == previous["version"]
        untouched = files_of(output, newer)
        # The older run finds the newer version committed: it stands, and the older run takes
        # away its own directory, and nothing else.
        assert publish(output, older, older_tally, {"images": 2}, PNG) == placed
        assert files_of(output, newer) == untouched
        kept = [previous["version"], newer]
    assert read_summary(output) == placed and placed["version"] == newer
    assert read_predictions(output)["source_id"].to_pylist() == ["b/1", "b/2", "b/3"]
    assert versions(output) == kept


# --- what stays ---------------------------------------------------------------------------


def test_files_the_bundle_did_not_write_stay(output, monkeypatch):
    # A user's files beside the predictions, one of them in a directory named like a version
    # long gone, and one where an earlier layout put predictions.
    mine = {
        "notes.txt": b"my notes",
        f"{VERSIONS}/README": b"what these are",
        f"{VERSIONS}/{new_version(datetime.datetime(2001, 1, 1))}/mine.csv": b"a,b\n",
        f"{PREDICTIONS}/part-00000.parquet": b"not really parquet",
    }
    for path, data in mine.items():
        output.child(path).write_bytes(data)
    monkeypatch.setattr("pipeline.infer.predictions.KEEP_HOURS", 0)  # every version is old
    runs = [run(output, [f"x/{i}"]) for i in range(3)]
    # Retention took the first run's version away, and nothing of the user's.
    assert not output.child(VERSIONS, runs[0]["version"]).exists()
    assert {path: output.child(path).read_bytes() for path in mine} == mine
    assert read_predictions(output)["source_id"].to_pylist() == ["x/2"]


def test_an_output_is_inferences_own_or_refused(output):
    check_output(output)  # none yet
    for i in range(2):
        run(output, [f"x/{i}"])
    start_version(output)  # a run that crashed, or still writes
    # What inference wrote at the top before versions, and on local disk a commit that crashed.
    output.child(PREDICTIONS, "part-00000.parquet").write_bytes(b"rows")
    output.child(CONFUSION_PNG).write_bytes(PNG)
    output.child(f".{SUMMARY}.tmp-123").write_bytes(b"{")
    check_output(output)

    output.child(VERSIONS, "README").write_bytes(b"what these are")
    output.child("notes.txt").write_bytes(b"my notes")
    with pytest.raises(
        InputError,
        match=r"^output \S+ holds files this bundle did not write \(notes.txt, versions/README\), "
        r"so it is not an inference output",
    ):
        check_output(output)


def test_predictions_of_another_input_never_replace_an_outputs(output):
    photos = "/data/photos"
    version, tally = stage(output, ["p/1"])
    first = publish(output, version, tally, {"images": 1, "input": photos}, None)
    # A run of another input commits nothing, and removes its own directory: those predictions
    # stay, and so does every version of them that retention weighs.
    for other in ({"input": "/data/dataset", "split": "val"}, {"input": "/data/more"}):
        version, tally = stage(output, ["d/1"])
        with pytest.raises(InputError, match="holds the predictions of input=/data/photos"):
            publish(output, version, tally, {"images": 1, **other}, None)
        assert read_summary(output) == first
        assert versions(output) == [first["version"]]
    assert read_predictions(output)["source_id"].to_pylist() == ["p/1"]

    # The infer job checks before any work; the same input, however spelled, replaces.
    from pipeline.infer.predictions import check_input

    check_input(output, f"{photos}/", None)
    said = r"^output \S+ holds the predictions of input=/data/photos"
    with pytest.raises(InputError, match=said):
        check_input(output, "/data/dataset", "val")
    # A dataset's splits are inputs of their own.
    dataset = output.child("elsewhere")
    version, tally = stage(dataset, ["v/1"])
    publish(dataset, version, tally, {"images": 1, "input": "/d", "split": "val"}, None)
    check_input(dataset, "/d", "val")
    with pytest.raises(InputError, match=r"input=/d \(split val\), which those of input=/d"):
        check_input(dataset, "/d", "train")


def test_a_training_runs_directory_is_no_output_for_predictions(output):
    # Its summary.json is the run's record, which a commit would replace.
    record = {
        SUMMARY: b'{"status": "finished"}',
        "checkpoint_manager_snapshot.json": b"{}",
        "epoch_0003/model.pt": b"weights",
        "history.csv": b"epoch\n0\n",
    }
    for path, data in record.items():
        output.child(path).write_bytes(data)
    with pytest.raises(InputError, match=r"\(checkpoint_manager_snapshot.json, epoch_0003, hist"):
        check_output(output)
    assert {path: output.child(path).read_bytes() for path in record} == record


def test_retention_removes_only_marked_versions_old_and_superseded(output):
    now = datetime.datetime(2030, 1, 1, tzinfo=datetime.timezone.utc)

    def version(hours_ago: float, *, marked: bool = True) -> str:
        name = new_version(now - datetime.timedelta(hours=hours_ago))
        output.child(VERSIONS, name, PREDICTIONS, "part-0.parquet").write_bytes(b"rows")
        if marked:
            output.child(VERSIONS, name, VERSION_MARKER).write_bytes(b"{}")
        return name

    superseded, crashed, users = version(50), version(49), version(48, marked=False)
    previous, young, committed, writing = version(47), version(3), version(2), version(1)
    assert remove_old_versions(output, now=now) == []  # nothing committed yet: all may be writing
    summary = {"version": committed, "previous_version": previous}
    output.child(SUMMARY).write_bytes(json.dumps(summary).encode())

    assert remove_old_versions(output, now=now) == [superseded, crashed]
    assert versions(output) == [users, previous, young, committed, writing]
    # A day on, the young one is old too; the committed version, the one it replaced, and the
    # one started after it stay whatever their age, and so does what is not the bundle's.
    assert remove_old_versions(output, now=now + datetime.timedelta(days=1)) == [young]
    assert versions(output) == [users, previous, committed, writing]


KEY = {"checkpoint": "s3://runs/r/epoch_0003", "checkpoint_files": "ab12", "top_k": 2}


def test_a_stopped_run_is_resumed_by_a_run_of_its_key_into_a_clean_runs_predictions(output, caplog):
    ids = [f"x/{i:02d}" for i in range(40)]
    clean = Location.parse(f"{output.uri}-clean")
    run(clean, ids)
    # A run stopped midway: whole parts of 25 images (10, 10, 5), the same first part again from
    # a retried attempt of its task, and a part cut short (no footer).
    job = {"id": "02000000", "started_ms": 1}
    stopped = start_version(output, {"key": KEY, "job": job})
    sink = sink_of(output, stopped)
    sink.write([of(ids[:25])], ctx(0))
    sink.write([of(ids[:10])], ctx(0))
    parts = output.child(VERSIONS, stopped, PREDICTIONS)
    parts.child("part-000001-0badc0de-0000.parquet").write_bytes(b"PAR1 cut short")
    foreign = output.child(VERSIONS, new_version())
    foreign.child("yours.txt").write_bytes(b"not the bundle's")

    def never(job):
        return False

    # Another checkpoint, or the same job still running: not resumed, and said why.
    other = KEY | {"checkpoint_files": "cd34"}
    assert find_partial(output, other, num_classes=3, alive=never) is None
    assert f"not resuming version {stopped}: its checkpoint_files differ" in caplog.text
    assert find_partial(output, KEY, num_classes=3, alive=lambda j: j == job) is None
    assert f"not resuming version {stopped}: its job" in caplog.text

    partial = find_partial(output, KEY, num_classes=3, alive=never)
    assert partial.versions == [stopped] and partial.tally.images == 25
    assert sorted(partial.ids.to_pylist()) == ids[:25]
    assert partial.tally.confusion.tolist() == [[0, 25, 0], [0, 0, 0], [0, 0, 0]]
    # The run that resumes it infers only the other 15 and commits what the clean run did.
    version = start_version(output, {"key": KEY, "job": {"id": "03000000", "started_ms": 2}})
    tally = carry(output, partial, version)
    sink = sink_of(output, version)
    tally.merge(summed(sink, sink.write([of(ids[25:])], ctx(0))))
    assert tally.images == 40
    publish(output, version, tally, {"images": tally.images}, PNG, resumed=partial.versions)
    by_id = lambda t: t.sort_by("source_id").to_pylist()  # noqa: E731
    assert by_id(read_predictions(output)) == by_id(read_predictions(clean))
    # The partial version is gone with the commit; what the bundle did not write stays, and the
    # committed version is no partial work for a later run.
    assert versions(output) == sorted([version, foreign.name])
    assert foreign.child("yours.txt").exists()
    assert find_partial(output, KEY, num_classes=3, alive=never) is None
    summary = read_summary(output)
    assert all(f["path"].startswith(f"{VERSIONS}/{version}/") for f in summary["files"])
