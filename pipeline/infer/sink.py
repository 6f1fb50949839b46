"""Predictions as Parquet parts: the table of one predicted batch, the write tasks that append
such tables to parts in a version's predictions.parquet/, and the `Tally` each task returns.

The predictor actors hand each batch on as a table; write tasks append it to a part and return
a `Tally`: the part's path and rows, a confusion matrix of counts and the files skipped. The
driver sums the tallies, so no prediction passes through it and its memory does not grow with
the input. This module imports no torch: the write tasks take no CPU and must start in a moment,
like the reads (pipeline.infer.inputs).
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from ray.data.block import Block, BlockAccessor
from ray.data.datasource import Datasink, WriteResult

from pipeline.core import faults
from pipeline.core.storage import Location

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
