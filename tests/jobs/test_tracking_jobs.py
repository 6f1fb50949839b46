"""A tracked training job through an outage of its MLflow server, for real: the server stopped
once rank 0 has logged epoch 0, a job submitted while it is down, and the server back. Training
never waits on tracking, the end of the job says what was not logged, a job that starts while
the server is down fails at once, and submitting the run again logs what was missing. (Tracked
runs on a healthy server: test_train_jobs' main run, test_s3's chain.)"""

from __future__ import annotations

import json
import secrets

import pytest
from helpers import (
    armed_runtime_env,
    held_worker,
    history,
    in_background,
    latest_recorded,
    metric_steps,
    tracked,
    train_job,
    wait_for,
)

from harness.faults import release
from harness.mlflow_server import MLflowServer
from pipeline.core import faults
from pipeline.model.runs import CURVES_PNG, HISTORY_CSV, RUN_SUMMARY


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A server of this module's own, which its test stops and starts."""
    with MLflowServer(tmp_path_factory.mktemp("mlflow-outage")) as server:
        yield server


def test_an_outage_mid_training_costs_no_training_and_a_resubmission_logs_the_rest(
    cluster_2cpu, tiny_dataset, server, tmp_path
):
    run = tmp_path / "outage"
    env, marker = armed_runtime_env(tmp_path, faults.CHECKPOINT_REPORTED)
    # One worker: the outage is rank 0's to live through, and the other would only cost CPU.
    args = ("name=outage", "epochs=3", "checkpoint.num_to_keep=1", "scaling.num_workers=1")
    args += tracked(server)
    job = in_background(train_job, cluster_2cpu, tiny_dataset, tmp_path, *args, runtime_env=env)
    held_worker(marker, job)  # rank 0 has reported epoch 0, and waits
    # Logged once its checkpoint is uploaded, in Ray's upload thread: before Ray records it.
    wait_for(lambda: latest_recorded(run) == "epoch_0000", "epoch 0 in Ray's record", 60)
    server.stop()
    release(marker)
    proc = job.result()
    assert proc.returncode == 0, proc.stdout
    assert [r["epoch"] for r in history(run)] == [0, 1, 2]  # training went on, whole
    run_id = json.loads((run / "mlflow_run.json").read_text())["run_id"]
    assert f"MLflow run {run_id} at {server.uri} did not take the metrics of epoch(s) 1 (" in (
        proc.stdout
    )
    best = json.loads((run / RUN_SUMMARY).read_text())["best_checkpoint"]
    lacks = (
        f"MLflow run {run_id} at {server.uri} lacks the metrics of epoch(s) 1, 2; the run's "
        f"worker-hours, GPU-hours and cost; artifacts "
        f"{HISTORY_CSV}, {CURVES_PNG}, {RUN_SUMMARY}; the best checkpoint {best} as a model and "
        "its version of ray-cv-classifier; the run's end (status FINISHED)"
    )
    assert lacks in proc.stdout, proc.stdout

    # A job that starts while the server is down fails before any work: exit 3, no run.
    never = f"never-{secrets.token_hex(4)}"
    proc = train_job(
        cluster_2cpu, tiny_dataset, tmp_path, f"name={never}", *tracked(server), submission_id=never
    )
    assert proc.returncode != 0
    assert "exit code 3" in cluster_2cpu.job(never)["message"]
    assert f"error: the tracking server {server.uri} does not answer (" in proc.stdout, proc.stdout
    assert "RayTrainWorker" not in proc.stdout and not (tmp_path / never).exists()

    server.start()
    client = server.client()
    h = history(run)
    assert all(steps == [0] for steps in metric_steps(server, run_id, h).values())
    assert client.get_run(run_id).info.status == "RUNNING"
    experiment = client.get_experiment_by_name("ray-cv-bundle").experiment_id
    assert not client.search_runs([experiment], f"tags.`ray_cv.run_dir` = '{tmp_path / never}'")

    # The run submitted again trains nothing and logs what the outage left out.
    proc = train_job(cluster_2cpu, tiny_dataset, tmp_path, *args)
    assert proc.returncode == 0, proc.stdout
    assert "is complete (3 epochs, epochs=3): nothing to train" in proc.stdout
    assert f"continuing MLflow run {run_id}" in proc.stdout
    assert f"MLflow run {run_id} at {server.uri} has every epoch" in proc.stdout, proc.stdout
    steps = metric_steps(server, run_id, h)
    assert steps and all(s == [0, 1, 2] for s in steps.values()), steps
    assert client.get_run(run_id).info.status == "FINISHED"
    assert client.get_run(run_id).data.metrics["run_worker_hours"] > 0  # the rest, logged now
    assert {HISTORY_CSV, CURVES_PNG, RUN_SUMMARY} <= {a.path for a in client.list_artifacts(run_id)}
    (version,) = client.search_model_versions(f"run_id = '{run_id}'")
    assert version.tags["ray_cv.checkpoint"] == best
