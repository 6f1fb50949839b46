"""Every bad input the table in docs/errors.md lists: its exit code and the start of its message.

Each case runs in the test process without Ray (the library call the job makes, raising the
error that `failure` turns into the job's exit code and `error:` line), or through the command
line itself (`python -m jobs.<job>` or the chain, asserting its exit code, one `error:` line and
no traceback: before any Ray call, or as a driver connected to a Ray instance where
`on_cluster`), or names the test that runs it as a job on a cluster. The tests:
tests/unit/test_bad_inputs.py, which also checks the docs' table against this list so that the
two cannot drift apart, and tests/ray/test_bad_inputs_on_a_driver.py."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import pyarrow.fs as pafs
import ray.train
import ray.train.torch
import torch
import torchvision
from corpus import damage_footer, damage_page_header, damage_stored_image, rewrite_shard
from helpers import checkpoint_meta, make_image_folder

from harness.cluster import BUNDLE_ROOT, free_port
from harness.counting import FlakyHandler
from pipeline.chain.plan import check_py_modules, plan
from pipeline.core.config import load_config
from pipeline.core.storage import Location
from pipeline.data.config import FolderSourceConfig, PreprocessConfig
from pipeline.data.dataset import VERSIONS, check_replaceable, read_manifest
from pipeline.data.preprocess import process_items
from pipeline.data.sources import FolderSource
from pipeline.export import formats
from pipeline.export.config import ExportConfig
from pipeline.export.exporter import check_output, export, export_checkpoint, parity_dataset
from pipeline.infer.batch import infer, resolve_checkpoint
from pipeline.infer.config import InferConfig
from pipeline.infer.inputs import list_input
from pipeline.infer.predictions import publish, start_version
from pipeline.infer.sink import Tally
from pipeline.model.checkpoint import (
    CHECKPOINT_FORMAT,
    METADATA,
    WEIGHTS,
    check_weights,
    read_meta,
    save_checkpoint,
    served_weights,
)
from pipeline.model.resume import resume_changes
from pipeline.model.run_status import mark_training
from pipeline.model.runs import RUN_FORMAT, RUN_SUMMARY, SNAPSHOT
from pipeline.model.source import trained_version
from pipeline.tracking import training_tracker
from pipeline.train import run_lock
from pipeline.train.config import TrainConfig
from pipeline.train.driver import fit
from pipeline.train.input.decoding import Decoded
from pipeline.train.input.rows import RowGroupStream, StreamSpec
from pipeline.train.preflight import (
    check_dataset,
    check_hooks,
    check_model,
    pick_dataset_version,
)
from pipeline.tune.config import SweepConfig
from pipeline.tune.sweep import pinned_version, sweep


@dataclass
class Case:
    what: str  # the bad input, as the docs' table says it
    exit_code: int
    message: str  # how the message starts; <...> stands for a path or a value
    run: Callable | None = None  # run(tmp_path, tiny_dataset) raises it ...
    test: str = ""  # ... or this test runs it as a job: tests/<file>.py::<test>
    # ... and/or cli(tmp_path, tiny_dataset) -> command lines (`python -m` <argv>) that meet it,
    # run as drivers connected to a Ray instance where `on_cluster`, else before any Ray call.
    cli: Callable | None = None
    on_cluster: bool = False

    def pattern(self) -> str:
        parts = re.split(r"<[^>]+>", self.message)
        return ".+?".join(re.escape(p) for p in parts)


def train_config(tmp_path, dataset, *overrides) -> TrainConfig:
    args = [f"dataset={dataset}", f"storage_path={tmp_path}/runs", *overrides]
    return load_config(TrainConfig, None, args)


def written(tmp_path, data: bytes) -> str:
    (tmp_path / "c.yaml").write_bytes(data)
    return str(tmp_path / "c.yaml")


def config_file(data: bytes):
    def run(tmp_path, _):
        load_config(PreprocessConfig, written(tmp_path, data))

    return run


def config_file_given(data: bytes):
    return lambda t, _: [["jobs.preprocess", "--config", written(t, data)]]


def train_args(tmp_path, dataset, *overrides) -> list[str]:
    return ["jobs.train", f"dataset={dataset}", f"storage_path={tmp_path}/runs", *overrides]


def chain_args(root, *args) -> list[str]:
    address = f"http://127.0.0.1:{free_port()}"  # where nothing answers
    # Tried again for 1 s, not the default minute, where a cluster may yet come up.
    return ["jobs.submit", "--address", address, "--root", str(root), "--submit-timeout-s=1", *args]


def checked_dataset(tmp_path, dataset, *overrides):
    cfg = train_config(tmp_path, dataset, *overrides)
    root = Location.parse(cfg.dataset)
    check_dataset(cfg, root, read_manifest(root).version)


def damaged(tmp_path, dataset):
    shutil.copytree(dataset, tmp_path / "d")
    next((tmp_path / "d").glob("data/*/train/*.parquet")).unlink()
    checked_dataset(tmp_path, tmp_path / "d")


def damaged_copy(tmp_path, dataset, split: str, *, cut: bool) -> Path:
    """A copy of `dataset` with a shard of `split` cut short (`cut`) or gone."""
    copy = tmp_path / f"{split}-{'cut' if cut else 'gone'}"
    shutil.copytree(dataset, copy)
    shard = next(copy.glob(f"data/*/{split}/*.parquet"))
    if cut:
        os.truncate(shard, shard.stat().st_size // 2)
    else:
        shard.unlink()
    return copy


def damaged_val_shard(tmp_path, dataset, *damages) -> None:
    """Reads the val split of a copy of `dataset` as training does, with `damages` (each a
    function of a shard's path) done to its first shard."""
    shutil.copytree(dataset, tmp_path / "d")
    for damage in damages:
        damage(next((tmp_path / "d").glob("data/*/val/*.parquet")))
    root = Location.parse(str(tmp_path / "d"))
    rows = RowGroupStream(root, read_manifest(root), "val", StreamSpec(batch_size=16))
    list(Decoded(rows))


def damaged_row_group(tmp_path, dataset):
    damaged_val_shard(tmp_path, dataset, lambda shard: damage_page_header(shard, 0))


def damaged_image_unchecked(tmp_path, dataset):
    damaged_val_shard(
        tmp_path,
        dataset,
        lambda shard: rewrite_shard(shard, page_checksums=False),
        lambda shard: damage_stored_image(shard, 0, 1),
    )


def damaged_footer(tmp_path, dataset):
    damaged_val_shard(tmp_path, dataset, damage_footer)


def label_of_no_class(tmp_path, dataset):
    damaged_val_shard(
        tmp_path, dataset, lambda shard: rewrite_shard(shard, page_checksums=True, label=(3, 4))
    )


def damaged_shards(tmp_path, dataset):
    # The train job, inference and the export's parity check, each on its own damage.
    checkpoint = fake_checkpoint(tmp_path)
    return [
        train_args(tmp_path, damaged_copy(tmp_path, dataset, "train", cut=True)),
        [
            "jobs.infer",
            f"model={checkpoint}",
            f"input={damaged_copy(tmp_path, dataset, 'val', cut=False)}",
            f"output={tmp_path}/p",
        ],
        [
            "jobs.export",
            f"model={checkpoint}",
            f"dataset={damaged_copy(tmp_path, dataset, 'val', cut=True)}",
        ],
    ]


def fake_checkpoint(tmp_path, *, cut: bool = False) -> Path:
    """A checkpoint directory of checkpoint_meta() whose weights file is whole, or cut short."""
    directory = tmp_path / ("cut-checkpoint" if cut else "checkpoint")
    directory.mkdir()
    (directory / METADATA).write_text(checkpoint_meta().model_dump_json())
    torch.save({"w": torch.zeros(4096)}, directory / WEIGHTS)
    if cut:
        os.truncate(directory / WEIGHTS, (directory / WEIGHTS).stat().st_size // 2)
    return directory


def checkpoint_naming(tmp_path, name: str, **kwargs) -> Path:
    """A checkpoint directory whose metadata names the model `name` with builder `kwargs`."""
    directory = tmp_path / "named"
    directory.mkdir()
    meta = checkpoint_meta(model={"name": name, "kwargs": kwargs})
    (directory / METADATA).write_text(meta.model_dump_json())
    torch.save({}, directory / WEIGHTS)
    return directory


def inferred_with_hub_checkpoint(tmp_path, dataset):
    # What the infer job's driver does before any predictor actor loads the checkpoint.
    checkpoint = checkpoint_naming(tmp_path, "torch.hub:load", repo_or_dir=str(tmp_path))
    inferred(checkpoint, dataset, tmp_path / "p")


def inferred_onto_another_inputs_output(tmp_path, dataset):
    # An output that holds the committed predictions of a folder of photos; the dataset's val
    # split would replace them.
    output = tmp_path / "p"
    output.mkdir()
    (output / "summary.json").write_text(json.dumps({"input": str(tmp_path / "photos")}))
    inferred(checkpoint_naming(tmp_path, "resnet18"), dataset, output)


def inferred(model, dataset, output) -> None:
    """The infer job's library call: `model` classifies `dataset` into `output`."""
    args = [f"model={model}", f"input={dataset}", f"output={output}"]
    cfg = load_config(InferConfig, None, args)
    infer(
        cfg,
        model=Location.parse(cfg.model),
        source=Location.parse(cfg.input),
        output=Location.parse(cfg.output),
    )


def exported_with_timm_loading(tmp_path, _):
    checkpoint = checkpoint_naming(tmp_path, "timm/resnet18", pretrained=True)
    cfg = load_config(ExportConfig, None, [f"model={checkpoint}"])
    output = Location.parse(str(tmp_path / "export"))
    export_checkpoint(cfg, checkpoint=Location.parse(str(checkpoint)), output=output)


def cut_weights(tmp_path, _):
    checkpoint = fake_checkpoint(tmp_path, cut=True)
    check_weights(Location.parse(str(checkpoint)), checkpoint_meta())


def cut_weights_given(tmp_path, dataset):
    checkpoint = fake_checkpoint(tmp_path, cut=True)
    return [
        ["jobs.infer", f"model={checkpoint}", f"input={dataset}", f"output={tmp_path}/p"],
        ["jobs.export", f"model={checkpoint}", f"dataset={dataset}"],
    ]


def resumed_on_another_version(tmp_path, dataset):
    cfg = train_config(tmp_path, dataset)
    pick_dataset_version(cfg, Location.parse(str(dataset)), checkpoint_meta(), run="r")


def png_dataset_decoded_on_gpu(tmp_path, dataset):
    png = tmp_path / "png"
    shutil.copytree(dataset, png)
    for path in (png / VERSIONS).glob("*.json"):
        path.write_text(json.dumps(json.loads(path.read_text()) | {"image_format": "png"}))
    root = Location.parse(str(png))
    check_dataset(train_config(tmp_path, png, "decode=gpu"), root, read_manifest(root).version)


def model_checked(tmp_path, dataset, *overrides):
    cfg = train_config(tmp_path, dataset, *overrides)
    root = Location.parse(cfg.dataset)
    check_model(cfg, read_manifest(root), root)


def weights_of_another_model(tmp_path, dataset):
    torch.save(torchvision.models.mobilenet_v3_small().state_dict(), tmp_path / "m.pt")
    model_checked(tmp_path, dataset, f"model.weights={tmp_path / 'm.pt'}")


def user_model(source: str):
    """A model.name of a module:function whose module holds `source`."""

    def run(tmp_path, dataset):
        module = f"user_model_{uuid.uuid4().hex}"
        (tmp_path / f"{module}.py").write_text(source)
        sys.path.insert(0, str(tmp_path))
        try:
            model_checked(tmp_path, dataset, f"model.name={module}:build")
        finally:
            sys.path.remove(str(tmp_path))

    return run


def hooks_checked(tmp_path, dataset, *overrides):
    cfg = train_config(tmp_path, dataset, *overrides)
    check_hooks(cfg, read_manifest(Location.parse(cfg.dataset)))


def balanced_without_a_class(tmp_path, dataset):
    manifest = read_manifest(Location.parse(str(dataset)))
    counts = dict(manifest.splits["train"].counts)
    counts.pop(manifest.classes[-1])
    train = manifest.splits["train"].model_copy(update={"counts": counts})
    lacking = manifest.model_copy(update={"splits": {**manifest.splits, "train": train}})
    check_hooks(train_config(tmp_path, dataset, "class_weights=balanced"), lacking)


def own_hook(tmp_path, dataset, key: str, source: str):
    """The train config's `key` (loss, augment, metrics) as module:function of a module that
    holds `source`, checked on the driver."""
    module = f"user_hook_{uuid.uuid4().hex}"
    (tmp_path / f"{module}.py").write_text(source)
    sys.path.insert(0, str(tmp_path))
    setting = f"metrics=[{module}:hook]" if key == "metrics" else f"{key}={module}:hook"
    extra = ["checkpoint.metric=val_hook"] if key == "metrics" else []
    try:
        hooks_checked(tmp_path, dataset, setting, *extra)
    finally:
        sys.path.remove(str(tmp_path))


def changed_optimizer(tmp_path, dataset):
    old = train_config(tmp_path, dataset).model_dump(mode="json")
    resume_changes(old, train_config(tmp_path, dataset, "optimizer.name=adamw"))


def changed_metric(tmp_path, dataset):
    old = train_config(tmp_path, dataset, "checkpoint.metric=val_accuracy").model_dump(mode="json")
    resume_changes(old, train_config(tmp_path, dataset, "checkpoint.metric=val_loss"))


def foreign_output(tmp_path, _):
    (tmp_path / "out" / "data" / "01_raw").mkdir(parents=True)
    check_replaceable(Location.parse(str(tmp_path / "out")), overwrite=False)


def unreadable_manifest(tmp_path, _):
    (tmp_path / VERSIONS).mkdir()
    (tmp_path / VERSIONS / "20240101T000000000000Z-0badc0de.json").write_text("{}")
    read_manifest(Location.parse(str(tmp_path)))


def source_image(error: OSError, *, gone: bool = False):
    def run(tmp_path, _):
        make_image_folder(tmp_path / "src", per_class=1, corrupt=False)
        source = FolderSource(FolderSourceConfig(path=str(tmp_path / "src")))
        handler = FlakyHandler(pafs.LocalFileSystem(), tmp_path / "r", error=error, failures=99)
        if not gone:
            source.root = Location(pafs.PyFileSystem(handler), source.root.path, source.root.uri)
        items = source.list_items()
        if gone:
            (tmp_path / "src" / items[0].source_id).unlink()
        cfg = load_config(PreprocessConfig, overrides=[f"output={tmp_path}/out"])
        process_items(cfg, source.classes, items, source)

    return run


def empty_class(tmp_path, _):
    (tmp_path / "src" / "cats").mkdir(parents=True)
    FolderSource(FolderSourceConfig(path=str(tmp_path / "src"))).list_items()


def checkpoint_of(name: str):
    def run(tmp_path, _):
        (tmp_path / "run").mkdir()
        resolve_checkpoint(Location.parse(str(tmp_path / name)))

    return run


def newer_checkpoint(tmp_path, _):
    save_checkpoint(tmp_path, {}, checkpoint_meta(), {})
    meta = json.loads((tmp_path / METADATA).read_text()) | {"format": CHECKPOINT_FORMAT + 1}
    (tmp_path / METADATA).write_text(json.dumps(meta | {"calibration": {"temperature": 1.3}}))
    read_meta(resolve_checkpoint(Location.parse(str(tmp_path))))


def unranked_checkpoint(tmp_path, _):
    save_checkpoint(tmp_path, {}, checkpoint_meta(), {})
    meta = json.loads((tmp_path / METADATA).read_text()) | {"config": {"epochs": 5}}
    (tmp_path / METADATA).write_text(json.dumps(meta))
    read_meta(resolve_checkpoint(Location.parse(str(tmp_path))))


def older_checkpoint(tmp_path, _):
    save_checkpoint(tmp_path, {}, checkpoint_meta(), {})
    meta = json.loads((tmp_path / METADATA).read_text()) | {"format": CHECKPOINT_FORMAT - 1}
    (tmp_path / METADATA).write_text(json.dumps(meta))
    read_meta(resolve_checkpoint(Location.parse(str(tmp_path))))


def newer_run(tmp_path, _):
    (tmp_path / SNAPSHOT).write_bytes(b"{}")
    summary = {"format": RUN_FORMAT + 1, "status": "finished", "checkpoint_metric": "val_loss"}
    (tmp_path / RUN_SUMMARY).write_text(json.dumps(summary))
    resolve_checkpoint(Location.parse(str(tmp_path)))


def held_run(tmp_path, dataset):
    """A train job's run that another live train job holds (pipeline.train.run_lock)."""
    run = Location.parse(str(tmp_path / "runs" / "r"))
    os.makedirs(run.path)
    holder = {"job_id": "01000000", "started_ms": 1, "submission_id": "raysubmit_first"}
    run.child(run_lock.LOCK).write_bytes(json.dumps({**holder, "host": "h", "since": 0}).encode())
    me = {"job_id": "02000000", "started_ms": 2, "submission_id": None}
    run_lock.take(run, me, lambda job: job["job_id"] == "01000000", ending_s=0)


def training_run(tmp_path, _):
    run = Location.parse(str(tmp_path / "run"))
    run.child(SNAPSHOT).write_bytes(b"{}")
    mark = mark_training(run)
    try:
        resolve_checkpoint(run)
    finally:
        mark.release(restore=False)


def run_left_training(tmp_path, _):
    # What a train job of before heartbeats left when it was stopped: a marker and no more.
    run = Location.parse(str(tmp_path / "run"))
    run.child(SNAPSHOT).write_bytes(b"{}")
    marker = {"run": run.uri, "status": "training", "since": 1767225600.0}
    run.child(RUN_SUMMARY).write_bytes(json.dumps(marker).encode())
    resolve_checkpoint(run)


def replaced_predictions(tmp_path, _):
    # Two runs on one output; the newer, of another checkpoint, commits first.
    output = Location.parse(str(tmp_path / "out"))
    older, newer = start_version(output), start_version(output)
    publish(output, newer, Tally.empty(1), {"checkpoint": "b", "input": "in"}, None)
    publish(output, older, Tally.empty(1), {"checkpoint": "a", "input": "in"}, None)


def run_as_inference_output(tmp_path, dataset):
    # The training run's own directory: a commit there would replace its summary.json.
    run = tmp_path / "run"
    (run / "epoch_0000").mkdir(parents=True)
    (run / SNAPSHOT).write_text("{}")
    (run / RUN_SUMMARY).write_text('{"status": "finished"}')
    inferred(run, dataset, run)


def foreign_export_output(tmp_path, _):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    check_output(Location.parse(str(tmp_path / "out")), Location.parse(str(tmp_path)), "raw")


class Branching(torch.nn.Module):
    """A network with no single graph: which branch runs depends on the input's values."""

    def forward(self, x):
        return x.flatten(1)[:, :3] if x.mean() > 0 else -x.flatten(1)[:, :3]


DROPPED = OSError("AWS Error NETWORK_CONNECTION during GetObject operation: curlCode: 28")


def sweep_config(tmp_path, dataset, *overrides) -> SweepConfig:
    return load_config(SweepConfig, None, sweep_args(tmp_path, dataset, *overrides)[1:])


def sweep_args(tmp_path, dataset, *overrides) -> list[str]:
    return ["jobs.tune", f"dataset={dataset}", f"storage_path={tmp_path}/runs", *overrides]


def sweep_over_a_run(tmp_path, dataset):
    (tmp_path / "runs" / "sweep").mkdir(parents=True)
    (tmp_path / "runs" / "sweep" / SNAPSHOT).write_text("{}")
    cfg = sweep_config(tmp_path, dataset)
    sweep(cfg, dataset=Location.parse(str(dataset)), runs=Location.parse(f"{tmp_path}/runs"))


def sweep_resumed_with(tmp_path, dataset, *changes):
    # The sweep's first start records its config and pins the dataset version: a resume must
    # match it. (Neither needs Ray: both come before the Tuner.)
    dataset, sweep_dir = Location.parse(str(dataset)), Location.parse(f"{tmp_path}/runs/sweep")
    pinned_version(sweep_config(tmp_path, dataset.uri, "num_samples=2"), dataset, sweep_dir)
    pinned_version(sweep_config(tmp_path, dataset.uri, *changes), dataset, sweep_dir)


def tracked_by(uri: str):
    def run(tmp_path, dataset):
        training_tracker(train_config(tmp_path, dataset, f"tracking.uri={uri}"))

    return run


# What Ray Train's NCCL RAS hang detector raises (ray.train.NCCLHangError), once the retries
# of its failure policy are used up: its message's first lines.
NCCL_HANG = (
    "1 of 1 communicators have a collective mismatch and made no progress for 600 seconds "
    "(60 polls). This usually means that the collective is deadlocked / hanging. The possible "
    "reasons for this is: a rank hit a divergent code path.\nTo debug:\n"
)


def nccl_hang_in_fit(tmp_path, dataset):
    # No NCCL here: a stand-in trainer raises what Ray Train's fit() raises.
    class Hung:
        def __init__(self, *args, **kwargs):
            pass

        def fit(self):
            raise ray.train.NCCLHangError(NCCL_HANG, worker_failures={})

    cfg, dataset = train_config(tmp_path, dataset), Location.parse(str(dataset))
    runs = Location.parse(f"{tmp_path}/runs")
    with mock.patch.object(ray.train.torch, "TorchTrainer", Hung), mock.patch.dict(os.environ):
        fit(cfg, read_manifest(dataset), None, dataset=dataset, runs=runs)


CASES = [
    # Configs: exit 2.
    Case(
        "a config file that does not exist",
        2,
        "config file <path> does not exist",
        lambda t, _: load_config(PreprocessConfig, t / "nope.yaml"),
        cli=lambda t, _: [["jobs.train", "--config", str(t / "nope.yaml")]],
    ),
    Case(
        "a config file that is not YAML",
        2,
        "config file <path> is not valid YAML",
        config_file(b"image_size: [64"),
        cli=config_file_given(b"image_size: [64"),
    ),
    Case(
        "a config file that is not UTF-8 text",
        2,
        "config file <path> is not UTF-8 text",
        config_file(b"name: caf\xe9\n"),  # Latin-1
        cli=config_file_given(b"name: caf\xe9\n"),
    ),
    Case(
        "a directory given as a config file",
        2,
        "config file <path> is a directory",
        lambda t, _: load_config(PreprocessConfig, t),
        cli=lambda t, _: [["jobs.infer", "--config", str(t)]],
    ),
    Case(
        "an override without `=`",
        2,
        "override 'epochs' must look like key=value",
        lambda t, d: load_config(TrainConfig, None, ["epochs"]),
        cli=lambda t, d: [train_args(t, d, "epochs")],
    ),
    Case(
        "an override whose value is not YAML (quote a string that is no YAML)",
        2,
        "override '<key=value>': the value is not valid YAML",
        lambda t, d: load_config(PreprocessConfig, None, ["image_size=[1,"]),
        cli=lambda t, d: [
            ["jobs.preprocess", "image_size=[1,"],
            ["jobs.infer", "tracking.experiment=*abc"],
            ["jobs.preprocess", "source.kind=@foo"],
            chain_args(t, "--set", "train.epochs=[1,", "all"),
        ],
    ),
    Case(
        "a path of a URI scheme that no filesystem opens (`foo://`, `S3://`)",
        2,
        "invalid config (<where>): <key>: no filesystem opens URIs of the scheme <scheme>",
        lambda t, _: load_config(PreprocessConfig, None, ["output=foo://bar"]),
        cli=lambda t, d: [
            ["jobs.preprocess", "output=foo://bar"],
            ["jobs.preprocess", "output=S3://bucket/data"],
            ["jobs.infer", "model=s4://bucket/run", f"input={d}"],
            train_args(t, d, "storage_path=Gs://bucket/runs"),
        ],
    ),
    Case(
        "an unknown key, or a value of the wrong type or range",
        2,
        "invalid config (<where>): epochs: Input should be a valid integer",
        lambda t, d: train_config(t, d, "epochs=many"),
        cli=lambda t, d: [train_args(t, d, "epochs=many")],
    ),
    Case(
        "a global batch that does not split over the workers",
        2,
        "invalid config (<where>): global_batch_size=32 does not split evenly",
        lambda t, d: train_config(t, d, "global_batch_size=32", "scaling.num_workers=3"),
    ),
    Case(
        "a dataset with fewer train images than one step's global batch",
        1,
        "dataset <path> has <n> train images, fewer than one step of global_batch_size=<n>",
        lambda t, d: checked_dataset(t, d, "global_batch_size=512"),
    ),
    Case(
        "a global batch of fewer than 2 images per worker",
        2,
        "invalid config (<where>): global_batch_size=2 gives a worker fewer than 2 images",
        lambda t, d: train_config(t, d, "global_batch_size=2"),
    ),
    Case(
        "a micro-batch size that does not divide a worker's share of the global batch",
        2,
        "invalid config (<where>): micro_batch_size=<n> does not divide each worker's share",
        lambda t, d: train_config(t, d, "global_batch_size=32", "micro_batch_size=5"),
    ),
    Case(
        "a negative seed",
        2,
        "invalid config (<where>): seed: Input should be greater than or equal to 0",
        lambda t, d: train_config(t, d, "seed=-1"),
        cli=lambda t, d: [train_args(t, d, "seed=-1")],
    ),
    Case(
        "a chain `--set` that names no step",
        2,
        "--set 'epochs=3': must start with one of",
        lambda t, _: plan(str(t), sets=["epochs=3"]),
        cli=lambda t, _: [chain_args(t, "--set", "epochs=3", "all")],
    ),
    Case(
        "a chain `--recipe` the bundle does not ship",
        2,
        "--recipe '<name>': no such recipe; the bundle has",
        lambda t, _: plan(str(t), recipe="fast"),
        cli=lambda t, _: [chain_args(t, "--recipe", "fast", "all")],
    ),
    Case(
        "a chain `--root` of a URI scheme that no filesystem opens",
        2,
        "--root <uri>: no filesystem opens URIs of the scheme <scheme>",
        lambda t, _: plan("S3://bucket/ray-cv"),
        cli=lambda t, _: [chain_args("S3://bucket/ray-cv", "all")],
    ),
    Case(
        "a chain `--py-module` that is no folder, .whl file or URI",
        2,
        "--py-module <path>: no such path; give your package's folder",
        lambda t, _: check_py_modules([str(t / "nowhere")]),
        cli=lambda t, _: [chain_args(t, "--py-module", str(t / "nowhere"), "all")],
    ),
    Case(
        "a resume with another optimizer, or to or from fp16",
        2,
        "this run cannot resume with these changes:",
        changed_optimizer,
    ),
    Case(
        "a resume with another `checkpoint.metric`",
        2,
        "this run cannot resume with these changes:\n  checkpoint.metric: val_accuracy -> "
        "val_loss (the checkpoints kept so far were chosen by the run's metric",
        changed_metric,
    ),
    Case(
        "a train job of a run that another train job still trains (wait for it, or "
        "`ray job stop <id>` it and submit again to resume)",
        2,
        "run <path> is being trained by train job <id> (on <host> since <time>)",
        held_run,
    ),
    Case(
        "an inference `model=` run that a train job trains again",
        2,
        "model=<path> is a run that a train job has been training again since",
        training_run,
    ),
    Case(
        "an inference `model=` run whose train job ended while training it again, of before "
        "heartbeats",
        1,
        "run <path> has been trained again since <time> by a train job it does not name; that "
        "job has ended without finishing it",
        run_left_training,
    ),
    Case(
        "a `checkpoint.metric` the bundle does not rank by: none of val_loss, val_accuracy, last "
        "or val_<name> of a `metrics` entry",
        2,
        "invalid config (<where>): checkpoint.metric=<name>: use val_loss, val_accuracy, last",
        lambda t, d: train_config(t, d, "checkpoint.metric=val_top5"),
    ),
    Case(
        "a `metrics` entry that is no metric's name nor module:function",
        2,
        "invalid config (<where>): metrics.0: unknown metric <name>: use top<k>_accuracy",
        lambda t, d: train_config(t, d, "metrics=[f1]"),
    ),
    Case(
        "two `metrics` entries that report the same `val_<name>` (`per_class_recall` reports "
        "`val_recall`, a `module:function` metric its function's name)",
        2,
        "invalid config (<where>): metrics: <entries> report the same val_<name>",
        lambda t, d: train_config(t, d, "metrics=[per_class_recall, my_metrics:recall]"),
    ),
    Case(
        "a `metrics` entry that would report as the job's own `val_images`, `val_loss` or "
        "`val_accuracy`",
        2,
        "invalid config (<where>): metrics: <entry> would report as val_<name>, the job's own",
        lambda t, d: train_config(t, d, "metrics=[my_metrics:images]"),
    ),
    Case(
        "`class_weights` of another count than the dataset's classes",
        2,
        "class_weights has <n> weights and the dataset <n> classes",
        lambda t, d: hooks_checked(t, d, "class_weights=[1, 2]"),
    ),
    Case(
        "`class_weights: balanced` where the train split has no rows of a class",
        1,
        "class_weights=balanced: the train split has no rows of class <name>",
        balanced_without_a_class,
    ),
    Case(
        "`optimizer.label_smoothing` with your own `loss`",
        2,
        "invalid config (<where>): optimizer.label_smoothing applies to the built-in "
        "cross-entropy, and loss=<name> replaces it",
        lambda t, d: train_config(t, d, "loss=my_loss:focal", "optimizer.label_smoothing=0.1"),
    ),
    Case(
        "your own `augment` with `decode: gpu`",
        2,
        "invalid config (<where>): augment=<name> runs on decoded images in the DataLoader "
        "processes",
        lambda t, d: train_config(t, d, "augment=my_augment:build", "decode=gpu"),
    ),
    Case(
        "a `module:function` loss, metric or augment whose module is not there",
        2,
        "loss=<name>: there is no module <module>",
        lambda t, d: hooks_checked(t, d, "loss=examples.no_such_module:focal"),
    ),
    Case(
        "a `module:function` loss, metric or augment that fails when called",
        2,
        "loss: <name>(num_classes=, class_weights=) failed: <error>",
        lambda t, d: own_hook(t, d, "loss", "def hook(num_classes):\n    pass\n"),
    ),
    Case(
        "your own augment that does not give uint8 images of the stored size",
        2,
        "augment=<name> must return uint8 (3, <n>, <n>) images",
        lambda t, d: own_hook(
            t,
            d,
            "augment",
            "from torchvision.transforms import v2\n\n\ndef hook(image_size):\n"
            "    return v2.Resize(image_size // 2)\n",
        ),
    ),
    Case(
        "`checkpoint.metric` of your own Metric whose `higher_is_better` is None, without "
        "`checkpoint.mode`",
        2,
        "checkpoint.metric=<name>: <hook>'s Metric has higher_is_better=None: set "
        "checkpoint.mode=max or min",
        lambda t, d: own_hook(
            t,
            d,
            "metrics",
            "from torchmetrics.classification import MulticlassAccuracy\n\n\n"
            "class Unordered(MulticlassAccuracy):\n    higher_is_better = None\n\n\n"
            "def hook(num_classes):\n    return Unordered(num_classes)\n",
        ),
    ),
    Case(
        "`checkpoint.metric` of your own Metric that computes one value per class",
        2,
        "checkpoint.metric=<name>: <hook>'s Metric computes one value per class",
        lambda t, d: own_hook(
            t,
            d,
            "metrics",
            "from torchmetrics.classification import MulticlassRecall\n\n\n"
            "def hook(num_classes):\n    return MulticlassRecall(num_classes, average='none')\n",
        ),
    ),
    Case(
        "a checkpoint or run ranked by a `val_<name>` of your own whose `checkpoint.mode` is not "
        "recorded: inference, serving, export and the MLflow model refuse it",
        1,
        "checkpoint.metric=<name> is recorded with checkpoint.mode=<mode>, so which of its "
        "values is best is unknown",
        lambda t, d: served_weights(
            checkpoint_meta(config={"metrics": ["my:f1"], "checkpoint": {"metric": "val_f1"}})
        ),
    ),
    Case(
        "`checkpoint.every_steps` with `ingest: ray_data`",
        2,
        "invalid config (<where>): checkpoint.every_steps needs ingest=torch",
        lambda t, d: train_config(t, d, "checkpoint.every_steps=100", "ingest=ray_data"),
        cli=lambda t, d: [train_args(t, d, "checkpoint.every_steps=100", "ingest=ray_data")],
    ),
    Case(
        "`decode: gpu` with `ingest: ray_data`",
        2,
        "invalid config (<where>): decode=gpu needs ingest=torch",
        lambda t, d: train_config(t, d, "decode=gpu", "ingest=ray_data"),
    ),
    Case(
        "a sweep `space` key the train config does not have",
        2,
        "invalid config (<where>): space.<key>: unknown key of the train config",
        lambda t, d: sweep_config(t, d, "space.optimizer.rate={choice: [0.1, 0.01]}"),
        cli=lambda t, d: [sweep_args(t, d, "space.optimizer.rate={choice: [0.1, 0.01]}")],
    ),
    Case(
        "a sweep `space` key the sweep sets for every trial (`name`, `dataset`, ...)",
        2,
        "invalid config (<where>): space.<key>: not searched",
        lambda t, d: sweep_config(t, d, "space.dataset_version={choice: [a, b]}"),
    ),
    Case(
        "a sweep `space` entry that is no choice, grid, uniform or loguniform",
        2,
        "invalid config (<where>): space.<key>: give one of {choice: [...]}",
        lambda t, d: sweep_config(t, d, "space.optimizer.lr=0.1"),
    ),
    Case(
        "a sweep `space` range that is empty (`low >= high`)",
        2,
        "invalid config (<where>): space.<key>: uniform [<low>, <high>] is empty",
        lambda t, d: sweep_config(t, d, "space.mixup_alpha={uniform: [0.4, 0.2]}"),
    ),
    Case(
        "a sweep `loguniform` range from 0 or below",
        2,
        "invalid config (<where>): space.<key>: loguniform [<low>, <high>] needs low > 0",
        lambda t, d: sweep_config(t, d, "space.optimizer.lr={loguniform: [0, 0.1]}"),
    ),
    Case(
        "a sweep `space` value a trial's train config refuses (a range's end included)",
        2,
        "invalid config (<where>): space.<key>=<value>: a trial's train config is refused",
        lambda t, d: sweep_config(t, d, "space.optimizer.momentum={uniform: [0.5, 1.0]}"),
        cli=lambda t, d: [sweep_args(t, d, "space.optimizer.lr={choice: [-1.0, 0.1]}")],
    ),
    Case(
        "a sweep `name` that is a training run",
        2,
        "name=<name>: <path> is a training run, not a sweep",
        lambda t, d: sweep_over_a_run(t, d),
    ),
    Case(
        "a sweep resumed with another config",
        2,
        "sweep <path> was started with another config",
        lambda t, d: sweep_resumed_with(t, d, "num_samples=3"),
    ),
    Case(
        "a model name that torchvision (or timm) does not have",
        2,
        "model.name=<name> is not a torchvision classification model (close names: <names>)",
        lambda t, d: model_checked(t, d, "model.name=resnet05"),
    ),
    Case(
        "model weights by a name the model does not have",
        2,
        "model.weights=<name> is not a weights name of <name>",
        lambda t, d: model_checked(t, d, "model.weights=IMAGENET"),
    ),
    Case(
        "model builder arguments the builder does not take",
        2,
        "model <name> with model.kwargs=<kwargs> cannot be built",
        lambda t, d: model_checked(t, d, "model.kwargs.image_size=32"),
    ),
    Case(
        "a `module:function` model whose module does not import",
        2,
        "model.name=<name>: importing <module> failed",
        user_model("import no_such_package\n\ndef build(num_classes):\n    pass\n"),
    ),
    Case(
        "a `module:function` model whose module is not there",
        2,
        "model.name=<name>: there is no module <module>",
        lambda t, d: model_checked(t, d, "model.name=examples.no_such_module:build"),
    ),
    Case(
        "a `module:function` model that does not return an `nn.Module`",
        2,
        "model <name> returned a <type>, not a torch.nn.Module",
        user_model("def build(num_classes):\n    return {'classes': num_classes}\n"),
    ),
    Case(
        "a model that does not take the input size",
        2,
        "model <name> does not take <n> px images",
        lambda t, d: model_checked(t, d, "model.name=vit_b_16", "model.kwargs.image_size=16"),
    ),
    Case(
        "a checkpoint whose `module:function` model is neither a file below the job's working "
        "dir (a pyfunc model's `code/`), nor in the runtime env's `py_modules`, nor in "
        "`allow_modules`: inference, serving, export and the MLflow model refuse it, running none "
        "of it",
        2,
        "the checkpoint's model.name=<name> names module <module>",
        inferred_with_hub_checkpoint,
    ),
    Case(
        "a checkpoint of a timm model whose `model.kwargs` load weights from elsewhere",
        2,
        "the checkpoint's model <name> has model.kwargs <keys>, which load weights from elsewhere",
        exported_with_timm_loading,
    ),
    # Input data: exit 1.
    Case(
        "a source folder that does not exist",
        1,
        "source.folder.path <path> does not exist",
        lambda t, _: FolderSource(FolderSourceConfig(path=str(t / "nope"))).list_items(),
    ),
    Case("an empty class folder", 1, "class folder <path> is empty", empty_class),
    Case(
        "no source image that decodes",
        1,
        "no usable images: all <n> inputs were skipped",
        test="tests/ray/test_preprocess.py::test_zero_usable_images_fails",
    ),
    Case(
        "a source image that is gone or forbidden",
        1,
        "cannot read source image <id>",
        source_image(DROPPED, gone=True),
    ),
    Case(
        "an output directory that holds other data",
        1,
        "output <path> holds files this bundle did not write",
        foreign_output,
    ),
    Case(
        "an output another preprocess job replaced meanwhile",
        1,
        "<path> was replaced while this job was writing",
        test="tests/jobs/test_publish.py::test_two_writers_at_once_leave_the_newer_dataset",
    ),
    Case(
        "a manifest this code cannot read",
        1,
        "<path> is not a manifest this code can read",
        unreadable_manifest,
    ),
    Case(
        "a dataset path with no committed version",
        1,
        "no dataset at dataset=<path>",
        lambda t, _: pick_dataset_version(
            train_config(t, t / "no"), Location.parse(str(t / "no")), None, run="r"
        ),
    ),
    Case(
        "a `dataset_version` the dataset does not hold (never committed, or past retention)",
        1,
        "dataset <path> has no version <v>",
        lambda t, d: read_manifest(Location.parse(str(d)), "20200101T000000000000Z-0badc0de"),
    ),
    Case(
        "a resumed run whose dataset has another version now, without `switch_dataset`",
        2,
        "run <name> trained on version <v> of dataset <path>",
        resumed_on_another_version,
    ),
    Case(
        "`decode: gpu` on a dataset of PNG images",
        2,
        "decode=gpu decodes JPEG images only, and dataset <path> stores png images",
        png_dataset_decoded_on_gpu,
    ),
    Case(
        "inference `dataset_version` for an input that is no dataset",
        1,
        "dataset_version=<v>, but input=<path> is not a preprocessed dataset",
        lambda t, _: list_input(Location.parse(str(t)), split="val", version="v1"),
    ),
    Case(
        "inference or export of a run's own dataset, whose version the run trained on is past "
        "retention",
        1,
        "<key>=<path> is the dataset the checkpoint was trained on, but no longer holds "
        "version <v>",
        lambda t, d: trained_version(
            checkpoint_meta(config={"dataset": str(d), "checkpoint": {"metric": "val_loss"}}),
            Location.parse(str(d)),
            None,
            key="input",
        ),
    ),
    Case(
        "a dataset whose shard files are missing, cut short or changed",
        1,
        "dataset <path> is damaged",
        damaged,
        cli=damaged_shards,
        on_cluster=True,
    ),
    Case(
        "an image in a dataset's shard damaged since it was written (the file's size unchanged): "
        "its page's checksum fails, and the job ends at once, not after `max_failures` retries",
        1,
        "dataset <path> is damaged: row group <g> of <file>: it does not read as Parquet (could "
        "not verify page integrity",
        test="tests/ray/test_worker_kills.py::"
        "test_a_stored_image_damaged_in_place_ends_the_job_at_once_naming_its_row_group",
    ),
    Case(
        "an image damaged in a shard written before shards carried page checksums",
        1,
        "dataset <path> is damaged: row <n> of row group <g> of <file>: not an image",
        damaged_image_unchecked,
    ),
    Case(
        "a row group of a dataset's shard damaged since it was written (the file's size "
        "unchanged): a page header that does not parse",
        1,
        "dataset <path> is damaged: row group <g> of <file>: it does not read as Parquet",
        damaged_row_group,
    ),
    Case(
        "a shard's footer damaged since it was written (the file's size unchanged)",
        1,
        "dataset <path> is damaged: <file>: its footer does not read as Parquet",
        damaged_footer,
    ),
    Case(
        "a label in a dataset's shard that is none of its classes",
        1,
        "dataset <path> is damaged: row <n> of row group <g> of <file>: label <v>, but the "
        "dataset has <k> classes",
        label_of_no_class,
    ),
    Case(
        "a checkpoint whose weights file is cut short",
        1,
        "<path> is damaged",
        cut_weights,
        cli=cut_weights_given,
        on_cluster=True,
    ),
    Case(
        "a run none of whose checkpoints reads (each cut short or changed in place): a resume "
        "goes on from the newest one that reads, and never starts the run over",
        1,
        "run <path> has checkpoints, and none of them reads",
        test="tests/unit/test_steps.py::"
        "test_a_resume_goes_on_from_the_newest_checkpoint_on_storage_and_brings_rays_record_in_line",
    ),
    Case(
        "a dataset of other classes than the checkpoint resumed",
        1,
        "checkpoint <path> was trained on 3 classes",
        test="tests/unit/test_train.py::test_resume_refuses_a_checkpoint_of_other_classes",
    ),
    Case(
        "model weights that do not exist",
        1,
        "model.weights <path> do not exist",
        lambda t, d: model_checked(t, d, f"model.weights={t / 'missing.pt'}"),
    ),
    Case(
        "a model weights file of another architecture",
        1,
        "model.weights <path> do not fit model <name>",
        weights_of_another_model,
    ),
    Case(
        "a dataset stored smaller than the model's input",
        1,
        "dataset <path> stores <n> px images, smaller than the <n> px model <name> takes",
        lambda t, d: model_checked(t, d, "model.input.image_size=64"),
    ),
    Case(
        "an inference `model=` that does not exist",
        1,
        "model=<path> does not exist",
        checkpoint_of("nope"),
    ),
    Case(
        "an inference `model=` that is no run or checkpoint",
        1,
        "model=<path> is neither a training run",
        checkpoint_of("run"),
    ),
    Case(
        "a checkpoint of a newer format than this code reads",
        1,
        "<path> is a checkpoint of format <n>, newer than this code reads",
        newer_checkpoint,
    ),
    Case(
        "a checkpoint whose metadata.json does not read: fields missing or of the wrong type, "
        "or a `config` without `checkpoint.metric` (the score that picks raw or EMA weights; "
        "`ModelCard.meta` records it)",
        1,
        "<path>/metadata.json is not valid checkpoint metadata (<field>: <problem>)",
        unranked_checkpoint,
    ),
    Case(
        "a checkpoint of an older format, written by an earlier bundle",
        1,
        "<path> holds a <name> checkpoint of format <n>; this code reads format <n>",
        older_checkpoint,
    ),
    Case(
        "a run of a newer run format than this code reads",
        1,
        "run <path> is of run format <n>, newer than this code reads",
        newer_run,
    ),
    Case(
        "an inference, serving or export `model=` run whose every kept checkpoint scored NaN "
        "(the training diverged); its train job ends so too",
        1,
        "run <path> diverged: no checkpoint it keeps has a <metric> to rank it by",
        test="tests/unit/test_loading.py::test_a_run_whose_every_checkpoint_is_nan_is_refused",
    ),
    Case(
        "an inference output another job replaced meanwhile, of another model or input",
        1,
        "<path> was replaced while this run was writing",
        replaced_predictions,
    ),
    Case(
        "an inference `output=` that holds the predictions of another input (another path, or "
        "another split of a dataset)",
        1,
        "output <path> holds the predictions of input=<path>, which those of input=<path> would "
        "replace",
        inferred_onto_another_inputs_output,
    ),
    Case(
        "an inference `output=` that holds files inference did not write (a training run's)",
        1,
        "output <path> holds files this bundle did not write (<names>), so it is not an "
        "inference output",
        run_as_inference_output,
    ),
    Case(
        "an export `model=` that holds no checkpoint",
        1,
        "model=<path> is neither a training run",
        lambda t, _: export(load_config(ExportConfig, None, [f"model={t}"])),
    ),
    Case(
        "an export `output=` that holds another checkpoint's export, or other files",
        1,
        "output <path> holds",
        foreign_export_output,
    ),
    Case(
        "an export `dataset=` of another image size than the checkpoint's",
        1,
        "dataset <path> stores <n> px images, but the checkpoint was trained on <n> px ones",
        lambda t, d: parity_dataset(
            load_config(ExportConfig, None, [f"model={t}", f"dataset={d}"]),
            checkpoint_meta(image_size=64),
        ),
    ),
    Case(
        "a network that torch.export cannot export (it branches on its tensors' values)",
        1,
        "the network does not export with torch.export",
        lambda t, _: formats.export_pt2(Branching(), torch.ones(2, 3, 8, 8), t / "m.pt2"),
    ),
    Case(
        "an export that ONNX Runtime or torch.export runs otherwise than PyTorch",
        1,
        "parity check failed: <runtime>: ",
        test="tests/unit/test_export.py::test_a_failed_parity_check_commits_nothing",
    ),
    # The cluster or its storage: exit 3.
    Case(
        "a chain `--address` where no cluster answers for `--submit-timeout-s` (nothing is "
        "submitted)",
        3,
        "cannot reach the cluster at --address <address>",
        cli=lambda t, _: [chain_args(t, "all")],
    ),
    Case(
        "a chain `--address` whose cluster does not take a job for `--submit-timeout-s` (its job "
        "agent is not up: another cluster on the machine holds the agent's port 52365)",
        3,
        "the cluster at --address <address> did not take the job for <n> s (--submit-timeout-s)",
        test="tests/unit/test_chain.py::test_a_cluster_that_never_takes_the_job_ends_the_chain_with_exit_3",
    ),
    Case(
        "a cluster that answers nothing for `--reconnect-timeout-s` while the chain follows a job",
        3,
        "cannot reach the cluster at --address <address> for <n> s (--reconnect-timeout-s), "
        "following job <id>",
        test="tests/unit/test_chain.py::test_a_cluster_lost_mid_job_ends_the_chain_with_exit_3_and_the_jobs_id",
    ),
    Case(
        "a cluster that no longer knows the chain's job (a head restarted without its jobs)",
        3,
        "the cluster at --address <address> no longer knows job <id>",
        test="tests/unit/test_chain.py::test_a_cluster_lost_mid_job_ends_the_chain_with_exit_3_and_the_jobs_id",
    ),
    Case(
        "storage that keeps failing",
        3,
        "reading source image <id> kept failing",
        source_image(DROPPED),
    ),
    Case(
        "preprocessing on a cluster with no CPU, for `capacity_timeout_s`",
        3,
        "each shard is a task of 1 CPU, but the cluster has <n> CPUs",
        test="tests/jobs/test_autoscale.py::test_preprocessing_fails_with_exit_3_when_no_capacity_comes",
    ),
    Case(
        "training workers the cluster cannot place",
        3,
        "the cluster could not place 2 training workers",
        test="tests/ray/test_node_loss.py::"
        "test_a_lost_node_is_recovered_from_the_last_checkpoint_and_one_never_replaced_fails_the_run",
    ),
    Case(
        "a training failure that outlasts `max_failures`",
        3,
        "training failed and max_failures=0 retries are used up",
        test="tests/ray/test_worker_kills.py::test_a_kill_with_max_failures_0_fails_the_job",
    ),
    Case(
        "a training step that makes no progress for `stall.multiple` times the median step, "
        "and at least `stall.min_s` (every rank's stacks in the log and under `<run>/stalls/`)",
        3,
        "training stalled: rank <n> (pid <n>, node <address>) made no progress",
        test="tests/jobs/test_stall_jobs.py::"
        "test_a_rank_stopped_between_steps_ends_the_job_naming_it_with_every_ranks_stacks",
    ),
    Case(
        "a hang that Ray Train's NCCL hang detector finds (`RAY_TRAIN_ENABLE_NCCL_HANG_DETECTOR=1`)"
        ", through `max_failures`",
        3,
        "training hung in NCCL: Ray Train's hang detector found that",
        run=nccl_hang_in_fit,
    ),
    Case(
        "an inference batch held for `stall.multiple` times the median batch, and at least "
        "`stall.min_s` (every predictor actor's stacks in the log)",
        3,
        "inference stalled: predictor actor pid <n> on node <address> has held a batch",
        test="tests/jobs/test_infer.py::"
        "test_a_predictor_held_on_a_batch_ends_the_job_naming_it_with_every_actors_stacks",
    ),
    Case(
        "`use_gpu=true` on a cluster without a GPU, for `capacity_timeout_s`",
        3,
        "use_gpu=true, but the cluster has <n> GPUs",
        test="tests/jobs/test_infer.py::test_resources_the_cluster_lacks_fail_fast",
    ),
    Case(
        "inference actors larger than the cluster, for `capacity_timeout_s`",
        3,
        "cpus_per_actor=<n>, but the cluster has <n> CPUs",
        test="tests/jobs/test_autoscale.py::test_inference_fails_with_exit_3_when_no_capacity_comes",
    ),
    Case(
        "inference actors larger than any node, for `capacity_timeout_s`",
        3,
        "cpus_per_actor=<n> asks for <n> CPU(s) on one node, but the largest node has <n> CPU(s)",
        test="tests/jobs/test_autoscale.py::test_inference_refuses_actors_larger_than_any_node_with_exit_3",
    ),
    Case(
        "a task or actor larger than any node type the autoscaler reports",
        3,
        "cpus_per_actor=<n> asks for <n> CPU(s) on one node, but the largest node the cluster has",
        test="tests/ray/test_capacity.py::test_a_bundle_no_node_type_holds_is_refused_at_once",
    ),
    Case(
        "a tracking server that does not answer when a job starts",
        3,
        "the tracking server <uri> does not answer",
        tracked_by(f"http://127.0.0.1:{free_port()}"),  # nothing listens there
    ),
    Case(
        "a tracking URI that is no MLflow server (a 404, an unknown scheme)",
        2,
        "the tracking URI <uri> is not an MLflow tracking server",
        tracked_by("nonsense://mlflow"),
    ),
    Case(
        "a tracked run resumed with another tracking server",
        2,
        "run <path> is tracked in MLflow run <id> at <uri>",
        test="tests/unit/test_tracking.py::test_a_run_tracked_on_another_server_is_not_split_across_two",
    ),
    Case(
        "a tracked run whose MLflow run was deleted",
        2,
        "MLflow run <id>, which <path> names, is gone from <uri>",
        test="tests/unit/test_tracking.py::test_a_deleted_run_or_experiment_is_not_tracked_into",
    ),
    Case(
        "a deleted MLflow experiment",
        2,
        "MLflow experiment <name> at <uri> is deleted",
        test="tests/unit/test_tracking.py::test_a_deleted_run_or_experiment_is_not_tracked_into",
    ),
    Case(
        "a `models:/` URI of no registered model version",
        1,
        "models:/<name>/<version> is no registered model version",
        test="tests/unit/test_tracking.py::test_a_registered_version_resolves_to_its_checkpoint",
    ),
    Case(
        "a cluster check with a failed row of the cluster's: a node that does not answer, a "
        "package a node lacks, workers that do not fit ([Cluster check](check.md))",
        3,
        "cluster check: <n> of <n> rows failed: <rows>",
        test="tests/jobs/test_check.py::test_a_node_gone_fails_the_nodes_row",
    ),
    Case(
        "a cluster check whose failed rows are all the input's: storage that refuses for good, "
        "a dataset that is there but unreadable",
        1,
        "cluster check: <n> of <n> rows failed: <rows>",
        test="tests/jobs/test_check.py::test_storage_that_refuses_writes_fails_the_storage_row",
    ),
]


def run_module(argv: list[str], env) -> subprocess.CompletedProcess:
    """`python -m <argv>` from the bundle's root, as a user runs it."""
    command = [sys.executable, "-m", *map(str, argv)]
    return subprocess.run(
        command, cwd=BUNDLE_ROOT, env=env, capture_output=True, text=True, timeout=300
    )
