"""What the tests share besides fixtures: tiny image folders, job submission, waits, faults."""

from __future__ import annotations

import csv
import faulthandler
import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import yaml

from harness.cluster import BUNDLE_ROOT, ENDED, LocalCluster
from harness.faults import arm
from pipeline.core import faults
from pipeline.core.config import load_config
from pipeline.core.storage import Location
from pipeline.data.dataset import read_manifest
from pipeline.data.sources import render_synthetic
from pipeline.model.checkpoint import CheckpointMeta, ModelInput
from pipeline.model.runs import (
    HISTORY_CSV,
    SNAPSHOT,
    STEPS,
    latest_step_checkpoint,
    load_result,
)
from pipeline.train.config import TrainConfig

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


USER_MODEL = "examples.custom_model.tiny_cnn:build"
# The train jobs of the fault, resume and scaling tests train the example's small network: what
# they check holds for any network, and ResNet-18 (the demo's, which the chain tests train) costs
# about 6 CPU-s more an epoch of the tiny dataset, and 135 MB a checkpoint. A run that must last
# while a fault lands holds a worker at a fault point, or trains SLOW_CNN.
TRAIN = [
    *("python", "-m", "jobs.train", "--config", "configs/demo-train.yaml"),
    f"model.name={USER_MODEL}",
]
# The shared training run's recipe (conftest.main_run). The demo config's global batch of 32 is
# 16 images a worker: two micro-batches of 8.
MAIN_RUN_RECIPE = ("ema.enabled=true", "ema.every_steps=2", "ema.decay=0.8", "micro_batch_size=8")


def train_job(cluster, dataset, storage, *overrides, **submit):
    args = [*TRAIN, f"dataset={dataset}", f"storage_path={storage}", *overrides]
    return cluster.run_job(args, capture=True, timeout_s=600, **submit)


def tracked(server) -> tuple[str, ...]:
    """A job's overrides that track it in `server` (a harness.mlflow_server.MLflowServer)."""
    return (f"tracking.uri={server.uri}",)


def mlflow_run(server, run: Path):
    """The MLflow run a training run's directory names (its mlflow_run.json), read back."""
    record = json.loads((run / "mlflow_run.json").read_text())
    assert record["tracking_uri"] == server.uri
    return server.client().get_run(record["run_id"])


def metric_steps(server, run_id: str, history: list[dict]) -> dict[str, list[int]]:
    """Each numeric key of `history`: the steps the MLflow run holds it at, in order, repeats
    kept; and the values must be the history's."""
    client, steps = server.client(), {}
    for key in [k for k in history[0] if k not in ("epoch", "dataset_version")]:
        logged = sorted(client.get_metric_history(run_id, key), key=lambda m: (m.step, m.timestamp))
        steps[key] = [m.step for m in logged]
        by_epoch = {int(r["epoch"]): r[key] for r in history}
        for m in logged:
            assert abs(m.value - float(by_epoch[m.step])) <= 1e-6 * max(1, abs(m.value)), key
    return steps


def history(run: Path) -> list[dict]:
    """history.csv's rows, numbers as floats (the dataset version stays a name)."""
    with open(run / HISTORY_CSV) as f:
        return [{k: _number(v) for k, v in row.items()} for row in csv.DictReader(f)]


def newest_step_checkpoint(run: Path) -> str:
    """The newest whole checkpoint inside an epoch of `run`, taken before its restarted
    workers could write one: epoch 1's step-20 checkpoint, or a later one where the loop went
    on meanwhile. For went_on_from."""
    newest = latest_step_checkpoint(Location.parse(str(run)))
    assert newest is not None and newest.name >= "epoch_0001_step_000020", newest
    return newest.path


def went_on_from(newest: str, said: str, run: Path) -> None:
    """A run whose epoch 0 checkpoint was on storage but not in Ray's record resumed from
    `newest`, the newest checkpoint on storage (its output `said` so), recorded epoch 0's, and
    trained each epoch once."""
    step = int(newest.rsplit("_", 1)[1])
    resumed = f"resumed from checkpoint {newest}: epoch 1, continuing after its step {step}"
    assert resumed in said, said
    assert f"checkpoint {run / 'epoch_0000'} is on storage and not in Ray's record" in said, said
    assert [r["epoch"] for r in history(run)] == [0, 1]
    recorded = load_result(Location.parse(str(run)))
    assert sorted(Path(c.path).name for c, _ in recorded.best_checkpoints) == [
        "epoch_0000",
        "epoch_0001",
    ]
    assert [m["epoch"] for _, m in recorded.best_checkpoints] == [0, 1]
    assert list((run / STEPS).iterdir()) == []  # gone once their epochs' checkpoints were in


def _number(value: str) -> float | str:
    try:
        return float(value)
    except ValueError:
        return value


# The GCS declares a killed node dead within about 5 s, not Ray's default of about 17 s
# (measured here: 4.8 s and 17.1 s): with 5 s placement attempts the job would otherwise race
# the detection, and could give up while the dead node still counts in the cluster's resources.
FAST_NODE_DEATH = {
    "RAY_health_check_period_ms": "1000",
    "RAY_health_check_timeout_ms": "1000",
    "RAY_health_check_failure_threshold": "2",
}


# Clusters that consecutive tests share: started by the first test that asks for the fixture,
# kept while the next test on this process asks for it too, stopped after the last
# (conftest's pytest_runtest_teardown). The xdist scheduler runs the modules that share one as a
# single unit, so that their tests follow one another; no idle cluster outlives them.
SHARED_CLUSTERS: dict[str, LocalCluster] = {}


def shared_cluster(request, **options) -> LocalCluster:
    """The cluster of the fixture asking (`request`), started with `options` if none runs."""
    name = request.fixturename
    if name not in SHARED_CLUSTERS:
        SHARED_CLUSTERS[name] = LocalCluster(**options).start()
    return SHARED_CLUSTERS[name]


def with_worker_nodes(cluster: LocalCluster, count: int) -> LocalCluster:
    """`cluster` with `count` live one-CPU worker nodes, none drained: the nodes an earlier test
    drained or left over are killed, those it lost replaced. Returns once Ray counts just these,
    as a fresh cluster of them would. A job an earlier test left running (it failed) is stopped."""
    for job in cluster.get("/api/jobs/"):
        if job["status"] not in ENDED and job.get("submission_id"):
            cluster.stop_job(job["submission_id"])
    live = [n for n in cluster.nodes if n.proc.poll() is None and not n.drained]
    gone = [n for n in cluster.nodes if n.proc.poll() is None and n not in live[:count]]
    for node in gone:
        node.kill()
    kept = live[:count] + [cluster.add_node(num_cpus=1) for _ in range(count - len(live))]
    expected = {node.tag for node in kept}

    def counted() -> bool:
        return {r for r in cluster.alive_resources() if r.startswith("local_node_")} == expected

    wait_for(counted, f"{count} worker node(s) alive in Ray's record", 60)
    if gone or len(kept) > len(live):
        # Ray Data's autoscaling coordinator, a detached actor that outlives jobs, reads the
        # nodes every 20 s, and Ray Train sizes an elastic group by what it reserved: killed,
        # it restarts (max_restarts=-1) from the nodes of now, as on a fresh cluster.
        coordinator = "class_name=_AutoscalingCoordinatorActor"
        for actor in cluster.state("actors", coordinator, "state=ALIVE", detail=True):
            os.kill(actor["pid"], signal.SIGKILL)
    return cluster


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


def job_runtime_env(directory: Path, *, py_modules=(), **env_vars: str) -> Path:
    """runtime_env.yaml plus `env_vars` and the packages `py_modules` (code outside the bundle,
    as a user ships theirs), written to `directory`: the file to submit a job with."""
    env = yaml.safe_load((BUNDLE_ROOT / "runtime_env.yaml").read_text())
    env["env_vars"] = {**env.get("env_vars", {}), **env_vars}
    if py_modules:
        env["py_modules"] = [str(p) for p in py_modules]
    path = directory / "runtime_env.yaml"  # its working_dir "." is the submitter's cwd: the bundle
    path.write_text(yaml.safe_dump(env))
    return path


def armed_runtime_env(
    directory: Path, point: str, *, py_modules=(), **env_vars: str
) -> tuple[Path, Path]:
    """job_runtime_env plus the variable that arms fault `point` for one job: returns the file
    to submit the job with, and the marker the held worker will write."""
    env = job_runtime_env(directory, py_modules=py_modules, **arm(point, directory), **env_vars)
    return env, directory / point


# The example's small CNN, slowed: each forward pass sleeps, holding no CPU. A run lasts while a
# fault lands, as a large network's would, without the suite paying for one.
SLOW_CNN = """
import time

from examples.custom_model.tiny_cnn import build as tiny_cnn


def build(num_classes, *, seconds=0.4, **kwargs):
    net = tiny_cnn(num_classes, **kwargs)
    net.register_forward_pre_hook(lambda module, args: time.sleep(seconds))
    return net
"""


def slow_cnn(directory: Path) -> tuple[Path, str]:
    """The package of SLOW_CNN, written under `directory`, and its model.name."""
    package = directory / "slowcnn"
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text(SLOW_CNN)
    return package, "slowcnn:build"


def held_worker(marker: Path, job: Future) -> int:
    """The pid of the worker blocked at the armed fault point, once it is there."""
    wait_for(lambda: marker.exists() or job.done(), f"a worker held at {marker.name}")
    assert not job.done(), f"the job ended without reaching {marker.name}:\n{job.result().stdout}"
    return int(marker.read_text())


def held_until_it_ends(
    cluster, job: Future, marker: Path, submission_id: str, within_s: float
) -> tuple[int, subprocess.CompletedProcess, float]:
    """For a job whose process holds at an armed fault point and that must end by itself: the
    held pid, the job's ending and the seconds from the hold to it; a job still running after
    `within_s` fails the test, and is stopped."""
    try:
        pid = held_worker(marker, job)
        held_at = time.monotonic()
        proc = job.result(timeout=within_s)
        return pid, proc, time.monotonic() - held_at
    finally:
        if not job.done():
            cluster.stop_job(submission_id)


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


# How long `ray.init` may take in all before the test's process is ended with every thread's
# stack: under load it once waited 12 minutes inside Ray's core worker, where no Python timeout
# reaches.
RAY_INIT_LIMIT_S = 300


def local_ray(attempts: int = 4) -> None:
    """`ray.init` of an in-process Ray instance of 2 CPUs. Ray waits a fixed 30 s for its raylet
    to register, which a loaded machine can exceed: it is started again, up to `attempts`. A start
    that takes longer than RAY_INIT_LIMIT_S in all ends the process, stacks first (xdist reports
    the test failed and goes on with a new worker)."""
    import ray

    watchdog = threading.Timer(RAY_INIT_LIMIT_S, stacks_and_exit, ["ray.init", RAY_INIT_LIMIT_S])
    watchdog.daemon = True
    watchdog.start()
    try:
        for attempt in range(1, attempts + 1):
            try:
                # "local": a new instance, never the cluster a `ray start` of another test left
                # in /tmp/ray/ray_current_cluster.
                ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
                return
            except Exception as e:
                if attempt == attempts or "timed out during startup" not in str(e):
                    raise
                ray.shutdown()
    finally:
        watchdog.cancel()


def stacks_and_exit(what: str, limit_s: float) -> None:
    """Every thread's stack to stderr, then end the process: `what` took over `limit_s`."""
    print(f"{what} still waiting after {limit_s:.0f} s: ending this process", file=sys.__stderr__)
    faulthandler.dump_traceback(file=sys.__stderr__, all_threads=True)
    sys.__stderr__.flush()
    os._exit(1)


def generated_dataset(out: Path, *overrides: str):
    """Preprocess generated images into `out`, the shards in this process (no Ray: the tiers
    that start none use it too); returns the manifest."""
    from pipeline.core.config import load_config
    from pipeline.core.storage import Location
    from pipeline.data.config import PreprocessConfig
    from pipeline.data.preprocess import preprocess

    args = [f"output={out}", "source.kind=synthetic", *overrides]
    cfg = load_config(PreprocessConfig, None, args)
    return preprocess(cfg, output=Location.parse(str(out)), in_process=True)


def recorded_run(run: Location, record: list[tuple], monkeypatch) -> Location:
    """`run` as Ray's record of `record`, (ray.train.Checkpoint, metrics) pairs with the latest
    last, for the loaders that read it (pipeline.model.source and runs); `run`."""
    import ray.train

    result = ray.train.Result(*record[-1][::-1], None, run.path, best_checkpoints=record)
    monkeypatch.setattr("pipeline.model.source.load_result", lambda _: result)
    monkeypatch.setattr("pipeline.model.runs.load_result", lambda _: result)
    run.child(SNAPSHOT).write_bytes(b"{}")
    return run


def checkpoint_meta(**changes) -> CheckpointMeta:
    """The metadata of a small checkpoint of three classes, with `changes`."""
    fields = dict(
        epoch=4,
        classes=["a", "b", "c"],
        image_size=32,
        mean=(0.5, 0.5, 0.5),
        std=(0.2, 0.2, 0.2),
        dataset_fingerprint="f",
        dataset_version="20260101T000000000000Z-00000000",
        metrics={"epoch": 4},
        history=[{"epoch": 4, "val_accuracy": 0.5}],
        config={"epochs": 5, "checkpoint": {"metric": "val_accuracy"}},
    )
    return CheckpointMeta(**(fields | changes))


def errors_table(section: str) -> list[tuple[str, int, str]]:
    """The rows of a table in docs/errors.md's `## <section>`: (what, code, message start)."""
    page = (BUNDLE_ROOT / "docs" / "errors.md").read_text()
    text = page.split(f"## {section}\n", 1)[1].split("\n#", 1)[0]
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells[1].isdigit():
            rows.append((cells[0], int(cells[1]), cells[2].strip("`")))
    return rows


# --- each kind of model, trained in this process (test_models, test_export) -------------------

# The model.* settings of each architecture the bundle is tested with.
ARCHITECTURES = {
    "resnet18": ["model.name=resnet18"],
    "mobilenet_v3_small": ["model.name=mobilenet_v3_small"],
    "efficientnet_b0": ["model.name=efficientnet_b0"],
    "convnext_tiny": ["model.name=convnext_tiny"],
    # A small ViT, for 16 px squares: the stored 32 px images are resized to them on the device.
    "vit": ["model.name=timm/test_vit", "model.kwargs.img_size=16", "model.input.image_size=16"],
    "timm": ["model.name=timm/test_convnext"],
    "user": [f"model.name={USER_MODEL}", "model.kwargs.width=8"],
}


class OneWorker:
    """One worker of a run in this process, train_loop_per_worker in a local run context: its
    checkpoints go to `run_dir/<name>`; after a run, `context` holds what it reported and
    `model` the model it prepared."""

    def __init__(self, run_dir: Path):
        self.run_dir, self.context = run_dir, None

    @property
    def model(self):
        return self.context.model

    def run(self, cfg: TrainConfig, inputs: ModelInput, *, resume_from: str | None = None):
        """Train `cfg` to its end, in a fresh loop; `resume_from`: the checkpoint (a name in
        the run) the runner's record names, as Ray's would after a restart."""
        from pipeline.train.worker import train_loop_per_worker

        recorded = str(self.run_dir / resume_from) if resume_from else None
        self.context = keeping_model(recorded=recorded)
        train_loop_per_worker(worker_config(cfg, inputs, self.run_dir), self.context)


def loop_here(cfg: TrainConfig, run_dir: Path, context) -> None:
    """train_loop_per_worker of `cfg`'s run at `run_dir` in this process, in the run context
    `context`, the network fed at its dataset's stored size."""
    from pipeline.train.worker import train_loop_per_worker

    manifest = read_manifest(Location.parse(cfg.dataset))
    inputs = ModelInput(manifest.image_size, "bilinear", manifest.mean, manifest.std)
    train_loop_per_worker(worker_config(cfg, inputs, run_dir), context)


def worker_config(cfg: TrainConfig, inputs: ModelInput, run_dir: Path) -> dict:
    """train_loop_per_worker's `config` for `cfg`'s run at `run_dir`, as the driver builds it."""
    dataset = Location.parse(cfg.dataset)
    return {
        "config": cfg.model_dump(mode="json"),
        "dataset": dataset,
        "dataset_version": read_manifest(dataset).version,
        "model_input": inputs,
        "run_dir": Location.parse(str(run_dir)),
    }


def keeping_model(**fields):
    """A local run context (of `fields`) that keeps the model it prepares, as `model`."""
    from pipeline.train.context import LocalContext

    class KeepsModel(LocalContext):
        model = None

        def prepare_model(self, model):
            self.model = super().prepare_model(model)
            return self.model

    return KeepsModel(**fields)


class Stopped(Exception):
    """A loop stopped on purpose inside an epoch, as a worker killed there would be."""


def stopping_after(steps: int, **fields):
    """A local run context (of `fields`) that stops the loop after its `steps`-th step, before
    that step's checkpoint: the loop asks it for a preemption notice after each step (with
    checkpoint.every_steps), as every rank asks Ray."""
    from pipeline.train.context import LocalContext

    class StoppingAfter(LocalContext):
        asked = 0

        def preemption(self):
            self.asked += 1
            if self.asked > steps:
                raise Stopped(f"after step {steps}")
            return None

    return StoppingAfter(**fields)


def waiting_for_step_checkpoints(monkeypatch, directory: Path) -> None:
    """Each checkpoint inside an epoch on storage before the loop goes on: the fault point
    after it armed, as fired already (pipeline.core.faults), so the loop waits for the write and
    passes the point. A loop stopped after a step then leaves its last checkpoint whole."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / faults.STEP_CHECKPOINTED).write_text("fired")
    monkeypatch.setenv(faults.ENV, f"{faults.STEP_CHECKPOINTED}:{directory}")


def assert_same_state(checkpoint: Path, expected: Path) -> None:
    """The two checkpoints hold equal weights, bit for bit, and the same optimisation state
    (the optimizer's, the schedule, the scaler, the EMA, the generators) and position."""
    import torch

    from pipeline.model.checkpoint import load_train_state, load_weights

    got, want = Location.parse(str(checkpoint)), Location.parse(str(expected))
    weights, expected_weights = load_weights(got), load_weights(want)
    assert weights.keys() == expected_weights.keys()
    for name, tensor in weights.items():
        assert torch.equal(tensor, expected_weights[name]), name
    state, expected_state = load_train_state(got), load_train_state(want)
    assert_equal_tree(state["optim"], expected_state["optim"], "optim")
    position = ("epoch", "step", "global_step")
    assert [state["loop"][k] for k in position] == [expected_state["loop"][k] for k in position]


def assert_equal_tree(value, expected, where: str) -> None:
    """`value` equals `expected`, nested dicts, lists and tensors (bit for bit) alike."""
    import torch

    if isinstance(expected, torch.Tensor):
        assert isinstance(value, torch.Tensor) and torch.equal(value, expected), where
    elif isinstance(expected, dict):
        assert value.keys() == expected.keys(), where
        for key in expected:
            assert_equal_tree(value[key], expected[key], f"{where}.{key}")
    elif isinstance(expected, list | tuple):
        assert len(value) == len(expected), where
        for i, (v, e) in enumerate(zip(value, expected, strict=True)):
            assert_equal_tree(v, e, f"{where}[{i}]")
    else:
        assert value == expected, where


def small_run_config(dataset: Path, storage: Path, *overrides: str) -> TrainConfig:
    """A one-worker run on `small_dataset`: steps of 8 images, plain SGD."""
    return load_config(
        TrainConfig,
        None,
        [
            f"dataset={dataset}",
            f"storage_path={storage}",
            "global_batch_size=8",
            "scaling.num_workers=1",
            "scaling.loader_workers=0",
            # Plain SGD: no optimizer state as large as the model to save and load.
            "optimizer.momentum=0",
            "optimizer.lr=0.01",
            "augment=crop_flip",
            *overrides,
        ],
    )


# Loaded where `pipeline` can come from the model's code alone: this file, first on PYTHONPATH,
# drops the finder of the bundle's editable install (a .pth in the venv), and writes where
# `pipeline` is found to $PIPELINE_FOUND_AT, in every process that imports it.
SITECUSTOMIZE = """
import os
import sys
from importlib.machinery import PathFinder

sys.meta_path[:] = [
    f for f in sys.meta_path if not getattr(f, "__module__", "").startswith("__editable__")
]


class Witness:
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name != "pipeline":
            return None
        spec = PathFinder.find_spec(name, path)
        with open(os.environ["PIPELINE_FOUND_AT"], "a") as f:
            f.write(f"{spec.origin if spec else None}\\n")
        return spec


sys.meta_path.insert(0, Witness)
"""


def bundle_hidden_env(tmp_path: Path) -> dict[str, str]:
    """An environment where the bundle is not importable (SITECUSTOMIZE), with the venv's
    tools on PATH; processes that import `pipeline` write where they found it to
    tmp_path/found."""
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = {
        "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin",
        "HOME": str(tmp_path),
        "TMPDIR": str(tmp_path),  # where MLflow downloads the model
        "PYTHONPATH": str(tmp_path / "site"),
        "PIPELINE_FOUND_AT": str(tmp_path / "found"),
    }
    proc = subprocess.run(
        [sys.executable, "-c", "import pipeline"], cwd=tmp_path, env=env, capture_output=True
    )
    assert b"No module named 'pipeline'" in proc.stderr, proc.stderr
    (tmp_path / "found").unlink()
    return env


# --- the online classifier (tests/unit/test_serve_app.py, tests/ray/test_serve.py) ------------

# The Serve app's max_request_bytes in the tests: small enough for a test to exceed at once,
# large enough for the test images (a few KiB).
MAX_REQUEST_BYTES = 100_000


def truncated_jpeg() -> bytes:
    data = jpeg_bytes(CLASSES[0], 999, size=64)
    return data[: len(data) // 2]


def decompression_bomb() -> bytes:
    """144 M pixels, past PIL's safety limit, in a 1-bit PNG of a few KiB."""
    from PIL import Image

    buf = io.BytesIO()
    Image.new("1", (12_000, 12_000)).save(buf, format="PNG")
    assert len(buf.getvalue()) < MAX_REQUEST_BYTES
    return buf.getvalue()


# What docs/errors.md's serving table lists: the request, its status, how the message starts,
# and the body that makes it (None: a PUT).
BAD_REQUESTS = [
    ("an empty body", 400, "empty request body", lambda: b""),
    ("a body that is no image", 415, "not an image (unrecognised format)", lambda: b"hello\n"),
    ("a truncated image", 400, "truncated or corrupt image", truncated_jpeg),
    (
        "a body over `max_request_bytes`",
        413,
        "request body larger than max_request_bytes=<n>",
        lambda: b"\xff" * (MAX_REQUEST_BYTES + 1),
    ),
    ("an image too large to decode safely", 413, "too large to decode safely", decompression_bomb),
    ("a method other than POST or GET", 405, "PUT is not served here", None),
]


def serve_checkpoints(tmp_path_factory) -> dict[str, Path]:
    """Two untrained checkpoints of CLASSES, different weights: "a" is deployed first, "b"
    rolled out."""
    import torch

    from pipeline.model.checkpoint import save_checkpoint
    from pipeline.model.networks import build_model

    paths = {}
    for seed, name in enumerate("ab"):
        path = tmp_path_factory.mktemp(f"checkpoint_{name}")
        torch.manual_seed(seed)
        meta = checkpoint_meta(classes=list(CLASSES))
        save_checkpoint(path, build_model(len(CLASSES)).eval().state_dict(), meta, {})
        paths[name] = path
    return paths


def registered_version(checkpoint: Path, server, name: str) -> str:
    """`checkpoint` logged and registered as the train job registers its best checkpoint,
    version 1 of model `name` in `server` (a harness.mlflow_server.MLflowServer), with the alias
    `production`: its URI."""
    from pipeline.tracking.client import connect
    from pipeline.tracking.registry import log_best_model

    conn = connect(server.uri, name)
    run_id = conn.client.create_run(conn.experiment_id).info.run_id
    log_best_model(conn, run_id, Location.parse(str(checkpoint)), name)
    conn.client.set_registered_model_alias(name, "production", "1")
    return f"models:/{name}@production"
