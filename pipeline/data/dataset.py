"""The on-storage dataset: Parquet shards per split plus a manifest that commits them.

Layout of `<output>/`:
    manifest.json                  the commit point: the dataset is the files it lists
    data/<version>/config.yaml     the resolved preprocessing config of each version
    data/<version>/train/part-00000.parquet, ...
    data/<version>/val/part-00000.parquet, ...

Each preprocess job writes a new version, only below its own `data/<version>/`, and commits it
by writing the manifest, one atomic write (a rename on local disk, a single PUT on object
stores), so a reader sees the previous dataset or the new one, whole, whatever moment a job
crashes at. After the commit the job removes the older versions. Versions are named by their
job's start time, and the newest start wins: a job that finds a newer version committed does
not replace it.
"""

from __future__ import annotations

import datetime
import logging

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
from pydantic import BaseModel, ConfigDict, ValidationError

from pipeline.core import faults
from pipeline.core.errors import InputError
from pipeline.core.storage import Location, retry

log = logging.getLogger(__name__)

SCHEMA_VERSION = 2
SPLITS = ("train", "val")
MANIFEST = "manifest.json"
CONFIG_YAML = "config.yaml"
DATA = "data"

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
    version: str  # the directory below data/ that holds its files (new_version)
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
    compression = {"image": "NONE", "label": "ZSTD", "label_name": "ZSTD", "source_id": "ZSTD"}
    retry(
        lambda: pq.write_table(
            table,
            location.path,
            filesystem=location.fs,
            row_group_size=row_group_size,
            compression=compression,
            use_dictionary=["label_name"],
        ),
        f"writing {location.uri}",
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
    """Refuse to publish over a directory that holds something other than our dataset: only
    our own `data/` is fine without a manifest (a first job that crashed before its commit)."""
    if overwrite or not root.exists() or root.child(MANIFEST).exists():
        return
    if not root.is_dir():
        raise InputError(f"output {root.uri} is a file: point output at a directory")
    selector = pafs.FileSelector(root.path)
    entries = retry(lambda: root.fs.get_file_info(selector), f"listing {root.uri}")
    foreign = sorted(e.base_name for e in entries if e.base_name != DATA)
    if foreign:
        raise InputError(
            f"output {root.uri} is not empty and holds no {MANIFEST}, so it is not a dataset "
            f"this job wrote (it has: {', '.join(foreign[:5])}). Choose an empty or new "
            "directory, or pass overwrite=true to write the dataset beside what it holds"
        )


def commit(root: Location, manifest: Manifest, config_yaml: str) -> Manifest:
    """Commit the version whose files `manifest` lists (below `data/<manifest.version>/`), then
    remove the older versions. Returns the manifest in place afterwards."""
    version_dir = root.child(DATA, manifest.version)
    version_dir.child(CONFIG_YAML).write_bytes(config_yaml.encode())
    faults.point(faults.DATASET_WRITTEN)
    try:
        current = read_manifest(root)
    except InputError:  # unreadable: this job was asked to replace it (overwrite=true)
        current = None
    if current is not None and current.version > manifest.version:
        # A job started after this one and committed first; its version stands.
        version_dir.delete()
        if current.fingerprint == manifest.fingerprint:
            log.info("version %s of the same dataset was committed meanwhile", current.version)
            return current
        raise InputError(
            f"{root.uri} was replaced while this job was writing: version {current.version}, "
            f"started after this one ({manifest.version}), committed another config first and "
            "stays. Run one preprocess job per output at a time, or submit this one again to "
            "replace it"
        )
    root.child(MANIFEST).write_bytes(manifest.model_dump_json(indent=2).encode())
    faults.point(faults.DATASET_COMMITTED)
    remove_older_versions(root, manifest.version)
    return manifest


def remove_older_versions(root: Location, version: str) -> None:
    """Delete the versions that started before `version`: the datasets its commit replaced and
    jobs that crashed. Newer ones may still be writing, so they stay."""
    older = [d for d in root.child(DATA).list_dirs() if d.base_name < version]
    for info in older:
        root.child(DATA, info.base_name).delete()
    if older:
        log.info("removed %d older version(s) below %s", len(older), root.child(DATA).uri)
