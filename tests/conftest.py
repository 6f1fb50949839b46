"""Shared fixtures: tiny image folders with corrupt files, and real Ray clusters."""

from __future__ import annotations

import io
import os
import secrets
from pathlib import Path

# A throwaway token for the Ray instances this process starts, or Ray writes one into the user's
# home. Ray reads it once, when first imported: so here, before anything imports ray.
os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32))

import pytest
import ray

from pipeline.cluster import LocalCluster
from pipeline.sources import render_synthetic

CLASSES = ("red_circle", "green_square", "blue_triangle")

# name -> bytes of files that are not usable images, and the reason the manifest must give.
CORRUPT = {
    "notes.txt": (b"not an image at all\n", "not an image"),
    "empty.jpg": (b"", "empty file"),
}


def png_bytes(class_name: str, index: int, size: int = 40) -> bytes:
    buf = io.BytesIO()
    render_synthetic(class_name, size=size, seed=1, index=index).save(buf, format="PNG")
    return buf.getvalue()


def jpeg_bytes(class_name: str, index: int, size: int = 40) -> bytes:
    buf = io.BytesIO()
    render_synthetic(class_name, size=size, seed=1, index=index).save(buf, format="JPEG")
    return buf.getvalue()


def make_image_folder(root: Path, per_class: int = 20, corrupt: bool = True) -> dict[str, str]:
    """`root/<class>/<n>.png|jpg`; with `corrupt`, a truncated JPEG, a text file and an empty
    file in the first class. Returns {relative path of each corrupt file: expected reason}."""
    for c in CLASSES:
        (root / c).mkdir(parents=True)
        for i in range(per_class):
            # Mixed formats and non-square sizes, as real folders have.
            if i % 2:
                (root / c / f"{i:03d}.jpg").write_bytes(jpeg_bytes(c, i, size=48))
            else:
                (root / c / f"{i:03d}.png").write_bytes(png_bytes(c, i, size=40))
    bad: dict[str, str] = {}
    if corrupt:
        first = root / CLASSES[0]
        truncated = jpeg_bytes(CLASSES[0], 999, size=64)
        (first / "truncated.jpg").write_bytes(truncated[: len(truncated) // 2])
        bad[f"{CLASSES[0]}/truncated.jpg"] = "truncated or corrupt"
        for name, (data, reason) in CORRUPT.items():
            (first / name).write_bytes(data)
            bad[f"{CLASSES[0]}/{name}"] = reason
    return bad


@pytest.fixture(scope="module")
def ray_session():
    """An in-process Ray instance for library-level tests; stopped after the module."""
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def cluster():
    """A real single-node cluster (`ray start`), for jobs sent with `ray job submit`."""
    with LocalCluster(num_cpus=2) as c:
        yield c


@pytest.fixture(scope="session")
def hf_dataset(tmp_path_factory):
    """A local dataset shaped like food101: 'image' + ClassLabel 'label', train/validation
    Parquet files, loaded through the same `load_dataset` call as the hub's."""
    datasets = pytest.importorskip("datasets")
    root = tmp_path_factory.mktemp("hf")
    names = ["apple_pie", "pizza", "sushi", "ramen", "steak"]
    features = datasets.Features(
        {"image": datasets.Image(), "label": datasets.ClassLabel(names=names)}
    )
    for split, per_class in (("train", 10), ("validation", 4)):
        rows = [(label, i) for i in range(per_class) for label in range(len(names))]
        ds = datasets.Dataset.from_dict(
            {
                "image": [{"bytes": png_bytes(CLASSES[c % 3], i), "path": None} for c, i in rows],
                "label": [c for c, _ in rows],
            },
            features=features,
        )
        ds.to_parquet(str(root / "data" / f"{split}-00000-of-00001.parquet"))
    return str(root)


@pytest.fixture(scope="session")
def tiny_dataset(tmp_path_factory) -> Path:
    """A preprocessed dataset of generated images: 4 classes, 32 px, several shards of several
    row groups; the val split has an odd number of rows (119), to catch padded evaluation."""
    from pipeline import preprocess
    from pipeline.config import PreprocessConfig, load_config

    out = tmp_path_factory.mktemp("tiny") / "dataset"
    cfg = load_config(PreprocessConfig, None, [
        f"output={out}", "source.kind=synthetic", "source.synthetic.num_classes=4",
        "source.synthetic.images_per_class=150", "source.synthetic.raw_size=48",
        "image_size=32", "shard_size=100", "row_group_size=25",
    ])  # fmt: skip
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        manifest = preprocess.run(cfg)
    finally:
        ray.shutdown()
    assert manifest.splits["val"].rows % 2 == 1
    return out
