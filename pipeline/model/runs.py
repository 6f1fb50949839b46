"""A training run on storage, `<storage_path>/<name>`, and what it records.

epoch_0007/                       a checkpoint (pipeline.model.checkpoint)
steps/epoch_0008_step_000200/     a checkpoint inside an epoch, until its epoch's own is in
checkpoint_manager_snapshot.json  Ray Train's record of the run's checkpoints and their metrics
summary.json                      written last: a run with it has finished, unless it says
                                  "training" (a train job trains it again: TrainingMark); it
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
import os
import posixpath
import re
import socket
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import ray.train

from pipeline.core.errors import ConfigError, InputError
from pipeline.core.job_table import submission_id
from pipeline.core.plots import plot_curves
from pipeline.core.ray_internals import (
    CHECKPOINT_MANAGER_LOGGER,
)
from pipeline.core.storage import Location
from pipeline.data.dataset import Manifest
from pipeline.model.checkpoint import (
    METADATA,
    CheckpointMeta,
    Score,
    best_of,
    read_meta,
    score_of,
)

log = logging.getLogger(__name__)

if TYPE_CHECKING:  # only a type here: inference reads runs without the train wing
    from pipeline.train.config import TrainConfig

# The run layout's version, in its summary.json (docs/own-loop.md); a summary without one is
# of format 1. A reader refuses a newer one: it may mean what this code cannot tell.
RUN_FORMAT = 1
SNAPSHOT = "checkpoint_manager_snapshot.json"
RUN_SUMMARY = "summary.json"
TRAINING = "training"  # the status of a run's summary while a train job trains it
FINISHED = "finished"  # the training marker's key for the summary of the run's last finish
# The train job refreshes its training marker's heartbeat every HEARTBEAT_S. A reader takes a
# marker not refreshed for STALE_BEATS of them as left by a job that ended without putting the
# finished summary back (killed, its node lost), and goes by that summary, which it keeps.
HEARTBEAT_S = 30.0
STALE_BEATS = 3
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


def job_holder() -> dict:
    """Who this process is, for a training marker: the Ray job's submission id (None where the
    process runs outside a Ray job), the host and the pid."""
    return {
        "submission_id": submission_id(),
        "host": socket.gethostname(),
        "pid": os.getpid(),
    }


class TrainingMark:
    """A finished run's summary.json while a train job trains the run again: it says
    "training", names the job (`holder`), carries a heartbeat and keeps the finished summary.

    Inference takes a run with a summary as finished and loads its best checkpoint; a run that
    trains on (a resume with more epochs) may delete that checkpoint as better ones come, and
    its old summary would name the checkpoints of before. `hold` writes the marker and starts a
    daemon thread that refreshes its heartbeat every `interval_s`; `release` stops the thread
    and, for a resume that failed or was stopped, puts the finished summary back. A job killed
    before that leaves the marker, whose heartbeat goes stale: readers (`run_summary`) then go
    by the finished summary it keeps. `clock` stands in for time.time in tests."""

    def __init__(
        self,
        run_dir: Location,
        finished: dict | None,
        *,
        interval_s: float = HEARTBEAT_S,
        clock: Callable[[], float] = time.time,
    ):
        self.run_dir, self.finished = run_dir, finished
        self.interval_s, self.clock = interval_s, clock
        self.holder = job_holder()
        self.since = clock()
        self._lock = threading.Lock()
        self._released = threading.Event()

    @classmethod
    def hold(cls, run_dir: Location, **options) -> TrainingMark:
        """Mark the run as training, heartbeat and all, keeping its finished summary (that of a
        marker left by a job that did not finish, if the summary is one)."""
        path = run_dir.child(RUN_SUMMARY)
        try:
            summary = json.loads(path.read_bytes()) if path.exists() else None
        except ValueError as e:  # damaged: write_reports replaces it once the run finishes
            log.warning("run %s: %s is not JSON (%s); it is not kept", run_dir.uri, path.uri, e)
            summary = None
        if summary is not None and summary.get("status") == TRAINING:
            log.warning(
                "run %s: its summary says that %s has trained it again since %s, and it did "
                "not finish: this job goes on from there",
                *(run_dir.uri, _holder(summary), _when(summary["since"])),
            )
            summary = summary.get(FINISHED)
        mark = cls(run_dir, summary, **options)
        mark._write()
        threading.Thread(target=mark._beat, name="training-heartbeat", daemon=True).start()
        return mark

    def _write(self) -> None:
        marker = {
            "run": self.run_dir.uri,
            "status": TRAINING,
            "since": self.since,
            "holder": self.holder,
            "heartbeat": self.clock(),
            "heartbeat_s": self.interval_s,
            FINISHED: self.finished,
        }
        self.run_dir.child(RUN_SUMMARY).write_bytes(json.dumps(marker, indent=2).encode())

    def _beat(self) -> None:
        while not self._released.wait(self.interval_s):
            with self._lock:
                if self._released.is_set():
                    return
                try:
                    self._write()
                except OSError as e:  # storage down for a while: the next beat tries again
                    log.warning("refreshing the training marker of %s: %s", self.run_dir.uri, e)

    def release(self, *, restore: bool) -> None:
        """Stop the heartbeat; with `restore` (the resume failed or was stopped), put the
        finished summary back. Without it the marker stays until write_reports replaces it."""
        with self._lock:
            self._released.set()
            if restore and self.finished is not None:
                data = json.dumps(self.finished, indent=2).encode()
                self.run_dir.child(RUN_SUMMARY).write_bytes(data)
                log.warning(
                    "run %s: the resume did not finish; the summary of the run's last finish is "
                    "back in place, and inference takes the run as finished again. Submitting "
                    "the train job again resumes it",
                    self.run_dir.uri,
                )


def mark_training(run_dir: Location, **options) -> TrainingMark:
    """TrainingMark.hold: the run's summary says it is training, until released."""
    return TrainingMark.hold(run_dir, **options)


def run_summary(run_dir: Location, *, now: float | None = None) -> dict:
    """The summary to go by for a run that has one: summary.json, but for the marker of a
    train job that stopped refreshing it (STALE_BEATS heartbeats missed), the finished summary
    that marker keeps. `now` defaults to time.time()."""
    summary = json.loads(run_dir.child(RUN_SUMMARY).read_bytes())
    check_run_format(run_dir, summary.get(FINISHED) or summary)
    if summary.get("status") != TRAINING:
        return summary
    now = time.time() if now is None else now
    beat = summary.get("heartbeat", summary["since"])  # a marker of before heartbeats: since
    interval = summary.get("heartbeat_s", HEARTBEAT_S)
    if now - beat <= STALE_BEATS * interval:
        return summary
    finished = summary.get(FINISHED)
    if finished is None:
        raise InputError(
            f"run {run_dir.uri} has been trained again since {describe_marker(summary, now=now)}"
            "; that job has ended without finishing it, and the summary keeps no finished state "
            "to go by: submit the train job again to finish the run, or pass one checkpoint "
            f"directory as model={run_dir.uri}/epoch_NNNN"
        )
    log.warning(
        "run %s: %s, training it again since %s, last refreshed its summary %.0f s ago (every "
        "%.0f s while it runs): it has ended without finishing, so the run goes as it last "
        "finished. Submitting the train job again resumes it",
        *(run_dir.uri, _holder(summary), _when(summary["since"]), now - beat, interval),
    )
    return finished


def check_run_format(run_dir: Location, summary: dict) -> None:
    """Raise InputError for a run summary of a format newer than this code's."""
    found = summary.get("format", 1)
    if not isinstance(found, int) or found > RUN_FORMAT:
        raise InputError(
            f"run {run_dir.uri} is of run format {found}, newer than this code reads (up to "
            f"{RUN_FORMAT}): update the bundle where this job runs"
        )


def training_since(run_dir: Location, *, now: float | None = None) -> float | None:
    """When a train job began to train the run again, if one still does (run_summary)."""
    summary = run_summary(run_dir, now=now)
    return summary["since"] if summary.get("status") == TRAINING else None


def describe_marker(marker: dict, *, now: float | None = None) -> str:
    """A training marker for a message: since when, by which job, its last heartbeat."""
    now = time.time() if now is None else now
    said = f"{_when(marker['since'])} by {_holder(marker)}"
    if "heartbeat" not in marker:  # a marker of before heartbeats
        return said
    return f"{said}, last heartbeat {now - marker['heartbeat']:.0f} s ago"


def _holder(marker: dict) -> str:
    """The job a training marker names: its submission id, host and pid."""
    holder = marker.get("holder")
    if not holder:
        return "a train job it does not name"
    job = holder["submission_id"] or "outside a Ray job"
    return f"train job {job} on {holder['host']} (pid {holder['pid']})"


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))


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
