"""Inference on a cluster idle at zero: a head with no CPUs, and a node that joins (as an
autoscaler adds one) while the job waits for capacity, or never does."""

from __future__ import annotations

import json
import time
import urllib.error

import pytest
import torch
from helpers import (
    FAST_NODE_DEATH,
    checkpoint_meta,
    in_background,
    job_runtime_env,
    make_image_folder,
    shared_cluster,
    start_task,
    wait_for,
    with_worker_nodes,
)

from harness.cluster import LocalCluster
from pipeline.chain.plan import STEPS, step_command
from pipeline.infer.predictions import SUMMARY
from pipeline.model.checkpoint import save_checkpoint
from pipeline.model.networks import build_model


@pytest.fixture(scope="module")
def model_and_images(tmp_path_factory):
    """An untrained checkpoint of the test classes, and an image folder of them."""
    checkpoint = tmp_path_factory.mktemp("checkpoint")
    torch.manual_seed(0)
    save_checkpoint(
        checkpoint,
        build_model(len(checkpoint_meta().classes)).eval().state_dict(),
        checkpoint_meta(),
        {},
    )
    images = tmp_path_factory.mktemp("images")
    make_image_folder(images, per_class=4, corrupt=False)
    return checkpoint, images


@pytest.fixture
def idle_cluster(request):
    """A head with no CPUs, as an autoscaling cluster at rest: nothing can run but drivers.
    Shared by consecutive tests (helpers.shared_cluster): the nodes a test added are gone when
    the next starts."""
    cluster = shared_cluster(request, num_cpus=0, env=FAST_NODE_DEATH)
    return with_worker_nodes(cluster, 0)


def infer(
    cluster, model_and_images, output, *overrides, submission_id: str, timeout_s=600, **submit
):
    checkpoint, images = model_and_images
    args = ["python", "-m", "jobs.infer", "--config", "configs/demo-infer.yaml"]
    args += [f"model={checkpoint}", f"input={images}", f"output={output}"]
    args += ["cpus_per_actor=1", "num_actors=2", *overrides]
    return cluster.run_job(
        args, capture=True, timeout_s=timeout_s, submission_id=submission_id, **submit
    )


def test_inference_fails_with_exit_3_when_no_capacity_comes(
    idle_cluster, model_and_images, tmp_path
):
    proc = infer(
        idle_cluster, model_and_images, tmp_path, "capacity_timeout_s=5", submission_id="never"
    )
    assert proc.returncode != 0
    assert "cpus_per_actor=1, but the cluster has 0 CPUs (waited 5 s" in proc.stdout
    assert "exit code 3" in idle_cluster.job("never")["message"]
    assert not (tmp_path / SUMMARY).exists()


def test_inference_refuses_actors_larger_than_any_node_with_exit_3(
    idle_cluster, model_and_images, tmp_path
):
    # Two nodes of 1 CPU: 2 CPUs in all, yet no node holds an actor of 2, and Ray would wait
    # for one forever.
    idle_cluster.add_node(num_cpus=1)
    idle_cluster.add_node(num_cpus=1)
    proc = infer(
        idle_cluster,
        model_and_images,
        tmp_path,
        "cpus_per_actor=2",
        "capacity_timeout_s=2",
        submission_id="split",
        timeout_s=300,  # where the job would wait forever
    )
    assert proc.returncode != 0
    assert (
        "cpus_per_actor=2 asks for 2 CPU(s) on one node, but the largest node has 1 CPU(s) "
        "(the cluster has 2 CPU(s) in all; waited 2 s, capacity_timeout_s): lower "
        "cpus_per_actor, or add nodes with at least 2 CPU(s)"
    ) in proc.stdout
    assert "exit code 3" in idle_cluster.job("split")["message"]
    assert not (tmp_path / SUMMARY).exists()


def test_preprocessing_fails_with_exit_3_when_no_capacity_comes(idle_cluster, tmp_path):
    output = tmp_path / "dataset"
    args = ["python", "-m", "jobs.preprocess", "--config", "configs/demo-preprocess.yaml"]
    args += [f"output={output}", "capacity_timeout_s=5"]
    proc = idle_cluster.run_job(args, capture=True, timeout_s=300, submission_id="no-cpus")
    assert proc.returncode != 0
    assert "each shard is a task of 1 CPU, but the cluster has 0 CPUs (waited 5 s" in proc.stdout
    assert "exit code 3" in idle_cluster.job("no-cpus")["message"]
    # Its run's directory is removed: nothing of it is left.
    assert not output.exists() or not any(output.rglob("*.parquet"))


def predictors(cluster) -> list[dict]:
    """The live actors of inference's pool (Ray Data names them after the predictor class)."""
    return [a for a in cluster.state("actors", "state=ALIVE") if "Predictor" in a["class_name"]]


# A classifier that takes half a second an image and holds no CPU meanwhile: the job lasts while
# nodes join, as a real model's would on a larger input, without the suite paying for it.
SLOW_NETWORK = """
import time

import torch


class Slow(torch.nn.Module):
    def __init__(self, num_classes):
        super().__init__()
        self.head = torch.nn.Linear(3, num_classes)

    def forward(self, x):
        time.sleep(0.5 * len(x))
        return self.head(x.mean(dim=(2, 3)))


def build(num_classes):
    return Slow(num_classes)
"""


def test_inference_waits_for_a_node_and_its_pool_grows_with_the_cluster_up_to_num_actors(
    idle_cluster, tmp_path, monkeypatch
):
    # The job starts on a cluster with no CPU and waits; a node joins and the job starts on it;
    # two more join while it runs: room for three actors, and num_actors=2. The pool grows to
    # two and no further.
    package = tmp_path / "src" / "slownet"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(SLOW_NETWORK)
    monkeypatch.syspath_prepend(str(package.parent))
    from slownet import build

    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    slow = checkpoint_meta(model={"name": "slownet:build"})
    save_checkpoint(checkpoint, build(len(slow.classes)).state_dict(), slow, {})
    images = tmp_path / "images"
    # 750 images of half a second each: minutes on one actor, time enough for the nodes that
    # join to start a second on a loaded machine (the pool stayed at one with 300). The wait
    # sleeps, and costs no CPU.
    make_image_folder(images, per_class=250, corrupt=False)
    # The job ships the network as a user's package: the runtime env's py_modules.
    runtime_env = job_runtime_env(tmp_path, py_modules=[package])
    job = in_background(
        infer,
        idle_cluster,
        (checkpoint, images),
        tmp_path / "out",
        "batch_size=8",
        submission_id="grow",
        runtime_env=runtime_env,
    )

    def log() -> str:
        try:
            return idle_cluster.job_logs("grow")
        except urllib.error.HTTPError:  # not submitted yet
            return ""

    wait_for(lambda: "waiting up to 600 s" in log() or job.done(), "the job waiting", 300)
    assert not job.done(), job.result().stdout
    idle_cluster.add_node(num_cpus=1)
    wait_for(lambda: predictors(idle_cluster) or job.done(), "the first predictor actor", 300)
    idle_cluster.add_node(num_cpus=1)
    idle_cluster.add_node(num_cpus=1)
    started = time.monotonic()
    sizes = []

    def watch() -> bool:
        sizes.append((round(time.monotonic() - started), len(predictors(idle_cluster))))
        return job.done()

    wait_for(watch, "inference done", 900)
    proc = job.result()
    print(f"predictor actors (seconds after the nodes joined, count): {sizes}")
    assert proc.returncode == 0, proc.stdout
    assert "the cluster has 1 CPU(s) now" in proc.stdout
    assert "1 to 2 predictor actors" in proc.stdout
    assert max(n for _, n in sizes) == 2, sizes
    assert json.loads((tmp_path / "out" / SUMMARY).read_text())["images"] == 750


# --- the chain on Ray's own autoscaler ---------------------------------------------------------

# Each step small, so that the test is about waiting for nodes, not about the work.
ZERO_SETTINGS = [
    "preprocess.source.synthetic.images_per_class=20",
    "preprocess.image_size=32",
    "preprocess.shard_size=30",
    "train.epochs=1",
    "train.global_batch_size=16",
    "infer.num_actors=2",
    "infer.cpus_per_actor=1",
    "infer.batch_size=4",
]


@pytest.fixture
def autoscaling_cluster():
    """A head with no CPUs and Ray's autoscaler, which adds up to two one-CPU nodes for the
    demand it sees and removes them after 5 s idle: a cluster.yaml cluster, on one machine."""
    node_types = {"cpu": {"resources": {"CPU": 1}, "max_workers": 2}}
    with LocalCluster(num_cpus=0, autoscale=node_types, idle_timeout_s=5) as c:
        yield c


def worker_nodes(cluster) -> list[dict]:
    return [n for n in cluster.state("nodes", "state=ALIVE") if not n["is_head_node"]]


def run_watching_nodes(cluster, cmd: list[str]) -> tuple[int, str, int]:
    """Run a step's command from the bundle root; return its exit code, its output and the most
    worker nodes seen meanwhile."""
    proc, lines, reading = start_task(cmd, cluster)
    seen = [0]

    def watch() -> bool:
        seen.append(len(worker_nodes(cluster)))
        return reading.done()

    try:
        wait_for(watch, "the step done", 900)
    except BaseException:
        proc.kill()
        raise
    return proc.wait(), "".join(lines), max(seen)


def test_the_chain_runs_on_a_cluster_autoscaling_from_zero(autoscaling_cluster, tmp_path):
    cluster = autoscaling_cluster
    logs, nodes = {}, {}
    for step in STEPS:
        # Every step starts on an idle cluster: no node but the head, no CPU.
        wait_for(lambda: not worker_nodes(cluster), "worker nodes removed when idle", 120)
        cmd = step_command(cluster.address, str(tmp_path), step, profile="demo", sets=ZERO_SETTINGS)
        code, logs[step], nodes[step] = run_watching_nodes(cluster, cmd)
        assert code == 0, logs[step]
    # Preprocessing submits its shards, then waits; the autoscaler adds nodes for them.
    assert (
        "waiting up to 600 s (capacity_timeout_s) for the cluster to hold 1 CPU(s)"
        in logs["preprocess"]
    )
    assert nodes["preprocess"] >= 1
    # Training's two one-CPU workers wait in their placement group for two nodes.
    assert nodes["train"] == 2
    # Inference asks the autoscaler for one actor's CPU, as it shows no demand of its own yet.
    assert (
        "waiting up to 600 s (capacity_timeout_s) for the cluster to hold 1 CPU(s)" in logs["infer"]
    )
    summary = json.loads((tmp_path / "predictions" / "demo" / SUMMARY).read_text())
    assert summary["images"] > 0
