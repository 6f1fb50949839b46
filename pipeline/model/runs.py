"""A training run on storage, `<storage_path>/<name>`, and what it records.

epoch_0007/                       a checkpoint (pipeline.model.checkpoint)
steps/epoch_0008_step_000200/     a checkpoint inside an epoch, until its epoch's own is in
checkpoint_manager_snapshot.json  Ray Train's record of the run's checkpoints and their metrics
summary.json                      written last: a run with it has finished, unless it says
                                  "training" (a train job trains it again: run_status); it
                                  records the run's checkpoint.metric, which inference reads to
                                  pick the best, and its `format` (RUN_FORMAT)
history.csv, curves.png           one row per epoch; loss and accuracy curves
"""

from __future__ import annotations

import csv
import io
import json
import logging
import math
import posixpath
import re

import ray.train

from pipeline.core.errors import InputError
from pipeline.core.plots import plot_curves
from pipeline.core.ray_internals import (
    CHECKPOINT_MANAGER_LOGGER,
)
from pipeline.core.storage import Location
from pipeline.model.checkpoint import (
    METADATA,
    Score,
    best_of,
    read_meta,
    score_of,
)

log = logging.getLogger(__name__)

# The run layout's version, in its summary.json (docs/own-loop.md); a summary without one is
# of format 1. A reader refuses a newer one: it may mean what this code cannot tell.
RUN_FORMAT = 1
SNAPSHOT = "checkpoint_manager_snapshot.json"
RUN_SUMMARY = "summary.json"
HISTORY_CSV = "history.csv"
CURVES_PNG = "curves.png"


def checkpoint_dir_name(epoch: int) -> str:
    return f"epoch_{epoch:04d}"


# Checkpoints inside an epoch (pipeline.train.checkpointer), beside the epochs'.
STEPS = "steps"
NAME = re.compile(r"epoch_(\d{4,})_step_(\d{6,})")


def step_dir_name(epoch: int, step: int) -> str:
    return f"epoch_{epoch:04d}_step_{step:06d}"


def step_checkpoints(run_dir: Location) -> list[tuple[int, int, Location]]:
    """(epoch, step, directory) of the run's whole checkpoints inside an epoch, oldest first."""
    found = []
    for info in run_dir.child(STEPS).list_dirs():
        if match := NAME.fullmatch(info.base_name):
            found.append((int(match[1]), int(match[2]), run_dir.child(STEPS, info.base_name)))
    return sorted(found, key=lambda f: f[:2])


def latest_step_checkpoint(run_dir: Location, epoch: int | None = None) -> Location | None:
    """The newest checkpoint inside an epoch (inside `epoch`, if given) that is whole (its
    metadata, written last, is there), if any."""
    for found, _, directory in reversed(step_checkpoints(run_dir)):
        if epoch in (None, found) and directory.child(METADATA).exists():
            return directory
    return None


EPOCH_NAME = re.compile(r"epoch_(\d{4,})")


def run_checkpoints(run_dir: Location) -> list[tuple[int, int | None, Location]]:
    """(epoch, step, directory) of the run's whole checkpoints on storage (their metadata, written
    last, is there), of both kinds, newest first: an epoch's own checkpoint (step None) after
    those inside it. Whether Ray's record names them or not: Ray records an epoch's checkpoint
    only once its upload returns, and the loop trains on meanwhile."""
    found: list[tuple[int, int | None, Location]] = list(step_checkpoints(run_dir))
    for info in run_dir.list_dirs():
        if match := EPOCH_NAME.fullmatch(info.base_name):
            found.append((int(match[1]), None, run_dir.child(info.base_name)))
    whole = [f for f in found if f[2].child(METADATA).exists()]
    return sorted(whole, key=lambda f: (f[0], math.inf if f[1] is None else f[1]), reverse=True)


def epoch_of(path: str) -> int:
    """The epoch of an epoch checkpoint's path (`.../epoch_0007`)."""
    match = EPOCH_NAME.fullmatch(posixpath.basename(path.rstrip("/")))
    assert match, f"{path} is not an epoch checkpoint's path"
    return int(match[1])


# A checkpoint being written to local disk, or the one it replaces (pipeline.train.saving): left
# behind by a writer killed midway.
PARTIAL = re.compile(r"\.epoch_\d{4,}(_step_\d{6,})?\.(tmp|old)-\S+")


def remove_partial_writes(run_dir: Location) -> None:
    """Remove what checkpoint writes killed midway left in the run: called as a new attempt
    starts, when no writer of the run is alive (a second train job of a run is refused)."""
    for directory in (run_dir, run_dir.child(STEPS)):
        for info in directory.list_dirs():
            if PARTIAL.fullmatch(info.base_name):
                log.info("removing %s, left by a checkpoint write cut short", info.path)
                directory.child(info.base_name).delete()


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
    checkpoint epoch 5 by val_loss (min): 0.4360; last epoch 5`. A checkpoint that scored NaN
    (or nothing) ranks worst: raises DivergedRun if every one did."""
    ranked = sorted(result.best_checkpoints, key=lambda cm: -cm[1]["epoch"])  # newest first
    found = best_of(ranked, lambda cm: cm[1].get(score.key), score.mode)
    if found is None:
        raise DivergedRun(run_dir, score, [m for _, m in ranked])
    best, metrics = in_run(run_dir, found[0]), found[1]
    why = "the newest epoch" if score.key == "epoch" else f"{metrics[score.key]:.4f}"
    log.info(
        "run %s: best checkpoint epoch %d by %s: %s; last epoch %d: %s",
        *(run_dir.uri, metrics["epoch"], score, why, result.metrics["epoch"], best.uri),
    )
    return best, metrics


class DivergedRun(InputError):
    """A run none of whose kept checkpoints has a score to rank (NaN: the training diverged)."""

    def __init__(self, run_dir: Location, score: Score, metrics: list[dict]):
        said = ", ".join(f"epoch {m['epoch']}: {m.get(score.key)}" for m in metrics)
        super().__init__(
            f"run {run_dir.uri} diverged: no checkpoint it keeps has a {score.key} to rank it by "
            f"({said}), so it has no best checkpoint. Train it again with a lower optimizer.lr "
            f"(a new name=), or pass the checkpoint to use as model={run_dir.uri}/epoch_NNNN"
        )


def summary_score(summary: dict) -> Score:
    """The score a finished run ranked its checkpoints by, as its summary records it."""
    return score_of(summary["checkpoint_metric"], summary.get("checkpoint_mode"))


def latest_checkpoint(run_dir: Location) -> Location | None:
    """The run's latest checkpoint, if the run exists and has one."""
    if not run_dir.child(SNAPSHOT).exists():
        return None
    result = load_result(run_dir)
    return in_run(run_dir, result.checkpoint) if result.checkpoint else None


def write_reports(run_dir: Location, score: Score, *, wall_time_s: float | None) -> dict:
    """summary.json (last), history.csv and curves.png in the run directory; returns the
    summary. Raises DivergedRun, once they are written, for a run with no best checkpoint."""
    result = load_result(run_dir)
    latest = in_run(run_dir, result.checkpoint)
    history = read_meta(latest).history
    diverged = None
    try:
        best, best_metrics = best_checkpoint(run_dir, result, score)
    except DivergedRun as e:  # the reports as they are, without a best; then the error
        best, best_metrics, diverged = None, None, e
    summary = {
        "format": RUN_FORMAT,
        "run": run_dir.uri,
        "status": "finished",
        "checkpoint_metric": score.metric,  # what inference, serving and export pick the best by
        "checkpoint_mode": score.mode,
        "best_checkpoint": best.uri if best else None,
        "best_metrics": best_metrics,
        "latest_checkpoint": latest.uri,
        "final_accuracy": history[-1]["val_accuracy"],
        "epochs": len(history),
        "wall_time_s": wall_time_s,
        # A loop of the user's own (pipeline.train.api) may not measure these: null then.
        "train_time_s": _sum_of(history, "train_s"),
        "images_per_s": _mean_of(history, "images_per_s"),
        "images_per_s_per_worker": _mean_of(history, "images_per_s_per_worker"),
        "input_wait_share": _mean_of(history, "input_wait_share"),
        **run_cost(history, read_meta(latest).config),
    }
    run_dir.child(HISTORY_CSV).write_bytes(history_csv(history).encode())
    best_epoch = best_metrics["epoch"] if best_metrics else None
    png = plot_curves(history, best_epoch=best_epoch, chosen_by=str(score))
    run_dir.child(CURVES_PNG).write_bytes(png)
    run_dir.child(RUN_SUMMARY).write_bytes(json.dumps(summary, indent=2).encode())
    if diverged is not None:
        raise diverged
    return summary


# What a run's epochs cost, each one's in its history row and the run's in summary.json.
COST_KEYS = ("worker_hours", "gpu_hours", "cost")


def run_cost(history: list[dict], config: dict) -> dict:
    """The run's worker-hours and GPU-hours, and cost where its config gives a price: the sums
    of its epochs' (an epoch's counts the workers' time on it, a resumed epoch's earlier part
    too; time lost to a failure before a checkpoint is not counted). None where no epoch has
    them (runs from before they were measured)."""
    totals = {key: _sum_of(history, key) for key in COST_KEYS}
    if totals["cost"] is not None:
        totals["currency"] = config.get("cost", {}).get("currency", "USD")
    return totals


def history_csv(history: list[dict]) -> str:
    out = io.StringIO()
    # Every key of every row: a run resumed from an older checkpoint has rows without the
    # newer ones (such as `workers`), left empty.
    fields = list(dict.fromkeys(key for row in history for key in row))
    writer = csv.DictWriter(out, fieldnames=fields)
    writer.writeheader()
    writer.writerows(history)
    return out.getvalue()


def _mean_of(history: list[dict], key: str) -> float | None:
    """The mean of `key` over the epochs that have it (those of runs from before it was
    measured do not); None if none has."""
    values = [h[key] for h in history if key in h]
    return _mean(values) if values else None


def _sum_of(history: list[dict], key: str) -> float | None:
    """The sum of `key` over the epochs that have it; None if none has."""
    values = [h[key] for h in history if key in h]
    return sum(values) if values else None


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)
