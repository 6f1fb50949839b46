"""The train job's config: `TrainConfig`, its top-level settings and the checks across them.
Its parts are pipeline.train.config_parts, the names its settings take
pipeline.train.config_names."""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BeforeValidator, Field, model_validator

from pipeline.core.config import AbsolutePathOrURI, StallConfig, Strict
from pipeline.model.config import ModelConfig
from pipeline.train.config_names import (
    FIXED_SCORES,
    PER_CLASS,
    RESERVED_NAMES,
    check_augment,
    check_class_weights,
    check_loss,
    check_metric,
    is_hook,
    metric_name,
)
from pipeline.train.config_parts import (
    CheckpointConfig,
    CostConfig,
    EMAConfig,
    OptimizerConfig,
    TrainScalingConfig,
    TrainTrackingConfig,
)
from pipeline.train.input.order import default_partitions

RunName = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$", max_length=100)]


class TrainConfig(Strict):
    dataset: AbsolutePathOrURI = Field(description="Output directory of the preprocess job.")
    storage_path: AbsolutePathOrURI = Field(
        description="Where runs live (shared by all nodes): a run is <storage_path>/<name>."
    )
    name: RunName = Field(
        "resnet18", description="Run name: submitting again with the same name resumes it."
    )
    dataset_version: str | None = Field(
        None,
        description="The dataset version to train on (a name in <dataset>/versions/); default: "
        "the newest when the run starts.",
    )
    switch_dataset: bool = Field(
        False,
        description="Resume a run on another dataset version than it started on (the history "
        "records it); else exit 2.",
    )
    epochs: int = Field(10, ge=1, description="Total epochs of the run, resumed ones included.")
    global_batch_size: int = Field(
        128,
        ge=1,
        description=(
            "Images per optimizer step over all workers, split evenly; the same at any worker "
            "count."
        ),
    )
    partitions: int | None = Field(
        None,
        ge=1,
        description=(
            "Parts each epoch's order is cut into (docs/train.md), fixed when the run starts; "
            "none: the largest divisor of global_batch_size up to 64."
        ),
    )
    ingest: Literal["torch", "ray_data"] = Field(
        "torch",
        description=(
            "torch: each worker decodes its share on its own node; ray_data: Ray Data decodes on "
            "the spare CPUs of any node."
        ),
    )
    decode: Literal["cpu", "gpu", "auto"] = Field(
        "cpu",
        description=(
            "Where ingest=torch decodes and augments: cpu (loader processes), gpu (the worker's "
            "device; JPEG only), auto (gpu on CUDA workers with JPEG datasets)."
        ),
    )
    augment: Annotated[str, AfterValidator(check_augment)] = Field(
        "random_resized_crop",
        description="Train-time augmentation (never val's): random_resized_crop, crop_flip, "
        "none, or module:function(image_size=) returning a v2 transform of uint8 images.",
    )
    crop_scale: tuple[float, float] = Field(
        (0.25, 1.0),
        description="random_resized_crop: the crop's share of the image's area, [min, max].",
    )
    crop_ratio: tuple[float, float] = Field(
        (0.75, 4 / 3), description="random_resized_crop: the crop's aspect ratio, [min, max]."
    )
    flip: bool = Field(
        True, description="random_resized_crop and crop_flip: a random horizontal flip."
    )
    auto_augment: Literal["none", "trivial_augment_wide", "rand_augment"] = Field(
        "none",
        description="A policy after `augment`'s crop and flip: TrivialAugmentWide or RandAugment "
        "(torchvision's).",
    )
    mixup_alpha: float = Field(
        0.0, ge=0, description="MixUp's Beta(alpha, alpha) on train batches; 0: off (0.2 is usual)."
    )
    cutmix_alpha: float = Field(
        0.0,
        ge=0,
        description="CutMix's alpha; 0: off. With both on, each batch gets one of the two.",
    )
    ema: EMAConfig = EMAConfig()
    loss: Annotated[str | None, AfterValidator(check_loss)] = Field(
        None,
        description="module:function(num_classes=, class_weights=) returning the loss, a "
        "callable (logits, targets) -> scalar; null: cross-entropy.",
    )
    class_weights: Annotated[Any, BeforeValidator(check_class_weights)] = Field(
        None,
        description="Weights of the classes in the loss: balanced (train rows / (classes x the "
        "class's rows), from the train split's counts), a list of one per class, or null.",
    )
    metrics: tuple[Annotated[str, AfterValidator(check_metric)], ...] = Field(
        (),
        description="Scores of the whole val split per epoch, as val_<name>: top<k>_accuracy, "
        "macro_f1, per_class_recall, or module:function(num_classes=) returning a Metric.",
    )
    micro_batch_size: int | None = Field(
        None,
        ge=2,
        description="Images per forward pass: a worker's share of the global batch is "
        "accumulated over several; null: all at once.",
    )
    compile: bool = Field(
        False, description="torch.compile the model on each worker (checkpoints stay plain)."
    )
    model: ModelConfig = ModelConfig()
    precision: Literal["auto", "fp32", "bf16", "fp16"] = Field(
        "auto",
        description="auto: on GPU bf16 from Ampere (compute capability 8.0) on, else fp16 with "
        "a grad scaler; fp32 on CPU.",
    )
    seed: int = Field(0, ge=0, description="Seed for weights init and data order.")
    optimizer: OptimizerConfig = OptimizerConfig()
    scaling: TrainScalingConfig = TrainScalingConfig()
    max_failures: int = Field(
        3,
        ge=-1,
        description="Worker failures to recover from; -1: always.",
    )
    max_preemptions: int = Field(
        -1,
        ge=-1,
        description=(
            "Node preemptions (spot instances reclaimed) to recover from, apart from "
            "max_failures; -1: always."
        ),
    )
    checkpoint: CheckpointConfig = CheckpointConfig()
    stall: StallConfig = StallConfig()
    log_every_s: float = Field(
        30,
        gt=0,
        description="Seconds between progress lines within an epoch (rank 0), with images/s, "
        "input wait and the run's ETA.",
    )
    cost: CostConfig = CostConfig()
    tracking: TrainTrackingConfig = TrainTrackingConfig()

    @model_validator(mode="after")
    def _batch_splits_evenly(self) -> TrainConfig:
        # Every worker count the run may go through, so that a resize never changes the batch.
        s = self.scaling
        counts = range(s.min_workers, s.max_workers + 1)
        if any(self.global_batch_size % n for n in counts):
            shown = list(s.num_workers) if s.elastic else s.num_workers
            multiple = math.lcm(*counts)
            raise ValueError(
                f"global_batch_size={self.global_batch_size} does not split evenly over "
                f"scaling.num_workers={shown}"
                + (" (every count in the range)" if s.elastic else "")
                + f": use a multiple of {multiple}"
            )
        if self.global_batch_size < 2 * s.max_workers:
            # BatchNorm normalises over the batch: one image a worker fails (or is noise).
            raise ValueError(
                f"global_batch_size={self.global_batch_size} gives a worker fewer than 2 images "
                f"per step with {s.max_workers} workers: use at least {2 * s.max_workers}"
            )
        if self.partitions is not None and self.global_batch_size % self.partitions:
            raise ValueError(
                f"partitions={self.partitions} does not divide global_batch_size="
                f"{self.global_batch_size}: use a divisor of it, or leave it out"
            )
        return self

    @model_validator(mode="after")
    def _micro_batches_split_evenly(self) -> TrainConfig:
        # Equal micro-batches at every worker count, so that a resize changes no micro-batch.
        m, s = self.micro_batch_size, self.scaling
        if m is None:
            return self
        shares = [self.batch_size_per_worker(n) for n in range(s.min_workers, s.max_workers + 1)]
        if any(share % m for share in shares):
            fits = math.gcd(*shares)
            raise ValueError(
                f"micro_batch_size={m} does not divide each worker's share of "
                f"global_batch_size={self.global_batch_size} ({', '.join(map(str, shares))} "
                f"images): use a divisor of {fits} (at least 2), or null for no accumulation"
            )
        return self

    @model_validator(mode="after")
    def _steps_resume_on_torch_input(self) -> TrainConfig:
        if self.checkpoint.every_steps is not None and self.ingest == "ray_data":
            raise ValueError(
                "checkpoint.every_steps needs ingest=torch: Ray Data cannot resume a dataset's "
                "iteration inside an epoch, so a resume would train rows twice. Use "
                "ingest=torch, or checkpoints at epoch ends only (checkpoint.every_steps=null)"
            )
        return self

    @model_validator(mode="after")
    def _device_decode_on_torch_input(self) -> TrainConfig:
        if self.decode == "gpu" and self.ingest == "ray_data":
            raise ValueError(
                "decode=gpu needs ingest=torch: with ingest=ray_data, Ray Data's tasks decode on "
                "CPUs. Use ingest=torch to decode on the workers' GPUs, or decode=cpu (auto "
                "picks cpu with ray_data)"
            )
        return self

    @model_validator(mode="after")
    def _loss_and_metrics(self) -> TrainConfig:
        if self.loss is not None and self.optimizer.label_smoothing:
            raise ValueError(
                f"optimizer.label_smoothing applies to the built-in cross-entropy, and loss="
                f"{self.loss} replaces it: smooth the labels in your loss, or set "
                "optimizer.label_smoothing=0"
            )
        for low, high, key in (*self.crop_scale, "crop_scale"), (*self.crop_ratio, "crop_ratio"):
            if not 0 < low <= high or (key == "crop_scale" and high > 1):
                raise ValueError(
                    f"{key}=[{low}, {high}]: give [min, max] with 0 < min <= max"
                    + (" <= 1" if key == "crop_scale" else "")
                )
        names = [metric_name(m) for m in self.metrics]
        if twice := sorted({n for n in names if names.count(n) > 1}):
            same = [m for m in self.metrics if metric_name(m) == twice[0]]
            raise ValueError(
                f"metrics: {', '.join(same)} report the same val_{twice[0]}: keep one, or "
                "rename your function (a module:function metric is named after its function)"
            )
        if clash := [m for m in self.metrics if metric_name(m) in RESERVED_NAMES]:
            raise ValueError(
                f"metrics: {clash[0]} would report as val_{metric_name(clash[0])}, the job's own "
                f"(val_{', val_'.join(RESERVED_NAMES)}): rename your function"
            )
        c = self.checkpoint
        ranked = [f"val_{metric_name(m)}" for m in self.metrics if m != PER_CLASS]
        if c.metric not in (*FIXED_SCORES, *ranked):
            raise ValueError(
                f"checkpoint.metric={c.metric}: use {', '.join((*FIXED_SCORES, *ranked))} "
                "(val_<name> of a `metrics` entry: add it to metrics)"
            )
        if c.metric in FIXED_SCORES and c.mode is not None:
            raise ValueError(
                f"checkpoint.mode={c.mode}: checkpoint.metric={c.metric} has its own order; "
                "set checkpoint.mode for val_<name> only"
            )
        entries = {f"val_{metric_name(m)}": m for m in self.metrics}
        builtin = c.metric in entries and not is_hook(entries[c.metric])
        if builtin and c.mode == "min":
            raise ValueError(f"checkpoint.mode=min: the highest {c.metric} is best")
        return self

    @model_validator(mode="after")
    def _own_augment_on_cpu(self) -> TrainConfig:
        if is_hook(self.augment) and self.decode == "gpu":
            raise ValueError(
                f"augment={self.augment} runs on decoded images in the DataLoader processes: "
                "decode=gpu augments on the device with the built-in augmentations only (the "
                "seeding per batch covers the CPU generator, not the GPU's). Use decode=cpu or "
                "decode=auto (which picks cpu with your augment)"
            )
        return self

    def ranked_by_hook(self) -> str | None:
        """The `metrics` entry (module:function) whose val_<name> checkpoint.metric names."""
        entries = {f"val_{metric_name(m)}": m for m in self.metrics}
        entry = entries.get(self.checkpoint.metric)
        return entry if entry is not None and is_hook(entry) else None

    def with_checkpoint_mode(self, mode: str | None) -> TrainConfig:
        """This config with checkpoint.mode set: what the train job records."""
        checkpoint = self.checkpoint.model_copy(update={"mode": mode})
        return self.model_copy(update={"checkpoint": checkpoint})

    def decode_setting(self) -> str:
        """`decode`, where auto goes to the CPU for the user's own augment."""
        return "cpu" if self.decode == "auto" and is_hook(self.augment) else self.decode

    def partitions_at_start(self) -> int:
        """The partition count a new run starts with (order.EpochOrder): never one of the
        layout's, which a resume may change."""
        if self.partitions is not None:
            return self.partitions
        return default_partitions(self.global_batch_size)

    def batch_size_per_worker(self, workers: int) -> int:
        """Each worker's share of the global batch, with `workers` workers running."""
        return self.global_batch_size // workers
