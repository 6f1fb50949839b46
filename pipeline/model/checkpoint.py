"""A checkpoint: a directory that carries everything needed to use the model or resume its run.

<checkpoint>/model.pt        state_dict of the bare model (never DDP-wrapped nor compiled)
<checkpoint>/model_ema.pt    the same, of the exponential moving average of the weights, in a
                             run that keeps one (ema.enabled); metadata.json names it
<checkpoint>/train_state.pt  for resuming: the optimisation state (optimizer, LR schedule, grad
                             scaler, EMA, random generators), the loop's progress and the train
                             loader's position (pipeline.train.checkpointer.State)
<checkpoint>/metadata.json   the model (name and builder arguments), epoch, classes, the
                             stored image size and what the network takes (its input size,
                             interpolation, normalisation), metrics, history, and the resolved
                             training config
"""

from __future__ import annotations

import io
import json
import math
import pickle
import zipfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

import torch
from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from pipeline.core.errors import InputError, first_line, validation_problems
from pipeline.core.storage import Location, retry

# Format 3: train_state.pt holds the run's state by part (pipeline.train.checkpointer.State).
# This code reads it alone, and refuses any other (docs/own-loop.md).
CHECKPOINT_FORMAT = 3
WEIGHTS, TRAIN_STATE, METADATA = "model.pt", "train_state.pt", "metadata.json"
EMA_WEIGHTS = "model_ema.pt"
RAW, EMA = "raw", "ema"  # the two sets of weights a checkpoint may hold


@dataclass(frozen=True)
class Score:
    """What "best" means in a run (its checkpoint.metric): checkpoints are ranked by the
    reported metric `key`, the lowest first where `mode` is min; a checkpoint's raw and EMA
    weights are compared by `weights_key` (and `ema_<weights_key>`), in `weights_mode`."""

    metric: str
    key: str
    mode: Literal["min", "max"]
    weights_key: str
    weights_mode: Literal["min", "max"]

    def __str__(self) -> str:
        return self.metric if self.key == "epoch" else f"{self.metric} ({self.mode})"


T = TypeVar("T")


def scored(value: Any) -> bool:
    """Whether `value` is a score that ranks: a finite number (NaN, inf, None and text are not:
    a run that diverged reports NaN, and every comparison with NaN is false)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def best_of(items: Iterable[T], score_of: Callable[[T], Any], mode: str) -> T | None:
    """The item whose score ranks best in `mode` ("min" or "max"), the first of those tied;
    items without a score that ranks (`scored`) rank worst of all: None if no item has one."""
    ranked = [item for item in items if scored(score_of(item))]
    if not ranked:
        return None
    pick = min if mode == "min" else max
    return pick(ranked, key=score_of)  # min and max keep the first of those tied


# checkpoint.metric -> its Score. `last` ranks by epoch; its weights go by val loss, which with a
# few hundred val images ties far less often than val accuracy.
SCORES = {
    "val_loss": Score("val_loss", "val_loss", "min", "val_loss", "min"),
    "val_accuracy": Score("val_accuracy", "val_accuracy", "max", "val_accuracy", "max"),
    "last": Score("last", "epoch", "max", "val_loss", "min"),
}


def score_of(metric: str, mode: str | None = None) -> Score:
    """The Score of checkpoint.metric `metric`: val_loss, val_accuracy, last, or a `metrics`
    entry's val_<name> ranked in `mode` (which the train job resolves and records); raw and EMA
    weights are compared by the same metric."""
    if metric in SCORES:
        return SCORES[metric]
    if mode not in ("min", "max"):
        raise InputError(
            f"checkpoint.metric={metric} is recorded with checkpoint.mode={mode}, so which of "
            'its values is best is unknown: add "mode": "max" or "min" beside "metric" in the '
            "checkpoint's metadata.json config.checkpoint (a run's summary.json: "
            "checkpoint_mode), as the train job records it"
        )
    return Score(metric, metric, mode, metric, mode)


def config_score(config: dict) -> Score:
    """The Score of a resolved training config (a checkpoint's or a run's record)."""
    metric, mode = config["checkpoint"]["metric"], config["checkpoint"].get("mode")
    named = {f"val_{m}" for m in config.get("metrics", ()) if ":" not in m}
    if mode is None and metric in named:
        mode = "max"  # the built-in metrics (accuracies, F1): the highest is best
    return score_of(metric, mode)


class ModelSpec(BaseModel):
    """What rebuilds the network, with a head of as many outputs as the checkpoint's classes:
    `pipeline.model.networks.build_model(len(classes), name=..., kwargs=..., bn_momentum=...,
    bn_eps=...)`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = "resnet18"
    kwargs: dict[str, Any] = {}
    bn_momentum: float | None = None  # set on every BatchNorm layer; None: the builder's own
    bn_eps: float | None = None


@dataclass(frozen=True)
class ModelInput:
    """What the network takes: `image_size` px squares, resized from the stored images with
    `interpolation`, normalised with `mean` and `std` (of 0-1 pixels)."""

    image_size: int
    interpolation: Literal["bilinear", "bicubic"]
    mean: tuple[float, float, float]
    std: tuple[float, float, float]


class CheckpointMeta(BaseModel):
    """metadata.json: how to rebuild the model and feed it, and how it got here."""

    # A diverged epoch's NaN loss is written as NaN, which Python's json reads back, not as null.
    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="constants")

    format: int = CHECKPOINT_FORMAT
    model: ModelSpec = ModelSpec()
    epoch: int  # the last completed epoch, 0-based; with `step`, the epoch in progress
    step: int | None = None  # a checkpoint inside `epoch`: its batches trained on so far
    classes: list[str]
    image_size: int  # the side of the stored images: inference shapes its inputs to it first
    # What the network takes (ModelInput); None: the stored size.
    input_size: int | None = None
    interpolation: Literal["bilinear", "bicubic"] = "bilinear"
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    dataset_fingerprint: str
    dataset_version: str  # the version of the dataset it was trained on (pipeline.data.dataset)
    # None: a NaN, as checkpoints written before NaN was kept wrote it
    metrics: dict[str, int | float | str | None]  # this epoch's
    history: list[dict[str, int | float | str | None]]  # every epoch up to and including this one
    config: dict[str, Any]
    ema_weights: str | None = None  # the EMA weights' file, in a run that keeps an EMA

    @field_validator("config")
    @classmethod
    def _ranked(cls, config: dict[str, Any]) -> dict[str, Any]:
        # Which of raw and EMA weights serve is decided by the run's score (config_score).
        ranked = config.get("checkpoint")
        if not isinstance(ranked, dict) or not isinstance(ranked.get("metric"), str):
            raise ValueError(
                "config holds no checkpoint.metric, the score its run ranks checkpoints by "
                "(the train job and ModelCard.meta record it)"
            )
        return config

    @property
    def model_input(self) -> ModelInput:
        size = self.input_size or self.image_size
        return ModelInput(size, self.interpolation, self.mean, self.std)


# What metadata.json says of one checkpoint: its place in the run and its metrics. The rest (the
# network, what it takes, the data, the config) is the run's, the same in each of its checkpoints.
PLACE = ("epoch", "step", "metrics", "history")


def checkpoint_meta(
    run: dict, metrics: dict, *, history: list[dict], step: int | None = None
) -> CheckpointMeta:
    """metadata.json of a checkpoint at the end of epoch `metrics["epoch"]`, or inside it after
    `step` steps; `run`: the run's fields of CheckpointMeta, those but PLACE; `history`: every
    epoch's metrics up to it. The one builder, whoever's loop it is: the train job's
    (pipeline.train.checkpointer) and a loop of the user's own (pipeline.train.api.ModelCard)."""
    assert not set(run) & set(PLACE), f"a run's fields hold no checkpoint's place: {run.keys()}"
    return CheckpointMeta(
        **run, epoch=metrics["epoch"], step=step, metrics=metrics, history=history
    )


def save_checkpoint(
    directory: str | Path,
    weights: dict,
    meta: CheckpointMeta,
    train_state: dict,
    *,
    ema: dict | None = None,
) -> None:
    """Write a checkpoint into a local directory; `weights` (and `ema`, the EMA's weights) are
    bare models' state_dicts."""
    d = Path(directory)
    torch.save(weights, d / WEIGHTS)
    if ema is not None:
        torch.save(ema, d / EMA_WEIGHTS)
        meta = meta.model_copy(update={"ema_weights": EMA_WEIGHTS})
    torch.save(train_state, d / TRAIN_STATE)
    (d / METADATA).write_text(meta.model_dump_json(indent=2))


def read_meta(checkpoint: Location) -> CheckpointMeta:
    """A checkpoint's metadata.json (local or on storage), checked to be ours."""
    path = checkpoint.child(METADATA)
    if not path.exists():
        raise InputError(
            f"{checkpoint.uri} has no {METADATA}: not a checkpoint written by this bundle's "
            "train job"
        )
    data = path.read_bytes()
    try:
        raw = json.loads(data)
        # Format 1 had no such field, and named its model alone: `"model": "resnet18"`.
        found = raw.get("format", 1 if isinstance(raw.get("model"), str) else None)
    except (ValueError, AttributeError):
        raw, found = {}, None  # not a JSON object: validation says what it is
    if isinstance(found, int) and found > CHECKPOINT_FORMAT:
        # Before validating: a newer format may hold fields this code does not know.
        raise InputError(
            f"{checkpoint.uri} is a checkpoint of format {found}, newer than this code reads "
            f"(format {CHECKPOINT_FORMAT}): update the bundle where this job runs"
        )
    if isinstance(found, int) and found != CHECKPOINT_FORMAT:
        model = raw.get("model")
        name = model.get("name") if isinstance(model, dict) else model
        raise InputError(
            f"{checkpoint.uri} holds a {name} checkpoint of format {found}; this code reads "
            f"format {CHECKPOINT_FORMAT}"
        )
    try:
        meta = CheckpointMeta.model_validate_json(data)
    except ValidationError as e:  # not JSON, fields missing or of the wrong type
        problems = validation_problems(e)
        raise DamagedCheckpoint(
            f"{path.uri} is not valid checkpoint metadata ({problems})"
        ) from None
    return meta


def load_weights(checkpoint: Location, meta: CheckpointMeta | None = None, which: str = RAW):
    """The checkpoint's raw weights, or (`which="ema"`) its EMA's, which `meta` names."""
    if which == RAW:
        return load_tensors(checkpoint.child(WEIGHTS))
    assert which == EMA and meta is not None and meta.ema_weights, "no EMA weights to load"
    return load_tensors(checkpoint.child(meta.ema_weights))


def served_weights(meta: CheckpointMeta) -> str:
    """The weights of a checkpoint to classify with: its EMA's where they scored better on val
    than the raw ones by its run's score (`Score.weights_key`; NaN ranks worst), else the raw
    weights."""
    scores = weights_scores(meta)
    # The raw weights first: they win a tie, and are served where neither scored (NaN).
    best = best_of([RAW, EMA], lambda w: scores.get(w), config_score(meta.config).weights_mode)
    return best or RAW


def weights_scores(meta: CheckpointMeta) -> dict[str, float]:
    """Each set of weights the checkpoint holds, and its val score that `served_weights`
    compares (its run's `Score.weights_key`)."""
    key = config_score(meta.config).weights_key
    scores = {RAW: meta.metrics.get(key), EMA: meta.metrics.get(f"ema_{key}")}
    held = {RAW} | ({EMA} if meta.ema_weights else set())
    return {k: v for k, v in scores.items() if k in held and isinstance(v, float | int)}


def weights_by(meta: CheckpointMeta) -> str:
    """What `served_weights` compares the weights by: `val_loss (min)`."""
    score = config_score(meta.config)
    return f"{score.weights_key} ({score.weights_mode})"


def load_train_state(checkpoint: Location) -> dict:
    return load_tensors(checkpoint.child(TRAIN_STATE))


def load_tensors(file: Location):
    """torch.load of a local or remote file, tensors only (weights_only), onto the CPU."""
    data = file.read_bytes()
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except (RuntimeError, ValueError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile) as e:
        raise DamagedCheckpoint(
            f"{file.uri} is damaged: {first_line(e)}. {_DAMAGED_HINT}"
        ) from None


class DamagedCheckpoint(InputError):
    """A checkpoint whose files are there but cannot be read: cut short, or changed in place. A
    resume goes on from the run's checkpoint before it."""


_DAMAGED_HINT = (
    "Use another checkpoint of the run (its epoch_NNNN directories, and those inside an epoch "
    "below steps/), or train again"
)


def check_weights(checkpoint: Location, meta: CheckpointMeta) -> None:
    """Raise InputError if a weights file of `checkpoint` is cut short: each file's zip
    directory is read (a few small reads at its end), not its tensors, so the driver finds it
    before the workers that load the weights do."""
    for name in filter(None, (WEIGHTS, meta.ema_weights)):
        file = checkpoint.child(name)
        try:
            with retry(lambda f=file: f.fs.open_input_file(f.path), f"opening {file.uri}") as f:
                zipfile.ZipFile(f)
        except zipfile.BadZipFile as e:  # torch.save writes a zip archive
            raise DamagedCheckpoint(f"{file.uri} is damaged: {e}. {_DAMAGED_HINT}") from None
