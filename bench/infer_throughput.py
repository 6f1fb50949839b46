"""Batch inference images/s: the infer job's Ray Data path, a plain PyTorch loop, and one Ray
task per image (the one-image pattern of the tutorial), side by side on one split and checkpoint.

    .venv/bin/python -m bench.infer_throughput        # 224 px, 600 val images, 2 CPUs

Preprocesses generated images (half of them in val), writes a ResNet-18 checkpoint (random
weights: speed does not depend on them), then measures on `--cpus` CPUs:
- ray_data: the infer job through `ray job submit` on a fresh local cluster, with its default
  actor pool (one 1-CPU actor per CPU). From its summary.json: `images/s` over the whole
  dataset (actor start-up with its torch import, reading, decoding and writing included; job
  start-up not) and `steady` after the first batch (start-up excluded);
- plain_loop: one process, torch threads = CPUs, pyarrow reads + the same decode + model;
- task_per_image: `--task-images` images, one `@ray.remote` task each, loading the model per
  task, as the tutorial does for one image (the workers warmed up first).
Targets: ray_data >= 0.85x plain_loop, >= 20x task_per_image.
Results go to bench/results/infer.json.
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch

from bench.common import preprocess_generated, random_checkpoint, write_results
from harness.cluster import LocalCluster
from pipeline.core.storage import Location
from pipeline.data.dataset import read_manifest
from pipeline.infer.batch import Classifier, _classify_one, prepare_image
from pipeline.infer.predictions import SUMMARY


def make_inputs(tmp: Path, per_class: int, size: int, cpus: int) -> tuple[Path, Path]:
    dataset = tmp / "dataset"
    preprocess_generated(
        dataset,
        f"source.synthetic.images_per_class={per_class}",
        f"image_size={size}",
        f"source.synthetic.raw_size={size + size // 7}",
        "val_fraction=0.5",
        cpus=cpus,
    )
    return dataset, random_checkpoint(dataset, tmp / "checkpoint")


def ray_data(dataset: Path, checkpoint: Path, out: Path, cpus: int, batch: int) -> dict:
    with LocalCluster(num_cpus=cpus) as cluster:
        proc = cluster.submit(
            [
                "python",
                "-m",
                "jobs.infer",
                "--config",
                "configs/demo-infer.yaml",
                f"model={checkpoint}",
                f"input={dataset}",
                f"output={out}",
                f"batch_size={batch}",
                f"num_actors={cpus}",
                "cpus_per_actor=1",
            ],
            capture=True,
        )
    if proc.returncode != 0:
        sys.exit(f"inference failed:\n{proc.stdout[-3000:]}")
    summary = json.loads((out / SUMMARY).read_text())
    return {
        "images": summary["images"],
        "images_per_s": round(summary["images_per_s"], 1),
        "steady_images_per_s": round(summary["steady_images_per_s"], 1),
        "first_batch_s": round(summary["first_batch_s"], 1),
    }


def plain_loop(dataset: Path, checkpoint: Path, cpus: int, batch: int) -> dict:
    torch.set_num_threads(cpus)
    root = Location.parse(str(dataset))
    files = [root.child(f.path).path for f in read_manifest(root).splits["val"].files]
    started = time.monotonic()
    classifier = Classifier(Location.parse(str(checkpoint)), use_gpu=False, precision="fp32")
    images = 0
    for f in files:
        for group in pq.ParquetFile(f).iter_batches(batch_size=batch, columns=["image"]):
            size = classifier.meta.image_size
            pixels = np.stack(
                [prepare_image(d, image_size=size) for d in group.column("image").to_pylist()]
            )
            classifier.probabilities(pixels).argmax(dim=1)
            images += len(pixels)
    return {"images": images, "images_per_s": round(images / (time.monotonic() - started), 1)}


def task_per_image(dataset: Path, checkpoint: Path, cpus: int, n: int) -> dict:
    import ray

    root = Location.parse(str(dataset))
    first = root.child(read_manifest(root).splits["val"].files[0].path).path
    data = pq.read_table(first, columns=["image"]).column("image").to_pylist()[:n]
    ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False)
    try:
        ckpt = Location.parse(str(checkpoint))
        ray.get(_classify_one.remote(ckpt, data[0], False, "fp32", 1))  # warm the workers
        started = time.monotonic()
        ray.get([_classify_one.remote(ckpt, d, False, "fp32", 1) for d in data])
        seconds = time.monotonic() - started
    finally:
        ray.shutdown()
    return {"images": len(data), "images_per_s": round(len(data) / seconds, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--images-per-class", type=int, default=200)
    parser.add_argument("--cpus", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--task-images", type=int, default=40)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        dataset, checkpoint = make_inputs(
            Path(tmp), args.images_per_class, args.image_size, args.cpus
        )
        ray = ray_data(dataset, checkpoint, Path(tmp) / "out", args.cpus, args.batch_size)
        plain = plain_loop(dataset, checkpoint, args.cpus, args.batch_size)
        tasks = task_per_image(dataset, checkpoint, args.cpus, args.task_images)
    ratios = {
        "steady_over_plain": round(ray["steady_images_per_s"] / plain["images_per_s"], 2),
        "whole_over_plain": round(ray["images_per_s"] / plain["images_per_s"], 2),
        "steady_over_task_per_image": round(ray["steady_images_per_s"] / tasks["images_per_s"], 1),
        "whole_over_task_per_image": round(ray["images_per_s"] / tasks["images_per_s"], 1),
    }
    print(f"\nbatch inference, ResNet-18 at {args.image_size} px, {args.cpus} CPUs")
    print(f"{'path':>15} {'images':>7} {'images/s':>9} {'steady':>7}")
    print(
        f"{'ray_data':>15} {ray['images']:>7} {ray['images_per_s']:>9.1f} "
        f"{ray['steady_images_per_s']:>7.1f}   (first batch after {ray['first_batch_s']} s)"
    )
    for name, r in (("plain_loop", plain), ("task_per_image", tasks)):
        print(f"{name:>15} {r['images']:>7} {r['images_per_s']:>9.1f}")
    for name, value in ratios.items():
        print(f"ray_data {name.replace('_', ' ')}: {value}x")
    targets = {"over_plain": 0.85, "over_task_per_image": 20}
    results = {"ray_data": ray, "plain_loop": plain, "task_per_image": tasks}
    write_results("infer", {"args": vars(args), **results, "ratios": ratios, "targets": targets})


if __name__ == "__main__":
    main()
