"""Training throughput with 1 and 2 workers, and the time from `ray job submit` to training.

    .venv/bin/python bench/train_throughput.py --image-size 64 --epochs 3

Preprocesses generated images once, then for each worker count starts a fresh local cluster
with that many CPUs and submits the train job (1 CPU per worker, no DataLoader processes) with
`ray job submit`. Reported, from the run's own history.csv and log: images/s of all workers
together and per worker (median over the epochs after the first, which pays for warm-up), and
the seconds from submission to rank 0's "training epochs" line, the moment before the first
step (job start-up, worker start-up and torch import included). Results go to
bench/results/train.json.
"""

import argparse
import csv
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import preprocess_generated, write_results

from pipeline.cluster import BUNDLE_ROOT, LocalCluster


def measure(dataset: Path, runs: Path, workers: int, epochs: int) -> dict:
    args = ["python", "-m", "jobs.train", "--config", "configs/demo-train.yaml",
            f"dataset={dataset}", f"storage_path={runs}", f"name=w{workers}", f"epochs={epochs}",
            f"scaling.num_workers={workers}", "global_batch_size=32"]  # fmt: skip
    with LocalCluster(num_cpus=workers) as cluster:
        # Streamed, to time when rank 0's "training epochs" line arrives.
        submitted, first_step = time.monotonic(), None
        proc = subprocess.Popen(
            cluster.submit_command(args), cwd=BUNDLE_ROOT, env=cluster.env, text=True,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )  # fmt: skip
        output = []
        for line in proc.stdout:
            output.append(line)
            if first_step is None and "training epochs" in line:
                first_step = time.monotonic()
        if proc.wait() != 0 or first_step is None:
            sys.exit(f"training failed with {workers} workers:\n{''.join(output)[-3000:]}")
    with open(runs / f"w{workers}" / "history.csv") as f:
        steady = list(csv.DictReader(f))[1:]
    return {
        "workers": workers,
        "images_per_s": round(statistics.median(float(r["images_per_s"]) for r in steady), 1),
        "images_per_s_per_worker": round(
            statistics.median(float(r["images_per_s_per_worker"]) for r in steady), 1
        ),
        "submit_to_training_s": round(first_step - submitted, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--images-per-class", type=int, default=100)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        dataset = Path(tmp) / "dataset"
        size, per_class = args.image_size, args.images_per_class
        preprocess_generated(dataset, f"image_size={size}", f"source.synthetic.raw_size={size}",
                             f"source.synthetic.images_per_class={per_class}")  # fmt: skip
        results = [measure(dataset, Path(tmp) / "runs", w, args.epochs) for w in args.workers]
    first = results[0]
    print(f"\ntrain ResNet-18, {args.image_size} px, 6 classes x {args.images_per_class} images")
    print(f"{'workers':>8} {'images/s':>9} {'ratio':>7} {'per worker':>11} {'submit->train s':>16}")
    for r in results:
        r["ratio"] = round(r["images_per_s"] / first["images_per_s"], 2)
        print(
            f"{r['workers']:>8} {r['images_per_s']:>9.1f} {r['ratio']:>6.2f}x "
            f"{r['images_per_s_per_worker']:>11.1f} {r['submit_to_training_s']:>16.1f}"
        )
    write_results("train", {"args": vars(args), "results": results})


if __name__ == "__main__":
    main()
