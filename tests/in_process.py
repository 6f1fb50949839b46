"""Training on a cluster of this process (`ray.cluster_utils.Cluster`, tests/ray): the driver
connected as a job with its runtime env, the train job's driver function called here, Ray Train's
workers and the workers' logs read back, a node drained as preempted."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

from helpers import TRAIN, held_worker, in_background, latest_recorded, wait_for

from harness.cluster import BUNDLE_ROOT
from harness.faults import arm
from pipeline.core import faults
from pipeline.core.config import load_config
from pipeline.core.storage import Location
from pipeline.model.runs import checkpoint_dir_name
from pipeline.train.config import TrainConfig


def connect(cluster, *, py_modules=(), **env_vars: str) -> None:
    """Connect this process's driver to `cluster` (a ray.cluster_utils.Cluster) anew, as a new
    job: its Ray processes get `env_vars` and the packages `py_modules`, as a submitted job's
    runtime env gives them (a fault point armed for one run: harness.faults.arm)."""
    import ray

    ray.shutdown()
    runtime_env = {"env_vars": {"PYTHONUNBUFFERED": "1", **env_vars}}
    if py_modules:
        runtime_env["py_modules"] = [str(p) for p in py_modules]
    ray.init(address=cluster.address, runtime_env=runtime_env, log_to_driver=False)


def connect_armed(cluster, directory: Path, point: str, *, py_modules=(), **env_vars) -> Path:
    """`connect` with fault `point` armed for the next run: returns the marker the held worker
    will write."""
    connect(cluster, py_modules=py_modules, **arm(point, directory), **env_vars)
    return directory / point


def train_config(dataset, storage, *overrides: str) -> TrainConfig:
    """The config that `train_job`'s job loads, with `overrides`."""
    at = TRAIN.index("--config") + 1
    args = [*TRAIN[at + 1 :], f"dataset={dataset}", f"storage_path={storage}", *overrides]
    return load_config(TrainConfig, BUNDLE_ROOT / TRAIN[at], args)


def train_here(dataset, storage, *overrides: str) -> dict:
    """What the train job runs (`pipeline.train.driver.train`), with `train_job`'s config and
    `overrides`, from this process's driver: returns the run's summary."""
    from pipeline.train.driver import train

    cfg = train_config(dataset, storage, *overrides)
    return train(cfg, dataset=Location.parse(cfg.dataset), runs=Location.parse(cfg.storage_path))


def train_workers_here() -> list[dict]:
    """The live Ray Train worker actors of the cluster this process is connected to, from the
    GCS (no dashboard): each with its "Pid" and "Address"'s "NodeID"."""
    import ray

    actors = ray._private.state.actors().values()
    return [a for a in actors if a["ActorClassName"] == "RayTrainWorker" and a["State"] == "ALIVE"]


def train_worker_nodes_here() -> list[str]:
    """The node of each live Ray Train worker."""
    return sorted(a["Address"]["NodeID"] for a in train_workers_here())


def node_of(cluster, pid: int):
    """The node of `cluster` whose raylet runs the training worker `pid`."""
    (node_id,) = [a["Address"]["NodeID"] for a in train_workers_here() if a["Pid"] == pid]
    (node,) = [n for n in cluster.worker_nodes if n.node_id == node_id]
    return node


def drain_as_preempted(cluster, node, *, deadline_s: float) -> None:
    """`ray drain-node` of `node`, as a cloud's notice that a spot instance goes in
    `deadline_s` seconds (the caller removes it then)."""
    from ray._raylet import GcsClient
    from ray.core.generated.autoscaler_pb2 import DrainNodeReason

    deadline_ms = time.time_ns() // 1_000_000 + int(deadline_s * 1000)
    accepted, refusal = GcsClient(address=cluster.address).drain_node(
        node.node_id,
        DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),
        "spot instance reclaimed (test)",
        deadline_ms,
    )
    assert accepted, refusal


def held_on_two_nodes_here(cluster, dataset, storage: Path, name: str, *args, epoch: int):
    """Train run `name` on a cluster of this process, rank 0 held once Ray has recorded the
    checkpoint of `epoch`, each worker on a node of its own: for a node to be lost at that
    defined point. Returns the run (a Future of its summary) and the held worker's pid."""
    fault = storage / f"fault-{name}-{epoch}"
    fault.mkdir()
    marker = connect_armed(cluster, fault, faults.CHECKPOINT_REPORTED)
    job = in_background(train_here, dataset, storage, f"name={name}", *args)
    pid = held_worker(marker, job)
    recorded = checkpoint_dir_name(epoch)
    wait_for(lambda: latest_recorded(storage / name) == recorded, f"{recorded} in Ray's record", 60)
    workers = train_worker_nodes_here()
    assert len(set(workers)) == 2, f"the two workers are not on two nodes: {workers}"
    return job, pid


class WorkerLogs:
    """What the Ray workers of a cluster of this process write to their logs (the train job's
    output, from the workers' side), from the moment this is made on."""

    def __init__(self, cluster):
        self.logs = Path(cluster.head_node.get_session_dir_path()) / "logs"
        self.start = {path: path.stat().st_size for path in self.logs.glob("worker-*")}

    def text(self) -> str:
        parts = []
        for path in sorted(self.logs.glob("worker-*")):
            with open(path, "rb") as f:
                f.seek(self.start.get(path, 0))
                parts.append(f.read().decode(errors="replace"))
        return "".join(parts)


def started(start, attempts: int = 4):
    """`start()` of a cluster's node, tried up to `attempts` times: Ray waits a fixed 30 s for a
    new node's raylet to register, which a loaded machine can exceed (as `helpers.local_ray`
    starts again). The processes of an attempt that timed out are killed before the next."""
    import psutil

    for attempt in range(1, attempts + 1):
        before = {p.pid for p in psutil.Process().children(recursive=True)}
        try:
            return start()
        except Exception as e:
            if attempt == attempts or "timed out during startup" not in str(e):
                raise
        for process in psutil.Process().children(recursive=True):
            if process.pid not in before:
                with contextlib.suppress(psutil.NoSuchProcess):
                    process.kill()


def kill_worker_here(pid: int) -> None:
    """SIGKILL the Ray Train worker `pid` of the cluster this process is connected to, as a
    crash would."""
    import os
    import signal

    assert pid in {a["Pid"] for a in train_workers_here()}, pid
    os.kill(pid, signal.SIGKILL)


def train_workers_of_this_job() -> list[dict]:
    """Every Ray Train worker actor the job of this process's driver has started, live or
    dead."""
    import ray

    job = ray.get_runtime_context().get_job_id()
    actors = ray._private.state.actors().values()
    return [a for a in actors if a["ActorClassName"] == "RayTrainWorker" and a["JobID"] == job]


def preprocess_here(*overrides: str):
    """What the preprocess job runs (`pipeline.data.preprocess.preprocess`), with its default
    config file and `overrides`, from this process's driver: returns the manifest it commits."""
    from pipeline.data.config import PreprocessConfig
    from pipeline.data.preprocess import preprocess

    default = BUNDLE_ROOT / "configs" / "preprocess.yaml"
    cfg = load_config(PreprocessConfig, default, list(overrides))
    return preprocess(cfg, output=Location.parse(cfg.output))
