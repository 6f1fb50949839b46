"""A training loop of the user's own (pipeline.train.api, docs/own-loop.md): the checkpoints and
run records it writes, read by every loader in process; the versioned formats, a newer one
refused; and examples/own_loop/train.py on the session's cluster, its run inferred and exported
by the chain's own steps."""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess

import pytest
import ray.train
import torch
from helpers import recorded_run
from test_chain import TINY

from harness.cluster import BUNDLE_ROOT
from jobs.submit import step_command
from pipeline.core.errors import InputError
from pipeline.core.storage import Location
from pipeline.infer.predictions import read_predictions, read_summary
from pipeline.model import source
from pipeline.model.checkpoint import CHECKPOINT_FORMAT, METADATA, read_meta, save_checkpoint
from pipeline.model.networks import build_model, load_model
from pipeline.model.runs import RUN_FORMAT, RUN_SUMMARY, checkpoint_dir_name
from pipeline.tracking import registered_checkpoint
from pipeline.train import api

CLASSES = ["a", "b", "c"]


def card(**changes) -> api.ModelCard:
    fields = dict(model="resnet18", classes=CLASSES, image_size=32, config={"lr": 0.1})
    return api.ModelCard(**(fields | changes))


def test_a_checkpoint_of_the_card_loads_as_the_train_jobs_do(tmp_path):
    net = build_model(len(CLASSES), name="resnet18")
    metrics = {"epoch": 2, "train_loss": 1.0, "val_loss": 0.9, "val_accuracy": 0.5}
    meta = card(metric="val_accuracy", dataset="/data/ds").meta(metrics, [metrics])
    save_checkpoint(tmp_path, net.state_dict(), meta, {})
    loaded, read = load_model(Location.parse(str(tmp_path)))
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(loaded(x), net.eval()(x))
    assert read.format == CHECKPOINT_FORMAT and read.classes == CLASSES and read.epoch == 2
    # What the loaders read from its config: the score, and the dataset it was trained on.
    assert read.config == {
        "lr": 0.1,
        "checkpoint": {"metric": "val_accuracy"},
        "dataset": "/data/ds",
    }
    assert read.model_input.image_size == 32 and read.mean == api.IMAGENET_MEAN


def test_a_card_refuses_a_metric_that_ranks_nothing_and_a_report_without_the_keys():
    with pytest.raises(ValueError, match=r"metric='val_f1': give one of val_loss"):
        card(metric="val_f1")
    with pytest.raises(ValueError, match=r"metrics lack \['val_accuracy'\]"):
        api.report(
            {"epoch": 0, "train_loss": 1, "val_loss": 1}, model=None, card=card(), history=[]
        )


def own_run(tmp_path, monkeypatch, losses: list[float], weights=None, **fields) -> Location:
    """A run as the API writes it (no throughput in its history), Ray's record faked."""
    tmp_path.mkdir(exist_ok=True)
    run = Location.parse(str(tmp_path))
    record, history = [], []
    for epoch, loss in enumerate(losses):
        directory = tmp_path / checkpoint_dir_name(epoch)
        directory.mkdir()
        metrics = {"epoch": epoch, "train_loss": loss, "val_loss": loss, "val_accuracy": 0.5}
        history = [*history, metrics]
        save_checkpoint(directory, weights or {}, card(**fields).meta(metrics, history), {})
        record.append((ray.train.Checkpoint(str(directory)), metrics))
    return recorded_run(run, record, monkeypatch)


def test_finishing_a_run_writes_the_records_the_loaders_pick_its_best_by(tmp_path, monkeypatch):
    run = own_run(tmp_path, monkeypatch, [0.9, 0.4, 0.6])
    summary = api.finish_run(str(tmp_path.parent), tmp_path.name)
    assert summary["format"] == RUN_FORMAT and summary["checkpoint_metric"] == "val_loss"
    assert summary["best_checkpoint"] == str(tmp_path / "epoch_0001")
    assert summary["train_time_s"] is None and summary["images_per_s"] is None
    assert (tmp_path / "history.csv").read_text().splitlines()[0] == (
        "epoch,train_loss,val_loss,val_accuracy"
    )
    assert source.resolve_checkpoint(run).path == str(tmp_path / "epoch_0001")


def test_a_registered_run_is_a_model_version_the_loaders_take(tmp_path, monkeypatch, mlflow_server):
    tiny = {"model": "examples.custom_model.tiny_cnn:build", "kwargs": {"width": 8}}
    net = build_model(len(CLASSES), name=tiny["model"], kwargs=tiny["kwargs"])
    own_run(tmp_path / "own", monkeypatch, [0.9, 0.4], weights=net.state_dict(), **tiny)
    api.finish_run(str(tmp_path), "own")
    run_id = api.register_run(
        str(tmp_path), "own", tracking_uri=mlflow_server.uri, registered_model="own-loop"
    )
    client = mlflow_server.client()
    assert [m.value for m in client.get_metric_history(run_id, "val_loss")] == [0.9, 0.4]
    checkpoint = registered_checkpoint("models:/own-loop/1", uri=mlflow_server.uri)
    loaded, meta = load_model(checkpoint)
    assert meta.epoch == 1 and meta.model.name == tiny["model"]
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(loaded(x), net.eval()(x))


def test_a_newer_format_is_refused_in_one_line(tmp_path, monkeypatch):
    run = own_run(tmp_path, monkeypatch, [0.5])
    api.finish_run(str(tmp_path.parent), tmp_path.name)
    summary = json.loads(run.child(RUN_SUMMARY).read_bytes())
    run.child(RUN_SUMMARY).write_bytes(json.dumps(summary | {"format": RUN_FORMAT + 1}).encode())
    with pytest.raises(InputError) as e:
        source.resolve_checkpoint(run)
    assert str(e.value) == (
        f"run {run.uri} is of run format {RUN_FORMAT + 1}, newer than this code reads (up to "
        f"{RUN_FORMAT}): update the bundle where this job runs"
    )
    # A checkpoint of a newer format, with a field this code does not know: the format speaks.
    checkpoint = tmp_path / checkpoint_dir_name(0)
    meta = json.loads((checkpoint / METADATA).read_text())
    meta |= {"format": CHECKPOINT_FORMAT + 1, "calibration": {"temperature": 1.3}}
    (checkpoint / METADATA).write_text(json.dumps(meta))
    with pytest.raises(
        InputError, match=rf"^\S+ is a checkpoint of format {CHECKPOINT_FORMAT + 1}, newer"
    ) as e:
        read_meta(Location.parse(str(checkpoint)))
    assert "\n" not in str(e.value)


# --- the example loop on the session's cluster, its run through the chain's steps ------------


@pytest.mark.slow
def test_the_example_loops_run_is_inferred_and_exported_by_the_chain(
    cluster_2cpu, small_dataset, tmp_path
):
    root = tmp_path / "chain"
    sets = [*TINY, "train.name=own"]

    def chain(step: str) -> str:
        cmd = step_command(cluster_2cpu.address, str(root), step, profile="demo", sets=sets)
        proc = subprocess.run(
            cmd, cwd=BUNDLE_ROOT, env=cluster_2cpu.env, text=True, capture_output=True, timeout=900
        )
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
        return proc.stdout

    # The chain's root holds a preprocessed dataset, as its preprocess step leaves one.
    shutil.copytree(small_dataset, root / "dataset")
    trained = cluster_2cpu.run_job(
        [
            *("python", "-m", "examples.own_loop.train", "--dataset", str(root / "dataset")),
            *("--storage-path", str(root / "runs"), "--name", "own", "--epochs", "1"),
            *("--num-workers", "1", "--batch-size", "16"),
        ],
        capture=True,
        timeout_s=600,
    )
    assert trained.returncode == 0, trained.stdout[-5000:]
    best = re.search(r"best checkpoint: (\S+)", trained.stdout)[1]
    summary = json.loads((root / "runs" / "own" / RUN_SUMMARY).read_text())
    assert summary["best_checkpoint"] == best and summary["epochs"] == 1
    assert not math.isnan(summary["best_metrics"]["val_loss"])

    out = chain("infer")
    # The run's own dataset, at the version its checkpoints record; with its best checkpoint.
    assert "is the dataset the checkpoint was trained on: reading version" in out
    predictions = Location.parse(str(root / "predictions" / "own"))
    said = read_summary(predictions)
    assert said["checkpoint"] == best
    assert read_predictions(predictions).num_rows == said["images"]
    chain("export")
    exported = root / "runs" / "own" / "export" / best.rsplit("/", 1)[-1]
    assert {"model.onnx", "model.pt2", "preprocessing.json"} <= {p.name for p in exported.iterdir()}
