"""The cluster check's config, and the train config it reads the bundle's needs from."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import AfterValidator, Field

from pipeline.core.config import AbsolutePathOrURI, AllowedModules, Strict, load_config
from pipeline.train.config import TrainConfig


def _override(value: str) -> str:
    if "=" not in value or value.startswith("="):
        raise ValueError(f"{value!r} must look like key=value, e.g. scaling.num_workers=4")
    return value


class CheckConfig(Strict):
    train: tuple[str, ...] = Field(
        ("configs/train.yaml",),
        min_length=1,
        description="The train config file(s) the check reads the needs of (workers, GPUs, "
        "loader, batch), later files over earlier ones; relative to the bundle.",
    )
    train_overrides: tuple[Annotated[str, AfterValidator(_override)], ...] = Field(
        (),
        description="key=value settings over those files, as the train job would get them, "
        'e.g. ["scaling.num_workers=4"].',
    )
    storage: AbsolutePathOrURI | None = Field(
        None,
        description="Storage the runs go to: a scratch object is written, listed, read and "
        "deleted under <storage>/.check-<id>/; null: the train config's storage_path.",
    )
    dataset: AbsolutePathOrURI | None = Field(
        None,
        description="The preprocessed dataset, read if it is there; null: the train config's "
        "dataset.",
    )
    packages: AllowedModules = Field(
        (),
        description="Modules every node must import in the jobs' runtime env, e.g. [mynets] "
        "(your model's package).",
    )
    min_nodes: int = Field(1, ge=1, description="Alive nodes the cluster must have.")
    timeout_s: float = Field(
        60,
        gt=0,
        description="Seconds each probe may take (a node's answer, the workers' placement, the "
        "collective) before its row fails.",
    )
    collective_mb: float = Field(
        64, gt=0, description="MB of the tensor the training workers all-reduce, timed."
    )
    scratch_mb: float = Field(
        4, gt=0, description="MB of the scratch object written to, and read back from, storage."
    )
    gpu_free_gb: float = Field(
        2, ge=0, description="GiB each GPU must have free (the device memory row)."
    )
    report: AbsolutePathOrURI | None = Field(
        None,
        description="Where the JSON report goes; null: <storage>/checks/<id>.json. It is also "
        "printed as one JSON line.",
    )


def train_config(cfg: CheckConfig, *, root: Path = Path(".")) -> TrainConfig:
    """The train config `cfg.train` names (files relative to `root`), its `train_overrides`
    over them, and `cfg`'s dataset and storage over those where it sets them: what the check
    measures the cluster against."""
    paths = [root / f for f in cfg.train]
    places = [f"dataset={cfg.dataset}"] if cfg.dataset else []
    places += [f"storage_path={cfg.storage}"] if cfg.storage else []
    return load_config(TrainConfig, paths, [*cfg.train_overrides, *places])
