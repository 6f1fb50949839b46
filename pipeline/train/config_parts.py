"""The train config's parts beside its top-level settings: the optimizer, the EMA, checkpoints,
cost, scaling (its worker count or elastic range) and tracking."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field

from pipeline.core.config import Strict, TrackingConfig


class TrainTrackingConfig(TrackingConfig):
    registered_model: str | None = Field(
        "ray-cv-classifier",
        description="Registered model the best checkpoint becomes a version of; null: logged, "
        "not registered.",
    )


class OptimizerConfig(Strict):
    name: Literal["sgd", "adamw"] = Field("sgd", description="SGD (Nesterov momentum) or AdamW.")
    lr: float = Field(0.1, gt=0, description="Peak learning rate, for the global batch size.")
    momentum: float = Field(0.9, ge=0, lt=1, description="SGD momentum.")
    weight_decay: float = Field(5e-5, ge=0, description="Weight decay.")
    schedule: Literal["cosine", "constant"] = Field("cosine", description="Per-epoch LR schedule.")
    warmup_epochs: int = Field(0, ge=0, description="Epochs of linear warm-up before the schedule.")
    label_smoothing: float = Field(
        0.0, ge=0, lt=1, description="Cross-entropy label smoothing (the built-in loss only)."
    )
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
    metric: str = Field(
        "val_loss",
        description="What makes a checkpoint best (kept, served, exported, a sweep's score): "
        "val_loss, val_accuracy, last (the newest epoch), or val_<name> of a `metrics` entry.",
    )
    mode: Literal["min", "max"] | None = Field(
        None,
        description="Whether the lowest or highest val_<name> is best; null: the metric's own "
        "(accuracies and F1: max; a hook's Metric: its higher_is_better), which the train job "
        "records here.",
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


class CostConfig(Strict):
    price_per_worker_hour: float | None = Field(
        None,
        ge=0,
        description="What an hour of one training worker costs (its share of a node: the "
        "node's price over its workers), for each epoch's and the run's `cost`; null: "
        "worker-hours and GPU-hours only.",
    )
    currency: str = Field("USD", description="The price's currency, as the reports name it.")


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
