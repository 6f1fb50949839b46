"""gs:// and abfs:// for real, against emulators on loopback: the jobs (preprocess -> train,
resumed -> infer) with the dataset and predictions on one store and the runs on the other, as
a team keeps data and models in buckets of their own, so each store is written by one job and
read by the next (each store's reads and writes: tests/unit/test_cloud_locations.py)."""

import json

import pytest
from cloud_stores import BUCKET, environment
from helpers import TRAIN

from harness.cluster import LocalCluster
from pipeline.core.storage import Location
from pipeline.data.dataset import read_manifest
from pipeline.infer.predictions import SUMMARY, read_predictions
from pipeline.model.runs import RUN_SUMMARY


@pytest.fixture(scope="module")
def cluster(gcs, azurite):
    """A 2-CPU cluster whose nodes reach both emulators as a real cluster's reach its cloud's
    storage: through their environment."""
    with LocalCluster(num_cpus=2, env={**gcs.env, **azurite.env}) as c:
        yield c


def run(cluster: LocalCluster, args: list[str]) -> str:
    done = cluster.run_job(args, capture=True, timeout_s=600)
    assert done.returncode == 0, done.stdout
    return done.stdout


def test_preprocess_train_resume_infer_across_gs_and_abfs(gcs, azurite, cluster):
    # gs:// as on Google Cloud (the emulator in the nodes' environment); abfs:// at Azurite's
    # address. This process reaches the stores as the nodes do.
    with environment({**gcs.env, **azurite.env}):
        data = Location.parse(f"gs://{BUCKET}/chain")
        chain(cluster, data, Location.parse(azurite.uri(BUCKET, "chain")))


def chain(cluster: LocalCluster, data: Location, models: Location) -> None:
    dataset, runs = data.child("dataset"), models.child("runs")
    predictions = data.child("predictions", "run")
    run(
        cluster,
        [
            *("python", "-m", "jobs.preprocess", "--config", "configs/demo-preprocess.yaml"),
            f"output={dataset.uri}",
            "source.synthetic.num_classes=3",
            "source.synthetic.images_per_class=16",
            "source.synthetic.raw_size=40",
            "image_size=32",
            "shard_size=20",
            "row_group_size=10",
        ],
    )
    manifest = read_manifest(dataset)
    assert manifest.image_size == 32 and manifest.splits["train"].rows > 0
    shards = [f.path for info in manifest.splits.values() for f in info.files]
    assert len(shards) >= 2 and all(dataset.child(s).exists() for s in shards)

    # One worker: the claim is the store's, and a second worker is a process that imports torch.
    train = [*TRAIN, f"dataset={dataset.uri}", f"storage_path={runs.uri}", "name=run"]
    train.append("scaling.num_workers=1")
    out = run(cluster, [*train, "epochs=1"])
    assert "epoch 0/0: train_loss" in out, out
    # The same run again, one epoch longer: resumed from its checkpoint on the store.
    out = run(cluster, [*train, "epochs=2"])
    run_base = runs.child("run").uri.partition("?")[0]
    assert f"resuming from {run_base}/epoch_0000" in out, out
    assert "epoch 0/1: train_loss" not in out and "epoch 1/1: train_loss" in out, out

    run(
        cluster,
        [
            *("python", "-m", "jobs.infer", "--config", "configs/demo-infer.yaml"),
            f"model={runs.child('run').uri}",
            f"input={dataset.uri}",
            f"output={predictions.uri}",
        ],
    )
    summary = json.loads(runs.child("run", RUN_SUMMARY).read_bytes())
    assert summary["epochs"] == 2
    assert summary["best_checkpoint"].startswith(f"{run_base}/epoch_")
    result = json.loads(predictions.child(SUMMARY).read_bytes())
    assert result["checkpoint"] == summary["best_checkpoint"]
    assert result["images"] == manifest.splits["val"].rows
    assert read_predictions(predictions).num_rows == manifest.splits["val"].rows
