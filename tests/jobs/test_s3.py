"""The chain, step by step as a scheduler's tasks run it, with everything on a real S3-compatible
server (moto, on loopback): the image folder, the dataset, checkpoints, the resume, the
predictions. test_airflow.py runs the same commands from the Airflow example under Airflow."""

import csv
import io
import json
import re
import subprocess

import pyarrow.parquet as pq
import pytest
import torch
import torchvision
from helpers import CLASSES, make_image_folder, start_task, wait_for

from harness.cluster import BUNDLE_ROOT, LocalCluster
from pipeline.chain.plan import STEPS, step_command
from pipeline.core import faults
from pipeline.core.progress import PROGRESS
from pipeline.core.storage import VERSION_MARKER, Location
from pipeline.data.dataset import read_manifest
from pipeline.infer.predictions import (
    CONFUSION_PNG,
    PREDICTIONS,
    SUMMARY,
    VERSIONS,
    read_predictions,
)
from pipeline.model.checkpoint import read_meta
from pipeline.model.runs import HISTORY_CSV, RUN_SUMMARY, SNAPSHOT

BUCKET = "bundle-test"


@pytest.fixture(scope="module")
def s3(s3_server):
    """The bucket's filesystem, with this process's AWS clients pointed at the session's S3
    server while the module runs (the cluster's nodes have the same in their environment, as
    a real cluster's credentials reach its workers), and the chain's initial weights in it."""
    with s3_server.client_env():
        fs = s3_server.create_bucket(BUCKET)
        torch.manual_seed(0)
        weights = io.BytesIO()
        torch.save(torchvision.models.mobilenet_v3_small().state_dict(), weights)
        fs.create_dir(f"{BUCKET}/weights")
        with fs.open_output_stream(f"{BUCKET}/weights/mobilenet_v3_small.pt") as f:
            f.write(weights.getvalue())
        yield fs


def upload(fs, local_root, prefix):
    for path in sorted(local_root.rglob("*")):
        if path.is_file():
            key = f"{prefix}/{path.relative_to(local_root)}"
            fs.create_dir(key.rsplit("/", 1)[0], recursive=True)
            with fs.open_output_stream(key) as f:
                f.write(path.read_bytes())


# --- the chain, one step at a time, with everything on S3 ------------------------------------

CHAIN_ROOT = f"s3://{BUCKET}/chain"
RECIPE = "finetune"
CHAIN_SETTINGS = [
    "preprocess.source.kind=folder",
    f"preprocess.source.folder.path=s3://{BUCKET}/raw",
    "preprocess.image_size=32",
    "preprocess.shard_size=30",
    "preprocess.row_group_size=10",
    "train.name=s3run",
    # Not the default ResNet-18: inference, which has no model setting, rebuilds it from the
    # checkpoint on S3. Fine-tuned (the chain's --recipe finetune) from weights on S3: the
    # recipe's DEFAULT weights would download, which nothing here can.
    "train.model.name=mobilenet_v3_small",
    f"train.model.weights=s3://{BUCKET}/weights/mobilenet_v3_small.pt",
    "train.epochs=2",
    # One worker: a CPU stays free for the preprocess job that runs while it trains.
    "train.scaling.num_workers=1",
    "train.global_batch_size=16",
    # Predictions in several files, each moved into place on S3: actors take batches of at least
    # batch_size rows, so small batches make several blocks of the ~24 val images.
    "infer.batch_size=8",
    "infer.rows_per_file=5",
]


@pytest.fixture(scope="module")
def tracking(mlflow_server) -> list[str]:
    """The chain's option that tracks its jobs in `mlflow_server`, through their environment."""
    return [f"--env=MLFLOW_TRACKING_URI={mlflow_server.uri}"]


@pytest.fixture(scope="module")
def steps(cluster_2cpu, tracking) -> dict[str, list[str]]:
    """Each step's command line: what the Airflow example's task for it runs, tracked."""
    return {step: command(cluster_2cpu, step, tracking=tracking) for step in STEPS}


def command(cluster: LocalCluster, step: str, *sets: str, tracking: list[str]) -> list[str]:
    """A step's command line with settings over CHAIN_SETTINGS."""
    *options, step = step_command(
        cluster.address,
        CHAIN_ROOT,
        step,
        profile="demo",
        sets=[*CHAIN_SETTINGS, *sets],
        recipe=RECIPE,
    )
    return [*options, *tracking, step]


def run_task(cmd: list[str], cluster: LocalCluster) -> tuple[int, str]:
    proc, lines, reading = start_task(cmd, cluster)
    reading.result(timeout=600)
    return proc.wait(), "".join(lines)


def test_chain_on_s3_counts_a_stopped_job_as_failed_and_resumes(
    s3, cluster_2cpu, steps, tracking, mlflow_server, tmp_path
):
    # Preprocessing: an image folder on S3 (with files that are not images) -> Parquet on S3.
    bad = make_image_folder(tmp_path / "src", per_class=40)
    upload(s3, tmp_path / "src", f"{BUCKET}/raw")
    code, out = run_task(steps["preprocess"], cluster_2cpu)
    assert code == 0, out
    dataset = Location.parse(f"{CHAIN_ROOT}/dataset")
    manifest = read_manifest(dataset)
    assert manifest.classes == sorted(CLASSES)
    assert {s.source_id for s in manifest.skipped} == set(bad)
    rows = sum(
        pq.read_table(dataset.child(f.path).path, filesystem=s3).num_rows
        for info in manifest.splits.values()
        for f in info.files
    )
    assert rows == 120
    keys = [i.path for i in dataset.list_files()]
    written = f"{dataset.path}/data/{manifest.version}"
    assert f"{written}/config.yaml" in keys
    entry = f"{dataset.path}/versions/{manifest.version}.json"
    assert all(k.startswith(written) for k in keys if k != entry), keys
    val_rows = manifest.splits["val"].rows

    # Training, stopped from outside with `ray job stop` after its first checkpoint on S3: the
    # step fails (exit 4), where `ray job submit` would have exited 0. Rank 0 is held once it
    # has reported epoch 0 (the fault point, through the chain's --env), so the stop lands
    # after that checkpoint and before the run could finish.
    run = Location.parse(f"{CHAIN_ROOT}/runs/s3run")
    marker = tmp_path / "fault" / faults.CHECKPOINT_REPORTED
    marker.parent.mkdir()
    held = [
        *steps["train"][:-1],
        f"--env={faults.ENV}={faults.CHECKPOINT_REPORTED}:{marker.parent}",
    ]
    proc, lines, reading = start_task([*held, "train"], cluster_2cpu)
    wait_for(lambda: marker.exists() or proc.poll() is not None, "rank 0 held after epoch 0")
    (submission_id,) = [
        re.search(r"\[train\] submitted (\S+):", line)[1]
        for line in lines
        if "[train] submitted" in line
    ]
    # A checkpoint counts once Ray Train has recorded it in the run's snapshot.
    wait_for(lambda: run.child(SNAPSHOT).exists(), "epoch 0 recorded on S3", 60)
    # Meanwhile the preprocess step runs again with other settings: a new version of the
    # dataset, committed beside the one the run reads, which stays whole.
    code, out = run_task(
        command(cluster_2cpu, "preprocess", "preprocess.image_size=40", tracking=tracking),
        cluster_2cpu,
    )
    assert code == 0, out
    newer = read_manifest(dataset)
    assert newer.image_size == 40 and read_manifest(dataset, manifest.version) == manifest
    cluster_2cpu.stop_job(submission_id)
    reading.result(timeout=300)
    out = "".join(lines)
    proc.wait()
    assert proc.returncode == 4, out
    assert f"[train] {submission_id} was stopped" in out

    # The scheduler's retry would resume the run on the newer version: refused, exit 2.
    code, out = run_task(steps["train"], cluster_2cpu)
    assert code == 2, out
    assert f"Pass dataset_version={manifest.version} to finish on the data it started on" in out
    # Pinned to the run's version, the retry resumes from the checkpoint on S3.
    pin = f"dataset_version={manifest.version}"
    code, out = run_task(
        command(cluster_2cpu, "train", f"train.{pin}", tracking=tracking), cluster_2cpu
    )
    assert code == 0, out
    resumed = re.search(rf"resuming from {CHAIN_ROOT}/runs/s3run/epoch_(\d+)", out)
    assert resumed, out
    trained_now = [int(e) for e in re.findall(r"epoch (\d)/1: train_loss", out)]
    assert trained_now == list(range(int(resumed[1]) + 1, 2))
    summary = json.loads(run.child(RUN_SUMMARY).read_bytes())
    rows = csv.DictReader(io.StringIO(run.child(HISTORY_CSV).read_bytes().decode()))
    assert [(int(r["epoch"]), r["dataset_version"]) for r in rows] == [
        (0, manifest.version),
        (1, manifest.version),
    ]
    assert summary["best_checkpoint"].startswith(f"{CHAIN_ROOT}/runs/s3run/epoch_")
    best = read_meta(Location.parse(summary["best_checkpoint"]))
    assert best.model.name == "mobilenet_v3_small" and best.model_input.image_size == 32
    kept = {i.path.rsplit("/", 2)[-2] for i in run.list_files() if i.path.endswith("/model.pt")}
    assert kept == {"epoch_0000", "epoch_0001"}

    # Inference reads the best checkpoint from S3 and writes its predictions there: the network
    # from the checkpoint, with no model setting of its own. Its step is told no version, and
    # reads the one the run was trained on, not the newer one committed meanwhile.
    code, out = run_task(steps["infer"], cluster_2cpu)
    assert code == 0, out
    assert (
        f"input={dataset.uri} is the dataset the checkpoint was trained on: reading version "
        f"{manifest.version}" in out
    )
    predictions = Location.parse(f"{CHAIN_ROOT}/predictions/s3run")
    result = json.loads(predictions.child(SUMMARY).read_bytes())
    assert result["checkpoint"] == summary["best_checkpoint"]
    assert result["dataset_version"] == manifest.version
    assert result["images"] == val_rows
    # The recipe keeps an EMA: inference serves the better of the two weights, and says which.
    score = {"raw": "val_accuracy", "ema": "ema_val_accuracy"}[result["weights"]]
    assert result["accuracy"] == pytest.approx(summary["best_metrics"][score], abs=1e-6)
    table = read_predictions(predictions)
    assert table.num_rows == val_rows
    # In parts, in the run's own version, and nothing else but the job's last progress
    # (status reads it): no file was moved or left over.
    version = f"{VERSIONS}/{result['version']}"
    parts = [f["path"] for f in result["files"]]
    assert len(parts) >= 2 and all(p.startswith(f"{version}/{PREDICTIONS}/part-") for p in parts)
    files = [i.path.removeprefix(predictions.path + "/") for i in predictions.list_files()]
    assert sorted(files) == sorted(
        [SUMMARY, PROGRESS, f"{version}/{VERSION_MARKER}", f"{version}/{CONFUSION_PNG}", *parts]
    )

    # In MLflow: each dataset version's preprocess run; one training run through the stop, the
    # refused retry and the resume, with each epoch once; the inference run, linked to it.
    client = mlflow_server.client()
    experiment = client.get_experiment_by_name("ray-cv-bundle").experiment_id

    def runs(job: str, **tags: str) -> list:
        query = " and ".join(f"tags.`ray_cv.{k}` = '{v}'" for k, v in {"job": job, **tags}.items())
        return client.search_runs([experiment], query)

    (prepared,) = runs("preprocess", dataset=dataset.uri, dataset_version=manifest.version)
    assert prepared.info.status == "FINISHED"
    counts = {k: prepared.data.metrics[f"{k}_images"] for k in ("train", "val")}
    assert counts == {k: manifest.splits[k].rows for k in ("train", "val")}
    assert len(runs("preprocess", dataset=dataset.uri, dataset_version=newer.version)) == 1
    record = json.loads(run.child("mlflow_run.json").read_bytes())
    (trained,) = runs("train", run_dir=run.uri)
    assert trained.info.run_id == record["run_id"] and trained.info.status == "FINISHED"
    assert trained.data.tags["ray_cv.preprocess_run_id"] == prepared.info.run_id
    history = list(csv.DictReader(io.StringIO(run.child(HISTORY_CSV).read_bytes().decode())))
    for key in ("train_loss", "val_accuracy"):
        logged = client.get_metric_history(trained.info.run_id, key)
        assert sorted(m.step for m in logged) == [0, 1], key
        assert [m.value for m in sorted(logged, key=lambda m: m.step)] == [
            float(r[key]) for r in history
        ]
    (inferred,) = runs("infer", output=predictions.uri)
    assert inferred.data.tags["ray_cv.training_run_id"] == trained.info.run_id
    assert inferred.data.tags["ray_cv.checkpoint"] == result["checkpoint"]
    assert inferred.data.tags["ray_cv.dataset_version"] == manifest.version
    assert inferred.data.metrics["images"] == val_rows
    assert inferred.data.metrics["accuracy"] == pytest.approx(result["accuracy"])


@pytest.mark.usefixtures("s3")
def test_chain_stops_at_the_first_failed_job_with_its_exit_code(cluster_2cpu):
    missing = f"preprocess.source.folder.path=s3://{BUCKET}/no-such-folder"
    sets = ["preprocess.source.kind=folder", missing]
    root = f"s3://{BUCKET}/broken"
    cmd = step_command(cluster_2cpu.address, root, "all", profile="demo", sets=sets)
    proc = subprocess.run(
        cmd, cwd=BUNDLE_ROOT, env=cluster_2cpu.env, text=True, capture_output=True, timeout=300
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr  # the preprocess job's own code
    assert f"s3://{BUCKET}/no-such-folder does not exist" in proc.stdout
    assert re.search(r"\[preprocess\] \S+ failed with exit code 1", proc.stderr)
    assert "[train]" not in proc.stdout + proc.stderr
