"""Ray Data ingest (`ingest: ray_data`) reads the stored dataset as the loader does: a new order of
blocks each epoch, the same for the same seed, and one error naming a damaged row. Ray runs in
the test process."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray.data
from corpus import rewrite_shard
from numbered import CLASSES, TRAIN_FILES, damaged_copy, numbered_dataset

from pipeline.core.errors import InputError
from pipeline.train.input import ray_data


@pytest.fixture(scope="module")
def numbered(tmp_path_factory):
    return numbered_dataset(tmp_path_factory.mktemp("numbered"))


def block_order(split) -> list[int]:
    """The files of the numbered dataset in the order one pass over the split reads them."""
    files = []
    for batch in split.iter_batches(batch_format="numpy"):
        images = batch["image"]
        for row_id in images[:, 0, 0, 0].astype(int) + 256 * images[:, 1, 0, 0].astype(int):
            if not files or files[-1] != row_id // 100:
                files.append(int(row_id // 100))
    return files


def test_ray_data_reads_train_blocks_in_a_new_order_each_epoch(
    numbered, ray_in_process, monkeypatch
):
    root, manifest, _ = numbered
    # A block per file: Ray Data reads files this small as one block, which has no order.
    table = pa.concat_tables(
        pq.read_table(root.child(f.path).path, columns=["image", "label"])
        for f in manifest.splits["train"].files
    )
    rows = table.to_pylist()
    monkeypatch.setattr(
        ray_data,
        "read_split",
        lambda *_: ray.data.from_items(rows, override_num_blocks=TRAIN_FILES),
    )

    def epochs(n: int) -> list[list[int]]:
        train = ray_data.datasets(manifest, root, augment="none", seed=0)["train"]
        train.context.execution_options.preserve_order = True  # rows leave in block order
        (split,) = train.streaming_split(1, equal=True)  # as Ray Train splits it
        return [block_order(split) for _epoch in range(n)]

    first, second = epochs(2)
    assert sorted(first) == list(range(TRAIN_FILES))
    assert first != second
    assert epochs(1) == [first]  # a run with the same seed reads the same orders


def test_ray_data_reads_row_groups_as_the_loader_does(numbered, tmp_path, ray_in_process):
    root, manifest, ids = numbered
    rows = ray_data.read_split(root, manifest, "val").take_all()
    assert sorted(r["label"] for r in rows) == sorted(i % len(CLASSES) for i in ids["val"])
    copy, path = damaged_copy(
        numbered,
        tmp_path,
        "val",
        2,
        lambda shard: rewrite_shard(shard, page_checksums=True, label=(12, 9)),
    )
    val = ray_data.datasets(manifest, copy, augment="none", seed=0)["val"]
    with pytest.raises(InputError) as raised:  # as a worker's ShardBatches raises it
        list(ray_data.input_errors_raised(val.iter_torch_batches(batch_size=16)))
    assert str(raised.value) == (
        f"dataset {copy.uri} is damaged: row 2 of row group 1 of {copy.uri}/{path}: label 9, "
        f"but the dataset has {len(CLASSES)} classes; re-run preprocessing with overwrite=true"
    )
