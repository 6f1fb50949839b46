"""What a GPU answers about this bundle, in one command, side by side in one run.

    make bench-gpu                                   # .venv/bin/python -m bench.gpu
    .venv/bin/python -m bench.gpu --models resnet50 --no-compile   # a part of it

With a CUDA GPU (about 8 min on one H100), at 224 px and batches of 256:
- tests: `pytest -m gpu`;
- training images/s per model, without and with torch.compile: one Ray Train worker on a local
  Ray cluster that this command starts, fed by the bundle's loader (`train_data`) through the
  bundle's step (`train_one_epoch` with `DevicePolicy`: autocast in bf16 where the GPU computes
  in it, else fp16; channels-last), against the same model and step on one random batch
  already on the GPU: the model's own limit. Both decode paths side by side, an epoch each:
  `decode=cpu` (JPEG decode and augmentation in `loader_workers` processes) and `decode=gpu`
  (the processes read rows, the worker decodes with nvJPEG and augments on the GPU), each with
  its share of the epoch the step loop waited for input. Loader over limit well under 1 says
  the input starves the GPU;
- inference images/s: the infer job (Ray Data, one GPU actor, ResNet-18) against the same
  model's forward pass on a random batch already on the GPU;
- JPEG decode images/s of the dataset's images: PIL on one core (`decode_image`, as the loader
  decodes), torchvision's `decode_jpeg` on one CPU thread, and `decode_jpeg` on the GPU in
  batches.
Without a GPU, the same paths at CPU sizes (32 px, two models, a few batches, no torch.compile)
in about 2 minutes: CI runs that, so that this command keeps working between GPU runs.

One table, printed and written to bench/results/gpu.md and gpu.json (gpu_cpu.* for the CPU
version), naming the device, the versions and the date. Exits 1 if any part failed; the table
says which, and still holds the rest.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import gc
import importlib.util
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow.parquet as pq
import torch
import torchvision

from bench.common import command, preprocess_generated, random_checkpoint, write_results
from harness.cluster import BUNDLE_ROOT, LocalCluster
from pipeline.core.config import load_config, validate_config
from pipeline.core.storage import Location
from pipeline.data.config import PreprocessConfig, SyntheticSourceConfig
from pipeline.data.dataset import (
    DATA,
    Manifest,
    ShardFile,
    SplitInfo,
    commit,
    read_manifest,
    start_version,
)
from pipeline.data.images import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    decode_image,
    encode_image,
    resize_center_crop,
)
from pipeline.data.shards import write_shard
from pipeline.data.sources import SyntheticSource, assign_split, render_synthetic
from pipeline.model.device import DevicePolicy, pick_precision
from pipeline.train.config import TrainConfig
from pipeline.train.epoch import train_one_epoch
from pipeline.train.input.loaders import train_data
from pipeline.train.optim import build_optimizer

if TYPE_CHECKING:
    from pipeline.infer.batch import Classifier

# The lent GPU machines have torch, torchvision, pyarrow and Pillow, but no Ray (its wheel is
# larger than what a call to them may carry): there, the parts that need no cluster run in this
# process, and the table says which did not.
RAY = importlib.util.find_spec("ray") is not None
NO_RAY = "needs Ray, which is not installed here"
MODELS = ("resnet18", "resnet50", "efficientnet_b0", "convnext_tiny", "vit_b_16")
DECODES = ("cpu", "gpu")  # TrainConfig.decode: both paths, one after the other, per model


@dataclass(frozen=True)
class Sizes:
    image_size: int
    images_per_class: int  # 6 generated classes; 80% of them train, and inference reads those
    models: tuple[str, ...]
    compile: tuple[bool, ...]
    batch_size: int  # training and inference
    warmup_steps: int  # compiles, and cuDNN's first calls
    limit_steps: int
    loader_epochs: int  # images/s after each epoch's first batch, the median over epochs


GPU = Sizes(224, 2000, MODELS, (False, True), 256, 5, 30, 1)
CPU = Sizes(32, 40, ("resnet18", "efficientnet_b0"), (False,), 16, 3, 10, 1)
CLASSES = 6


def build_network(name: str, num_classes: int, seed: int) -> torch.nn.Module:
    """A torchvision architecture by name with a fresh `num_classes` head, random weights."""
    torch.manual_seed(seed)
    return torchvision.models.get_model(name, num_classes=num_classes)


def free_memory() -> None:
    gc.collect()
    torch._dynamo.reset()  # compiled graphs hold the model they were traced from
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def make_dataset(cluster: LocalCluster, dataset: Path, sizes: Sizes) -> dict:
    """Generated images preprocessed by the preprocess job: what the other parts read."""
    preprocess_generated(
        dataset,
        f"source.synthetic.num_classes={CLASSES}",
        f"source.synthetic.images_per_class={sizes.images_per_class}",
        f"source.synthetic.raw_size={sizes.image_size + sizes.image_size // 7}",
        f"image_size={sizes.image_size}",
        "shard_size=1000",
        "row_group_size=128",
        cluster=cluster,
    )
    splits = read_manifest(Location.parse(str(dataset))).splits
    return {split: info.rows for split, info in splits.items()}


def write_dataset(dataset: Path, sizes: Sizes) -> dict:
    """The same generated images as `make_dataset`, written without Ray: rendered, resized,
    cropped and encoded as the preprocess job does it, in shards as it writes them."""
    cfg = PreprocessConfig(
        output=str(dataset),
        source={"kind": "synthetic", "synthetic": synthetic(sizes)},
        image_size=sizes.image_size,
    )
    source = SyntheticSource(SyntheticSourceConfig(**synthetic(sizes)))
    items = source.list_items()
    render = [(source.classes[i.label], i.source_id, source.cfg.seed) for i in items]
    with concurrent.futures.ProcessPoolExecutor() as pool:
        images = list(pool.map(encoded, render, [sizes] * len(render), chunksize=64))
    root = Location.parse(str(dataset))
    version = start_version(root)
    splits: dict[str, SplitInfo] = {}
    rows: dict[str, list[dict]] = {}
    for item, image, (name, *_) in zip(items, images, render, strict=True):
        row = {"image": image, "label": item.label, "label_name": name, "source_id": item.source_id}
        rows.setdefault(assign_split(item, cfg.val_fraction), []).append(row)
    for split, split_rows in rows.items():
        info = splits[split] = SplitInfo()
        for shard, at in enumerate(range(0, len(split_rows), 1000)):
            part = split_rows[at : at + 1000]
            rel = f"{DATA}/{version}/{split}/part-{shard:05d}.parquet"
            size = write_shard(root.child(rel), part, row_group_size=128)
            info.files.append(ShardFile(path=rel, rows=len(part), size=size))
            info.rows += len(part)
    manifest = Manifest(
        version=version,
        created_at=Manifest.now(),
        fingerprint=cfg.fingerprint(),
        classes=source.classes,
        image_size=sizes.image_size,
        image_format="jpeg",
        mean=IMAGENET_MEAN,
        std=IMAGENET_STD,
        splits=splits,
        skipped=[],
        config=cfg.model_dump(mode="json"),
    )
    commit(root, manifest, "")
    return {split: info.rows for split, info in splits.items()}


def synthetic(sizes: Sizes) -> dict:
    raw = sizes.image_size + sizes.image_size // 7
    return {"num_classes": CLASSES, "images_per_class": sizes.images_per_class, "raw_size": raw}


def encoded(render: tuple[str, str, int], sizes: Sizes) -> bytes:
    name, source_id, seed = render
    index = int(source_id.rsplit("/", 1)[1])
    raw = sizes.image_size + sizes.image_size // 7
    img = render_synthetic(name, size=raw, seed=seed, index=index)
    return encode_image(resize_center_crop(img, size=sizes.image_size), image_format="jpeg")


# --- training: in a Ray Train worker, or in this process without Ray ---------------------------


def train_loop(config: dict) -> None:
    """Ray Train worker: the rows of `train_rows`, written to a file (a run's Result keeps only
    metrics sent with a checkpoint)."""
    import ray.train.torch

    cfg = validate_config(TrainConfig, config["train"])
    sizes = Sizes(**config["sizes"])
    device = ray.train.torch.get_device()
    out = train_rows(cfg, sizes, device, ray.train.torch.prepare_model)
    Path(config["out"]).write_text(json.dumps(out))


def train_rows(cfg: TrainConfig, sizes: Sizes, device: torch.device, prepare) -> dict:
    """For each model and compile setting, the limit, then each decode path's loader;
    `prepare` takes the model to the training setup (Ray Train's prepare_model, or nothing)."""
    root = Location.parse(cfg.dataset)
    manifest = read_manifest(root)
    policy = DevicePolicy(
        device, pick_precision(cfg.precision, device), manifest.mean, manifest.std
    )
    loaders = {
        decode: train_data(
            cfg.model_copy(update={"decode": decode}),
            root,
            manifest,
            rank=0,
            world=1,
            device=device,
        )
        for decode in DECODES
    }
    rows = []
    for name in sizes.models:
        for compiled in sizes.compile:
            row = {"model": name, "compile": compiled}
            try:
                # No torch.<name> in this function: cloudpickle, sending it to a Ray Train
                # worker, would take torch.classes for a submodule by manifest.classes' name.
                classes = len(manifest.classes)
                model = prepare(policy.prepare(build_network(name, classes, cfg.seed)))
                row |= train_row(model, compiled, cfg, sizes, policy, loaders, classes)
            except Exception as e:  # one model's failure (a compile error, memory) is a row
                traceback.print_exc()
                row["error"] = f"{type(e).__name__}: {e}"[:300]
            free_memory()
            print(f"training: {json.dumps(row)}", flush=True)
            rows.append(row)
    return {"rows": rows, "precision": policy.precision}


def train_row(model, compiled, cfg, sizes, policy, loaders, num_classes) -> dict:
    if compiled:
        model = torch.compile(model)
    optimizer, _ = build_optimizer(model, cfg)
    criterion = torch.nn.CrossEntropyLoss()
    # One random batch on the device, as the loader's: uint8 pixels, normalised by the step.
    batch, size, device = cfg.batch_size_per_worker(1), sizes.image_size, policy.device
    x = torch.randint(0, 256, (batch, 3, size, size), dtype=torch.uint8, device=device)
    y = torch.randint(0, num_classes, (batch,), device=device)
    started = time.perf_counter()
    train_one_epoch(model, [(x, y)] * sizes.warmup_steps, optimizer, criterion, policy=policy)
    warmup_s = time.perf_counter() - started
    limit = train_one_epoch(
        model, [(x, y)] * sizes.limit_steps, optimizer, criterion, policy=policy
    )
    limit_rate = limit["images"] / limit["seconds"]
    row = {"limit_images_per_s": round(limit_rate, 1), "warmup_s": round(warmup_s, 1)}
    for decode, loader in loaders.items():
        row[decode] = loader_rates(model, loader, optimizer, criterion, policy, sizes, limit_rate)
    return row


def loader_rates(model, loader, optimizer, criterion, policy, sizes, limit_rate) -> dict:
    """Images/s of the step fed by `loader`, after each epoch's first batch and whole, and the
    share of the epoch the step loop waited for input (as the train job records it)."""
    rates, epoch_rates, waits = [], [], []
    for epoch in range(sizes.loader_epochs):
        loader.set_epoch(epoch)
        first: list[tuple[float, int]] = []

        def progress(i: int, images: int, waited_s: float, first=first) -> None:
            if i == 1:
                first.append((time.perf_counter(), images))

        t = train_one_epoch(model, loader, optimizer, criterion, policy=policy, progress=progress)
        end = time.perf_counter()  # after the step's last .item(): the GPU is done
        (at, images) = first[0]
        rates.append((t["images"] - images) / (end - at))
        epoch_rates.append(t["images"] / t["seconds"])
        waits.append(t["input_wait_s"] / t["seconds"])
    rate = statistics.median(rates)
    return {
        "images_per_s": round(rate, 1),
        "epoch_images_per_s": round(statistics.median(epoch_rates), 1),
        "over_limit": round(rate / limit_rate, 2),
        "input_wait_share": round(statistics.median(waits), 3),
    }


def training(cluster: LocalCluster, dataset: Path, sizes: Sizes, cuda: bool, tmp: Path) -> dict:
    """One Ray Train worker on `cluster` (a GPU, and all CPUs but one for it and its loader),
    driven from a fresh process that joins the cluster with its token, as a job's driver does."""
    cfg = training_config(dataset, sizes, cuda, tmp)
    spec, out = tmp / "train.json", tmp / "train-rows.json"
    train = {"train": cfg.model_dump(mode="json"), "sizes": asdict(sizes), "out": str(out)}
    spec.write_text(json.dumps(train))
    # RAY_ADDRESS: Ray Train's helper actors find the cluster by it, where others run here too.
    proc = subprocess.run(
        [sys.executable, "-m", "bench.gpu", "--ray-train", str(spec)],
        cwd=BUNDLE_ROOT,
        env={**cluster.env, "RAY_ADDRESS": cluster.gcs_address},
    )
    if proc.returncode != 0:
        raise RuntimeError(f"the Ray Train run exited {proc.returncode} (its log is above)")
    return training_result(cfg, json.loads(out.read_text()), "in a Ray Train worker")


def training_here(dataset: Path, sizes: Sizes, cuda: bool, tmp: Path) -> dict:
    """The same rows in this process, where there is no Ray: the same loaders and step."""
    cfg = training_config(dataset, sizes, cuda, tmp)
    device = torch.device("cuda" if cuda else "cpu")
    # Ray Train's prepare_model moves the model to its device; here that is all it has to do.
    rows = train_rows(cfg, sizes, device, lambda model: model.to(device))
    return training_result(cfg, rows, "in this process (no Ray here)")


def training_config(dataset: Path, sizes: Sizes, cuda: bool, tmp: Path) -> TrainConfig:
    cpus = max(1, (os.cpu_count() or 2) - 1)
    overrides = [
        f"dataset={dataset}",
        f"storage_path={tmp / 'runs'}",
        f"global_batch_size={sizes.batch_size}",
        "scaling.num_workers=1",
        f"scaling.cpus_per_worker={cpus}",
        f"scaling.loader_workers={max(1, cpus - 1)}",
        f"scaling.use_gpu={str(cuda).lower()}",
    ]
    return load_config(TrainConfig, None, overrides)


def training_result(cfg: TrainConfig, metrics: dict, where: str) -> dict:
    return {
        "where": where,
        "loader_workers": cfg.scaling.loader_workers,
        "decodes": list(DECODES),
        "augment": cfg.augment,
        "precision": metrics["precision"],
        "rows": metrics["rows"],
    }


def ray_train(spec: Path) -> None:
    """The driver of `training`'s run: TorchTrainer.fit() on the cluster at RAY_ADDRESS."""
    import ray
    import ray.train
    import ray.train.torch

    config = json.loads(spec.read_text())
    cfg = validate_config(TrainConfig, config["train"])
    ray.init()
    try:
        trainer = ray.train.torch.TorchTrainer(
            train_loop,
            train_loop_config=config,
            scaling_config=ray.train.ScalingConfig(
                num_workers=1,
                use_gpu=cfg.scaling.use_gpu,
                resources_per_worker={"CPU": cfg.scaling.cpus_per_worker},
            ),
            run_config=ray.train.RunConfig(name="bench-gpu", storage_path=cfg.storage_path),
        )
        trainer.fit()
    finally:
        ray.shutdown()


# --- inference ---------------------------------------------------------------------------------


def inference(cluster: LocalCluster, dataset: Path, sizes: Sizes, cuda: bool, tmp: Path) -> dict:
    """The infer job over the train split against the model's forward pass on the device."""
    from pipeline.infer.batch import Classifier
    from pipeline.infer.predictions import SUMMARY

    checkpoint = random_checkpoint(dataset, tmp / "checkpoint")
    cpus = os.cpu_count() or 2
    args = command(
        "python -m jobs.infer --config configs/infer.yaml split=train num_actors=1",
        f"model={checkpoint}",
        f"input={dataset}",
        f"output={tmp / 'predictions'}",
        f"batch_size={sizes.batch_size}",
        f"use_gpu={str(cuda).lower()}",
        *([] if cuda else [f"cpus_per_actor={cpus}"]),
    )
    proc = cluster.submit(args, capture=True)
    if proc.returncode != 0:
        raise RuntimeError(f"the infer job failed:\n{proc.stdout[-3000:]}")
    summary = json.loads((tmp / "predictions" / SUMMARY).read_text())

    if not cuda:
        torch.set_num_threads(cpus)  # as the job's actor, with cpus_per_actor threads
    classifier = Classifier(Location.parse(str(checkpoint)), use_gpu=cuda, precision="auto")
    limit = forward_limit(classifier, sizes)
    precision = classifier.precision
    del classifier
    free_memory()
    steady = summary["steady_images_per_s"]
    return {
        "model": "resnet18",
        "precision": precision,
        "images": summary["images"],
        "job_images_per_s": round(summary["images_per_s"], 1),
        "job_steady_images_per_s": round(steady, 1),
        "job_first_batch_s": round(summary["first_batch_s"], 1),
        "limit_images_per_s": round(limit, 1),
        "steady_over_limit": round(steady / limit, 2),
    }


def forward_limit(classifier: Classifier, sizes: Sizes) -> float:
    """Images/s of the classifier's model and policy on one random batch already on its device."""
    model, policy, size = classifier.model, classifier.policy, classifier.meta.image_size
    x = torch.randint(0, 256, (sizes.batch_size, 3, size, size), dtype=torch.uint8)
    x = x.to(policy.device)

    def forward(steps: int) -> float:
        started = time.perf_counter()
        with torch.inference_mode(), policy.autocast():
            for _ in range(steps):
                model(policy.inputs(x)).float().softmax(dim=1)
        if policy.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - started

    forward(sizes.warmup_steps)
    return sizes.limit_steps * sizes.batch_size / forward(sizes.limit_steps)


# --- JPEG decode -------------------------------------------------------------------------------


def jpeg_decode(dataset: Path, sizes: Sizes, cuda: bool) -> dict:
    """The train split's stored JPEGs: PIL on one core, torchvision on one CPU thread and on
    the GPU in batches."""
    from torchvision.io import decode_jpeg
    from torchvision.transforms.v2.functional import pil_to_tensor

    root = Location.parse(str(dataset))
    files = read_manifest(root).splits["train"].files
    data = [d for f in files for d in pq.read_table(root.child(f.path).path)["image"].to_pylist()]
    encoded = [torch.frombuffer(bytearray(d), dtype=torch.uint8) for d in data]
    rates = {}

    started = time.perf_counter()
    for d in data:
        pil_to_tensor(decode_image(d))
    rates["pil_1_core"] = len(data) / (time.perf_counter() - started)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    started = time.perf_counter()
    for i in range(0, len(encoded), sizes.batch_size):
        decode_jpeg(encoded[i : i + sizes.batch_size])
    rates["torchvision_cpu_1_thread"] = len(data) / (time.perf_counter() - started)
    torch.set_num_threads(threads)

    if cuda:
        decode_jpeg(encoded[: sizes.batch_size], device="cuda")  # nvJPEG's start-up
        torch.cuda.synchronize()
        started = time.perf_counter()
        for i in range(0, len(encoded), sizes.batch_size):
            decode_jpeg(encoded[i : i + sizes.batch_size], device="cuda")
        torch.cuda.synchronize()
        rates["torchvision_cuda_batched"] = len(data) / (time.perf_counter() - started)
        free_memory()
    mean_bytes = sum(map(len, data)) / len(data)
    return {
        "images": len(data),
        "mean_bytes": round(mean_bytes),
        "images_per_s": {k: round(v, 1) for k, v in rates.items()},
        "over_pil": {k: round(v / rates["pil_1_core"], 2) for k, v in rates.items()},
    }


# --- the gpu tests -----------------------------------------------------------------------------


def gpu_tests(tmp: Path) -> dict:
    """`pytest -m gpu`, its output kept in a file: counts from its JUnit XML."""
    xml, log = tmp / "gpu-tests.xml", tmp / "gpu-tests.log"
    with open(log, "w") as out:
        proc = subprocess.run(
            [sys.executable, *command("-m pytest -m gpu -p no:xdist -q"), f"--junitxml={xml}"],
            cwd=BUNDLE_ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    suite = ET.parse(xml).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    failed = counts["failures"] + counts["errors"]
    result = {**counts, "passed": counts["tests"] - failed - counts["skipped"]}
    result["seconds"] = round(float(suite.get("time", 0)), 1)
    if proc.returncode not in (0, 5) or failed:
        result["error"] = f"pytest exited {proc.returncode}:\n" + log.read_text()[-3000:]
    return result


# --- the run and its table ---------------------------------------------------------------------


def environment(cuda: bool) -> dict:
    import PIL

    if cuda:
        props = torch.cuda.get_device_properties(0)
        device = f"{torch.cuda.get_device_name(0)} ({props.total_memory / 2**30:.0f} GiB)"
    else:
        device = f"no GPU: CPU only ({cpu_name()})"
    return {
        "device": device,
        "cpus": os.cpu_count(),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version() if cuda else None,
            "torchvision": torchvision.__version__,
            "ray": importlib.import_module("ray").__version__ if RAY else "not installed",
            "pillow": PIL.__version__,
        },
    }


def unusable_gpus() -> list[str]:
    """The GPUs that nvidia-smi lists (where there is one), for when torch finds none."""
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.split(" (UUID")[0] for line in out.stdout.splitlines() if line.startswith("GPU ")]


def cpu_name() -> str:
    with open("/proc/cpuinfo") as f:
        names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    return f"{len(names)} x {names[0]}" if names else platform.processor()


def part(results: dict, name: str, fn, *args) -> None:
    """results[name] = fn(*args), or the error that stopped it; timed."""
    started = time.monotonic()
    print(f"--- {name}", flush=True)
    try:
        results[name] = fn(*args)
    except Exception as e:  # the other parts still run, and the table says what failed
        traceback.print_exc()
        results[name] = {"error": f"{type(e).__name__}: {e}"[:3000]}
    results[name]["part_s"] = round(time.monotonic() - started, 1)


def table(results: dict, sizes: Sizes) -> str:
    env, v = results["environment"], results["environment"]["versions"]
    lines = [
        f"# bench.gpu: {env['device']}",
        "",
        f"{env['date']}; {env['cpus']} CPUs; Python {v['python']}, torch {v['torch']} "
        f"(CUDA {v['cuda']}, cuDNN {v['cudnn']}), torchvision {v['torchvision']}, Ray {v['ray']}, "
        f"Pillow {v['pillow']}; {sizes.image_size} px generated images, batches of "
        f"{sizes.batch_size}; whole run {results['seconds']:.0f} s.",
        "",
    ]
    if env["device"].startswith("no GPU"):
        lines += [
            "The CPU version: it shows that every path runs. Its figures are no GPU's answers, "
            "and on a shared machine the paths and their limits compete with other work.",
            "",
        ]
    d = results["dataset"]
    if "train" in d:
        lines += [
            f"Dataset: {d['train']} train and {d['val']} val images of {CLASSES} generated "
            f"classes, {'by the preprocess job' if RAY else 'written as it writes them'} "
            f"({d['part_s']:.0f} s).",
            "",
        ]
    lines += error_lines(d)
    t = results.get("gpu_tests", {})
    lines += [f"## Tests (`pytest -m gpu`){seconds(t)}", ""]
    if "tests" in t:
        lines.append(
            f"{t['tests']} tests in {t['seconds']} s: passed {t['passed']}, skipped "
            f"{t['skipped']}, failed {t['failures'] + t['errors']}"
            + (" (skipped: no CUDA GPU here)" if t["skipped"] == t["tests"] else "")
        )
    lines += [*error_lines(t), ""]

    t = results.get("training", {})
    lines += [f"## Training images/s: the loader against the limit{seconds(t)}", ""]
    if "rows" in t:
        where = (
            "on the GPU" if not env["device"].startswith("no GPU") else "in the training process"
        )
        lines += [
            f"One worker, {t['where']}, precision {t['precision']}, channels-last on CUDA, "
            f"{t['loader_workers']} loader processes, augment {t['augment']}. Limit: the same "
            "step on one random batch already on the device. Each decode path an epoch, one "
            "after the other on the same model: `decode=cpu` decodes and augments in the loader "
            f"processes, `decode=gpu` {where} (the processes only read rows). Images/s after "
            "each epoch's first batch (the whole epoch, loader start included, in the JSON); "
            "wait: the share of the epoch the step loop waited for its next batch, as the "
            "train job records it (`input_wait_share`; `decode=gpu`'s decode and augmentation "
            "count in it).",
            "",
            "| model | torch.compile | limit | decode=cpu | / limit | wait | decode=gpu | / limit "
            "| wait | warm-up s |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for r in t["rows"]:
            compiled = "yes" if r["compile"] else "no"
            if "error" in r:
                failed = f"failed: {r['error'][:120]}"
                lines.append(f"| {r['model']} | {compiled} | {failed} | | | | | | | |")
                continue
            cells = [
                f"{d['images_per_s']:,.0f} | **{d['over_limit']:.2f}x** | "
                f"{d['input_wait_share']:.0%}"
                for d in (r[decode] for decode in t["decodes"])
            ]
            lines.append(
                f"| {r['model']} | {compiled} | {r['limit_images_per_s']:,.0f} | "
                f"{' | '.join(cells)} | {r['warmup_s']} |"
            )
    lines += [*error_lines(t), ""]

    t = results.get("inference", {})
    lines += [f"## Inference images/s: the infer job against the limit{seconds(t)}", ""]
    if "limit_images_per_s" in t:
        lines += [
            f"{t['model']}, precision {t['precision']}, one actor, {t['images']} images.",
            "",
            "| path | images/s | over limit |",
            "| --- | ---: | ---: |",
            f"| infer job, after the first batch ({t['job_first_batch_s']} s) | "
            f"{t['job_steady_images_per_s']:,.0f} | **{t['steady_over_limit']:.2f}x** |",
            f"| infer job, whole run | {t['job_images_per_s']:,.0f} | |",
            f"| limit: forward on a random batch on the device | {t['limit_images_per_s']:,.0f} "
            "| 1.00x |",
        ]
    lines += [*error_lines(t), ""]

    t = results.get("jpeg_decode", {})
    lines += [f"## JPEG decode images/s{seconds(t)}", ""]
    if "images_per_s" in t:
        lines += [
            f"The train split's {t['images']} stored JPEGs, {t['mean_bytes']:,} bytes each on "
            "average (generated shapes: smaller and quicker to decode than photos).",
            "",
            "| decoder | images/s | over PIL |",
            "| --- | ---: | ---: |",
        ]
        names = {
            "pil_1_core": "PIL, one core (`decode_image`, as the loader decodes)",
            "torchvision_cpu_1_thread": "`torchvision.io.decode_jpeg`, CPU, one thread",
            "torchvision_cuda_batched": f"`decode_jpeg(device='cuda')`, batches of "
            f"{sizes.batch_size}",
        }
        for k, rate in t["images_per_s"].items():
            lines.append(f"| {names[k]} | {rate:,.0f} | {t['over_pil'][k]:.2f}x |")
    lines += [*error_lines(t), ""]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines))


def seconds(part_result: dict) -> str:
    if "not_run" in part_result:
        return f" (not run: {part_result['not_run']})"
    return f" ({part_result['part_s']:.0f} s)" if "part_s" in part_result else " (not run)"


def error_lines(part_result: dict) -> list[str]:
    if "error" not in part_result:
        return []
    return ["", "Failed:", "", "```", part_result["error"], "```"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", help=f"of {', '.join(MODELS)} (default: all)")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile rows")
    parser.add_argument("--cpu", action="store_true", help="the CPU version, even with a GPU")
    parser.add_argument("--ray-train", type=Path, help=argparse.SUPPRESS)  # training's driver
    args = parser.parse_args()
    if args.ray_train:
        ray_train(args.ray_train)
        return 0
    started = time.monotonic()
    cuda = torch.cuda.is_available() and not args.cpu
    unusable = [] if cuda or args.cpu else unusable_gpus()
    if unusable:
        parser.exit(
            2,
            f"nvidia-smi lists {', '.join(unusable)}, but torch {torch.__version__} "
            f"(built for CUDA {torch.version.cuda}) cannot use it: install an NVIDIA driver "
            "for that CUDA version, or pass --cpu for the CPU version\n",
        )
    sizes = GPU if cuda else CPU
    if args.models:
        unknown = sorted(set(args.models) - set(torchvision.models.list_models()))
        if unknown:
            parser.error(f"unknown --models {unknown}: torchvision.models.list_models() names them")
        sizes = replace(sizes, models=tuple(args.models))
    if args.no_compile:
        sizes = replace(sizes, compile=(False,))
    results: dict = {"environment": environment(cuda), "sizes": asdict(sizes)}
    print(f"bench.gpu on {results['environment']['device']}", flush=True)

    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        dataset = tmp / "dataset"
        if RAY:
            part(results, "gpu_tests", gpu_tests, tmp)
            with LocalCluster(num_cpus=os.cpu_count()) as cluster:
                part(results, "dataset", make_dataset, cluster, dataset, sizes)
                if "error" not in results["dataset"]:
                    part(results, "training", training, cluster, dataset, sizes, cuda, tmp)
                    part(results, "inference", inference, cluster, dataset, sizes, cuda, tmp)
        else:  # the tests' fixtures and the infer job start Ray clusters
            results["gpu_tests"] = results["inference"] = {"not_run": NO_RAY}
            part(results, "dataset", write_dataset, dataset, sizes)
            if "error" not in results["dataset"]:
                part(results, "training", training_here, dataset, sizes, cuda, tmp)
        if "error" not in results["dataset"]:
            part(results, "jpeg_decode", jpeg_decode, dataset, sizes, cuda)
    results["seconds"] = round(time.monotonic() - started, 1)

    name = "gpu" if cuda else "gpu_cpu"
    markdown = table(results, sizes)
    print(f"\n{markdown}")
    write_results(name, results)
    path = BUNDLE_ROOT / "bench" / "results" / f"{name}.md"
    path.write_text(markdown)
    print(f"written to {path}")
    failed = [k for k, r in results.items() if isinstance(r, dict) and "error" in r]
    rows = results.get("training", {}).get("rows", [])
    failed += [f"training {r['model']}" for r in rows if "error" in r]
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
