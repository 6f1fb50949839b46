"""The on-storage dataset: Parquet shards per split, in versions committed to an append-only log.

Layout of `<output>/`:
    versions/<version>.json        a committed version's manifest, written once and never changed:
                                   the dataset at <output> is the newest of them
    data/<version>/_version.json   written first: marks the directory as this bundle's
                                   (core.storage.mark_version)
    data/<version>/config.yaml     the resolved preprocessing config
    data/<version>/train/part-00000.parquet, ...
    data/<version>/val/part-00000.parquet, ...

Each preprocess job writes a new version below its own `data/<version>/` and commits it by
writing `versions/<version>.json`, one atomic write (a rename on local disk, a single PUT on
object stores) of a name no other job writes. Versions are named by their job's start time, so
the newest start wins: two jobs committing at once, in any interleaving, each add one entry to
the log, and every reader takes the same newest one. No commit rewrites or deletes a file that
another job wrote, so there is nothing to race on.

A reader resolves a version once (the newest, or one it pinned) and reads exactly the files its
manifest lists. Those files stay for `retention_hours` after a newer version is committed: only
then does a later preprocess job remove them (`remove_expired`), as table formats vacuum. The
newest version is never removed, and nothing is removed that lacks the bundle's marker.

The shards themselves (their Parquet schema, written and read back): pipeline.data.shards.
"""

from __future__ import annotations

import datetime
import logging

import pyarrow.fs as pafs
from pydantic import BaseModel, ConfigDict, ValidationError

from pipeline.core import faults
from pipeline.core.errors import InputError, validation_problems
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

SCHEMA_VERSION = 3
SPLITS = ("train", "val")
VERSIONS = "versions"
DATA = "data"
CONFIG_YAML = "config.yaml"


class ShardFile(BaseModel):
    path: str  # relative to the dataset root
    rows: int
    size: int | None = None  # bytes as written; None in manifests of before it was recorded


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
        return _now()


def committed_versions(root: Location) -> list[str]:
    """The versions committed at `root`, oldest first; none if it holds no dataset."""
    log_dir = root.child(VERSIONS)
    selector = pafs.FileSelector(log_dir.path, allow_not_found=True)
    infos = retry(lambda: root.fs.get_file_info(selector), f"listing {log_dir.uri}")
    names = (i.base_name for i in infos if i.type == pafs.FileType.File)
    # Skips the temporary files of commits in progress on local disk (".<name>.tmp-<pid>").
    return sorted(n.removesuffix(".json") for n in names if n.endswith(".json") and n[0] != ".")


def read_manifest(root: Location, version: str | None = None) -> Manifest | None:
    """The manifest of `version` at `root`, by default of the newest; None if `root` holds no
    committed dataset. A version asked for by name must be there."""
    listed = version is None  # then just listed: no need to look it up again
    if listed:
        versions = committed_versions(root)
        if not versions:
            return None
        version = versions[-1]
    path = root.child(VERSIONS, f"{version}.json")
    if not listed and not path.exists():
        raise InputError(
            f"dataset {root.uri} has no version {version} (it has: "
            f"{', '.join(committed_versions(root)[-3:]) or 'none'}): it was removed "
            "retention_hours after a newer one was committed, or never committed. Train on the "
            "newest version, or preprocess the data again"
        )
    try:
        manifest = Manifest.model_validate_json(path.read_bytes())
    except ValidationError as e:  # not JSON, fields missing or of the wrong type
        raise UnreadableManifest(
            f"{path.uri} is not a manifest this code can read ({validation_problems(e)})"
        ) from None
    if manifest.schema_version != SCHEMA_VERSION:
        raise UnreadableManifest(
            f"{path.uri} has schema version {manifest.schema_version}; this code reads "
            f"{SCHEMA_VERSION}"
        )
    return manifest


class UnreadableManifest(InputError):
    """A committed version's manifest that this code cannot read: `problem` says why."""

    def __init__(self, problem: str):
        super().__init__(f"{problem}. Re-run preprocessing with overwrite=true")
        self.problem = problem


def start_version(root: Location) -> str:
    """A new version at `root`: its name, its directory `data/<version>/` marked as the bundle's
    before anything else is written in it."""
    version = new_version()
    mark_version(root.child(DATA, version))
    return version


def check_replaceable(root: Location, *, overwrite: bool) -> None:
    """Refuse to write into a directory that holds anything but this bundle's datasets; with
    `overwrite` the new version goes beside what it holds, which stays untouched."""
    if overwrite or not root.exists():
        return
    if not root.is_dir():
        raise InputError(f"output {root.uri} is a file: point output at a directory")
    foreign = foreign_entries(root, (VERSIONS, DATA), versions=DATA)
    if foreign:
        raise InputError(
            f"output {root.uri} holds files this bundle did not write "
            f"({', '.join(foreign[:5])}), so it is not a dataset of its own. Choose an "
            "empty or new directory, or pass overwrite=true to write the dataset beside them"
        )


def commit(root: Location, manifest: Manifest, config_yaml: str) -> Manifest:
    """Commit the version whose files `manifest` lists (below `data/<manifest.version>/`) by
    adding it to the log. Returns the manifest of the dataset in place afterwards."""
    version_dir = root.child(DATA, manifest.version)
    version_dir.child(CONFIG_YAML).write_bytes(config_yaml.encode())
    faults.point(faults.DATASET_WRITTEN)
    try:
        current = read_manifest(root)
    except InputError:  # unreadable: this job was asked to replace it (overwrite=true)
        current = None
    if current is not None and current.version > manifest.version:
        # A job started after this one and committed first; its version stands. This one was
        # never committed, so no reader can have its files.
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
    # A newer job may commit between the check above and this write: its entry then sorts
    # after this one, and readers take it, as if it had committed a moment later.
    entry = root.child(VERSIONS, f"{manifest.version}.json")
    entry.write_bytes(manifest.model_dump_json(indent=2).encode())
    faults.point(faults.DATASET_COMMITTED)
    return manifest


def remove_expired(root: Location, retention_hours: float) -> list[str]:
    """Remove the versions no reader may still need; return their names.

    A committed version expires `retention_hours` after the next newer one was committed; a
    version never committed (its job crashed, or lost the race to a newer one) expires
    `retention_hours` after its job started, once a newer one is committed: until then it may
    be a job still writing. The newest committed version never expires, and only directories
    with the bundle's marker are touched.

    A version whose manifest cannot be read is skipped, with a warning: it stays, files and
    all, for a person to look at. The version before it counts as replaced when the next
    readable version was committed, later than in truth, so it is kept longer, never shorter."""
    cutoff_at = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(
        hours=retention_hours
    )
    cutoff = cutoff_at.isoformat(timespec="microseconds")  # as Manifest.created_at is written
    versions = committed_versions(root)
    created = {v: t for v in versions if (t := _created_at(root, v)) is not None}
    removed = []
    for i, older in enumerate(versions[:-1]):
        replaced = next((created[v] for v in versions[i + 1 :] if v in created), None)
        if older in created and replaced is not None and replaced <= cutoff:
            # The log entry first: no reader resolves this version any more.
            root.child(VERSIONS, f"{older}.json").delete()
            removed.append(older)
    kept, newest = set(versions) - set(removed), versions[-1] if versions else ""
    for info in root.child(DATA).list_dirs():
        name = info.base_name
        if name in kept or name > newest:  # read, or perhaps a job still writing
            continue
        started = version_started(name)
        if started is None or (name not in removed and started > cutoff_at):
            continue
        version_dir = root.child(DATA, name)
        if is_marked(version_dir):
            version_dir.delete()
            removed.append(name)
    removed = sorted(set(removed))
    if removed:
        log.info(
            "removed %d version(s) older than retention_hours=%g: %s",
            *(len(removed), retention_hours, ", ".join(removed)),
        )
    return removed


def _created_at(root: Location, version: str) -> str | None:
    """When `version` was committed; None, with a warning, if its manifest cannot be read."""
    try:
        return read_manifest(root, version).created_at
    except UnreadableManifest as e:
        log.warning(
            "retention skips version %s: %s. It stays, with its files, until removed by hand "
            "(%s and %s/) once no one needs to look at it",
            *(version, e.problem, root.child(VERSIONS, f"{version}.json").uri),
            root.child(DATA, version).uri,
        )
        return None
    except InputError:  # gone since listed: another job's retention removed it
        return None


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="microseconds")
