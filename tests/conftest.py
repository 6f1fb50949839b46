"""Shared fixtures: tiny image folders with corrupt files, and real Ray clusters."""

from __future__ import annotations

import csv
import io
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

# A throwaway token for the Ray instances this process starts, or Ray writes one into the user's
# home. Ray reads it once, when first imported: so here, before anything imports ray.
os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32))

import pytest
import ray
import yaml

from harness.cluster import BUNDLE_ROOT, LocalCluster
from harness.faults import arm
from pipeline.core import faults
from pipeline.data.sources import render_synthetic
from pipeline.model.runs import HISTORY_CSV, SNAPSHOT

EXIT_STATUS = pytest.StashKey[int]()

CLASSES = ("red_circle", "green_square", "blue_triangle")

# name -> bytes of files that are not usable images, and the reason the manifest must give.
CORRUPT = {
    "notes.txt": (b"not an image at all\n", "not an image"),
    "empty.jpg": (b"", "empty file"),
}


def png_bytes(class_name: str, index: int, size: int = 40) -> bytes:
    buf = io.BytesIO()
    render_synthetic(class_name, size=size, seed=1, index=index).save(buf, format="PNG")
    return buf.getvalue()


def jpeg_bytes(class_name: str, index: int, size: int = 40) -> bytes:
    buf = io.BytesIO()
    render_synthetic(class_name, size=size, seed=1, index=index).save(buf, format="JPEG")
    return buf.getvalue()


def make_image_folder(root: Path, per_class: int = 20, corrupt: bool = True) -> dict[str, str]:
    """`root/<class>/<n>.png|jpg`; with `corrupt`, a truncated JPEG, a text file and an empty
    file in the first class. Returns {relative path of each corrupt file: expected reason}."""
    for c in CLASSES:
        (root / c).mkdir(parents=True)
        for i in range(per_class):
            # Mixed formats and non-square sizes, as real folders have.
            if i % 2:
                (root / c / f"{i:03d}.jpg").write_bytes(jpeg_bytes(c, i, size=48))
            else:
                (root / c / f"{i:03d}.png").write_bytes(png_bytes(c, i, size=40))
    bad: dict[str, str] = {}
    if corrupt:
        first = root / CLASSES[0]
        truncated = jpeg_bytes(CLASSES[0], 999, size=64)
        (first / "truncated.jpg").write_bytes(truncated[: len(truncated) // 2])
        bad[f"{CLASSES[0]}/truncated.jpg"] = "truncated or corrupt"
        for name, (data, reason) in CORRUPT.items():
            (first / name).write_bytes(data)
            bad[f"{CLASSES[0]}/{name}"] = reason
    return bad


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    session.config.stash[EXIT_STATUS] = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """Leave without the interpreter's teardown, keeping pytest's exit status. After the last
    test, native threads of the libraries loaded here (the AWS SDK inside Arrow, Ray's core
    worker, torch's pools) can crash while Python finalises (apache/arrow#38352): a segfault
    that says nothing about the code under test, yet failed a CI run whose every test passed."""
    if EXIT_STATUS in config.stash:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(config.stash[EXIT_STATUS])


@pytest.fixture(scope="module")
def ray_session():
    """An in-process Ray instance for library-level tests; stopped after the module."""
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def cluster():
    """A real single-node cluster (`ray start`), for jobs sent with `ray job submit`."""
    with LocalCluster(num_cpus=2) as c:
        yield c


@pytest.fixture(scope="session")
def hf_dataset(tmp_path_factory):
    """A local dataset shaped like food101: 'image' + ClassLabel 'label', train/validation
    Parquet files, loaded through the same `load_dataset` call as the hub's."""
    datasets = pytest.importorskip("datasets")
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
def tiny_dataset(tmp_path_factory) -> Path:
    """A preprocessed dataset of generated images: 4 classes, 32 px, several shards of several
    row groups; the val split has an odd number of rows (119), to catch padded evaluation."""
    from pipeline.core.config import PreprocessConfig, load_config
    from pipeline.core.storage import Location
    from pipeline.data.preprocess import preprocess

    out = tmp_path_factory.mktemp("tiny") / "dataset"
    cfg = load_config(
        PreprocessConfig,
        None,
        [
            f"output={out}",
            "source.kind=synthetic",
            "source.synthetic.num_classes=4",
            "source.synthetic.images_per_class=150",
            "source.synthetic.raw_size=48",
            "image_size=32",
            "shard_size=100",
            "row_group_size=25",
        ],
    )
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        manifest = preprocess(cfg, output=Location.parse(str(out)))
    finally:
        ray.shutdown()
    assert manifest.splits["val"].rows % 2 == 1
    return out


# --- training runs, shared by test_train and test_infer --------------------------------------

TRAIN = ["python", "-m", "jobs.train", "--config", "configs/demo-train.yaml"]


def train_job(cluster, dataset, storage, *overrides, **submit):
    args = [*TRAIN, f"dataset={dataset}", f"storage_path={storage}", *overrides]
    return cluster.submit(args, capture=True, timeout_s=600, **submit)


def history(run: Path) -> list[dict]:
    with open(run / HISTORY_CSV) as f:
        return [{k: float(v) for k, v in row.items()} for row in csv.DictReader(f)]


# The GCS declares a killed node dead within about 5 s, not Ray's default of about 17 s
# (measured here: 4.8 s and 17.1 s): with 5 s placement attempts the job would otherwise race
# the detection, and could give up while the dead node still counts in the cluster's resources.
FAST_NODE_DEATH = {
    "RAY_health_check_period_ms": "1000",
    "RAY_health_check_timeout_ms": "1000",
    "RAY_health_check_failure_threshold": "2",
}


@pytest.fixture(scope="module")
def nodes():
    """Head with no CPUs (it runs drivers, never training, as in cluster.yaml) + 2 one-CPU nodes."""
    with LocalCluster(num_cpus=0, env=FAST_NODE_DEATH) as cluster:
        cluster.add_node(num_cpus=1)
        cluster.add_node(num_cpus=1)
        yield cluster


def training_worker_nodes(cluster) -> list[str]:
    return sorted(a["node_id"] for a in training_workers(cluster))


def wait_for(predicate, what: str, timeout_s: float = 300):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.5)
    raise TimeoutError(f"no {what} after {timeout_s} s")


def training_workers(cluster) -> list[dict]:
    """The live Ray Train worker actors, from Ray's state API."""
    return cluster.state("actors", "class_name=RayTrainWorker", "state=ALIVE", detail=True)


def kill_worker(cluster, pid: int) -> float:
    """SIGKILL a Ray Train worker process, as a crash would; returns when (time.time())."""
    assert pid in {a["pid"] for a in training_workers(cluster)}, pid
    os.kill(pid, signal.SIGKILL)
    return time.time()


def armed_runtime_env(directory: Path, point: str) -> tuple[Path, Path]:
    """runtime_env.yaml plus the variable that arms fault `point` for one job:
    returns the file to submit the job with, and the marker the held worker will write."""
    env = yaml.safe_load((BUNDLE_ROOT / "runtime_env.yaml").read_text())
    env["env_vars"] = {**env.get("env_vars", {}), **arm(point, directory)}
    path = directory / "runtime_env.yaml"  # its working_dir "." is the submitter's cwd: the bundle
    path.write_text(yaml.safe_dump(env))
    return path, directory / point


def held_worker(marker: Path, job: Future) -> int:
    """The pid of the worker blocked at the armed fault point, once it is there."""
    wait_for(lambda: marker.exists() or job.done(), f"a worker held at {marker.name}")
    assert not job.done(), f"the job ended without reaching {marker.name}:\n{job.result().stdout}"
    return int(marker.read_text())


def latest_recorded(run: Path) -> str | None:
    """The directory name of the latest checkpoint in Ray Train's record of `run`, if any."""
    try:
        snapshot = json.loads((run / SNAPSHOT).read_text())
    except (FileNotFoundError, json.JSONDecodeError):  # none yet, or Ray is rewriting it
        return None
    latest = snapshot["latest_checkpoint_result"]
    return latest["checkpoint_dir_name"] if latest else None


def in_background(fn, *args, **kwargs) -> Future:
    return ThreadPoolExecutor(max_workers=1).submit(fn, *args, **kwargs)


def start_task(cmd: list[str], cluster: LocalCluster) -> tuple[subprocess.Popen, list[str], Future]:
    """Run a step's command from the bundle root; its output lines collect in the list as they
    come."""
    proc = subprocess.Popen(
        cmd,
        cwd=BUNDLE_ROOT,
        env=cluster.env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    lines: list[str] = []

    def read():
        for line in proc.stdout:
            lines.append(line)

    return proc, lines, in_background(read)


@pytest.fixture(scope="session")
def train_cluster():
    """The cluster of the training and inference tests: shared, as they share `main_run`."""
    with LocalCluster(num_cpus=2) as c:
        yield c


@pytest.fixture(scope="session")
def main_run(train_cluster, tiny_dataset, tmp_path_factory):
    """One 2-worker training run of 4 epochs, num_to_keep=1, with a training worker SIGKILLed
    once Ray has recorded the checkpoint of epoch 0 and before epoch 1's: what a real fault
    looks like, at a defined point. test_train checks one claim about it per test; test_infer
    classifies with it. Returns (the job's output, the run directory)."""
    storage = tmp_path_factory.mktemp("runs")
    run = storage / "main"
    fault = tmp_path_factory.mktemp("fault")
    runtime_env, marker = armed_runtime_env(fault, faults.CHECKPOINT_REPORTED)
    args = ("name=main", "epochs=4", "num_to_keep=1")
    submit = {"submission_id": "train-main", "runtime_env": runtime_env}
    job = in_background(train_job, train_cluster, tiny_dataset, storage, *args, **submit)
    pid = held_worker(marker, job)
    # Rank 0 is held right after reporting epoch 0: Ray records that checkpoint without it, and
    # no later one can come.
    wait_for(lambda: latest_recorded(run) == "epoch_0000", "epoch 0 in Ray's record", 60)
    assert not (run / "epoch_0001").exists()
    killed_at = kill_worker(train_cluster, pid)
    wait_for(lambda: latest_recorded(run) != "epoch_0000" or job.done(), "a checkpoint after it")
    recovered_s = time.time() - killed_at
    proc = job.result()
    assert proc.returncode == 0, proc.stdout
    done_s = time.time() - killed_at
    print(f"main run: kill -> next checkpoint {recovered_s:.0f} s, -> job done {done_s:.0f} s")
    return proc, run
