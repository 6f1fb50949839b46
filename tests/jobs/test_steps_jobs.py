"""A train job whose worker is killed mid-epoch resumes at its step checkpoint and ends with the
weights of the run never stopped, which decoded on the GPU path (decode=gpu) on CPU workers
(the writer, the resume rules: tests/unit/test_steps.py)."""

from __future__ import annotations

import pytest
import torch
from helpers import armed_runtime_env, held_worker, history, in_background, kill_worker, train_job

from pipeline.core import faults
from pipeline.model.checkpoint import (
    EMA_WEIGHTS,
    WEIGHTS,
)
from pipeline.model.runs import (
    STEPS,
)

EVERY = 4
# Two workers of two loader processes each; MixUp and an EMA, whose draws and state a resume
# inside an epoch must carry on exactly.
RECIPE = (
    "epochs=1",
    f"checkpoint.every_steps={EVERY}",
    "scaling.loader_workers=2",
    "mixup_alpha=0.2",
    "ema.enabled=true",
    "ema.every_steps=2",
)


@pytest.fixture(scope="module")
def never_stopped(cluster_2cpu, tiny_dataset, tmp_path_factory):
    """The run never stopped, with decode=gpu: on CPU workers its JPEGs are decoded in the
    training process, not the loaders. The killed run, with decode=cpu, must end with its
    weights: one reference for both claims, the resume's and decode=gpu's."""
    storage = tmp_path_factory.mktemp("never-stopped")
    proc = train_job(cluster_2cpu, tiny_dataset, storage, "name=r", *RECIPE, "decode=gpu")
    assert proc.returncode == 0, proc.stdout
    assert "decode=gpu: JPEGs decoded and augmented on cpu" in proc.stdout
    return storage / "r"


def test_a_worker_killed_mid_epoch_resumes_at_its_step_and_ends_bit_identical(
    cluster_2cpu, tiny_dataset, tmp_path, never_stopped
):
    runtime_env, marker = armed_runtime_env(tmp_path, faults.STEP_CHECKPOINTED)
    storage = tmp_path / "runs"
    submit = {"runtime_env": runtime_env}
    job = in_background(train_job, cluster_2cpu, tiny_dataset, storage, "name=r", *RECIPE, **submit)
    # Rank 0 is held once the checkpoint of epoch 0 step 4 is on storage: killed there.
    pid = held_worker(marker, job)
    step = f"epoch_0000_step_{EVERY:06d}"
    assert (storage / "r" / STEPS / step / "metadata.json").exists()
    assert not (storage / "r" / "epoch_0000").exists()  # mid-epoch: no epoch checkpoint yet
    kill_worker(cluster_2cpu, pid)
    proc = job.result()
    assert proc.returncode == 0, proc.stdout
    resumed_at = f"{storage / 'r' / STEPS / step}: epoch 0, continuing after its step {EVERY}"
    assert f"resumed from checkpoint {resumed_at}" in proc.stdout

    run = storage / "r"
    for name in (WEIGHTS, EMA_WEIGHTS):
        resumed = torch.load(run / "epoch_0000" / name, weights_only=True)
        uninterrupted = torch.load(never_stopped / "epoch_0000" / name, weights_only=True)
        assert resumed.keys() == uninterrupted.keys()
        for key in resumed:
            assert torch.equal(resumed[key], uninterrupted[key]), (name, key)
    rows, reference = history(run), history(never_stopped)
    assert [r["epoch"] for r in rows] == [0]  # the epoch once
    for row, ref in zip(rows, reference, strict=True):
        assert row["val_loss"] == ref["val_loss"] and row["val_accuracy"] == ref["val_accuracy"]
        # Summed in another order (before and after the resume): equal to rounding.
        assert row["train_loss"] == pytest.approx(ref["train_loss"], rel=1e-9)
    assert list((run / STEPS).iterdir()) == []  # gone once their epochs' checkpoints were in
