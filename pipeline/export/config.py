"""The export job's config."""

from __future__ import annotations

from pydantic import Field

from pipeline.core.config import (
    CAPACITY_TIMEOUT_S,
    AbsolutePathOrURI,
    AllowedModules,
    Strict,
    allow_modules_field,
)


class ExportConfig(Strict):
    model: AbsolutePathOrURI = Field(
        description="A training run directory (its best checkpoint, as inference picks it) or "
        "one checkpoint directory."
    )
    output: AbsolutePathOrURI | None = Field(
        None,
        description="Directory to create, never replaced; default: <run>/export/<checkpoint name>.",
    )
    dataset: AbsolutePathOrURI | None = Field(
        None,
        description="Dataset whose val split the parity check classifies; default: the one the "
        "checkpoint was trained on.",
    )
    dataset_version: str | None = Field(
        None,
        description="The dataset version to read (a name in <dataset>/versions/); default: the "
        "one the run was trained on, for its own dataset, else the newest.",
    )
    images: int | None = Field(
        None, ge=1, description="Val images the parity check compares; null: the whole split."
    )
    opset: int = Field(
        18,
        ge=18,
        le=23,
        description="ONNX opset of model.onnx: from 18 (torch's exporter) to 23 (the bundle's "
        "ONNX Runtime).",
    )
    tolerance: float = Field(
        1e-4,
        gt=0,
        le=1,
        description="Largest difference of any class probability allowed between a runtime and "
        "PyTorch.",
    )
    min_agreement: float = Field(
        0.995,
        gt=0,
        le=1,
        description="Share of the images whose top-1 class each runtime must give as PyTorch does.",
    )
    batch_size: int = Field(32, ge=1, description="Images per call in the parity check.")
    cpus: int = Field(
        2, ge=1, description="CPUs of the export task (its torch and ONNX Runtime threads)."
    )
    capacity_timeout_s: float = Field(
        CAPACITY_TIMEOUT_S,
        gt=0,
        description="Seconds to wait for a node with `cpus` CPUs; then exit 3.",
    )
    allow_modules: AllowedModules = allow_modules_field()
