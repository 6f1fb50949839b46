"""The batch inference job's config."""

from __future__ import annotations

import hashlib
import re
from typing import Literal

from pydantic import Field

from pipeline.core.config import (
    CAPACITY_TIMEOUT_S,
    AbsolutePathOrURI,
    AllowedModules,
    StallConfig,
    Strict,
    TrackingConfig,
    allow_modules_field,
)
from pipeline.core.uris import join_uri


class InferConfig(Strict):
    model: AbsolutePathOrURI = Field(
        description="A training run directory (its best checkpoint by the run's "
        "checkpoint.metric) or one checkpoint directory."
    )
    input: AbsolutePathOrURI = Field(
        description="A preprocessed dataset (its `split`), an image folder (<class>/<image>), "
        "or one image file."
    )
    split: Literal["train", "val"] = Field("val", description="Dataset split to classify.")
    dataset_version: str | None = Field(
        None,
        description="The dataset version to read (a name in <input>/versions/); default: the "
        "one the run was trained on, for its own dataset, else the newest.",
    )
    output: AbsolutePathOrURI | None = Field(
        None,
        description="Directory for summary.json and versions/, which holds the predictions "
        "(not for one image).",
    )
    top_k: int = Field(5, ge=1, description="Most likely classes kept per image.")
    # Rows wait in the object store until a file's worth has been predicted, and blocks under
    # 100 KiB (the predictions of a few hundred images) wait in the driver's own memory, as their
    # owner: at 100,000 rows per file its peak RSS was 60 MiB above that at 10,000
    # (bench/infer_scale.py, 100,000 images).
    rows_per_file: int = Field(
        10_000,
        ge=1,
        description="Predictions per Parquet file (each write task's last file holds the rest).",
    )
    batch_size: int = Field(64, ge=1, description="Images per model call.")
    use_gpu: bool = Field(False, description="One GPU per predictor actor, mixed precision.")
    num_actors: int = Field(
        2,
        ge=1,
        description=(
            "Most predictor actors; the pool starts with what the cluster holds and grows as "
            "nodes join."
        ),
    )
    cpus_per_actor: int = Field(
        1,
        ge=1,
        description="Without use_gpu: CPUs, and torch threads, of each predictor actor, which "
        "decodes its own batches.",
    )
    precision: Literal["auto", "fp32", "bf16", "fp16"] = Field(
        "auto", description="auto: bf16 (else fp16) on GPU, fp32 on CPU."
    )
    capacity_timeout_s: float = Field(
        CAPACITY_TIMEOUT_S,
        gt=0,
        description=(
            "Seconds to wait for room for one predictor actor (a GPU, or cpus_per_actor CPUs); "
            "then exit 3."
        ),
    )
    stall: StallConfig = StallConfig()
    tracking: TrackingConfig = TrackingConfig()
    allow_modules: AllowedModules = allow_modules_field()


def predictions_output(predictions: str, run: str, cfg: InferConfig, *, dataset: str) -> str:
    """Where the chain writes run `run`'s predictions of `cfg.input`, below `predictions`: the
    run's `dataset`'s val split at `<run>`; any other input (a folder, another dataset or split)
    at `<run>-<input's name>[-<split>]-<8 hex of the input>`, so that no input's predictions
    replace another's."""
    given = _place(cfg.input)
    if given == _place(dataset) and cfg.split == "val":
        return join_uri(predictions, run)
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", given.rpartition("/")[2])[:40] or "input"
    split = "" if cfg.split == "val" else f"-{cfg.split}"
    digest = hashlib.sha256(f"{given}\0{cfg.split}".encode()).hexdigest()[:8]
    return join_uri(predictions, f"{run}-{name}{split}-{digest}")


def _place(uri: str) -> str:
    """`uri` without a query, `file://` or trailing slash: one spelling of a place."""
    return uri.partition("?")[0].removeprefix("file://").rstrip("/") or "/"
