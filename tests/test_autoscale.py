"""Inference on a cluster idle at zero: a head with no CPUs, and a node that joins (as an
autoscaler adds one) while the job waits for capacity, or never does."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch
from conftest import in_background, make_image_folder, wait_for
from test_model import meta

from harness.cluster import LocalCluster
from pipeline.checkpoint import save_checkpoint
from pipeline.model import build_model
from pipeline.predictions import SUMMARY

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model_and_images(tmp_path_factory):
    """An untrained checkpoint of the test classes, and an image folder of them."""
    checkpoint = tmp_path_factory.mktemp("checkpoint")
    torch.manual_seed(0)
    save_checkpoint(checkpoint, build_model(len(meta().classes)).eval().state_dict(), meta(), {})
    images = tmp_path_factory.mktemp("images")
    make_image_folder(images, per_class=4, corrupt=False)
    return checkpoint, images


@pytest.fixture
def idle_cluster():
    """A head with no CPUs, as an autoscaling cluster at rest: nothing can run but drivers."""
    with LocalCluster(num_cpus=0) as c:
        yield c


def infer(cluster, model_and_images, output, *overrides, submission_id: str):
    checkpoint, images = model_and_images
    args = ["python", "-m", "jobs.infer", "--config", "configs/demo-infer.yaml"]
    args += [f"model={checkpoint}", f"input={images}", f"output={output}"]
    args += ["cpus_per_actor=1", "num_actors=2", *overrides]
    return cluster.submit(args, capture=True, timeout_s=600, submission_id=submission_id)


def test_inference_waits_for_a_node_to_join(idle_cluster, model_and_images, tmp_path):
    job = in_background(infer, idle_cluster, model_and_images, tmp_path, submission_id="wait")

    def log() -> str:
        try:
            return idle_cluster.ray("job", "logs", "wait")
        except subprocess.CalledProcessError:  # not submitted yet
            return ""

    wait_for(lambda: "waiting up to 120 s" in log() or job.done(), "the job waiting", 300)
    assert not job.done(), job.result().stdout
    idle_cluster.add_node(num_cpus=1)
    proc = job.result(timeout=600)
    assert proc.returncode == 0, proc.stdout
    assert "the cluster has 1 CPU(s) now" in proc.stdout
    assert "1 to 2 predictor actors" in proc.stdout
    assert json.loads((tmp_path / SUMMARY).read_text())["images"] == 12


def test_inference_fails_with_exit_3_when_no_capacity_comes(
    idle_cluster, model_and_images, tmp_path
):
    proc = infer(
        idle_cluster, model_and_images, tmp_path, "capacity_timeout_s=5", submission_id="never"
    )
    assert proc.returncode != 0
    assert "cpus_per_actor=1, but the cluster has 0 CPUs (waited 5 s" in proc.stdout
    assert "exit code 3" in idle_cluster.ray("job", "status", "never")
    assert not (tmp_path / SUMMARY).exists()
