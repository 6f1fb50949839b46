"""Typed job configs: defaults < YAML file < `key=value` command-line overrides."""

from __future__ import annotations

import hashlib
import json
import math
import re
import textwrap
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    model_validator,
)
from pydantic_core import PydanticUndefined

from pipeline.core.errors import ConfigError

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


class _Strict(BaseModel):
    # strict: YAML and overrides are parsed to real types, so "5" for an int is a mistake.
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class SyntheticSourceConfig(_Strict):
    num_classes: int = Field(10, ge=2, le=20, description="Number of generated classes.")
    images_per_class: int = Field(100, ge=1, description="Images generated per class.")
    raw_size: int = Field(96, ge=16, description="Side of the generated images, before transforms.")
    seed: int = Field(0, description="Seed: the same seed gives byte-identical images.")


def _absolute_or_uri(value: str | None) -> str | None:
    # A Ray job runs in a temporary copy of the bundle: a relative path would vanish with it.
    if value and "://" not in value and not value.startswith("/"):
        raise ValueError(
            f"{value!r} is relative; use an absolute path or a URI such as s3://bucket/path "
            "(jobs run in a temporary copy of the bundle, where relative paths are lost)"
        )
    return value


AbsolutePathOrURI = Annotated[str, AfterValidator(_absolute_or_uri)]

# A model version in MLflow's registry: models:/<name>/<version> or models:/<name>@<alias>.
REGISTERED_MODEL = "models:/"


def registered_model(uri: str) -> tuple[str, str, str]:
    """(name, version, alias) of models:/<name>/<version> (alias "") or models:/<name>@<alias>
    (version "")."""
    name, at, alias = uri.removeprefix(REGISTERED_MODEL).partition("@")
    if at:
        return name, "", alias
    name, _, version = name.rpartition("/")
    return name, version, ""


def _model_source(value: str) -> str:
    if value.startswith(REGISTERED_MODEL):
        name, version, alias = registered_model(value)
        if not name or not (version or alias):
            raise ValueError(
                f"{value!r} names no version: give models:/<name>/<version> or "
                "models:/<name>@<alias>"
            )
        return value
    return _absolute_or_uri(value)


ModelSource = Annotated[str, AfterValidator(_model_source)]


class FolderSourceConfig(_Strict):
    path: AbsolutePathOrURI | None = Field(
        None, description="Root laid out as <root>/<class>/<image>; or a URI."
    )


class HuggingFaceSourceConfig(_Strict):
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


class SourceConfig(_Strict):
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


class TrackingConfig(_Strict):
    uri: str | None = Field(
        None,
        description="MLflow tracking server (http://host:5000); null: MLFLOW_TRACKING_URI if set, "
        "else no tracking.",
    )
    experiment: str = Field("ray-cv-bundle", description="MLflow experiment of the job's runs.")


class TrainTrackingConfig(TrackingConfig):
    registered_model: str | None = Field(
        "ray-cv-classifier",
        description="Registered model the best checkpoint becomes a version of; null: logged, "
        "not registered.",
    )


# A cloud node takes minutes to boot and run its setup commands (cluster.yaml installs torch).
CAPACITY_TIMEOUT_S = 600


class PreprocessConfig(_Strict):
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


RunName = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$", max_length=100)]


class OptimizerConfig(_Strict):
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


class EMAConfig(_Strict):
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


class CheckpointConfig(_Strict):
    metric: Literal["val_loss", "val_accuracy", "last"] = Field(
        "val_loss",
        description="What makes a checkpoint best, for retention, inference, serving, export and "
        "the registry: val_loss (lowest), val_accuracy (highest) or last (the newest epoch).",
    )
    num_to_keep: int = Field(
        2, ge=1, description="Best checkpoints kept by `metric` (the latest is kept too)."
    )


# A model by name: a torchvision builder, timm/<name>, or the user's own module:function.
MODEL_NAME = re.compile(r"^(timm/)?[A-Za-z0-9_][A-Za-z0-9_.\-]*$|^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
WEIGHTS_FILE_SUFFIXES = (".pt", ".pth", ".bin", ".safetensors")


def is_weights_file(weights: str) -> bool:
    """A weights setting that names a file (a path or a URI), not weights by name."""
    return "/" in weights or weights.endswith(WEIGHTS_FILE_SUFFIXES)


def _model_name(value: str) -> str:
    if not MODEL_NAME.match(value):
        raise ValueError(
            "not a model name: give a torchvision builder (resnet50), timm/<name> "
            "(timm/convnext_tiny) or module:function (examples.custom_model.tiny_cnn:build)"
        )
    return value


class ModelInputConfig(_Strict):
    image_size: int | None = Field(
        None,
        ge=8,
        description="Side of the square images the network takes (stored images are resized to "
        "it); default: the weights' own, else the dataset's.",
    )
    interpolation: Literal["bilinear", "bicubic"] | None = Field(
        None, description="How stored images are resized to image_size; default: the weights' own."
    )
    mean: tuple[float, float, float] | None = Field(
        None,
        description="Per-channel mean of 0-1 pixels; default: the weights' own, else the "
        "dataset's (ImageNet's).",
    )
    std: tuple[float, float, float] | None = Field(
        None,
        description="Per-channel std of 0-1 pixels; default: the weights' own, else the "
        "dataset's (ImageNet's).",
    )

    @model_validator(mode="after")
    def _positive_std(self) -> ModelInputConfig:
        if self.std is not None and min(self.std) <= 0:
            raise ValueError(f"std={list(self.std)}: every value must be above 0")
        return self


class ModelConfig(_Strict):
    name: Annotated[str, AfterValidator(_model_name)] = Field(
        "resnet18",
        description="A torchvision classifier (resnet50, efficientnet_b0, vit_b_16, ...), "
        "timm/<name>, or module:function returning an nn.Module.",
    )
    weights: str | None = Field(
        None,
        description="Initial weights: a name (DEFAULT, IMAGENET1K_V2, ...) or a state_dict file "
        "(absolute path or URI); the head is always new.",
    )
    kwargs: dict[str, Any] = Field(
        {}, description="Keyword arguments to the model's builder, e.g. {image_size: 32} for a ViT."
    )
    input: ModelInputConfig = ModelInputConfig()

    @model_validator(mode="after")
    def _name_and_weights(self) -> ModelConfig:
        if "num_classes" in self.kwargs:
            raise ValueError("kwargs.num_classes: the dataset's classes set it; leave it out")
        w = self.weights
        if w and is_weights_file(w):
            if "://" not in w:
                _absolute_or_uri(w)
        elif w and ":" in self.name:
            raise ValueError(
                f"weights={w!r}: a module:function model takes weights from a state_dict file "
                "only (absolute path or URI); or load them in the function itself"
            )
        return self


class TrainScalingConfig(_Strict):
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


class TrainConfig(_Strict):
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

    def batch_size_per_worker(self, workers: int) -> int:
        """Each worker's share of the global batch, with `workers` workers running."""
        return self.global_batch_size // workers


class InferConfig(_Strict):
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
        description="The dataset version to read (a name in <input>/versions/); default: newest.",
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
    tracking: TrackingConfig = TrackingConfig()


class ServeConfig(_Strict):
    """The online classifier's `args` in a Serve config file (configs/serve.yaml). Replicas,
    autoscaling, CPUs and GPUs are Serve's own deployment options, beside them in that file."""

    model: ModelSource = Field(
        description="A training run directory (its best checkpoint by its checkpoint.metric), one "
        "checkpoint directory, or a registered model version (models:/<name>/<version>, "
        "models:/<name>@<alias>); resolved once per deploy, so every replica serves one "
        "checkpoint."
    )
    tracking_uri: str | None = Field(
        None,
        description="MLflow server holding the registered model; null: MLFLOW_TRACKING_URI.",
    )
    top_k: int = Field(5, ge=1, description="Most likely classes in each answer.")
    max_batch_size: int = Field(
        16, ge=1, description="Most images per model call: requests that arrive together."
    )
    batch_wait_timeout_s: float = Field(
        0.005, ge=0, description="Longest wait for a batch to fill once its first image is in."
    )
    max_request_bytes: int = Field(
        10 * 2**20, ge=1, description="Largest request body accepted; a larger one gets 413."
    )
    precision: Literal["auto", "fp32", "bf16", "fp16"] = Field(
        "auto", description="auto: bf16 (else fp16) on a replica with a GPU, fp32 on CPU."
    )


class ExportConfig(_Strict):
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
        description="The dataset version to read (a name in <dataset>/versions/); default: newest.",
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


C = TypeVar("C", bound=BaseModel)


class _YAMLLoader(yaml.SafeLoader):
    """YAML with numbers as people write them. PyYAML follows YAML 1.1, where `1e-3` and
    `1.0e3` are strings (an exponent needs a dot and a sign); YAML 1.2 reads them as floats."""


_YAMLLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9][0-9_]*)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def parse_yaml(text: str) -> Any:
    return yaml.load(text, Loader=_YAMLLoader)


def load_config(
    cls: type[C],
    path: str | Path | list[str | Path] | None = None,
    overrides: list[str] = (),
) -> C:
    """Build `cls` from YAML files and `dotted.key=value` overrides (values parsed as YAML).

    With several files (a base config, then a recipe), each later file overrides the earlier
    ones key by key: a section it names is merged, not replaced."""
    paths = [] if path is None else [path] if isinstance(path, str | Path) else list(path)
    data: dict[str, Any] = {}
    for p in paths:
        _merge(data, _read_yaml(p))
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} must look like key=value, e.g. {_example(cls)}")
        _set_dotted(data, key, parse_yaml(raw) if raw else None)
    return validate_config(cls, data, " + ".join(map(str, paths)) or "overrides")


def _read_yaml(path: str | Path) -> dict[str, Any]:
    try:
        data = parse_yaml(Path(path).read_text()) or {}
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping, not {type(data).__name__}")
    return data


def _merge(base: dict[str, Any], over: dict[str, Any]) -> None:
    """`over` into `base`, section by section: a leaf of `over` replaces `base`'s."""
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _merge(base[key], value)
        else:
            base[key] = value


def validate_config(cls: type[C], data: dict[str, Any], where: str = "config") -> C:
    """Validate a plain dict (e.g. a config sent to a Ray worker) into `cls`."""
    try:
        return cls.model_validate(_lists_to_tuples(data))
    except ValidationError as e:
        problems = [_describe(cls, err) for err in e.errors()]
        if len(problems) == 1:  # on the first line, which is what a scheduler's alert shows
            raise ConfigError(f"invalid config ({where}): {problems[0]}") from None
        raise ConfigError(f"invalid config ({where}):\n  " + "\n  ".join(problems)) from None


def dump_config(cfg: BaseModel) -> str:
    """The resolved config as YAML, loadable again with load_config."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


def _set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    *parents, leaf = key.split(".")
    node = data
    for i, part in enumerate(parents):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {key}: {'.'.join(parents[: i + 1])} is not a section")
        node = child
    node[leaf] = value


def _lists_to_tuples(value: Any) -> Any:
    # YAML gives lists; configs are frozen and hold tuples.
    if isinstance(value, dict):
        return {k: _lists_to_tuples(v) for k, v in value.items()}
    if isinstance(value, list):
        return tuple(_lists_to_tuples(v) for v in value)
    return value


def _describe(cls: type[BaseModel], err: dict[str, Any]) -> str:
    loc = [str(p) for p in err["loc"]]
    key = ".".join(loc)
    if err["type"] == "extra_forbidden":
        allowed = ", ".join(_fields_at(cls, loc[:-1]))
        return f"{key}: unknown key (allowed here: {allowed})"
    if err["type"] == "missing":
        return f"{key}: required, but not set (set it in the YAML file or as {key}=...)"
    msg = err["msg"].removeprefix("Value error, ")  # our validators' own words
    if not loc:  # a check across keys: its message names them
        return msg
    got = err.get("input")
    shown = f" (got {got!r}, a {type(got).__name__})" if not isinstance(got, dict) else ""
    return f"{key}: {msg}{shown}"


def _fields_at(cls: type[BaseModel], loc: list[str]) -> list[str]:
    model: Any = cls
    for part in loc:
        field = model.model_fields.get(part) if hasattr(model, "model_fields") else None
        if field is None:
            return []
        model = field.annotation
    return list(model.model_fields) if hasattr(model, "model_fields") else []


def _example(cls: type[BaseModel]) -> str:
    key, _, default, _ = next(k for k in describe_keys(cls) if k[2] != "required")
    return f"{key}={default}"


def describe_keys(cls: type[BaseModel], prefix: str = "") -> list[tuple[str, str, str, str]]:
    """(dotted key, type, default, description) of every setting of `cls`, sections flattened."""
    keys = []
    for name, field in cls.model_fields.items():
        key, annotation = prefix + name, field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            keys += describe_keys(annotation, key + ".")
            continue
        if field.default is PydanticUndefined:
            default = "required"
        else:
            default = json.dumps(field.default) if field.default is not None else "null"
            default = default.replace('"', "")
        keys.append((key, _type_name(annotation), default, field.description or ""))
    return keys


def keys_help(cls: type[BaseModel]) -> str:
    """The settings of `cls` as `key=value` help text: one entry per key."""
    lines = []
    for key, kind, default, description in describe_keys(cls):
        lines.append(f"  {key} ({kind}, default {default})")
        lines += textwrap.wrap(
            description, width=96, initial_indent=" " * 6, subsequent_indent=" " * 6
        )
    return "\n".join(lines)


def _type_name(annotation: Any) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Annotated:
        return _type_name(args[0])
    if origin is Literal:
        return "|".join(map(str, args))
    if origin in (typing.Union, types.UnionType):
        named = [_type_name(a) for a in args if a is not type(None)]
        return " or ".join(named) + (" or null" if type(None) in args else "")
    if origin is tuple:
        return f"list of {_type_name(args[0])}"
    return getattr(annotation, "__name__", str(annotation))
