"""The training job on a real local Ray cluster, sent with `ray job submit`: learning,
retention, exact distributed accuracy, worker kills at Ray's commit points, both input paths.
(A job stopped while an upload is unrecorded, and submitted again: test_train_faults; worker
kills and input errors, each on a run of its own: tests/ray/test_worker_kills.py. Stop and
resubmit: test_s3, with the run on S3. Nodes lost: tests/ray/test_node_loss.py, test_elastic.py
and test_node_preemption.py.)"""

from __future__ import annotations

import json
import re
import shutil
import uuid
from pathlib import Path

import pytest
import torch
from helpers import (
    MAIN_RUN_RECIPE,
    armed_runtime_env,
    held_worker,
    history,
    in_background,
    latest_recorded,
    metric_steps,
    mlflow_run,
    tracked,
    train_job,
    training_workers,
    wait_for,
)
from torch.utils.data import DataLoader

from pipeline.core import faults
from pipeline.core.errors import ConfigError
from pipeline.core.storage import Location
from pipeline.data.dataset import read_manifest
from pipeline.model.checkpoint import WEIGHTS, read_meta
from pipeline.model.device import DevicePolicy
from pipeline.model.loading import load_model
from pipeline.model.runs import (
    CURVES_PNG,
    HISTORY_CSV,
    RUN_SUMMARY,
    checkpoint_dir_name,
)
from pipeline.model.source import resolve_checkpoint
from pipeline.tracking import registered_checkpoint
from pipeline.tracking.registry import model_spec
from pipeline.train.epoch import evaluate
from pipeline.train.input.decoding import Decoded
from pipeline.train.input.rows import RowGroupStream, StreamSpec

pytestmark = pytest.mark.xdist_group("main_run")  # its costly fixture, made once
# A preprocess job of other images (3 classes, 40 px) for an output given by the caller.


def test_two_workers_learn(main_run):
    proc, run = main_run
    assert "2 workers on cpu, precision fp32" in proc.stdout
    assert "recipe: EMA decay 0.8 every 2 steps, 2 micro-batches of 8 per step" in proc.stdout
    assert re.search(r"\binput-bound: the step loop waited for input \d+% of its time", proc.stdout)
    h = history(run)
    assert h[-1]["train_loss"] < h[0]["train_loss"]
    assert h[-1]["val_accuracy"] > 0.4  # 4 classes: chance is 0.25


def test_killed_worker_is_replaced_and_every_epoch_runs_once(main_run):
    # Killed once epoch 0's checkpoint was in Ray's record (see conftest.main_run): the new
    # workers resume from it, and train epochs 1 to 3 only.
    proc, run = main_run
    resumed = r"resumed from checkpoint \S+/main/epoch_0000 \(epoch 0 done\)"
    assert re.search(resumed, proc.stdout), proc.stdout
    # 481 train rows in steps of 32: 16 steps, the last filled; an update every 2.
    assert proc.stdout.count("resumed the EMA of the weights (8 updates)") == 1
    assert proc.stdout.count("training epochs 0 to 3") == 1
    assert proc.stdout.count("training epochs 1 to 3") == 1
    assert [r["epoch"] for r in history(run)] == [0, 1, 2, 3]


def test_reports_and_retention(cluster_2cpu, main_run):
    _, run = main_run
    summary = json.loads((run / RUN_SUMMARY).read_text())
    h = history(run)
    assert summary["final_accuracy"] == h[-1]["val_accuracy"] and summary["epochs"] == 4
    # The share of each epoch the step loop waited for input, and the run's verdict on it.
    assert all(0 <= r["input_wait_share"] <= 1 for r in h)
    assert summary["input_wait_share"] == pytest.approx(sum(r["input_wait_share"] for r in h) / 4)
    assert (run / CURVES_PNG).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    logs = cluster_2cpu.job_logs("train-main")
    assert logs.rstrip().splitlines()[-1] == f"best checkpoint: {summary['best_checkpoint']}"
    # Retention: the best by the default checkpoint.metric, the lowest val loss (of equal ones
    # the newest, as Ray keeps), with checkpoint.num_to_keep=1, plus the latest, nothing else.
    lowest = min(h, key=lambda r: (r["val_loss"], -r["epoch"]))
    assert (summary["checkpoint_metric"], summary["checkpoint_mode"]) == ("val_loss", "min")
    assert summary["best_metrics"]["epoch"] == lowest["epoch"]
    kept = {p.name for p in run.glob("epoch_*")}
    assert kept == {checkpoint_dir_name(int(lowest["epoch"])), checkpoint_dir_name(3)}
    best = summary["best_metrics"]
    why = f"best checkpoint epoch {best['epoch']} by val_loss (min): {best['val_loss']:.4f}"
    assert f"{why}; last epoch 3" in logs


def test_distributed_accuracy_is_exact(main_run, tiny_dataset):
    # What two workers computed is exactly what one process computes over all of val (119
    # images: an uneven split, where a DistributedSampler would count one image twice).
    # The EMA of the weights the same: both sets of weights in the checkpoint are the ones
    # the workers evaluated.
    _, run = main_run
    checkpoint = Location.parse(str(run / checkpoint_dir_name(3)))
    model, meta = load_model(checkpoint, weights="raw")
    ema, _ = load_model(checkpoint, weights="ema")
    root = Location.parse(str(tiny_dataset))
    val = Decoded(RowGroupStream(root, read_manifest(root), "val", StreamSpec(batch_size=50)))
    one = evaluate(
        model,
        DataLoader(val, batch_size=None),
        num_classes=4,
        policy=DevicePolicy.for_input(torch.device("cpu"), "fp32", meta.model_input),
        ema=ema,
    )
    assert one["val_images"] == val.rows.rows == 119
    last = history(run)[-1]
    for prefix in ("", "ema_"):
        assert one[f"{prefix}val_accuracy"] == pytest.approx(
            last[f"{prefix}val_accuracy"], abs=1e-6
        )
        assert one[f"{prefix}val_loss"] == pytest.approx(last[f"{prefix}val_loss"], rel=1e-4)
    assert one["ema_val_loss"] != pytest.approx(one["val_loss"], rel=1e-4)


def test_the_run_is_one_mlflow_run_with_every_epoch_once_through_a_kill_and_a_resubmission(
    cluster_2cpu, main_run, tiny_dataset, mlflow_server, tmp_path
):
    # main_run's rank 0 logged epoch 0, then was killed; the new rank 0 resumed from epoch 0's
    # checkpoint. The run submitted again is finished: it trains nothing, starts no worker,
    # continues the same MLflow run, and adds no epoch, no model and no version.
    proc, run = main_run
    tracked_run = mlflow_run(mlflow_server, run)
    run_id = tracked_run.info.run_id
    assert proc.stdout.count(f"new MLflow run {run_id}") == 1 and "did not take" not in proc.stdout
    assert f"MLflow run {run_id} at {mlflow_server.uri} has every epoch" in proc.stdout
    args = ("name=main", "epochs=4", *tracked(mlflow_server))
    again = train_job(cluster_2cpu, tiny_dataset, run.parent, *args)
    assert again.returncode == 0, again.stdout
    assert "is complete (4 epochs, epochs=4): nothing to train" in again.stdout
    assert "RayTrainWorker" not in again.stdout
    assert f"continuing MLflow run {run_id}" in again.stdout
    assert "ray-cv-classifier version 1 is this checkpoint already" in again.stdout, again.stdout

    client = mlflow_server.client()
    named = f"tags.`ray_cv.run_dir` = '{run}'"
    runs = client.search_runs([tracked_run.info.experiment_id], named)
    assert [r.info.run_id for r in runs] == [run_id]
    tracked_run = client.get_run(run_id)
    assert tracked_run.info.status == "FINISHED"
    h = history(run)
    steps = metric_steps(mlflow_server, run_id, h)
    assert {"train_loss", "val_accuracy", "ema_val_accuracy", "lr", "worker_hours"} <= set(steps)
    assert all(s == [0, 1, 2, 3] for s in steps.values()), steps
    # What the run cost, epoch by epoch above and in all here, as its summary.json says.
    summary = json.loads((run / RUN_SUMMARY).read_text())
    totals = client.get_run(run_id).data.metrics
    assert totals["run_worker_hours"] == pytest.approx(summary["worker_hours"])
    assert summary["worker_hours"] > 0
    assert totals["run_gpu_hours"] == summary["gpu_hours"] == 0  # CPU workers
    assert summary["worker_hours"] == pytest.approx(sum(r["worker_hours"] for r in h))
    params = tracked_run.data.params
    assert (params["epochs"], params["micro_batch_size"], params["ema.decay"]) == ("4", "8", "0.8")
    assert tracked_run.data.tags["ray_cv.dataset_version"] == h[0]["dataset_version"]
    artifacts = {a.path for a in client.list_artifacts(run_id)}
    assert {HISTORY_CSV, CURVES_PNG, RUN_SUMMARY} <= artifacts
    logged = client.download_artifacts(run_id, HISTORY_CSV, str(tmp_path))
    assert Path(logged).read_bytes() == (run / HISTORY_CSV).read_bytes()

    # The best checkpoint, registered once, with where it came from; and back to it by name.
    summary = json.loads((run / RUN_SUMMARY).read_text())
    (version,) = client.search_model_versions(f"run_id = '{run_id}'")
    best = Path(summary["best_checkpoint"])
    tags = version.tags
    assert (version.name, tags["ray_cv.checkpoint"]) == ("ray-cv-classifier", str(best))
    meta = read_meta(Location.parse(str(best)))
    assert tags["ray_cv.dataset_version"] == meta.dataset_version
    assert tags["ray_cv.model"] == model_spec(meta)
    assert tags["ray_cv.code_version"].startswith(("git:", "sha256:"))
    model_uri = f"models:/ray-cv-classifier/{version.version}"
    copy = registered_checkpoint(model_uri, uri=mlflow_server.uri, dst=tmp_path / "registered")
    assert copy.child(WEIGHTS).read_bytes() == (best / WEIGHTS).read_bytes()


def test_a_resume_stopped_with_ray_job_stop_leaves_the_run_as_it_finished(
    cluster_2cpu, main_run, tiny_dataset, tmp_path
):
    # A copy of the shared finished run, resumed to 6 epochs and stopped with `ray job stop`
    # once epoch 4 is in Ray's record: the driver puts the finished summary back, and
    # inference takes the run again at once.
    storage, submission_id = tmp_path / "runs", f"resume-stopped-{uuid.uuid4().hex[:8]}"
    run = storage / "main"
    shutil.copytree(main_run[1], run)
    finished = json.loads((run / RUN_SUMMARY).read_text())
    env, marker = armed_runtime_env(tmp_path, faults.CHECKPOINT_REPORTED)
    args = ("name=main", "epochs=6", "checkpoint.num_to_keep=1", *MAIN_RUN_RECIPE)
    submit = {"runtime_env": env, "submission_id": submission_id}
    job = in_background(train_job, cluster_2cpu, tiny_dataset, storage, *args, **submit)
    held_worker(marker, job)
    wait_for(lambda: latest_recorded(run) == "epoch_0004", "epoch 4 in Ray's record", 60)
    training = json.loads((run / RUN_SUMMARY).read_text())
    assert training["status"] == "training" and training["finished"] == finished
    assert training["holder"]["submission_id"] == submission_id
    with pytest.raises(ConfigError, match=rf"since .* by train job {submission_id} on "):
        resolve_checkpoint(Location.parse(str(run)))

    cluster_2cpu.stop_job(submission_id)
    job.result()
    logs = cluster_2cpu.job_logs(submission_id)
    assert "SIGTERM: the job is being stopped" in logs, logs
    assert "the summary of the run's last finish is back in place" in logs, logs
    assert json.loads((run / RUN_SUMMARY).read_text()) == finished
    # Its best by Ray's record now: the finished run's, or epoch 4 if that scored better.
    best = read_meta(resolve_checkpoint(Location.parse(str(run))))
    assert best.epoch in {finished["best_metrics"]["epoch"], 4}
    # The stopped job's workers are gone: the shared cluster as it was.
    wait_for(lambda: not training_workers(cluster_2cpu), "the stopped job's workers gone", 120)
