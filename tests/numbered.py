"""The numbered dataset: generated images whose first pixel holds their row id, in files and
row groups of awkward sizes, so that a test reads which rows a loader gave, in which order. The
unit tier's loader tests and the Ray tier's Ray Data tests share it."""

from __future__ import annotations

import io
import shutil
from pathlib import Path

import numpy as np
from PIL import Image

from pipeline.core.storage import Location
from pipeline.data.dataset import VERSIONS, Manifest, ShardFile, SplitInfo
from pipeline.data.images import IMAGENET_MEAN, IMAGENET_STD
from pipeline.data.shards import write_shard

CLASSES = ["a", "b", "c", "d"]
# The numbered dataset: files of 97 rows in row groups of 10 (the last one of 7), so groups
# straddle every batch and rank boundary. Row ids: 100 * file + row in file; val's files come
# after train's.
FILE_ROWS, GROUP_ROWS, TRAIN_FILES, VAL_FILES = 97, 10, 10, 3
SIZE = 16


def numbered_image(row_id: int, rng: np.random.Generator) -> bytes:
    """A noise PNG (so the images are most of the bytes, as real ones are) whose first pixel's
    red and green hold the row id."""
    pixels = rng.integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8)
    pixels[0, 0, :2] = (row_id % 256, row_id // 256)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def numbered_dataset(out: Path):
    """(root, manifest, {split: all row ids}) of the numbered dataset, written at `out`."""
    root = Location.parse(str(out))
    rng = np.random.default_rng(0)
    splits, ids = {}, {}
    for split, first, files in (("train", 0, TRAIN_FILES), ("val", TRAIN_FILES, VAL_FILES)):
        info = SplitInfo()
        for file in range(first, first + files):
            rows = [
                {
                    "image": numbered_image(100 * file + r, rng),
                    "label": (100 * file + r) % len(CLASSES),
                    "label_name": CLASSES[(100 * file + r) % len(CLASSES)],
                    "source_id": f"{split}/{file}/{r}",
                }
                for r in range(FILE_ROWS)
            ]
            path = f"{split}/part-{file:05d}.parquet"
            write_shard(root.child(path), rows, row_group_size=GROUP_ROWS)
            info.files.append(ShardFile(path=path, rows=FILE_ROWS))
            info.rows += FILE_ROWS
        splits[split] = info
        ids[split] = [100 * f + r for f in range(first, first + files) for r in range(FILE_ROWS)]
    manifest = Manifest(
        version="numbered",
        created_at=Manifest.now(),
        fingerprint="numbered",
        classes=CLASSES,
        image_size=SIZE,
        image_format="png",
        mean=IMAGENET_MEAN,
        std=IMAGENET_STD,
        splits=splits,
        skipped=[],
        config={},
    )
    root.child(VERSIONS, "numbered.json").write_bytes(manifest.model_dump_json().encode())
    return root, manifest, ids


def damaged_copy(numbered, tmp_path, split: str, file: int, damage) -> tuple[Location, str]:
    """A copy of the numbered dataset with `damage(path)` done to file `file` of `split`; the
    copy, and the file's path in it."""
    root, manifest, _ = numbered
    copy = Location.parse(str(tmp_path / "copy"))
    shutil.copytree(root.path, copy.path)
    path = manifest.splits[split].files[file].path
    damage(Path(copy.child(path).path))
    return copy, path
