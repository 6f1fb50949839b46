"""Your own training loop, writing a run that the bundle's jobs take as one of their own:
inference, export, serving, the registry and the chain's later steps (docs/own-loop.md).

On the driver:

    card = api.ModelCard.for_dataset(
        "s3://bucket/ray-cv/dataset", model="resnet18", metric="val_f1", mode="max"
    )
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"card": card.to_dict(), "lr": 1e-3},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=api.run_config("s3://bucket/ray-cv/runs", "my-run", metric="val_f1", mode="max"),
    )
    trainer.fit()
    api.finish_run("s3://bucket/ray-cv/runs", "my-run")
    api.register_run("s3://bucket/ray-cv/runs", "my-run", tracking_uri="http://mlflow:5000")

In `train_loop_per_worker(config)`, every rank, once per epoch:

    card = api.ModelCard.from_dict(config["card"])
    resumed = api.resume()            # None, or the weights, train state and history to go on
    ...
    history.append(metrics)           # epoch, train_loss, val_loss, val_accuracy, val_f1, ...
    api.report(metrics, model=model, card=card, history=history, train_state={...})

A run is the one documented in docs/own-loop.md: `<storage_path>/<name>/` with Ray Train's
record of its checkpoints, one `epoch_NNNN/` checkpoint per report (CHECKPOINT_FORMAT), and
summary.json, history.csv and curves.png written by `finish_run` (RUN_FORMAT).
"""

from __future__ import annotations

import copyreg
import dataclasses
import importlib
import tempfile
from dataclasses import dataclass, field
from typing import Any, Literal

import ray.train
import torch

from pipeline.core.errors import InputError
from pipeline.core.storage import Location
from pipeline.data.dataset import read_manifest
from pipeline.model.checkpoint import (
    CHECKPOINT_FORMAT,
    SCORES,
    CheckpointMeta,
    ModelSpec,
    Score,
    checkpoint_meta,
    config_score,
    load_train_state,
    load_weights,
    read_meta,
    save_checkpoint,
    score_of,
)
from pipeline.model.networks import unwrap
from pipeline.model.runs import RUN_FORMAT, checkpoint_dir_name, latest_checkpoint, write_reports

__all__ = [
    "CHECKPOINT_FORMAT",
    "REPORTED",
    "RUN_FORMAT",
    "ModelCard",
    "Resumed",
    "checkpoint_score",
    "finish_run",
    "register_run",
    "report",
    "resume",
    "run_config",
]

# What every epoch's metrics hold: the run's history, curves and best checkpoint read them.
REPORTED = ("epoch", "train_loss", "val_loss", "val_accuracy")
# The card's fields that metadata.json holds as they are.
RECORDED = ("classes", "image_size", "input_size", "interpolation", "mean", "std")
RECORDED += ("dataset_fingerprint", "dataset_version")
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)

# cloudpickle ships a loop defined in the user's script by value, with each module held in
# sys.modules as `<a module the loop names>.<a name its code uses>`: a loop naming `torch` and
# any `.classes` (the card's) ships `torch.classes`, a module no pickler takes. Shipped as the
# name to import it by, the loop runs as the tutorial writes it.
copyreg.pickle(type(torch.classes), lambda module: (importlib.import_module, (module.__name__,)))


def checkpoint_score(metric: str, mode: str | None = None) -> Score:
    """What ranks a run's checkpoints: val_loss, val_accuracy or last in their own order, or
    any metric the loop reports with its `mode` ("max": the highest is best, or "min")."""
    own = SCORES.get(metric)
    if mode not in (None, "min", "max"):
        raise ValueError(f"mode={mode!r}: give 'max' (the highest {metric} is best) or 'min'")
    if own is not None and mode not in (None, own.mode):
        raise ValueError(f"mode={mode!r}: metric={metric!r} has its own order; leave mode out")
    if own is None and mode is None:
        raise ValueError(
            f"metric={metric!r} needs its direction: add mode='max' (the highest is best) or "
            "mode='min'"
        )
    return score_of(metric, mode)


@dataclass(frozen=True)
class ModelCard:
    """What a checkpoint records beside its weights: how to rebuild the network and feed it, and
    what it was trained on. Built once on the driver; passed to the workers as a dict."""

    model: str  # torchvision builder | timm/<name> | module:function, as model.name
    classes: list[str]  # the head's outputs, in order
    image_size: int  # the side of the stored (preprocessed) square images
    kwargs: dict[str, Any] = field(default_factory=dict)  # the builder's arguments
    input_size: int | None = None  # the side the network takes; None: image_size
    interpolation: Literal["bilinear", "bicubic"] = "bilinear"  # image_size -> input_size
    mean: tuple[float, float, float] = IMAGENET_MEAN  # per channel, of 0-1 pixels
    std: tuple[float, float, float] = IMAGENET_STD
    dataset: str | None = None  # the bundle's dataset it was trained on (its URI), if any
    dataset_version: str = ""
    dataset_fingerprint: str = ""
    metric: str = "val_loss"  # what ranks its checkpoints: val_loss, val_accuracy, last, any
    mode: Literal["min", "max"] | None = None  # another metric's best: its highest, or lowest
    config: dict[str, Any] = field(default_factory=dict)  # your settings, recorded as they are

    def __post_init__(self):
        checkpoint_score(self.metric, self.mode)
        if "num_classes" in self.kwargs:
            raise ValueError("kwargs: num_classes comes from classes, not from kwargs")

    @classmethod
    def for_dataset(
        cls, dataset: str, *, model: str, version: str | None = None, **fields
    ) -> ModelCard:
        """The card of a model trained on the bundle's preprocessed `dataset` (its newest
        version, or `version`): its classes, image size, normalisation and version."""
        root = Location.parse(dataset)
        manifest = read_manifest(root, version)
        if manifest is None:
            raise ValueError(f"dataset={dataset} holds no dataset: run the preprocess job first")
        read = {k: getattr(manifest, k) for k in ("classes", "image_size", "mean", "std")}
        return cls(
            model=model,
            dataset=root.uri,
            dataset_version=manifest.version,
            dataset_fingerprint=manifest.fingerprint,
            **read,
            **fields,
        )

    def split_files(self, split: str) -> list[str]:
        """The Parquet files of `split` ("train" or "val") of the card's dataset version:
        columns `image` (encoded image_size squares), `label` (index into classes)."""
        root = Location.parse(self.dataset)
        manifest = read_manifest(root, self.dataset_version)
        return [root.child(f.path).uri for f in manifest.splits[split].files]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> ModelCard:
        return cls(**values)

    def meta(self, metrics: dict, history: list[dict]) -> CheckpointMeta:
        """metadata.json of the checkpoint of epoch `metrics["epoch"]`."""
        return checkpoint_meta(self.recorded(), metrics, history=history)

    def recorded(self) -> dict:
        """What every checkpoint of the run records of the card: CheckpointMeta's fields of the
        run (the network, what it takes, the data, the config with the score it ranks by)."""
        ranked = {"metric": self.metric} | ({"mode": self.mode} if self.mode else {})
        config = {**self.config, "checkpoint": ranked}
        if self.dataset:
            config["dataset"] = self.dataset  # inference of it reads the version trained on
        model = ModelSpec(name=self.model, kwargs=self.kwargs)
        return {"model": model, "config": config, **{k: getattr(self, k) for k in RECORDED}}


def run_config(
    storage_path: str,
    name: str,
    *,
    metric: str = "val_loss",
    mode: Literal["min", "max"] | None = None,
    num_to_keep: int | None = 2,
    **rest,
) -> ray.train.RunConfig:
    """Ray Train's RunConfig for a run at `<storage_path>/<name>` (a path every node shares, or
    s3://...) that keeps its `num_to_keep` best checkpoints by `metric` (in `mode`, for a metric
    of your own: `checkpoint_score`), as the train job does; `rest`: RunConfig's other
    arguments (failure_config, ...)."""
    score = checkpoint_score(metric, mode)
    runs = Location.parse(storage_path)
    return ray.train.RunConfig(
        name=name,
        storage_path=runs.path,
        storage_filesystem=runs.fs,
        checkpoint_config=ray.train.CheckpointConfig(
            num_to_keep=num_to_keep,
            checkpoint_score_attribute=score.key,
            checkpoint_score_order=score.mode,
        ),
        **rest,
    )


def report(
    metrics: dict,
    *,
    model: torch.nn.Module,
    card: ModelCard,
    history: list[dict],
    train_state: dict | None = None,
) -> None:
    """`ray.train.report` of the epoch's `metrics` from every rank; rank 0 attaches the
    checkpoint `epoch_NNNN` (the bare model's weights, `train_state` for resuming: tensors and
    plain values, and metadata.json with `history`, every epoch's metrics up to this one)."""
    needed = [*REPORTED, *([card.metric] if card.metric not in (*REPORTED, "last") else [])]
    missing = [k for k in needed if k not in metrics]
    if missing:
        raise ValueError(f"metrics lack {missing}: report {', '.join(needed)} every epoch")
    if ray.train.get_context().get_world_rank() != 0:
        ray.train.report(metrics)
        return
    with tempfile.TemporaryDirectory(prefix="checkpoint-") as directory:
        weights = unwrap(model).state_dict()
        save_checkpoint(directory, weights, card.meta(metrics, history), train_state or {})
        ray.train.report(
            metrics,
            checkpoint=ray.train.Checkpoint.from_directory(directory),
            checkpoint_dir_name=checkpoint_dir_name(metrics["epoch"]),
        )


@dataclass(frozen=True)
class Resumed:
    """The latest checkpoint of a run that goes on: its weights (a bare model's state_dict),
    train state, last epoch done and history."""

    weights: dict
    train_state: dict
    epoch: int
    history: list[dict]


def resume() -> Resumed | None:
    """On a worker: what the run's latest checkpoint holds, if it has one (a run submitted
    again, or a worker group restarted after a failure); None for a new run."""
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        return None
    with checkpoint.as_directory() as directory:
        where = Location.parse(directory)
        meta = read_meta(where)
        return Resumed(load_weights(where), load_train_state(where), meta.epoch, meta.history)


def finish_run(storage_path: str, name: str, *, wall_time_s: float | None = None) -> dict:
    """On the driver, once `fit()` returned: the run's summary.json (what inference, export
    and serving pick its best checkpoint by), history.csv and curves.png; returns the summary."""
    run = Location.parse(storage_path).child(name)
    latest = latest_checkpoint(run)
    if latest is None:
        raise InputError(f"run {run.uri} has no checkpoint: report one with api.report first")
    return write_reports(run, config_score(read_meta(latest).config), wall_time_s=wall_time_s)


def register_run(
    storage_path: str,
    name: str,
    *,
    tracking_uri: str,
    registered_model: str | None = "ray-cv-classifier",
    experiment: str = "ray-cv-bundle",
) -> str:
    """On the driver, once the run finished: an MLflow run of `experiment` at `tracking_uri`
    with the run's history, its best checkpoint logged as the bundle's MLflow model and
    registered as a new version of `registered_model` (None: logged only), as the train job
    does; returns the MLflow run's id."""
    from pipeline.model.source import resolve_checkpoint
    from pipeline.tracking.client import RUN_DIR, connect
    from pipeline.tracking.registry import log_best_model

    run = Location.parse(storage_path).child(name)
    best = resolve_checkpoint(run)
    history = read_meta(latest_checkpoint(run)).history
    conn = connect(tracking_uri, experiment)
    mlflow_run = conn.client.create_run(conn.experiment_id, run_name=name, tags={RUN_DIR: run.uri})
    run_id = mlflow_run.info.run_id
    for row in history:
        for key, value in row.items():
            if key != "epoch" and isinstance(value, int | float) and not isinstance(value, bool):
                conn.client.log_metric(run_id, key, value, step=row["epoch"])
    log_best_model(conn, run_id, best, registered_model)
    conn.client.set_terminated(run_id)
    return run_id
