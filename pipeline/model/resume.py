"""What a resumed training run may change: its settings against the config it recorded (a
checkpoint's weights and optimisation state fit only some), its data against its checkpoint."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipeline.core.config import flatten_config
from pipeline.core.errors import ConfigError, InputError
from pipeline.data.dataset import Manifest
from pipeline.model.checkpoint import CheckpointMeta

if TYPE_CHECKING:  # only a type here: inference reads runs without the train wing
    from pipeline.train.config import TrainConfig


# Settings a run cannot change on resume: the weights, the optimizer's state and the grad scaler's
# would not fit the new ones. Everything else is applied from the resumed epoch on.
FIXED_ON_RESUME = {
    "optimizer.name": "the optimizer's state (momentum or Adam moments) belongs to its kind",
    "checkpoint.metric": "the checkpoints kept so far were chosen by the run's metric, and Ray "
    "Train goes on ranking them in that order",
    "checkpoint.mode": "the checkpoints kept so far were chosen in the run's order",
}


# A run goes on with the network it started with, fed as it was: its checkpoint holds them.
MODEL_FIXED = "the run's weights belong to its network and its input"
# ...but for how fast its BatchNorm statistics follow the batches: a run stuck at chance by them
# goes on with another momentum.
MODEL_CHANGES_ON_RESUME = ("bn_momentum",)


def resume_changes(recorded: dict, cfg: TrainConfig) -> list[str]:
    """The settings `cfg` changes against the run's recorded config, as 'key: old -> new'.
    Raises ConfigError for what a resume cannot change."""
    now = cfg.model_dump(mode="json")
    was_model, now_model = recorded["model"], now.pop("model")
    old = flatten_config({k: v for k, v in recorded.items() if k != "model"})
    new = flatten_config(now)
    changed = {k: (old.get(k), v) for k, v in new.items() if k in old and old[k] != v}
    changed |= {
        f"model.{k}": (was_model.get(k), now_model[k])
        for k in MODEL_CHANGES_ON_RESUME
        if was_model.get(k) != now_model.get(k)
    }
    fixed = {k: ab for k, ab in changed.items() if k in FIXED_ON_RESUME}
    problems = [f"{k}: {a} -> {b} ({FIXED_ON_RESUME[k]})" for k, (a, b) in fixed.items()]
    problems += [
        f"model.{k}: {was_model[k]} -> {v} ({MODEL_FIXED})"
        for k, v in now_model.items()
        if k in was_model and was_model[k] != v and k not in MODEL_CHANGES_ON_RESUME
    ]
    a, b = old.get("precision"), new["precision"]
    if a != b and "fp16" in (a, b):
        problems.append(
            f"precision: {a} -> {b} (fp16 trains with a grad scaler, whose state the other "
            "precisions do not have)"
        )
    if problems:
        raise ConfigError(
            "this run cannot resume with these changes:\n  " + "\n  ".join(problems) + "\n"
            "Set them back to the run's values, or pick a new name= for a new run"
        )
    return [f"{k}: {a} -> {b}" for k, (a, b) in changed.items()]


def check_resumable(meta: CheckpointMeta, manifest: Manifest, *, checkpoint: str, dataset: str):
    """A checkpoint can only continue on data with the same classes, in the same order, and
    images of the same size."""
    if meta.image_size != manifest.image_size:
        raise InputError(
            f"checkpoint {checkpoint} was trained on {meta.image_size} px images, but dataset "
            f"{dataset} has {manifest.image_size} px. A run resumes only on images of its size: "
            "pick a new name= for a new run, or point dataset= at data of that size"
        )
    if meta.classes != manifest.classes:
        raise InputError(
            f"checkpoint {checkpoint} was trained on {len(meta.classes)} classes "
            f"({', '.join(meta.classes[:5])}...), but dataset {dataset} has "
            f"{len(manifest.classes)} ({', '.join(manifest.classes[:5])}...). A run resumes "
            "only on the classes it started with: pick a new name= for a new run, or point "
            "dataset= at the data this run was trained on"
        )
