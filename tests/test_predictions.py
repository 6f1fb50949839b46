"""The predictions' commit protocol, without a cluster: write tasks stage parts and return
counts; nothing is visible until the driver publishes, and summary.json comes last."""

import json

import numpy as np
import pyarrow.parquet as pq
import pytest
from ray.data.datasource import WriteResult

from pipeline.core.ray_internals import TaskContext
from pipeline.core.storage import Location
from pipeline.infer.predictions import (
    PREDICTION_SCHEMA,
    PREDICTIONS,
    STAGING,
    SUMMARY,
    PredictionSink,
    batch_table,
    publish,
)

CLASSES = ["a", "b", "c"]


def batch(ids, labels, preds, *, at, errors=None):
    """A predictor's output for images `ids`: top-2 with `preds` first; label -1 = unknown."""
    labels, preds = np.array(labels), np.array(preds)
    top_k = np.stack([preds, (preds + 1) % len(CLASSES)], axis=1)
    return batch_table(
        source_id=np.array(ids, dtype=object),
        label=labels,
        top_k=top_k,
        top_k_prob=np.tile(np.array([0.75, 0.25], dtype=np.float32), (len(ids), 1)),
        error=np.array(errors or [""] * len(ids), dtype=object),
        classes=CLASSES,
        predicted_at=at,
    )


def previous_run(output) -> dict[str, bytes]:
    """What a complete earlier run left in `output`: its files' bytes by relative path."""
    old = batch(["old-0", "old-1"], [0, 1], [0, 0], at=1.0)
    (output / PREDICTIONS).mkdir(parents=True)
    pq.write_table(old.select(PREDICTION_SCHEMA.names), output / PREDICTIONS / "part-00000.parquet")
    (output / SUMMARY).write_text(json.dumps({"images": 2}))
    return snapshot(output)


def snapshot(output) -> dict[str, bytes]:
    return {
        str(p.relative_to(output)): p.read_bytes()
        for p in sorted(output.rglob("*"))
        if p.is_file() and STAGING not in p.parts
    }


def test_parts_stay_staged_until_published_and_only_reported_ones_count(tmp_path):
    output = tmp_path / "out"
    before = previous_run(output)
    root = Location.parse(str(output))
    sink = PredictionSink(root.child(STAGING, "run"), num_classes=3, rows_per_file=10)
    first = sink.write(
        [
            batch(["x/1", "x/2", "x/3"], [0, 1, -1], [0, 2, 1], at=100.0),
            batch(["x/4", "x/bad"], [2, 0], [2, 0], at=101.0, errors=["", "empty file"]),
        ],
        TaskContext(task_idx=0, op_name="Write"),
    )
    # An attempt that failed after writing its part: Ray retried it, so no tally reports it.
    sink.write([batch(["x/1"], [0], [0], at=99.0)], TaskContext(task_idx=1, op_name="Write"))
    second = sink.write(
        [batch(["y/1", "y/2"], [1, 1], [1, 0], at=100.5)], TaskContext(task_idx=1, op_name="Write")
    )
    staged = list((output / STAGING / "run").glob("*.parquet"))
    assert len(staged) == 3
    # Staged, not published: readers still see the previous run, whole.
    assert snapshot(output) == before

    sink.on_write_complete(WriteResult(num_rows=7, size_bytes=0, write_returns=[first, second]))
    tally = sink.tally
    assert tally.images == 6
    assert tally.skipped == [{"source_id": "x/bad", "reason": "empty file"}]
    # Labelled images only (x/3 has no label); rows: true class, columns: predicted.
    assert tally.confusion.tolist() == [[1, 0, 0], [1, 1, 1], [0, 0, 1]]
    assert (tally.first_at, tally.first_images) == (100.0, 3)

    publish(root, tally, {"images": tally.images}, None)
    table = pq.read_table(output / PREDICTIONS)
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
    assert sorted(p.name for p in (output / PREDICTIONS).iterdir()) == [
        "part-00000.parquet",
        "part-00001.parquet",
    ]
    assert json.loads((output / SUMMARY).read_text()) == {"images": 6}


def test_files_hold_rows_per_file_rows_however_the_blocks_come(tmp_path):
    root = Location.parse(str(tmp_path / "out"))
    sink = PredictionSink(root.child(STAGING, "run"), num_classes=3, rows_per_file=2)
    ids = [f"x/{i}" for i in range(7)]
    # One block of five, one of two: the files split them at every second row.
    blocks = [batch(ids[:5], [0] * 5, [0] * 5, at=1.0), batch(ids[5:], [1, 1], [1, 1], at=2.0)]
    tally = sink.write(blocks, TaskContext(task_idx=0, op_name="Write"))
    assert [rows for _, rows in tally.parts] == [2, 2, 2, 1]
    sink.on_write_complete(WriteResult(num_rows=7, size_bytes=0, write_returns=[tally]))
    publish(root, sink.tally, {"images": 7}, None)
    files = sorted((tmp_path / "out" / PREDICTIONS).iterdir())
    assert [pq.read_metadata(f).num_rows for f in files] == [2, 2, 2, 1]
    assert pq.read_table(files[0])["source_id"].to_pylist() == ["x/0", "x/1"]
    assert pq.read_table(tmp_path / "out" / PREDICTIONS)["source_id"].to_pylist() == ids


def test_a_publish_that_fails_midway_leaves_no_summary(tmp_path):
    output = tmp_path / "out"
    previous_run(output)
    root = Location.parse(str(output))
    sink = PredictionSink(root.child(STAGING, "run"), num_classes=3, rows_per_file=10)
    tally = sink.write([batch(["x/1"], [0], [0], at=1.0)], TaskContext(task_idx=0, op_name="Write"))
    (staged,) = (output / STAGING / "run").glob("*.parquet")
    staged.unlink()  # the storage loses a part between the write and the commit
    with pytest.raises(FileNotFoundError):
        publish(root, tally, {"images": 1}, None)
    # No summary: a reader cannot take what is there for complete predictions.
    assert not (output / SUMMARY).exists()


def test_no_readable_image_still_gives_a_table(tmp_path):
    root = Location.parse(str(tmp_path / "out"))
    sink = PredictionSink(root.child(STAGING, "run"), num_classes=3, rows_per_file=10)
    only_bad = batch(["x/bad"], [0], [0], at=1.0, errors=["not an image"])
    tally = sink.write([only_bad], TaskContext(task_idx=0, op_name="Write"))
    assert tally.parts == [] and tally.images == 0
    sink.on_write_complete(WriteResult(num_rows=1, size_bytes=0, write_returns=[tally]))
    publish(root, sink.tally, {"images": 0}, None)
    table = pq.read_table(tmp_path / "out" / PREDICTIONS)
    assert table.num_rows == 0 and table.schema == PREDICTION_SCHEMA
