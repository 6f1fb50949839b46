"""Image sources: generated, an image folder, or a Hugging Face dataset.

Every source lists its items on the driver (cheap: ids and labels, no pixels) and gives, per
shard, a picklable reader that a Ray task uses to fetch the encoded bytes. Folder and generated
sources are read inside the tasks, in parallel; a Hugging Face dataset lives in the driver's cache,
so its bytes are read there and travel to the tasks through the object store.
"""

from __future__ import annotations

import hashlib
import io
import logging
import math
import posixpath
from collections import defaultdict
from dataclasses import dataclass
from typing import Protocol

import numpy as np
from PIL import Image, ImageDraw

from pipeline.core.errors import InputError
from pipeline.core.storage import Location
from pipeline.data.config import (
    FolderSourceConfig,
    HuggingFaceSourceConfig,
    SourceConfig,
    SyntheticSourceConfig,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Item:
    """One source image: a stable id, its class index, its own split if the source has one."""

    source_id: str
    label: int
    split: str | None = None


class Reader(Protocol):
    def read(self, item: Item) -> bytes:
        """The item's encoded image bytes; OSError if they cannot be read."""


class Source(Protocol):
    classes: list[str]
    # True when each shard's reader carries the image bytes (through the object store).
    reads_on_driver: bool

    def list_items(self) -> list[Item]: ...

    def reader(self, items: list[Item]) -> Reader: ...


def build_source(cfg: SourceConfig) -> Source:
    """The source that `cfg.kind` selects."""
    if cfg.kind == "synthetic":
        return SyntheticSource(cfg.synthetic)
    if cfg.kind == "folder":
        return FolderSource(cfg.folder)
    return HuggingFaceSource(cfg.huggingface)


def stable_fraction(key: str) -> float:
    """A number in [0, 1) fixed by `key` alone: the same on every run, machine and Python."""
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


def assign_split(item: Item, val_fraction: float) -> str:
    """The source's own split, else 'val' for a stable `val_fraction` share of ids."""
    if item.split is not None:
        return item.split
    return "val" if stable_fraction(item.source_id) < val_fraction else "train"


# --- generated -------------------------------------------------------------------------------

_SHAPES = ("circle", "square", "triangle")
_COLORS = {
    "red": (220, 40, 40),
    "green": (40, 180, 60),
    "blue": (40, 80, 220),
    "yellow": (230, 210, 40),
    "magenta": (200, 50, 200),
    "cyan": (40, 200, 210),
    "orange": (240, 140, 30),
}


class SyntheticSource:
    """Coloured shapes on noisy backgrounds: class = (colour, shape), so a small CNN can learn
    it; position, size, tint and noise vary per image. Deterministic in (seed, class, index)."""

    reads_on_driver = False

    def __init__(self, cfg: SyntheticSourceConfig):
        self.cfg = cfg
        pairs = [(c, s) for c in _COLORS for s in _SHAPES][: cfg.num_classes]
        self.classes = [f"{c}_{s}" for c, s in pairs]

    def list_items(self) -> list[Item]:
        return [
            Item(f"synthetic/{name}/{i:05d}", label)
            for label, name in enumerate(self.classes)
            for i in range(self.cfg.images_per_class)
        ]

    def reader(self, items: list[Item]) -> SyntheticSource:
        return self

    def read(self, item: Item) -> bytes:
        index = int(item.source_id.rsplit("/", 1)[1])
        img = render_synthetic(
            self.classes[item.label], size=self.cfg.raw_size, seed=self.cfg.seed, index=index
        )
        buf = io.BytesIO()
        img.save(buf, format="PNG")
        return buf.getvalue()


def render_synthetic(class_name: str, *, size: int, seed: int, index: int) -> Image.Image:
    """One generated image of `class_name` (e.g. 'red_circle')."""
    color_name, shape = class_name.split("_")
    key = int.from_bytes(hashlib.blake2b(class_name.encode(), digest_size=4).digest(), "big")
    rng = np.random.default_rng([seed, key, index])
    background = rng.integers(60, 200, size=3)
    noise = rng.normal(0, 18, size=(size, size, 3))
    pixels = np.clip(background + noise, 0, 255).astype(np.uint8)
    img = Image.fromarray(pixels, "RGB")

    radius = size * rng.uniform(0.2, 0.32)
    cx, cy = rng.uniform(radius, size - radius, size=2)
    tint = rng.integers(-25, 26, size=3)
    fill = tuple(int(v) for v in np.clip(np.array(_COLORS[color_name]) + tint, 0, 255))
    box = (cx - radius, cy - radius, cx + radius, cy + radius)
    draw = ImageDraw.Draw(img)
    if shape == "circle":
        draw.ellipse(box, fill=fill)
    elif shape == "square":
        draw.rectangle(box, fill=fill)
    else:
        draw.polygon(
            [(cx, cy - radius), (cx - radius, cy + radius), (cx + radius, cy + radius)], fill=fill
        )
    return img


# --- image folder ----------------------------------------------------------------------------


class FolderSource:
    """`root/<class>/<image>` (images may sit in subfolders of a class); local path or URI.
    Every non-hidden file is an item: the ones that do not decode are skipped and counted."""

    reads_on_driver = False

    def __init__(self, cfg: FolderSourceConfig):
        assert cfg.path, "validated by SourceConfig"
        self.root = Location.parse(cfg.path)
        self.classes: list[str] = []

    def list_items(self) -> list[Item]:
        if not self.root.is_dir():
            what = "is not a directory" if self.root.exists() else "does not exist"
            raise InputError(
                f"source.folder.path {self.root.uri} {what}: point it at a folder laid out as "
                "<root>/<class>/<image>"
            )
        class_dirs = [d for d in self.root.list_dirs() if not d.base_name.startswith((".", "_"))]
        if not class_dirs:
            raise InputError(
                f"source.folder.path {self.root.uri} has no class folders: expected "
                "<root>/<class>/<image>"
            )
        self.classes = [d.base_name for d in class_dirs]
        items = []
        for label, class_dir in enumerate(class_dirs):
            class_root = self.root.child(class_dir.base_name)
            files = [f for f in class_root.list_files() if not f.base_name.startswith(".")]
            if not files:
                raise InputError(
                    f"class folder {class_root.uri} is empty: add images or remove the folder"
                )
            for f in files:
                rel = posixpath.relpath(f.path, self.root.path)
                items.append(Item(rel, label))
        return items

    def reader(self, items: list[Item]) -> FolderSource:
        return self

    def read(self, item: Item) -> bytes:
        return self.root.child(item.source_id).read_bytes()


# --- Hugging Face ----------------------------------------------------------------------------


class _BytesReader:
    """Bytes fetched on the driver, keyed by source id."""

    def __init__(self, data: dict[str, bytes]):
        self.data = data

    def read(self, item: Item) -> bytes:
        return self.data[item.source_id]


class HuggingFaceSource:
    """A `datasets` image-classification dataset (food101 by default): the configured classes,
    picked by label name and remapped to 0..n-1, and a stable `fraction` of each class."""

    reads_on_driver = True

    def __init__(self, cfg: HuggingFaceSourceConfig):
        self.cfg = cfg
        self.classes = list(cfg.classes)
        self._splits: dict[str, object] = {}  # our split name -> datasets.Dataset (decode=False)

    def list_items(self) -> list[Item]:
        try:
            import datasets
        except ImportError:
            raise InputError(
                "source.kind=huggingface needs the `datasets` package: "
                "pip install 'ray-cv-bundle[hf]'"
            ) from None
        items = []
        for ours, theirs in (("train", self.cfg.train_split), ("val", self.cfg.val_split)):
            ds = datasets.load_dataset(self.cfg.dataset, split=theirs, revision=self.cfg.revision)
            label_of = self._label_map(ds.features)
            # Raw encoded bytes: tasks decode, so the driver never holds decoded pixels.
            self._splits[ours] = ds.cast_column("image", datasets.Image(decode=False))
            by_class: dict[int, list[str]] = defaultdict(list)
            for row, hf_label in enumerate(ds["label"]):
                if hf_label in label_of:
                    by_class[label_of[hf_label]].append(f"{theirs}/{row}")
            for label, name in enumerate(self.classes):
                ids = by_class.get(label, [])
                if not ids:
                    raise InputError(f"class {name!r} has no images in split {theirs!r}")
                # A stable `fraction` of the class: ranked by hash, so it is the same subset on
                # every run, and a larger fraction keeps the smaller one's images.
                keep = max(1, math.ceil(self.cfg.fraction * len(ids)))
                chosen = sorted(ids, key=lambda i: stable_fraction(f"{self.cfg.dataset}/{i}"))
                items += [Item(i, label, ours) for i in sorted(chosen[:keep], key=_row)]
        return items

    def reader(self, items: list[Item]) -> _BytesReader:
        data = {}
        for split in {item.split for item in items}:
            mine = [item for item in items if item.split == split]
            images = self._splits[split].select([_row(i.source_id) for i in mine])["image"]
            data.update(
                {item.source_id: image["bytes"] for item, image in zip(mine, images, strict=True)}
            )
        return _BytesReader(data)

    def _label_map(self, features) -> dict[int, int]:
        names = getattr(features.get("label"), "names", None)
        if names is None or "image" not in features:
            raise InputError(
                f"dataset {self.cfg.dataset!r} needs an 'image' column and a ClassLabel 'label' "
                f"column; it has {sorted(features)}"
            )
        unknown = [c for c in self.classes if c not in names]
        if unknown:
            raise InputError(
                f"source.huggingface.classes has names not in {self.cfg.dataset!r}: {unknown}. "
                f"Valid names: {', '.join(names)}"
            )
        return {names.index(name): label for label, name in enumerate(self.classes)}


def _row(source_id: str) -> int:
    return int(source_id.rsplit("/", 1)[1])
