"""Fixtures: tiny datasets, real Ray clusters, and the training run the train and infer tests
share. Plain helpers live in helpers.py."""

from __future__ import annotations

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
# (test_preemption's notice test): an actor per worker group, a Python process of its own that
# polls the GCS for drained nodes, about 2 CPU-seconds each, and only the notice reads it.
# Ray Train classifies a lost node as preempted without it (docs/development.md).
os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")

import pytest
import ray
from helpers import (
    CLASSES,
    FAST_NODE_DEATH,
    MAIN_RUN_RECIPE,
    SHARED_CLUSTERS,
    armed_runtime_env,
    generated_dataset,
    held_worker,
    in_background,
    kill_worker,
    latest_recorded,
    local_ray,
    png_bytes,
    shared_cluster,
    tracked,
    train_job,
    wait_for,
    with_worker_nodes,
)

from harness import cpu_cost
from harness.cluster import LocalCluster
from harness.mlflow_server import MLflowServer
from harness.s3 import S3Server
from pipeline.core import faults

EXIT_STATUS = pytest.StashKey[int]()
LOW_GROUP = pytest.StashKey["Path | None"]()
METER = pytest.StashKey["cpu_cost.Meter | None"]()
# `CPU_REPORT=<file> make test`: each test's CPU-seconds, Ray's processes included
# (harness/cpu_cost.py), and the costliest at the end. A pytest that a test runs (its
# PYTEST_CURRENT_TEST inherited) leaves the report alone: it would start it over.
CPU_REPORT = (
    os.environ.get("CPU_REPORT")
    and not os.environ.get("PYTEST_CURRENT_TEST")
    and Path(os.environ["CPU_REPORT"]).resolve()
)


def pytest_addoption(parser):
    parser.addoption(
        "--light-worker",
        action="store_true",
        help="with -n N: the last worker runs only the LIGHT modules, at low CPU priority",
    )


def pytest_collection_finish(session):
    """The light worker at low CPU priority once it has collected: xdist hands out no unit
    before every worker has."""
    if getattr(session.config, "workerinput", {}).get("light"):
        # A group per process: `make test` runs beside whatever else runs on the machine.
        group = cpu_cost.low_priority(f"pytest-light-{os.getpid()}")
        if group is None:
            os.nice(15)  # no cgroup v1 `cpu` to write: the nice value of about its weight
        session.config.stash[LOW_GROUP] = group


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef, request):
    """In the light worker, a fixture of NORMAL_PRIORITY starts its processes at the normal
    weight: Ray's daemons and workers, a server. Only the tests' own computing waits. (Where the
    light worker has no group, at `nice 15`, they start at that nice value.)"""
    group = request.config.stash.get(LOW_GROUP, None)
    if group is None or fixturedef.argname not in NORMAL_PRIORITY:
        yield
        return
    with cpu_cost.normal_priority(group):
        yield


def pytest_configure(config):
    if not CPU_REPORT:
        return
    if not hasattr(config, "workerinput"):  # the run's own process, before any test process
        CPU_REPORT.unlink(missing_ok=True)
        CPU_REPORT.parent.mkdir(parents=True, exist_ok=True)
    config.stash[METER] = cpu_cost.Meter.join(f"pytest-{os.getpid()}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    meter = item.config.stash.get(METER, None)
    if meter is None:
        yield
        return
    cpu, started = meter.usage(), time.time()
    yield
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
    if group := config.stash.get(LOW_GROUP, None):
        cpu_cost.leave(group)
    if config.stash.get(EXIT_STATUS, None) not in (None, pytest.ExitCode.USAGE_ERROR):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(config.stash[EXIT_STATUS])


# Modules that share an expensive fixture, run by one xdist worker as one unit, so that it is
# made once: `make test`'s `--dist loadscope` otherwise sends modules to workers one by one, and
# each worker would make its own (main_run trains for minutes; a cluster of three nodes costs
# as much CPU as a short job to start).
SHARED_FIXTURES = {
    "tests/test_train_jobs.py": "main_run",
    "tests/test_infer.py": "main_run",
    "tests/test_elastic.py": "head_and_two_nodes",
    "tests/test_multinode.py": "head_and_two_nodes",
    "tests/test_preemption.py": "head_and_two_nodes",
}

# The longest units first, so that none is left running alone at the end of `make test`: the
# wall minutes each took in a fresh clone's `make test` at two units (its CPU report at e0b97fd,
# 2026-11-27). Units not named take under a minute and fill in after these, in xdist's order.
MINUTES = {
    "head_and_two_nodes": 11.0,
    "main_run": 7.1,
    "tests/test_autoscale.py": 6.2,
    # Measured alone on this machine's two cores: their jobs, their clusters and emulators.
    "tests/test_cloud_storage.py": 5.0,
    "tests/test_platform_jobs.py": 4.6,
    "tests/test_check.py": 3.5,
    "tests/test_metrics.py": 4.5,
    "tests/test_stall.py": 2.5,
    "tests/test_tune.py": 5.4,
    "tests/test_train_faults.py": 4.0,
    "tests/test_deploy.py": 3.4,
    "tests/test_airflow.py": 3.0,
    "tests/test_publish.py": 2.8,
    "tests/test_s3.py": 2.8,
    "tests/test_tracking_jobs.py": 2.5,
    "tests/test_serve.py": 2.3,
    "tests/test_chain.py": 2.0,
    "tests/test_steps.py": 1.6,
    "tests/test_own_loop.py": 1.5,
    "tests/test_export.py": 1.4,
    "tests/test_loader.py": 1.0,
    # Under a minute, but waiting on clusters: before the LIGHT units.
    "tests/test_bad_inputs.py": 0.8,
    "tests/test_jobs.py": 0.7,
    "tests/test_harness.py": 0.6,
    "tests/test_capacity.py": 0.2,
}

# Modules whose tests compute in their own process, or in-process Ray's, for seconds: no
# cluster, no job, no wait of minutes. `make test` (--light-worker) gives them to a worker of
# their own at low CPU priority, which runs them mostly on what the cluster tests leave of the
# cores while those wait on their clusters; the other workers take them only once all else is
# handed out. Its fixtures of NORMAL_PRIORITY start their processes at the normal weight, so that
# Ray's raylet and a server answer in time however busy the cores; a test of a LIGHT module that
# asks for a cluster (NOT_LIGHT) fails at its setup. Kept with the other workers: the modules
# that wait on a subprocess against a deadline (test_faults, test_tracking, test_platforms).
LIGHT = {
    "tests/test_check_rows.py",
    "tests/test_cli.py",
    "tests/test_cluster_yaml.py",
    "tests/test_config.py",
    "tests/test_device_decode.py",
    "tests/test_export.py",
    "tests/test_hooks.py",
    "tests/test_layout.py",
    "tests/test_loader.py",
    "tests/test_loading.py",
    "tests/test_model.py",
    "tests/test_models.py",
    "tests/test_predictions.py",
    "tests/test_preprocess.py",
    "tests/test_shards.py",
    "tests/test_sources.py",
    "tests/test_status.py",
    "tests/test_storage.py",
    "tests/test_sweep_config.py",
    "tests/test_telemetry.py",
    "tests/test_train.py",
    "tests/test_transforms.py",
    "tests/test_versions.py",
}
NORMAL_PRIORITY = {"ray_in_process", "tiny_dataset", "small_dataset", "s3_server", "mlflow_server"}
NOT_LIGHT = {"cluster_2cpu", "head_and_two_nodes", "main_run"}


def minutes(unit: str) -> float:
    """A unit's expected wall minutes: its module's, for a class of its tests."""
    return MINUTES.get(unit, MINUTES.get(unit.split("::")[0], 0))


def light(unit: str) -> bool:
    return unit.split("::")[0] in LIGHT


def pytest_runtest_setup(item):
    if light(item.nodeid) and (unsafe := NOT_LIGHT & set(item.fixturenames)):
        pytest.fail(
            f"{item.nodeid} asks for {', '.join(sorted(unsafe))}: a cluster, minutes of jobs "
            "for the other workers; take its module out of conftest.py's LIGHT",
            pytrace=False,
        )


def light_worker(config) -> str | None:
    """The id of the worker that runs only the LIGHT units, if any: the last one."""
    workers = config.getoption("numprocesses", None)
    if config.getoption("light_worker") and isinstance(workers, int) and workers > 1:
        return f"gw{workers - 1}"
    return None


@pytest.hookimpl(optionalhook=True)  # xdist's hooks: unknown under `-p no:xdist`
def pytest_configure_node(node):
    node.workerinput["light"] = node.gateway.id == light_worker(node.config)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class UnitScheduling(LoadScopeScheduling):
        """Units to workers, the longest left first (the first of equals: xdist's own order);
        LIGHT units to the light worker only, and to the others last."""

        def __init__(self, config, log=None):
            super().__init__(config, log)
            self.light_worker = light_worker(config)

        def _split_scope(self, nodeid: str) -> str:
            scope = super()._split_scope(nodeid)
            return SHARED_FIXTURES.get(scope, scope)

        def _next_unit(self, node) -> str | None:
            units = self.workqueue
            if node.gateway.id == self.light_worker:
                units = [u for u in units if light(u)]
            return max(units, key=lambda u: (not light(u), minutes(u)), default=None)

        def _assign_work_unit(self, node) -> None:
            unit = self._next_unit(node)
            if unit is None:
                node.shutdown()
                return
            work = self.assigned_work[node][unit] = self.workqueue.pop(unit)
            collection = self.registered_collections[node]
            node.send_runtest_some([collection.index(i) for i, done in work.items() if not done])

        def remove_node(self, node) -> str | None:
            """A worker that crashed (a test past its timeout ends its process): xdist reports
            the test it was running as failed, and the rest of its unit goes to the next worker
            free, the crashed test not again (xdist's own puts it back: a hang would crash one
            worker after another)."""
            workload = self.assigned_work.pop(node)
            pending = [i for unit in workload.values() for i, done in unit.items() if not done]
            if not pending:
                return None
            crashed = pending[0]  # a worker runs its unit's tests in order
            for scope, unit in workload.items():
                if crashed in unit:
                    unit[crashed] = True
                if not all(unit.values()):
                    self.workqueue[scope] = unit
            for other in self.assigned_work:
                self._reschedule(other)
            return crashed

        def _reschedule(self, node) -> None:
            """Units for `node` until it holds more than two tests (xdist's: work in hand), or
            none are left for it and it is told to finish. A worker starts a test only once it
            holds the next one or is told to finish: a worker that replaced a crashed one, given
            a unit of one test, would otherwise wait for ever."""
            while not node.shutting_down:
                if self._next_unit(node) is None:
                    node.shutdown()
                elif self._pending_of(self.assigned_work[node]) <= 2:
                    self._assign_work_unit(node)
                else:
                    return

    return UnitScheduling(config, log)


@pytest.fixture(scope="module")
def ray_in_process():
    """An in-process Ray instance for library-level tests; stopped after the module."""
    local_ray()
    yield
    ray.shutdown()


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
def small_dataset(tmp_path_factory) -> Path:
    """3 classes of generated 32 px images: one step of 8 images an epoch, 3 val images."""
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


@pytest.fixture
def head_and_two_nodes(request):
    """Head with no CPUs (it runs drivers, never training, as in cluster.yaml) + 2 one-CPU nodes,
    shared by consecutive tests (helpers.shared_cluster): each test starts with two live nodes."""
    cluster = shared_cluster(request, num_cpus=0, env=FAST_NODE_DEATH)
    return with_worker_nodes(cluster, 2)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After a test, stop the shared clusters that the next test on this process does not ask
    for (all of them after the last)."""
    yield
    for name in list(SHARED_CLUSTERS):
        if nextitem is None or name not in nextitem.fixturenames:
            SHARED_CLUSTERS.pop(name).stop()


@pytest.fixture(scope="session")
def s3_server():
    """An S3-compatible server (moto) on loopback for the whole session; each module that
    claims S3 makes a bucket of its own on it."""
    with S3Server() as server:
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
        yield c


@pytest.fixture(scope="session")
def main_run(cluster_2cpu, tiny_dataset, tmp_path_factory, mlflow_server):
    """One 2-worker training run of 4 epochs, checkpoint.num_to_keep=1, with a training worker
    SIGKILLed once Ray has recorded the checkpoint of epoch 0 and before epoch 1's: what a real
    fault looks like, at a defined point. It keeps an EMA of the weights and accumulates each step
    over two micro-batches, so that both go through DDP, the kill and the resume, and it is
    tracked in `mlflow_server`. test_train checks one claim about it per test; test_infer
    classifies with it. Returns (the job's output, the run directory)."""
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
