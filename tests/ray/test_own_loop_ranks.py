"""The example loop (examples/own_loop/train.py) at world size 2 on Ray in the test process: its
val metrics count each val row once, as the whole split evaluated at once gives them."""

from __future__ import annotations

import sys

import pytest
import torch
from torchvision.transforms import v2

from pipeline.core.storage import Location
from pipeline.model.loading import load_model
from pipeline.model.runs import checkpoint_dir_name
from pipeline.train import api


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
