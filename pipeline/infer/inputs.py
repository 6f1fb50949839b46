"""Inference inputs as Ray Data rows, read by tasks that take no CPU and import no torch.

On CPUs the predictor actors hold every CPU, so the reads must need none: Ray Data's own
readers first list files in a task of one whole CPU, which would wait for the actors forever.
Reading encoded bytes mostly waits on storage; READ_TASKS of them at a time keep the actors fed,
and this module imports only pyarrow, so their worker processes start in a moment.
"""

from __future__ import annotations

import logging
import posixpath

import numpy as np
import pyarrow as pa
import ray.data

from pipeline.core.errors import InputError
from pipeline.core.storage import Location
from pipeline.data.dataset import (
    SCHEMA,
    check_files,
    committed_versions,
    read_footer,
    read_manifest,
    read_row_group,
)

log = logging.getLogger(__name__)

READ_TASKS = 2
FILES_PER_READ = 64


def read_input(
    root: Location, *, split: str, version: str | None = None
) -> tuple[ray.data.Dataset, str | None, list[str]]:
    """Rows of (data: encoded image, source_id, label_name or ''): one read per Parquet shard
    of `split` of a dataset's `version` (by default its newest, resolved once here), or per
    FILES_PER_READ image files of a folder; the dataset version read (None: a folder); and the
    input's classes (a dataset's, or a folder's <class>/ folders that hold files)."""
    # A damaged shard's InputError raised as it is (in Ray's RayTaskError, whose message
    # `failure` takes), not wrapped in Ray Data's UserCodeException: for every dataset after.
    ray.data.DataContext.get_current().raise_original_map_exception = True
    if versions := committed_versions(root):
        manifest = read_manifest(root, version or versions[-1])
        files = [f.path for f in manifest.splits[split].files]  # relative to root
        if not files:
            raise InputError(f"split {split!r} of dataset {root.uri} is empty")
        check_files(root, manifest, [split])
        log.info(
            "input: dataset %s, version %s, split %s, %d images",
            *(root.uri, manifest.version, split, manifest.splits[split].rows),
        )
        reader, blocks, version = read_shard, len(files), manifest.version
        classes = manifest.classes
    else:
        if version is not None:
            raise InputError(
                f"dataset_version={version}, but input={root.uri} is not a preprocessed dataset"
            )
        files = [
            f.path for f in root.list_files() if not posixpath.basename(f.path).startswith(".")
        ]
        if not files:
            raise InputError(f"input={root.uri} has no files: give a dataset, a folder or an image")
        log.info("input: folder %s, %d files", root.uri, len(files))
        reader, blocks = read_images, -(-len(files) // FILES_PER_READ)
        classes = sorted({label for f in files if (label := folder_label(root, f))})
    ds = ray.data.from_items([{"path": f} for f in files], override_num_blocks=blocks)
    rows = ds.map_batches(
        reader,
        fn_kwargs={"root": root},
        batch_size=None,
        num_cpus=0,
        compute=ray.data.TaskPoolStrategy(size=READ_TASKS),
    )
    return rows, version, classes


def folder_label(root: Location, path: str) -> str:
    """The label of an image file below folder `root`: its <class>/ folder, or '' for none."""
    source_id = posixpath.relpath(path, root.path)
    return source_id.split("/")[0] if "/" in source_id else ""


def read_shard(batch: dict, *, root: Location) -> dict:
    """Ray Data stage: Parquet shard paths (relative to `root`) -> their rows; a damaged one
    is an InputError naming it (`dataset.read_row_group`)."""
    columns = ["image", "source_id", "label_name"]
    shards = [read_footer(root, p) for p in batch["path"]]
    tables = [
        read_row_group(shard, g, columns)
        for shard in shards
        for g in range(shard.metadata.num_row_groups)
    ]
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
