"""The preprocess job's config: where images come from and how they are stored."""

from __future__ import annotations

import hashlib
import json
from typing import Literal

from pydantic import Field, model_validator

from pipeline.core.config import CAPACITY_TIMEOUT_S, AbsolutePathOrURI, Strict, TrackingConfig

# Food-101-Lite: ten classes of food101, by its label names; remapped to 0..9 in this order.
FOOD101_LITE_CLASSES = (
    "pizza",
    "hamburger",
    "sushi",
    "ramen",
    "fried_rice",
    "steak",
    "hot_dog",
    "pancakes",
    "breakfast_burrito",
    "caesar_salad",
)


class SyntheticSourceConfig(Strict):
    num_classes: int = Field(10, ge=2, le=20, description="Number of generated classes.")
    images_per_class: int = Field(100, ge=1, description="Images generated per class.")
    raw_size: int = Field(96, ge=16, description="Side of the generated images, before transforms.")
    seed: int = Field(0, description="Seed: the same seed gives byte-identical images.")


class FolderSourceConfig(Strict):
    path: AbsolutePathOrURI | None = Field(
        None, description="Root laid out as <root>/<class>/<image>; or a URI."
    )


class HuggingFaceSourceConfig(Strict):
    dataset: str = Field("ethz/food101", description="Hub id or local path for load_dataset().")
    classes: tuple[str, ...] = Field(
        FOOD101_LITE_CLASSES, min_length=1, description="Label names to keep, in index order."
    )
    fraction: float = Field(1.0, gt=0, le=1, description="Fraction of each class's images kept.")
    train_split: str = Field("train", description="Dataset split that becomes our train split.")
    val_split: str = Field("validation", description="Dataset split that becomes our val split.")
    revision: str | None = Field(None, description="Dataset revision (tag or commit) to pin.")

    @model_validator(mode="after")
    def _unique_classes(self) -> HuggingFaceSourceConfig:
        dupes = sorted({c for c in self.classes if self.classes.count(c) > 1})
        if dupes:
            raise ValueError(f"classes are listed twice: {dupes}")
        return self


class SourceConfig(Strict):
    kind: Literal["synthetic", "folder", "huggingface"] = Field(
        "huggingface", description="Which of the sections below to read images from."
    )
    synthetic: SyntheticSourceConfig = SyntheticSourceConfig()
    folder: FolderSourceConfig = FolderSourceConfig()
    huggingface: HuggingFaceSourceConfig = HuggingFaceSourceConfig()

    @model_validator(mode="after")
    def _folder_has_path(self) -> SourceConfig:
        if self.kind == "folder" and not self.folder.path:
            raise ValueError("source.kind is 'folder' but source.folder.path is not set")
        return self


class PreprocessConfig(Strict):
    output: AbsolutePathOrURI = Field(
        description="Dataset directory: an absolute path or a pyarrow.fs URI (s3://...)."
    )
    source: SourceConfig = SourceConfig()
    image_size: int = Field(224, ge=8, description="Resize the short side, then center crop.")
    image_format: Literal["jpeg", "png"] = Field("jpeg", description="Encoding of stored images.")
    jpeg_quality: int = Field(95, ge=1, le=100, description="JPEG quality when image_format=jpeg.")
    val_fraction: float = Field(
        0.2,
        ge=0,
        lt=1,
        description="Share held out for val, for sources with no split of their own.",
    )
    shard_size: int = Field(1000, ge=1, description="Images per task and per Parquet file.")
    row_group_size: int = Field(128, ge=1, description="Rows per Parquet row group.")
    overwrite: bool = Field(False, description="Rebuild even if the output is already up to date.")
    retention_hours: float = Field(
        168,
        ge=0,
        description="Hours an older version stays readable after a newer one is committed, for "
        "the jobs still reading it.",
    )
    capacity_timeout_s: float = Field(
        CAPACITY_TIMEOUT_S,
        gt=0,
        description=(
            "Seconds to wait for a CPU for the first shard (a cluster autoscaling from zero); "
            "then exit 3."
        ),
    )
    tracking: TrackingConfig = TrackingConfig()

    def fingerprint(self) -> str:
        """Hash of everything that shapes the output, to tell an up-to-date dataset."""
        data = self.model_dump(
            mode="json",
            exclude={"overwrite", "retention_hours", "capacity_timeout_s", "tracking"},
        )
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]
