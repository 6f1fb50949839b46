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
import sys

import pytest
import ray.train
import torch
from helpers import recorded_run
from test_chain_jobs import TINY
from torchvision.transforms import v2

from harness.cluster import BUNDLE_ROOT
from pipeline.chain.plan import step_command
from pipeline.core.errors import InputError
from pipeline.core.storage import Location
from pipeline.infer.predictions import read_predictions, read_summary
from pipeline.model import source
from pipeline.model.checkpoint import CHECKPOINT_FORMAT, METADATA, read_meta, save_checkpoint
from pipeline.model.loading import load_model
from pipeline.model.networks import build_model
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


def test_a_card_refuses_a_metric_without_its_direction_and_a_report_without_the_keys():
    direction = r"^metric='val_f1' needs its direction: add mode='max' \(the highest is best\) or "
    with pytest.raises(ValueError, match=direction + r"mode='min'$"):
        card(metric="val_f1")
    with pytest.raises(ValueError, match=r"^mode='max': metric='val_loss' has its own order; "):
        card(metric="val_loss", mode="max")
    with pytest.raises(ValueError, match=r"metrics lack \['val_accuracy'\]"):
        api.report(
            {"epoch": 0, "train_loss": 1, "val_loss": 1}, model=None, card=card(), history=[]
        )
    # The metric the card ranks by, every epoch.
    with pytest.raises(ValueError, match=r"metrics lack \['val_f1'\]: report epoch, .*, val_f1 "):
        api.report(
            {"epoch": 0, "train_loss": 1, "val_loss": 1, "val_accuracy": 0.5},
            model=None,
            card=card(metric="val_f1", mode="max"),
            history=[],
        )


def test_a_run_ranks_by_any_metric_it_reports_in_its_direction(tmp_path, monkeypatch):
    ranked = api.run_config(str(tmp_path), "own", metric="val_f1", mode="max").checkpoint_config
    assert (ranked.checkpoint_score_attribute, ranked.checkpoint_score_order) == ("val_f1", "max")
    with pytest.raises(ValueError, match=r"^metric='val_f1' needs its direction: add mode="):
        api.run_config(str(tmp_path), "own", metric="val_f1")
    # The lowest val loss is epoch 1's, the highest macro-F1 epoch 2's: the F1 picks.
    f1s = [{"val_f1": f1} for f1 in (0.2, 0.5, 0.7)]
    run = own_run(
        tmp_path / "own", monkeypatch, [0.9, 0.4, 0.6], more=f1s, metric="val_f1", mode="max"
    )
    summary = api.finish_run(str(tmp_path), "own")
    assert (summary["checkpoint_metric"], summary["checkpoint_mode"]) == ("val_f1", "max")
    assert summary["best_checkpoint"] == str(tmp_path / "own" / "epoch_0002")
    assert source.resolve_checkpoint(run).path == str(tmp_path / "own" / "epoch_0002")
    config = read_meta(run.child("epoch_0002")).config
    assert config["checkpoint"] == {"metric": "val_f1", "mode": "max"}


def own_run(
    tmp_path, monkeypatch, losses: list[float], weights=None, more=None, **fields
) -> Location:
    """A run as the API writes it (no throughput in its history), Ray's record faked; `more`:
    each epoch's other metrics."""
    tmp_path.mkdir(exist_ok=True)
    run = Location.parse(str(tmp_path))
    record, history = [], []
    for epoch, loss in enumerate(losses):
        directory = tmp_path / checkpoint_dir_name(epoch)
        directory.mkdir()
        metrics = {"epoch": epoch, "train_loss": loss, "val_loss": loss, "val_accuracy": 0.5}
        metrics |= more[epoch] if more else {}
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


# --- the example loop at world size 2, in process ----------------------------------------------


def test_the_example_loops_val_metrics_count_each_val_row_once(
    ray_in_process, small_dataset, tmp_path, monkeypatch
):
    from examples.own_loop import train as example

    own = api.ModelCard.for_dataset(str(small_dataset), model="resnet18")
    to_tensor = [v2.ToImage(), v2.ToDtype(torch.float32, scale=True)]
    as_fed = v2.Compose([*to_tensor, v2.Normalize(own.mean, own.std)])  # as the example's val
    val = example.ParquetImages(own.split_files("val"), as_fed)
    assert len(val) % 2 == 1  # two ranks: a sampler that pads would count a row twice
    args = ["--dataset", str(small_dataset), "--storage-path", str(tmp_path), "--name", "own"]
    args += ["--epochs", "1", "--num-workers", "2", "--batch-size", "2"]
    monkeypatch.setattr(sys, "argv", ["train", *args])
    example.main()

    # The epoch's weights, evaluated here on the whole val split at once.
    checkpoint = Location.parse(str(tmp_path / "own" / checkpoint_dir_name(0)))
    model, meta = load_model(checkpoint)
    images, labels = zip(*(val[i] for i in range(len(val))), strict=True)
    with torch.no_grad():
        logits = model(torch.stack(images))
    labels = torch.tensor(labels)
    loss = torch.nn.functional.cross_entropy(logits, labels).item()
    accuracy = (logits.argmax(dim=1) == labels).float().mean().item()
    assert meta.metrics["val_loss"] == pytest.approx(loss, rel=1e-5, abs=1e-6)
    assert meta.metrics["val_accuracy"] == pytest.approx(accuracy, abs=1e-6)


# --- a loop of the user's own, submitted as a script --------------------------------------------

# As the tutorial writes a loop: it names `torch` and the card's `classes`.
TUTORIAL_LOOP = """
import sys

import ray.train
import torch
from ray.train.torch import TorchTrainer, prepare_model
from torchvision.models import get_model

from pipeline.train import api


def train_loop_per_worker(config):
    card = api.ModelCard.from_dict(config["card"])
    model = prepare_model(get_model(card.model, num_classes=len(card.classes), **card.kwargs))
    images = torch.randn(4, 3, card.image_size, card.image_size)
    loss = torch.nn.functional.cross_entropy(model(images), torch.tensor([0, 1, 0, 1])).item()
    metrics = {"epoch": 0, "train_loss": loss, "val_loss": loss, "val_accuracy": 0.5}
    api.report(metrics, model=model, card=card, history=[metrics])


if __name__ == "__main__":
    storage_path, name = sys.argv[1:]
    card = api.ModelCard(model="resnet18", classes=["cat", "dog"], image_size=32)
    TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"card": card.to_dict()},
        scaling_config=ray.train.ScalingConfig(num_workers=1),
        run_config=api.run_config(storage_path, name),
    ).fit()
    print(f"best checkpoint: {api.finish_run(storage_path, name)['best_checkpoint']}")
"""


def test_a_loop_naming_torch_and_the_cards_classes_runs_as_a_script(cluster_2cpu, tmp_path):
    script = tmp_path / "my_loop.py"
    script.write_text(TUTORIAL_LOOP)
    job = cluster_2cpu.run_job(
        ["python", str(script), str(tmp_path / "runs"), "mine"], capture=True, timeout_s=600
    )
    assert job.returncode == 0, job.stdout[-5000:]
    assert f"best checkpoint: {tmp_path / 'runs' / 'mine' / 'epoch_0000'}" in job.stdout
