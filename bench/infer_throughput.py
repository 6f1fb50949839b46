"""Batch inference images/s: the infer job's Ray Data path, a plain PyTorch loop, and one Ray
task per image (seed 001's pattern), side by side on the same Parquet split and checkpoint.

    .venv/bin/python bench/infer_throughput.py --images-per-class 300 --cpus 2

Preprocesses generated images (64 px, half of them in val), writes a ResNet-18 checkpoint
(random weights: speed does not depend on them), then measures on `--cpus` CPUs:
- ray_data: the infer job through `ray job submit` on a fresh local cluster; images/s from its
  summary (reading, decoding, actor start-up and writing included, job start-up excluded);
- plain_loop: one process, torch threads = CPUs, pyarrow reads + the same decode + model;
- task_per_image: `--task-images` images, one `@ray.remote` task each, loading the model per
  task, as seed 001 does for one image.
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
from common import preprocess_generated, write_results

from pipeline.cluster import LocalCluster
from pipeline.dataset import read_manifest
from pipeline.infer import Classifier, _classify_one, prepare_image
from pipeline.model import CheckpointMeta, build_model, save_checkpoint
from pipeline.storage import Location


def make_inputs(tmp: Path, per_class: int, cpus: int) -> tuple[Path, Path]:
    dataset, checkpoint = tmp / "dataset", tmp / "checkpoint"
    preprocess_generated(dataset, f"source.synthetic.images_per_class={per_class}",
                         "val_fraction=0.5", cpus=cpus)  # fmt: skip
    m = read_manifest(Location.parse(str(dataset)))
    checkpoint.mkdir()
    meta = CheckpointMeta(epoch=0, classes=m.classes, image_size=m.image_size, mean=m.mean,
                          std=m.std, dataset_fingerprint=m.fingerprint, metrics={}, history=[],
                          config={})  # fmt: skip
    save_checkpoint(checkpoint, build_model(len(m.classes)), meta, {})
    return dataset, checkpoint


def ray_data(dataset: Path, checkpoint: Path, out: Path, cpus: int, batch: int) -> dict:
    with LocalCluster(num_cpus=cpus) as cluster:
        proc = cluster.submit(
            ["python", "-m", "jobs.infer", "--config", "configs/demo-infer.yaml",
             f"model={checkpoint}", f"input={dataset}", f"output={out}",
             f"batch_size={batch}", f"num_actors={max(1, cpus - 1)}"],
            capture=True,
        )  # fmt: skip
    if proc.returncode != 0:
        sys.exit(f"inference failed:\n{proc.stdout[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    return {"images": summary["images"], "images_per_s": round(summary["images_per_s"], 1)}


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
            pixels = np.stack([prepare_image(d, image_size=size)
                               for d in group.column("image").to_pylist()])  # fmt: skip
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
    parser.add_argument("--images-per-class", type=int, default=300)
    parser.add_argument("--cpus", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--task-images", type=int, default=40)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        dataset, checkpoint = make_inputs(Path(tmp), args.images_per_class, args.cpus)
        results = {
            "ray_data": ray_data(dataset, checkpoint, Path(tmp) / "out", args.cpus,
                                 args.batch_size),
            "plain_loop": plain_loop(dataset, checkpoint, args.cpus, args.batch_size),
            "task_per_image": task_per_image(dataset, checkpoint, args.cpus, args.task_images),
        }  # fmt: skip
    base = results["ray_data"]["images_per_s"]
    print(f"\nbatch inference, ResNet-18 at 64 px, {args.cpus} CPUs")
    print(f"{'path':>15} {'images':>7} {'images/s':>9} {'ray_data is':>12}")
    for name, r in results.items():
        r["ray_data_ratio"] = round(base / r["images_per_s"], 2)
        print(f"{name:>15} {r['images']:>7} {r['images_per_s']:>9.1f} "
              f"{r['ray_data_ratio']:>11.2f}x")  # fmt: skip
    write_results("infer", {"args": vars(args), "results": results})


if __name__ == "__main__":
    main()
