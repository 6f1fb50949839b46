"""The training worker's loop run for real in this process, in a local run context: no Ray, no
monkeypatching. What it reports, epoch by epoch, and the checkpoints it writes."""

from __future__ import annotations

import math

import torch
from helpers import loop_here, small_run_config

from pipeline.core.storage import Location
from pipeline.data.dataset import read_manifest
from pipeline.model.checkpoint import load_weights, read_meta
from pipeline.model.runs import checkpoint_dir_name
from pipeline.train.context import LocalContext


def test_the_loop_reports_each_epochs_metrics_and_writes_its_checkpoint(small_dataset, tmp_path):
    cfg = small_run_config(small_dataset, tmp_path, "epochs=2")
    manifest = read_manifest(Location.parse(str(small_dataset)))
    run_dir = tmp_path / "run"
    context = LocalContext()

    loop_here(cfg, run_dir, context)

    assert [m["epoch"] for m, _ in context.reports] == [0, 1]
    steps = math.ceil(manifest.splits["train"].rows / cfg.global_batch_size)
    for epoch, (metrics, checkpoint) in enumerate(context.reports):
        assert checkpoint == Location.parse(str(run_dir / checkpoint_dir_name(epoch)))
        assert metrics["train_images"] == steps * cfg.global_batch_size  # whole steps
        assert metrics["val_images"] == manifest.splits["val"].rows
        assert metrics["workers"] == 1 and math.isfinite(metrics["train_loss"])
        meta = read_meta(checkpoint)
        assert (meta.epoch, meta.step) == (epoch, None) and meta.metrics == metrics
        assert meta.history == [m for m, _ in context.reports[: epoch + 1]]
        state = torch.load(run_dir / checkpoint.name / "train_state.pt", weights_only=True)
        assert state["loop"]["epoch"] == epoch + 1
        assert state["loop"]["global_step"] == (epoch + 1) * steps
    # The last checkpoint holds the weights the loop ended with.
    assert context.recorded == str(run_dir / checkpoint_dir_name(1))
    assert set(load_weights(Location.parse(context.recorded))) >= {"fc.weight"}
