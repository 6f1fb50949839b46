"""A dataset's shards: the Parquet files of a version's splits, as written and as read back.

Each shard is written with a CRC per page and read a row group at a time from its footer;
bytes that are not what preprocessing wrote are a ShardDamaged (an InputError) that names the
row group and row, never retried, while storage's own errors are. `check_files` finds a
version's shards missing or changed with metadata reads alone.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from pipeline.core.errors import InputError, first_line
from pipeline.core.storage import Location, retry
from pipeline.data.dataset import SPLITS, Manifest

SCHEMA = pa.schema(
    [
        pa.field("image", pa.binary(), nullable=False),  # encoded JPEG/PNG, image_size square
        pa.field("label", pa.int64(), nullable=False),  # index into manifest.classes
        pa.field("label_name", pa.string(), nullable=False),
        pa.field("source_id", pa.string(), nullable=False),  # stable id of the source image
    ]
)


def write_shard(location: Location, rows: list[dict], *, row_group_size: int) -> int:
    """One Parquet file, and its size in bytes; images are already compressed, so only the
    small columns get zstd. Each page carries a CRC of its bytes, which every read checks
    (`read_row_group`)."""
    table = pa.Table.from_pylist(rows, schema=SCHEMA)
    location.create_parent()
    compression = {"image": "NONE", "label": "ZSTD", "label_name": "ZSTD", "source_id": "ZSTD"}
    retry(
        lambda: pq.write_table(
            table,
            location.path,
            filesystem=location.fs,
            row_group_size=row_group_size,
            compression=compression,
            use_dictionary=["label_name"],
            write_page_checksum=True,
        ),
        f"writing {location.uri}",
    )
    return location.info().size


# pyarrow's errors for bytes that do not parse as what was written: once the bytes are in memory
# (storage read them, with its own retries), no retry reads other ones.
PARSE_ERRORS = (OSError, ValueError, pa.ArrowException)


# Bytes read from a shard's end, in one request: its footer and the 8 bytes after it (a footer
# past that costs a second request).
TAIL_BYTES = 64 * 1024


@dataclass(frozen=True)
class ShardFooter:
    """A shard's footer, read once so that each row group read fetches only its columns."""

    root: Location  # the dataset it belongs to, which its errors name
    path: str  # on root.fs
    uri: str
    size: int  # bytes
    metadata: pq.FileMetaData


class ShardDamaged(InputError):
    """A shard's bytes are not the Parquet that preprocessing wrote (changed in storage since):
    `what` says how."""

    def __init__(self, message: str, what: str):
        super().__init__(message)
        self.what = what

    def __reduce__(self):  # raised in a loader process, handed to the trainer's
        return type(self), (str(self), self.what)


def damaged(
    root: Location, uri: str, what: str, *, group: int | None = None, row: int | None = None
) -> ShardDamaged:
    """The error for damaged bytes of shard `uri` of dataset `root`, naming the row group and
    row where known."""
    where = "" if row is None else f"row {row} of "
    where += "" if group is None else f"row group {group} of "
    return ShardDamaged(
        f"dataset {root.uri} is damaged: {where}{uri}: {what}; re-run preprocessing with "
        "overwrite=true",
        what,
    )


def missing(loc: Location) -> InputError:
    return InputError(
        f"{loc.uri} is listed in the manifest but missing: the dataset is damaged; "
        "re-run preprocessing with overwrite=true"
    )


def read_footer(root: Location, path: str) -> ShardFooter:
    """The footer of shard `path` (relative to `root`): ShardDamaged if its bytes are not a
    footer, an InputError if it is a footer of another schema."""
    loc = root.child(path)

    def tail() -> tuple[int, bytes]:
        with loc.fs.open_input_file(loc.path) as fh:
            size = fh.size()
            data = fh.read_at(min(size, TAIL_BYTES), size - min(size, TAIL_BYTES))
            length = int.from_bytes(data[-8:-4], "little") + 8 if size >= 8 else 0
            if len(data) < length <= size:  # a footer longer than the first request
                data = fh.read_at(length, size - length)
            return size, data

    try:
        size, data = retry(tail, f"reading {loc.uri}")
    except FileNotFoundError:
        raise missing(loc) from None
    try:
        # From memory: pyarrow finds the footer at the end of what it is given.
        metadata = pq.ParquetFile(pa.BufferReader(data)).metadata
        schema = metadata.schema.to_arrow_schema()
    except PARSE_ERRORS as e:
        what = f"its footer does not read as Parquet ({first_line(e)})"
        raise damaged(root, loc.uri, what) from None
    if not schema.equals(SCHEMA, check_metadata=False):
        raise InputError(
            f"{loc.uri} does not have the schema this code reads ({SCHEMA.names}); re-run "
            "preprocessing with overwrite=true"
        )
    return ShardFooter(root, loc.path, loc.uri, size, metadata)


def read_row_group(
    shard: ShardFooter, group: int, columns: Sequence[str], *, classes: int | None = None
) -> pa.Table:
    """Row group `group` of `shard`, its `columns`, each page checked against its CRC; with
    `classes`, each label checked to be one of them. Bytes that are not what preprocessing
    wrote are a ShardDamaged naming the row group (and row), never retried: only storage's own
    errors are, as `retry` may."""

    def read() -> pa.Table:
        with shard.root.fs.open_input_file(shard.path) as fh:
            source = Reads(fh)
            # pre_buffer: the columns' chunks in one coalesced read (one GET on S3).
            parquet = pq.ParquetFile(
                pa.PythonFile(source, mode="r"),
                metadata=shard.metadata,
                pre_buffer=True,
                page_checksum_verification=True,
            )
            try:
                return parquet.read_row_group(group, columns=list(columns))
            except PARSE_ERRORS as e:
                if source.failed is not None:  # the read's, not the bytes'
                    raise source.failed from None
                what = f"it does not read as Parquet ({first_line(e)})"
                raise damaged(shard.root, shard.uri, what, group=group) from None

    try:
        table = retry(read, f"reading {shard.uri}")
    except FileNotFoundError:
        raise missing(Location(shard.root.fs, shard.path, shard.uri)) from None
    rows = shard.metadata.row_group(group).num_rows
    if table.num_rows != rows:
        what = f"{table.num_rows} rows read where its footer says {rows}"
        raise damaged(shard.root, shard.uri, what, group=group)
    if classes is not None and "label" in columns:
        labels = table.column("label")
        bad = pc.or_(pc.less(labels, 0), pc.greater_equal(labels, classes))
        if pc.any(bad).as_py():
            row = pc.index(bad, True).as_py()
            what = f"label {labels[row].as_py()}, but the dataset has {classes} classes"
            raise damaged(shard.root, shard.uri, what, group=group, row=row)
    return table


class Reads:
    """A file's reads for pyarrow, which keep storage's error apart: pyarrow raises a failed
    read and bytes that do not parse alike (an OSError), but only the first may pass.

    pyarrow learns a Python file's size by seeking to its end and back. GCS's file opens a
    ranged read at each seek, which the service refuses at the end (HTTP 416,
    apache/arrow#38854), so a position at or past the end is kept here, never sought."""

    def __init__(self, file: pa.NativeFile):
        self.file, self.failed = file, None
        self.size = file.size()
        self.beyond: int | None = None  # the position, when at or past the end

    def read(self, n: int = -1) -> pa.Buffer:
        if self.beyond is not None:
            return pa.py_buffer(b"")
        try:
            return self.file.read_buffer(n if n >= 0 else None)
        except OSError as e:
            self.failed = e
            raise

    def seek(self, pos: int, whence: int = 0) -> int:
        target = (0, self.tell(), self.size)[whence] + pos
        self.beyond = target if target >= self.size else None
        return target if self.beyond is not None else self.file.seek(target)

    def tell(self) -> int:
        return self.beyond if self.beyond is not None else self.file.tell()

    @property
    def closed(self) -> bool:
        return self.file.closed

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True


def check_files(root: Location, manifest: Manifest, splits: Iterable[str] = SPLITS) -> None:
    """Raise InputError if a shard file of `splits` that `manifest` lists is gone, or is not the
    file that was written (another size, or no Parquet footer): metadata reads on the driver,
    rather than every worker failing on the file and the job's retries used up on it."""
    files = [f for split in splits for f in manifest.splits[split].files]
    paths = [root.child(f.path).path for f in files]
    found = retry(lambda: root.fs.get_file_info(paths), f"looking up {root.uri}")  # one call
    changed = []
    for file, info in zip(files, found, strict=True):
        if info.type == pafs.FileType.NotFound:
            changed.append(f"{file.path} (missing)")
        elif file.size is not None and info.size != file.size:
            changed.append(f"{file.path} ({info.size} bytes, written as {file.size})")
        elif file.size is None and (problem := _footer_problem(root, file.path)):
            # A manifest from before sizes were recorded: the file's footer, read.
            changed.append(f"{file.path} ({problem})")
    if changed:
        raise InputError(
            f"dataset {root.uri} is damaged: {len(changed)} files its version {manifest.version} "
            f"lists are missing or changed: {', '.join(changed[:3])}. Re-run preprocessing with "
            "overwrite=true"
        )


def _footer_problem(root: Location, path: str) -> str | None:
    """Why shard `path` cannot be read, or None if its footer reads."""
    try:
        read_footer(root, path)
    except ShardDamaged as e:
        return e.what
    return None
