"""The chain's `status` without a cluster: where it looks, what it says, and its answer when
there is nothing to say (pipeline/chain/status.py; on a real cluster:
tests/jobs/test_metrics.py)."""

from __future__ import annotations

import json
import time

from harness.cluster import free_port
from jobs.submit import main
from pipeline.chain.plan import plan
from pipeline.chain.status import describe, progress_places
from pipeline.core.progress import PROGRESS


def test_status_looks_where_the_chains_train_and_infer_jobs_write():
    places = progress_places(plan("s3://b/x", sets=["train.name=r1"]))
    assert places == {
        "train": f"s3://b/x/runs/r1/{PROGRESS}",
        "infer": f"s3://b/x/predictions/r1/{PROGRESS}",
    }


def test_a_record_reads_as_lines_for_people():
    now = time.time()
    train = {
        "kind": "train",
        "run": "s3://b/x/runs/r1",
        "job_id": "ray-cv-train-1",
        "job_status": "RUNNING",
        "state": "training",
        "age_s": 4.0,
        "epoch": 3,
        "epochs": 10,
        "step": 120,
        "steps": 391,
        "progress": 0.3307,
        "images_per_s": 1520.34,
        "input_wait_share": 0.04,
        "eta_s": 1300,
        "last_checkpoint": {"uri": "s3://b/x/runs/r1/epoch_0002", "epoch": 2, "at": now - 185},
        "best": {"metric": "val_loss", "value": 0.81234, "epoch": 2},
        "worker_hours": 0.742,
        "gpu_hours": 0.742,
        "cost": 2.27,
        "currency": "USD",
        "newer_job": {"job_id": "ray-cv-train-2", "job_status": "PENDING"},
    }
    assert describe("train", train) == [
        "train run s3://b/x/runs/r1 (job ray-cv-train-1: RUNNING; training, updated 4s ago)",
        "  epoch 3/9, step 120/391 (33% of the run), 1520.3 images/s, 4% waiting for input, "
        "ETA 21m40s",
        "  last checkpoint s3://b/x/runs/r1/epoch_0002 (epoch 2), 3m05s ago",
        "  best val_loss 0.8123 (epoch 2)",
        "  0.742 worker-hours, 0.742 GPU-hours, 2.27 USD",
        "  a newer job ray-cv-train-2 is PENDING: no progress yet",
    ]
    infer = {
        "kind": "infer",
        "output": "s3://b/x/predictions/r1",
        "job_id": "ray-cv-infer-1",
        "job_status": "SUCCEEDED",
        "state": "finished",
        "age_s": 7300,
        "images_done": 40,
        "images": 40,
        "progress": 1.0,
        "images_per_s": None,
        "eta_s": 0.0,
    }
    assert describe("infer", infer) == [
        "infer output s3://b/x/predictions/r1 (job ray-cv-infer-1: SUCCEEDED; finished, "
        "updated 2h01m ago)",
        "  40 of 40 images (100%), ? images/s, ETA 0s",
    ]
    starting = {"job_id": "ray-cv-train-3", "job_status": "RUNNING", "state": "starting"}
    assert describe("train", starting) == ["train: job ray-cv-train-3: RUNNING; starting"]


def test_status_answers_from_storage_when_the_cluster_does_not(tmp_path, capsys):
    nowhere = f"http://127.0.0.1:{free_port()}"
    args = ["--address", nowhere, "--root", str(tmp_path), "--set", "train.name=r1", "status"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: no progress yet at {tmp_path}/runs/r1/{PROGRESS}, ")
    run = tmp_path / "runs" / "r1"
    run.mkdir(parents=True)
    record = {"kind": "infer", "output": "o", "job_id": "j1", "state": "finished"}
    record |= {"images_done": 3, "images": 3, "progress": 1.0, "images_per_s": 2.0, "eta_s": 0}
    (run / PROGRESS).write_text(json.dumps(record | {"updated_at": time.time()}))
    assert main([*args, "--json"]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert answer["train"]["job_status"].startswith("UNKNOWN (the cluster does not answer")
    assert answer["train"]["images_done"] == 3
