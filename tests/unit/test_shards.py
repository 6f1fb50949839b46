"""A shard's bytes, changed in storage since preprocessing wrote them: every change reads back
the rows that were written or is one InputError naming the shard (and the row group)."""

from __future__ import annotations

import dataclasses
import random
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest
import ray.exceptions
from corpus import damage_footer, rewrite_shard

from harness.counting import ByteCounter, CountedReads
from pipeline.core import storage
from pipeline.core.errors import InputError, failure
from pipeline.core.storage import Location
from pipeline.data.dataset import Manifest, ShardFile, SplitInfo, read_manifest
from pipeline.data.shards import (
    SCHEMA,
    ShardDamaged,
    check_files,
    read_footer,
    read_row_group,
    write_shard,
)
from pipeline.export.parity import val_batches
from pipeline.infer.inputs import read_shard

CLASSES = 4
SHARD = "train/part-00000.parquet"


def shard_rows(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [
        {
            "image": rng.randbytes(24),
            "label": i % CLASSES,
            "label_name": "abcd"[i % CLASSES],
            "source_id": f"s/{i}",
        }
        for i in range(n)
    ]


def read_all(root: Location) -> list[pa.Table]:
    """Every row group of the shard, every column, as a reader of the bundle reads them."""
    footer = read_footer(root, SHARD)
    groups = range(footer.metadata.num_row_groups)
    return [read_row_group(footer, g, SCHEMA.names, classes=CLASSES) for g in groups]


def regions(path: Path, rows: list[pa.Table]) -> dict[str, range]:
    """Byte ranges of a shard: the page header and the values of the image and label columns
    of each row group (one page each), and the footer."""
    meta = pq.ParquetFile(path).metadata
    data = path.read_bytes()
    footer = int.from_bytes(data[-8:-4], "little")
    out = {"footer": range(len(data) - footer - 8, len(data))}
    for g, table in enumerate(rows):
        for c, name in enumerate(("image", "label")):
            chunk = meta.row_group(g).column(c)
            assert not chunk.has_dictionary_page
            start, end = (
                chunk.data_page_offset,
                chunk.data_page_offset + chunk.total_compressed_size,
            )
            if name == "image":  # PLAIN, uncompressed: each value's length, then its bytes
                values = end - sum(4 + len(v) for v in table["image"].to_pylist())
            else:  # ZSTD: the frame starts with its magic number
                values = data.index(b"\x28\xb5\x2f\xfd", start, end)
            out[f"{name} {g} header"] = range(start, values)
            out[f"{name} {g} values"] = range(values, end)
    return out


def test_every_flipped_bit_reads_back_the_rows_or_names_the_shard(tmp_path):
    root = Location.parse(str(tmp_path))
    write_shard(root.child(SHARD), shard_rows(12), row_group_size=4)
    path = Path(root.child(SHARD).path)
    written, want = path.read_bytes(), read_all(root)
    parts = regions(path, want)
    # Every byte of each region's first 24, then every 5th: about 700 reads, a few seconds.
    positions = sorted({i for r in parts.values() for i in (*r[:24], *r[24::5])})
    outcome: dict[str, list[str]] = {name: [] for name in parts}
    for i in positions:
        data = bytearray(written)
        data[i] ^= 1 << (i % 8)
        path.write_bytes(data)
        try:
            got = read_all(root)
        except InputError as e:
            message = str(e)
            assert root.child(SHARD).uri in message, (i, message)
            assert failure(e) == (1, message)  # the job's exit code: bad input
            if not isinstance(e, ShardDamaged):  # the footer's schema is another one's
                assert "does not have the schema this code reads" in message, (i, message)
            elif "its footer" not in message:
                assert "is damaged: row group" in message or "of row group" in message, message
            result = "failed"
        else:
            assert len(got) == len(want), i
            for a, b in zip(got, want, strict=True):
                assert a.equals(b), i  # never other rows, or other labels
            result = "same"
        for name, r in parts.items():
            if i in r:
                outcome[name].append(result)
    for name, results in outcome.items():
        assert "failed" in results, name  # each region was hit, and a change to it found
        if name.endswith("values"):  # every one: each page carries a checksum of its bytes
            assert set(results) == {"failed"}, (name, results)


def test_shards_written_without_page_checksums_still_read(tmp_path):
    # Preprocessing wrote no checksums before: verification finds none, and checks nothing.
    root = Location.parse(str(tmp_path))
    rows = shard_rows(10)
    table = pa.Table.from_pylist(rows, schema=SCHEMA)
    root.child(SHARD).create_parent()
    pq.write_table(table, root.child(SHARD).path, row_group_size=4)
    assert [len(t) for t in read_all(root)] == [4, 4, 2]
    assert pa.concat_tables(read_all(root)).equals(table)


def test_a_label_that_is_no_class_names_its_row(tmp_path):
    root = Location.parse(str(tmp_path))
    rows = shard_rows(10)
    rows[6]["label"] = 253
    write_shard(root.child(SHARD), rows, row_group_size=4)
    with pytest.raises(ShardDamaged) as raised:
        read_all(root)
    assert str(raised.value) == (
        f"dataset {root.uri} is damaged: row 2 of row group 1 of {root.child(SHARD).uri}: label "
        "253, but the dataset has 4 classes; re-run preprocessing with overwrite=true"
    )


def test_a_read_that_fails_is_retried_not_taken_for_damage(tmp_path, monkeypatch):
    monkeypatch.setattr(storage, "FIRST_WAIT_S", 0.01)
    root = Location.parse(str(tmp_path / "d"))
    write_shard(root.child(SHARD), shard_rows(8), row_group_size=4)
    counter = ByteCounter(pafs.LocalFileSystem(), tmp_path / "counts")
    footer = dataclasses.replace(read_footer(root, SHARD), root=counter.location(root))
    dropped = OSError("AWS Error NETWORK_CONNECTION during GetObject operation: curlCode: 28")
    reads = {"left": 2}  # reads that drop, as a connection does mid-read
    real = CountedReads.read

    def read(self, nbytes=None):
        reads["left"] -= 1
        if reads["left"] >= 0:
            raise dropped
        return real(self, nbytes)

    monkeypatch.setattr(CountedReads, "read", read)
    assert read_row_group(footer, 1, ["image", "label"]).equals(
        read_row_group(read_footer(root, SHARD), 1, ["image", "label"])
    )
    reads["left"] = 100  # every attempt's read drops: storage's error, exit 3
    with pytest.raises(OSError, match="NETWORK_CONNECTION") as raised:
        read_row_group(footer, 1, ["image", "label"])
    assert not isinstance(raised.value, InputError)
    assert failure(raised.value)[0] == 3


def test_the_drivers_check_of_an_old_manifest_names_a_damaged_footer(tmp_path):
    # A manifest from before sizes were recorded: the driver reads each footer.
    root = Location.parse(str(tmp_path))
    write_shard(root.child(SHARD), shard_rows(8), row_group_size=4)
    path = Path(root.child(SHARD).path)
    data = bytearray(path.read_bytes())
    data[-8:-4] = (len(data) * 2).to_bytes(4, "little")  # a footer longer than the file
    path.write_bytes(data)
    manifest = Manifest(
        version="v",
        created_at=Manifest.now(),
        fingerprint="f",
        classes=list("abcd"),
        image_size=8,
        image_format="png",
        mean=(0, 0, 0),
        std=(1, 1, 1),
        splits={"train": SplitInfo(rows=8, files=[ShardFile(path=SHARD, rows=8)])},
        skipped=[],
        config={},
    )
    with pytest.raises(InputError, match=rf"{SHARD} \(its footer does not read as Parquet"):
        check_files(root, manifest, ["train"])


def test_inference_reads_a_dataset_split_as_training_does(tmp_path):
    root = Location.parse(str(tmp_path))
    rows = shard_rows(10)
    write_shard(root.child(SHARD), rows, row_group_size=4)
    got = read_shard({"path": [SHARD]}, root=root)  # a read task of `read_input`
    assert list(got["source_id"]) == [r["source_id"] for r in rows]
    assert [bytes(b) for b in got["data"]] == [r["image"] for r in rows]
    path = Path(root.child(SHARD).path)
    data = bytearray(path.read_bytes())
    data[len(data) - 8 - int.from_bytes(data[-8:-4], "little")] ^= 0xFF  # the footer's start
    path.write_bytes(data)
    with pytest.raises(ShardDamaged, match=rf"{root.child(SHARD).uri}: its footer does not read"):
        read_shard({"path": [SHARD]}, root=root)


def test_the_parity_check_reads_the_val_split_and_names_a_label_of_no_class(tiny_dataset, tmp_path):
    root = Location.parse(str(tiny_dataset))
    manifest = read_manifest(root)
    batches = list(val_batches(root, manifest, images=None, batch_size=32))
    assert sum(len(labels) for _, labels in batches) == manifest.splits["val"].rows
    copy = Location.parse(str(tmp_path / "d"))
    shutil.copytree(root.path, copy.path)
    path = manifest.splits["val"].files[0].path
    rewrite_shard(Path(copy.child(path).path), page_checksums=True, label=(0, -1))
    with pytest.raises(ShardDamaged, match=r"row 0 of row group 0 of .*: label -1, but the"):
        list(val_batches(copy, manifest, images=None, batch_size=32))


def test_a_read_tasks_damaged_shard_ends_a_job_with_its_own_line(tmp_path):
    # As inference's Ray Data reads raise it: Ray's RayTaskError of the task's error, whose text
    # is the task's traceback, and Ray Data's lines added to the error's own.
    root = Location.parse(str(tmp_path))
    write_shard(root.child(SHARD), shard_rows(8), row_group_size=4)
    path = Path(root.child(SHARD).path)
    damage_footer(path)
    with pytest.raises(ShardDamaged) as raised:
        read_shard({"path": [SHARD]}, root=root)
    line = str(raised.value)
    raised.value.args = (f"{line}\nFailed to apply UDF transform after 1/1 attempts.",)
    error = ray.exceptions.RayTaskError(
        "read_shard", "Traceback (most recent call last): ...", raised.value
    ).as_instanceof_cause()
    assert isinstance(error, InputError)
    assert failure(error) == (1, line)
