"""The on-storage dataset: Parquet shards per split plus a manifest that commits them.

Layout of `<output>/`:
    manifest.json          written last: a dataset exists only once it is there
    config.yaml            the resolved preprocessing config
    train/part-00000.parquet, ...
    val/part-00000.parquet, ...
    _staging/<run>/...     a run in progress (pyarrow and Ray Data ignore `_` paths)
"""

from __future__ import annotations

import datetime
import logging

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
from pydantic import BaseModel, ConfigDict, ValidationError

from pipeline.errors import InputError
from pipeline.storage import Location

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
SPLITS = ("train", "val")
MANIFEST = "manifest.json"
CONFIG_YAML = "config.yaml"
STAGING = "_staging"

SCHEMA = pa.schema(
    [
        pa.field("image", pa.binary(), nullable=False),  # encoded JPEG/PNG, image_size square
        pa.field("label", pa.int64(), nullable=False),  # index into manifest.classes
        pa.field("label_name", pa.string(), nullable=False),
        pa.field("source_id", pa.string(), nullable=False),  # stable id of the source image
    ]
)


class ShardFile(BaseModel):
    path: str  # relative to the dataset root
    rows: int


class SplitInfo(BaseModel):
    rows: int = 0
    counts: dict[str, int] = {}  # class name -> rows
    files: list[ShardFile] = []


class Skipped(BaseModel):
    source_id: str
    reason: str


class Manifest(BaseModel):
    """What a reader needs to trust and use the dataset, in one small JSON file."""

    model_config = ConfigDict(extra="forbid")

    schema_version: int = SCHEMA_VERSION
    created_at: str
    fingerprint: str
    classes: list[str]
    image_size: int
    image_format: str
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    splits: dict[str, SplitInfo]
    skipped: list[Skipped]
    config: dict

    @staticmethod
    def now() -> str:
        return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def write_shard(location: Location, rows: list[dict], *, row_group_size: int) -> None:
    """One Parquet file; images are already compressed, so only the small columns get zstd."""
    table = pa.Table.from_pylist(rows, schema=SCHEMA)
    location.create_parent()
    pq.write_table(
        table,
        location.path,
        filesystem=location.fs,
        row_group_size=row_group_size,
        compression={"image": "NONE", "label": "ZSTD", "label_name": "ZSTD", "source_id": "ZSTD"},
        use_dictionary=["label_name"],
    )


def read_manifest(root: Location) -> Manifest | None:
    """The committed manifest, or None if there is no complete dataset at `root`."""
    path = root.child(MANIFEST)
    if not path.exists():
        return None
    try:
        manifest = Manifest.model_validate_json(path.read_bytes())
    except ValidationError as e:  # not JSON, fields missing or of the wrong type
        problems = "; ".join(
            f"{'.'.join(map(str, err['loc'])) or 'file'}: {err['msg']}" for err in e.errors()[:3]
        )
        raise InputError(
            f"{path.uri} is not a manifest this code can read ({problems}). "
            "Re-run preprocessing with overwrite=true"
        ) from None
    if manifest.schema_version != SCHEMA_VERSION:
        raise InputError(
            f"{path.uri} has schema version {manifest.schema_version}; this code reads "
            f"{SCHEMA_VERSION}: re-run preprocessing with overwrite=true"
        )
    return manifest


def check_replaceable(root: Location, *, overwrite: bool) -> None:
    """Refuse to publish over a directory that holds something other than our dataset.

    Publishing deletes `train/` and `val/`: in a folder of raw images laid out that way, that
    would destroy the user's data. Only our own leftovers (`_staging`) are fine without a
    manifest."""
    if overwrite or not root.exists() or root.child(MANIFEST).exists():
        return
    if not root.is_dir():
        raise InputError(f"output {root.uri} is a file: point output at a directory")
    entries = root.fs.get_file_info(pafs.FileSelector(root.path))
    foreign = sorted(e.base_name for e in entries if e.base_name != STAGING)
    if foreign:
        raise InputError(
            f"output {root.uri} is not empty and holds no {MANIFEST}, so it is not a dataset "
            f"this job wrote (it has: {', '.join(foreign[:5])}). Choose an empty or new "
            "directory; or, if a previous run was interrupted while publishing, or you mean to "
            "replace its train/ and val/, pass overwrite=true"
        )


def publish(root: Location, staging: Location, manifest: Manifest, config_yaml: str) -> None:
    """Move a complete staged dataset into place, committing it with the manifest last.

    Readers go through the manifest, so from its removal to its rewrite they see no dataset
    rather than a mix of two: a crash in between leaves `root` without a manifest, and the next
    run replaces it. Object stores have no atomic directory rename, hence this order."""
    root.child(MANIFEST).delete()
    for split in SPLITS:
        root.child(split).delete()
    for info in manifest.splits.values():
        for f in info.files:
            target = root.child(f.path)
            target.create_parent()
            root.fs.move(staging.child(f.path).path, target.path)
    root.child(CONFIG_YAML).write_bytes(config_yaml.encode())
    root.child(MANIFEST).write_bytes(manifest.model_dump_json(indent=2).encode())
    staging.delete()
