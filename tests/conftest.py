"""Fixtures: tiny datasets, real Ray clusters, and the training run the train and infer tests
share. Plain helpers live in helpers.py."""

from __future__ import annotations

import faulthandler
import os
import secrets
import sys
import time
from pathlib import Path

# A throwaway token for the Ray instances this process starts, or Ray writes one into the user's
# home. Ray reads it once, when first imported: so here, before anything imports ray.
os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32))
# One OpenMP thread for torch in each test process and what it starts, unless set: `make test`
# keeps both cores busy, where torch's second thread mostly spins, waiting for the first to be
# scheduled again; the in-process model tests took twice the CPU with it (docs/development.md).
# Where it counts, the bundle sets torch's threads itself (an inference actor's cpus_per_actor),
# and Ray gives a worker of one CPU one thread anyway.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Ray Train's preemption watcher off in the clusters the tests start, unless a test turns it on
# (tests/ray/test_node_preemption.py's notice test): an actor per worker group, a Python process
# of its own that polls the GCS for drained nodes, about 2 CPU-seconds each, and only the notice
# reads it.
# Ray Train classifies a lost node as preempted without it (docs/development.md).
os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")

import pytest
import ray
import tiers
from cloud_stores import BUCKET

from harness import cpu_cost
from harness.cloud_storage import AzuriteServer, GcsServer
from harness.cluster import LocalCluster
from harness.mlflow_server import MLflowServer
from harness.s3 import S3Server
from pipeline.core import faults

EXIT_STATUS = pytest.StashKey[int]()
METER = pytest.StashKey["cpu_cost.Meter | None"]()
STDERR = pytest.StashKey[int]()
# `CPU_REPORT=<file> make test`: each test's CPU-seconds, Ray's processes included
# (harness/cpu_cost.py), and the costliest at the end. A pytest that a test runs (its
# PYTEST_CURRENT_TEST inherited) leaves the report alone: it would start it over.
CPU_REPORT = (
    os.environ.get("CPU_REPORT")
    and not os.environ.get("PYTEST_CURRENT_TEST")
    and Path(os.environ["CPU_REPORT"]).resolve()
)


@pytest.hookimpl(tryfirst=True)  # before xdist's, which reads the groups
def pytest_collection_modifyitems(config, items):
    tiers.mark(items)


def pytest_configure(config):
    # The process's own stderr, which pytest's capture leaves alone (and xdist's workers share
    # with the run): where faulthandler writes the stacks of a test it ends.
    config.stash[STDERR] = os.dup(sys.__stderr__.fileno())
    if not CPU_REPORT:
        return
    if not hasattr(config, "workerinput"):  # the run's own process, before any test process
        CPU_REPORT.unlink(missing_ok=True)
        CPU_REPORT.parent.mkdir(parents=True, exist_ok=True)
    config.stash[METER] = cpu_cost.Meter.join(f"pytest-{os.getpid()}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    marker = item.get_closest_marker("timeout")
    timeout_s = marker and (marker.kwargs.get("timeout") or (marker.args or [0])[0])
    if timeout_s:
        grace_s = min(timeout_s, tiers.NATIVE_GRACE_S)
        stderr = item.config.stash[STDERR]
        faulthandler.dump_traceback_later(timeout_s + grace_s, exit=True, file=stderr)
    meter = item.config.stash.get(METER, None)
    cpu, started = meter and meter.usage(), time.time()
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
    if meter is not None:
        cpu_cost.record(CPU_REPORT, item.nodeid, meter.usage() - cpu, started, time.time())


def pytest_terminal_summary(terminalreporter, config):
    if not CPU_REPORT or hasattr(config, "workerinput"):
        return
    if config.stash.get(METER, None) is None:
        terminalreporter.write_line(f"CPU_REPORT: no cgroup v1 cpuacct at {cpu_cost.CPUACCT}")
    elif CPU_REPORT.exists():
        terminalreporter.section("CPU-seconds (CPU_REPORT)")
        for line in cpu_cost.summary(CPU_REPORT):
            terminalreporter.write_line(line)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    session.config.stash[EXIT_STATUS] = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """Leave without the interpreter's teardown, keeping pytest's exit status. After the last
    test, native threads of the libraries loaded here (the AWS SDK inside Arrow, Ray's core
    worker, torch's pools) can crash while Python finalises (apache/arrow#38352): a segfault
    that says nothing about the code under test, yet failed a CI run whose every test passed.
    A usage error (a bad `-k` expression) is left to pytest, which prints it after this hook."""
    if meter := config.stash.get(METER, None):
        meter.leave()
    if config.stash.get(EXIT_STATUS, None) not in (None, pytest.ExitCode.USAGE_ERROR):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(config.stash[EXIT_STATUS])


@pytest.fixture(scope="module")
def ray_in_process():
    """An in-process Ray instance for library-level tests; stopped after the module."""
    from helpers import local_ray

    local_ray()
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def hf_dataset(tmp_path_factory):
    """A local dataset shaped like food101: 'image' + ClassLabel 'label', train/validation
    Parquet files, loaded through the same `load_dataset` call as the hub's."""
    datasets = pytest.importorskip("datasets")
    from helpers import CLASSES, png_bytes

    root = tmp_path_factory.mktemp("hf")
    names = ["apple_pie", "pizza", "sushi", "ramen", "steak"]
    features = datasets.Features(
        {"image": datasets.Image(), "label": datasets.ClassLabel(names=names)}
    )
    for split, per_class in (("train", 10), ("validation", 4)):
        rows = [(label, i) for i in range(per_class) for label in range(len(names))]
        ds = datasets.Dataset.from_dict(
            {
                "image": [{"bytes": png_bytes(CLASSES[c % 3], i), "path": None} for c, i in rows],
                "label": [c for c, _ in rows],
            },
            features=features,
        )
        ds.to_parquet(str(root / "data" / f"{split}-00000-of-00001.parquet"))
    return str(root)


@pytest.fixture(scope="session")
def small_dataset(tmp_path_factory) -> Path:
    """3 classes of generated 32 px images: one step of 8 images an epoch, 3 val images."""
    from helpers import generated_dataset

    out = tmp_path_factory.mktemp("small") / "dataset"
    generated_dataset(
        out,
        "source.synthetic.num_classes=3",
        "source.synthetic.images_per_class=6",
        "source.synthetic.raw_size=40",
        "image_size=32",
        "val_fraction=0.3",
    )
    return out


@pytest.fixture(scope="session")
def tiny_dataset(tmp_path_factory) -> Path:
    """A preprocessed dataset of generated images: 4 classes, 32 px, several shards of several
    row groups; the val split has an odd number of rows (119), to catch padded evaluation."""
    from helpers import generated_dataset

    out = tmp_path_factory.mktemp("tiny") / "dataset"
    manifest = generated_dataset(
        out,
        "source.synthetic.num_classes=4",
        "source.synthetic.images_per_class=150",
        "source.synthetic.raw_size=48",
        "image_size=32",
        "shard_size=100",
        "row_group_size=25",
    )
    assert manifest.splits["val"].rows % 2 == 1
    return out


# --- training runs, shared by test_train and test_infer --------------------------------------


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After a test, stop the shared clusters that the next test on this process does not ask
    for (all of them after the last); and the session's cluster once the next test is of another
    tier and does not ask for it: xdist hands out the tests in the order collected, the jobs tier
    first, and an idle cluster costs about 4 CPU-seconds a minute while the other tiers run."""
    yield
    # Only helpers.py makes shared clusters: none where no test module has imported it.
    shared = getattr(sys.modules.get("helpers"), "SHARED_CLUSTERS", {})
    for name in list(shared):
        if nextitem is None or name not in nextitem.fixturenames:
            shared.pop(name).stop()
    if nextitem is None or (
        tiers.tier(nextitem) != "jobs" and "cluster_2cpu" not in nextitem.fixturenames
    ):
        for cluster in SESSION_CLUSTER:
            cluster.stop()


def pytest_runtest_setup(item):
    """The session's cluster started again for a test that asks for it after it was stopped."""
    if "cluster_2cpu" in item.fixturenames:
        for cluster in SESSION_CLUSTER:
            if not cluster.running:
                cluster.start()


# The session's cluster, once made: for the two hooks above.
SESSION_CLUSTER: list[LocalCluster] = []


@pytest.fixture(scope="session")
def s3_server():
    """An S3-compatible server (moto) on loopback for the whole session; each module that
    claims S3 makes a bucket of its own on it."""
    with S3Server() as server:
        yield server


@pytest.fixture(scope="module")
def gcs(tmp_path_factory):
    """fake-gcs-server on loopback (npm, on first use), with the tests' bucket."""
    with GcsServer(tmp_path_factory.mktemp("gcs") / "server.log") as server:
        server.create_bucket(BUCKET)
        yield server


@pytest.fixture(scope="module")
def azurite(tmp_path_factory):
    """Azurite's blob service on loopback (npm, on first use), with the tests' container."""
    with AzuriteServer(tmp_path_factory.mktemp("azurite") / "server.log") as server:
        server.create_container(BUCKET)
        yield server


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    """A real MLflow tracking server (SQLite, artifacts on local disk) on loopback for the whole
    session: the tracked jobs log to it, and the tests read back through MLflow's client."""
    with MLflowServer(tmp_path_factory.mktemp("mlflow")) as server:
        yield server


@pytest.fixture(scope="session")
def cluster_2cpu(s3_server):
    """A real single-node cluster of 2 CPUs (`ray start`), for jobs sent with `ray job submit`:
    one for the whole session, shared by the modules whose jobs leave it as they found it. Its
    nodes reach `s3_server` as a real cluster's reach S3: through the nodes' environment."""
    with LocalCluster(num_cpus=2, env=s3_server.env) as c:
        SESSION_CLUSTER.append(c)
        yield c


@pytest.fixture(scope="session")
def main_run(cluster_2cpu, tiny_dataset, tmp_path_factory, mlflow_server):
    """One 2-worker training run of 4 epochs, checkpoint.num_to_keep=1, with a training worker
    SIGKILLed once Ray has recorded the checkpoint of epoch 0 and before epoch 1's: what a real
    fault looks like, at a defined point. It keeps an EMA of the weights and accumulates each step
    over two micro-batches, so that both go through DDP, the kill and the resume, and it is
    tracked in `mlflow_server`. test_train checks one claim about it per test; test_infer
    classifies with it. Returns (the job's output, the run directory)."""
    from helpers import (
        MAIN_RUN_RECIPE,
        armed_runtime_env,
        held_worker,
        in_background,
        kill_worker,
        latest_recorded,
        tracked,
        train_job,
        wait_for,
    )

    storage = tmp_path_factory.mktemp("runs")
    run = storage / "main"
    fault = tmp_path_factory.mktemp("fault")
    runtime_env, marker = armed_runtime_env(fault, faults.CHECKPOINT_REPORTED)
    keep = "checkpoint.num_to_keep=1"
    args = ("name=main", "epochs=4", keep, *MAIN_RUN_RECIPE, *tracked(mlflow_server))
    submit = {"submission_id": "train-main", "runtime_env": runtime_env}
    job = in_background(train_job, cluster_2cpu, tiny_dataset, storage, *args, **submit)
    pid = held_worker(marker, job)
    # Rank 0 is held right after reporting epoch 0: Ray records that checkpoint without it, and
    # no later one can come.
    wait_for(lambda: latest_recorded(run) == "epoch_0000", "epoch 0 in Ray's record", 60)
    assert not (run / "epoch_0001").exists()
    killed_at = kill_worker(cluster_2cpu, pid)
    wait_for(lambda: latest_recorded(run) != "epoch_0000" or job.done(), "a checkpoint after it")
    recovered_s = time.time() - killed_at
    proc = job.result()
    assert proc.returncode == 0, proc.stdout
    done_s = time.time() - killed_at
    print(f"main run: kill -> next checkpoint {recovered_s:.0f} s, -> job done {done_s:.0f} s")
    return proc, run
