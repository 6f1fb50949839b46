"""Inference inputs as Ray Data rows, read by tasks that take no CPU and import no torch.

On CPUs the predictor actors hold every CPU, so the reads must need none: Ray Data's own
readers first list files in a task of one whole CPU, which would wait for the actors forever.
Reading encoded bytes mostly waits on storage; READ_TASKS of them at a time keep the actors fed,
and this module imports only pyarrow, so their worker processes start in a moment.
"""

from __future__ import annotations

import hashlib
import logging
import posixpath
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import ray.data

from pipeline.core.errors import InputError
from pipeline.core.storage import Location
from pipeline.data.dataset import committed_versions, read_manifest
from pipeline.data.shards import SCHEMA, check_files, read_footer, read_row_group

log = logging.getLogger(__name__)

READ_TASKS = 2
FILES_PER_READ = 64


@dataclass
class Input:
    """What an inference input holds, listed once by the driver."""

    root: Location
    files: list[str]  # Parquet shards of the split, or image files
    version: str | None  # the dataset version (None: a folder)
    classes: list[str]  # a dataset's, or a folder's <class>/ folders that hold files
    images: int  # rows of the split, or files of the folder
    identity: dict  # what makes its images these: for resume keys (pipeline.infer.resume)


def list_input(root: Location, *, split: str, version: str | None = None) -> Input:
    """The Parquet shards of `split` of a dataset's `version` (by default its newest, resolved
    once here), or the image files of a folder."""
    if versions := committed_versions(root):
        manifest = read_manifest(root, version or versions[-1])
        files = [f.path for f in manifest.splits[split].files]  # relative to root
        if not files:
            raise InputError(f"split {split!r} of dataset {root.uri} is empty")
        check_files(root, manifest, [split])
        images = manifest.splits[split].rows
        log.info(
            "input: dataset %s, version %s, split %s, %d images",
            *(root.uri, manifest.version, split, images),
        )
        # A committed version's shards never change: its name says which images.
        identity = {"input": root.uri, "dataset_version": manifest.version, "split": split}
        return Input(root, files, manifest.version, manifest.classes, images, identity)
    if version is not None:
        raise InputError(
            f"dataset_version={version}, but input={root.uri} is not a preprocessed dataset"
        )
    infos = [f for f in root.list_files() if not posixpath.basename(f.path).startswith(".")]
    if not infos:
        raise InputError(f"input={root.uri} has no files: give a dataset, a folder or an image")
    files = [f.path for f in infos]
    log.info("input: folder %s, %d files", root.uri, len(files))
    classes = sorted({label for f in files if (label := folder_label(root, f))})
    # A folder changes in place: its files' names, sizes and times say which images.
    listing = hashlib.sha256()
    for f in infos:
        listing.update(f"{f.path}\0{f.size}\0{f.mtime_ns}\n".encode())
    identity = {"input": root.uri, "files": listing.hexdigest()}
    return Input(root, files, None, classes, len(files), identity)


def read_input(inp: Input, *, skip: pa.Array | None = None) -> ray.data.Dataset | None:
    """Rows of (data: encoded image, source_id, label_name or ''): one read per Parquet shard,
    or per FILES_PER_READ image files, leaving out the images whose source_id is in `skip`;
    None where that leaves no file to read."""
    # A damaged shard's InputError raised as it is (in Ray's RayTaskError, whose message
    # `failure` takes), not wrapped in Ray Data's UserCodeException: for every dataset after.
    ray.data.DataContext.get_current().raise_original_map_exception = True
    files, reader, kwargs = inp.files, read_images, {"root": inp.root}
    if inp.version is not None:
        reader = read_shard
        if skip is not None and len(skip):
            kwargs["skip"] = ray.put(skip)  # once, not in every task's arguments
    elif skip is not None and len(skip):
        ids = pa.array([posixpath.relpath(f, inp.root.path) for f in files], pa.string())
        done = pc.is_in(ids, value_set=skip).to_pylist()
        files = [f for f, d in zip(files, done, strict=True) if not d]
        if not files:
            return None
    blocks = len(files) if inp.version is not None else -(-len(files) // FILES_PER_READ)
    ds = ray.data.from_items([{"path": f} for f in files], override_num_blocks=blocks)
    return ds.map_batches(
        reader,
        fn_kwargs=kwargs,
        batch_size=None,
        num_cpus=0,
        compute=ray.data.TaskPoolStrategy(size=READ_TASKS),
    )


def folder_label(root: Location, path: str) -> str:
    """The label of an image file below folder `root`: its <class>/ folder, or '' for none."""
    source_id = posixpath.relpath(path, root.path)
    return source_id.split("/")[0] if "/" in source_id else ""


def read_shard(batch: dict, *, root: Location, skip: ray.ObjectRef | None = None) -> dict:
    """Ray Data stage: Parquet shard paths (relative to `root`) -> their rows, but those whose
    source_id is in the array `skip` refers to (a row group of those only is read no further
    than its ids); a damaged shard is an InputError naming it (`dataset.read_row_group`)."""
    done = None if skip is None else ray.get(skip)
    columns = ["image", "source_id", "label_name"]
    tables = []
    for path in batch["path"]:
        shard = read_footer(root, path)
        for group in range(shard.metadata.num_row_groups):
            if done is None:
                tables.append(read_row_group(shard, group, columns))
                continue
            ids = read_row_group(shard, group, ["source_id"])["source_id"]
            keep = pc.invert(pc.is_in(ids, value_set=done))
            if pc.any(keep).as_py():
                tables.append(read_row_group(shard, group, columns).filter(keep))
    table = pa.concat_tables(tables) if tables else SCHEMA.empty_table().select(columns)
    return {
        "data": table["image"].to_numpy(),
        "source_id": table["source_id"].to_numpy(),
        "label_name": table["label_name"].to_numpy(),
    }


def read_images(batch: dict, *, root: Location) -> dict:
    """Ray Data stage: image file paths under `root` -> bytes, with <class>/ as the label."""
    data = [Location(root.fs, p, p).read_bytes() for p in batch["path"]]
    ids = [posixpath.relpath(p, root.path) for p in batch["path"]]
    return {
        "data": np.array(data, dtype=object),
        "source_id": np.array(ids, dtype=object),
        "label_name": np.array([folder_label(root, p) for p in batch["path"]], dtype=object),
    }
