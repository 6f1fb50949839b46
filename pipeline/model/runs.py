"""A training run on storage, `<storage_path>/<name>`, and what it records.

epoch_0007/                       a checkpoint (pipeline.model.checkpoint)
checkpoint_manager_snapshot.json  Ray Train's record of the run's checkpoints and their metrics
summary.json                      written last: a run with it has finished, unless it says
                                  "training" (a train job trains it again); it records the
                                  run's checkpoint.metric, which inference reads to pick the best
history.csv, curves.png           one row per epoch; loss and accuracy curves
"""

from __future__ import annotations

import csv
import io
import json
import logging
import posixpath
import time
from typing import TYPE_CHECKING

import ray.train

from pipeline.core.errors import ConfigError, InputError
from pipeline.core.plots import plot_curves
from pipeline.core.ray_internals import CHECKPOINT_MANAGER_LOGGER
from pipeline.core.storage import Location
from pipeline.data.dataset import Manifest
from pipeline.model.checkpoint import (
    RECORDED_BEFORE_SCORES,
    SCORES,
    CheckpointMeta,
    Score,
    read_meta,
)

log = logging.getLogger(__name__)

if TYPE_CHECKING:  # only a type here: inference reads runs without the train wing
    from pipeline.train.config import TrainConfig

SNAPSHOT = "checkpoint_manager_snapshot.json"
RUN_SUMMARY = "summary.json"
TRAINING = "training"  # the status of a run's summary while a train job trains it
HISTORY_CSV = "history.csv"
CURVES_PNG = "curves.png"


def checkpoint_dir_name(epoch: int) -> str:
    return f"epoch_{epoch:04d}"


def load_result(run_dir: Location) -> ray.train.Result:
    """Ray's record of a run's checkpoints and their metrics, read from storage."""
    # Quiet: reading the record makes Ray log a notice meant for runs about to resume.
    quiet = logging.getLogger(CHECKPOINT_MANAGER_LOGGER)
    level = quiet.level
    quiet.setLevel(logging.WARNING)
    try:
        return ray.train.Result.from_path(run_dir.path, storage_filesystem=run_dir.fs)
    finally:
        quiet.setLevel(level)


def in_run(run_dir: Location, checkpoint: ray.train.Checkpoint) -> Location:
    """A checkpoint of Ray's record, as a Location under the run's own URI."""
    return run_dir.child(posixpath.basename(checkpoint.path))


def best_checkpoint(
    run_dir: Location, result: ray.train.Result, score: Score
) -> tuple[Location, dict]:
    """The retained checkpoint that `score` ranks best, and its metrics (Result.checkpoint is
    the latest, not the best). On a tie, the newest of the tied. Logs which and why: `best
    checkpoint epoch 5 by val_loss (min): 0.4360; last epoch 5`."""
    pick = min if score.mode == "min" else max
    ranked = sorted(result.best_checkpoints, key=lambda cm: -cm[1]["epoch"])  # newest first
    best, metrics = pick(ranked, key=lambda cm: cm[1][score.key])
    best = in_run(run_dir, best)
    why = "the newest epoch" if score.key == "epoch" else f"{metrics[score.key]:.4f}"
    log.info(
        "run %s: best checkpoint epoch %d by %s: %s; last epoch %d: %s",
        *(run_dir.uri, metrics["epoch"], score, why, result.metrics["epoch"], best.uri),
    )
    return best, metrics


def run_score(run_dir: Location) -> Score:
    """The score a finished run ranked its checkpoints by, as its summary records it (runs
    from before checkpoint.metric: val accuracy, which they were ranked by)."""
    summary = json.loads(run_dir.child(RUN_SUMMARY).read_bytes())
    return SCORES[summary.get("checkpoint_metric", RECORDED_BEFORE_SCORES)]


def latest_checkpoint(run_dir: Location) -> Location | None:
    """The run's latest checkpoint, if the run exists and has one."""
    if not run_dir.child(SNAPSHOT).exists():
        return None
    result = load_result(run_dir)
    return in_run(run_dir, result.checkpoint) if result.checkpoint else None


def mark_training(run_dir: Location) -> None:
    """Replace a run's summary with one that says it is training, until `write_reports`.

    Inference takes a run with a summary as finished and loads its best checkpoint; a run that
    trains on (a resume with more epochs) may delete that checkpoint as better ones come, and
    its old summary would name the checkpoints of before."""
    status = {"run": run_dir.uri, "status": TRAINING, "since": time.time()}
    run_dir.child(RUN_SUMMARY).write_bytes(json.dumps(status, indent=2).encode())


def training_since(run_dir: Location) -> float | None:
    """When a train job began to train the run again, if its summary says it is training."""
    summary = json.loads(run_dir.child(RUN_SUMMARY).read_bytes())
    return summary["since"] if summary.get("status") == TRAINING else None


def write_reports(run_dir: Location, score: Score, *, wall_time_s: float) -> dict:
    """summary.json (last), history.csv and curves.png in the run directory; returns the
    summary."""
    result = load_result(run_dir)
    best, best_metrics = best_checkpoint(run_dir, result, score)
    latest = in_run(run_dir, result.checkpoint)
    history = read_meta(latest).history
    summary = {
        "run": run_dir.uri,
        "status": "finished",
        "checkpoint_metric": score.metric,  # what inference, serving and export pick the best by
        "checkpoint_mode": score.mode,
        "best_checkpoint": best.uri,
        "best_metrics": best_metrics,
        "latest_checkpoint": latest.uri,
        "final_accuracy": history[-1]["val_accuracy"],
        "epochs": len(history),
        "wall_time_s": wall_time_s,
        "train_time_s": sum(h["train_s"] for h in history),
        "images_per_s": _mean(h["images_per_s"] for h in history),
        "images_per_s_per_worker": _mean(h["images_per_s_per_worker"] for h in history),
    }
    run_dir.child(HISTORY_CSV).write_bytes(history_csv(history).encode())
    png = plot_curves(history, best_epoch=best_metrics["epoch"], chosen_by=str(score))
    run_dir.child(CURVES_PNG).write_bytes(png)
    run_dir.child(RUN_SUMMARY).write_bytes(json.dumps(summary, indent=2).encode())
    return summary


def history_csv(history: list[dict]) -> str:
    out = io.StringIO()
    # Every key of every row: a run resumed from an older checkpoint has rows without the
    # newer ones (such as `workers`), left empty.
    fields = list(dict.fromkeys(key for row in history for key in row))
    writer = csv.DictWriter(out, fieldnames=fields)
    writer.writeheader()
    writer.writerows(history)
    return out.getvalue()


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


# Settings a run cannot change on resume: the weights, the optimizer's state and the grad scaler's
# would not fit the new ones. Everything else is applied from the resumed epoch on.
FIXED_ON_RESUME = {
    "optimizer.name": "the optimizer's state (momentum or Adam moments) belongs to its kind",
    "checkpoint.metric": "the checkpoints kept so far were chosen by the run's metric, and Ray "
    "Train goes on ranking them in that order",
}


# A run goes on with the network it started with, fed as it was: its checkpoint holds them.
MODEL_FIXED = "the run's weights belong to its network and its input"
# ...but for how fast its BatchNorm statistics follow the batches: a run stuck at chance by them
# goes on with another momentum.
MODEL_CHANGES_ON_RESUME = ("bn_momentum",)
# What a run recorded before the model section trained: ResNet-18 (its `pretrained` aside).
RECORDED_BEFORE_MODELS = {"name": "resnet18", "kwargs": {}}


def resume_changes(recorded: dict, cfg: TrainConfig) -> list[str]:
    """The settings `cfg` changes against the run's recorded config, as 'key: old -> new'.
    Raises ConfigError for what a resume cannot change."""
    now = cfg.model_dump(mode="json")
    was_model, now_model = recorded.get("model", RECORDED_BEFORE_MODELS), now.pop("model")
    old = flatten_config({k: v for k, v in recorded.items() if k != "model"})
    old.setdefault("checkpoint.metric", RECORDED_BEFORE_SCORES)
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


def flatten_config(config: dict, prefix: str = "") -> dict:
    """A config as one level of dotted keys (`optimizer.lr`), as overrides name them."""
    flat = {}
    for key, value in config.items():
        if isinstance(value, dict):
            flat |= flatten_config(value, f"{prefix}{key}.")
        else:
            flat[prefix + key] = value
    return flat


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
