"""A training loop of the user's own on the session's cluster: examples/own_loop/train.py
submitted as a job, its run inferred and exported by the chain's own steps, and a loop written as
the tutorial writes one, submitted as a script. (Its records and formats: tests/unit/
test_own_loop_api.py.)"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess

from test_chain_jobs import TINY

from harness.cluster import BUNDLE_ROOT
from pipeline.chain.plan import step_command
from pipeline.core.storage import Location
from pipeline.infer.predictions import read_predictions, read_summary
from pipeline.model.runs import RUN_SUMMARY

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
