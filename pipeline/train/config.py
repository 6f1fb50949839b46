"""The train job's config."""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, model_validator

from pipeline.core.config import AbsolutePathOrURI, Strict, TrackingConfig
from pipeline.model.config import ModelConfig


class TrainTrackingConfig(TrackingConfig):
    registered_model: str | None = Field(
        "ray-cv-classifier",
        description="Registered model the best checkpoint becomes a version of; null: logged, "
        "not registered.",
    )


RunName = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$", max_length=100)]


class OptimizerConfig(Strict):
    name: Literal["sgd", "adamw"] = Field("sgd", description="SGD (Nesterov momentum) or AdamW.")
    lr: float = Field(0.1, gt=0, description="Peak learning rate, for the global batch size.")
    momentum: float = Field(0.9, ge=0, lt=1, description="SGD momentum.")
    weight_decay: float = Field(5e-5, ge=0, description="Weight decay.")
    schedule: Literal["cosine", "constant"] = Field("cosine", description="Per-epoch LR schedule.")
    warmup_epochs: int = Field(0, ge=0, description="Epochs of linear warm-up before the schedule.")
    label_smoothing: float = Field(0.0, ge=0, lt=1, description="Cross-entropy label smoothing.")
    clip_grad_norm: float | None = Field(
        None,
        gt=0,
        description="Clip the gradients' total norm to this before each step; null: off.",
    )


def _worker_range(value: Any) -> Any:
    # One error that says what is allowed, rather than one per member of the union.
    if isinstance(value, bool) or not isinstance(value, int | tuple):
        raise ValueError("give a number of workers, or [min, max] for elastic training")
    if isinstance(value, int):
        if value < 1:
            raise ValueError(f"{value} workers: at least 1")
        return value
    if len(value) != 2 or not all(isinstance(n, int) and not isinstance(n, bool) for n in value):
        raise ValueError("give [min, max] for elastic training: two numbers, e.g. [1, 4]")
    if not 1 <= value[0] <= value[1]:
        raise ValueError("[min, max] needs 1 <= min <= max, e.g. [1, 4]")
    return value


WorkerCount = Annotated[int | tuple[int, ...], BeforeValidator(_worker_range)]


class EMAConfig(Strict):
    enabled: bool = Field(
        False,
        description="Keep an exponential moving average of the weights, evaluated and "
        "checkpointed beside them.",
    )
    decay: float = Field(
        0.99,
        gt=0,
        lt=1,
        description="Weight of the average at each update: it spans about every_steps / "
        "(1 - decay) steps.",
    )
    every_steps: int = Field(4, ge=1, description="Optimizer steps between two updates of the EMA.")


class CheckpointConfig(Strict):
    metric: Literal["val_loss", "val_accuracy", "last"] = Field(
        "val_loss",
        description="What makes a checkpoint best, for retention, inference, serving, export and "
        "the registry: val_loss (lowest), val_accuracy (highest) or last (the newest epoch).",
    )
    num_to_keep: int = Field(
        2, ge=1, description="Best checkpoints kept by `metric` (the latest is kept too)."
    )
    every_steps: int | None = Field(
        None,
        ge=1,
        description="Also a checkpoint every N steps inside an epoch, and one at a preemption "
        "notice, to resume from exactly there (ingest=torch); null: at epoch ends only.",
    )


class TrainScalingConfig(Strict):
    num_workers: WorkerCount = Field(
        2,
        description=(
            "Training workers: a number, or [min, max] for elastic training (fewer when nodes are"
            " lost, back up when they return)."
        ),
    )
    cpus_per_worker: int = Field(1, ge=1, description="CPUs reserved per worker (torch threads).")
    use_gpu: bool = Field(False, description="One GPU per worker; mixed precision on it.")
    loader_workers: int = Field(
        2, ge=0, description="DataLoader processes per worker that decode and augment images."
    )
    startup_timeout_s: float = Field(
        120,
        gt=0,
        description="Seconds one attempt to place the workers waits before it counts as a failure.",
    )
    resize_interval_s: float = Field(
        60,
        gt=0,
        description=(
            "With [min, max] num_workers: seconds between checks for room to grow (a restart from"
            " the latest checkpoint)."
        ),
    )

    @property
    def min_workers(self) -> int:
        n = self.num_workers
        return n if isinstance(n, int) else n[0]

    @property
    def max_workers(self) -> int:
        n = self.num_workers
        return n if isinstance(n, int) else n[1]

    @property
    def elastic(self) -> bool:
        return self.min_workers < self.max_workers


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
    augment: Literal["random_resized_crop", "crop_flip", "none"] = Field(
        "random_resized_crop", description="Train-time augmentation; val is never augmented."
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
    log_every_s: float = Field(
        30, gt=0, description="Seconds between progress lines within an epoch (rank 0)."
    )
    tracking: TrainTrackingConfig = TrainTrackingConfig()

    @model_validator(mode="before")
    @classmethod
    def _keys_moved(cls, data: Any) -> Any:
        if isinstance(data, dict) and "pretrained" in data:
            raise ValueError(
                "pretrained: this key is now model.weights (e.g. model.weights=IMAGENET1K_V1, "
                "or the path of a state_dict file), beside model.name"
            )
        if isinstance(data, dict) and "num_to_keep" in data:
            raise ValueError(
                "num_to_keep: this key is now checkpoint.num_to_keep (e.g. "
                "checkpoint.num_to_keep=2), beside checkpoint.metric, what it keeps the best by"
            )
        return data

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

    def batch_size_per_worker(self, workers: int) -> int:
        """Each worker's share of the global batch, with `workers` workers running."""
        return self.global_batch_size // workers
