"""A training loop of the user's own (pipeline.train.api, docs/own-loop.md): the checkpoints and
run records it writes, read by every loader in process, with Ray's record of the run written as
Ray writes it; the versioned formats, a newer one refused. (The example loop at world size 2:
tests/ray/test_own_loop_ranks.py; on a cluster, through the chain: tests/jobs/test_own_loop.py.)"""

from __future__ import annotations

import json

import pytest
import ray.train
import torch
from helpers import recorded_run

from pipeline.core.errors import InputError
from pipeline.core.storage import Location
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
