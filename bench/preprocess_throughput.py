"""Preprocessing throughput with 1 and 2 CPUs, measured side by side in one run.

    make bench        # or: .venv/bin/python bench/preprocess_throughput.py --images 1200

Builds one folder of food-photo-sized JPEGs (512x384), then for each CPU count starts a fresh
local cluster and submits the same preprocess job (224 px, JPEG out) with `ray job submit`.
Two figures per run, both from the job's own log: `images/s` from the first shard submitted to
the last one written (worker start-up and torch import included, as a user sees it), and
`steady` from the first shard done to the last (start-up excluded). Results go to
bench/results/preprocess.json.
"""

import argparse
import datetime
import re
import sys
import tempfile
from pathlib import Path

from common import write_results

from pipeline.cluster import LocalCluster
from pipeline.sources import render_synthetic

PROGRESS = re.compile(
    r"^(\S+ \S+) INFO pipeline.preprocess: progress: (\d+)/(\d+) images .* ([\d.]+) images/s$",
    re.MULTILINE,
)


def make_folder(root: Path, images: int, classes: int = 6) -> None:
    for i in range(images):
        name = ["red_circle", "green_square", "blue_triangle", "yellow_circle", "cyan_square",
                "orange_triangle"][i % classes]  # fmt: skip
        (root / name).mkdir(parents=True, exist_ok=True)
        img = render_synthetic(name, size=512, seed=0, index=i).crop((0, 0, 512, 384))
        img.save(root / name / f"{i:05d}.jpg", quality=90)


def measure(src: Path, out: Path, cpus: int) -> dict:
    with LocalCluster(num_cpus=cpus) as cluster:
        proc = cluster.submit(
            ["python", "-m", "jobs.preprocess", "--config", "configs/demo-preprocess.yaml",
             "source.kind=folder", f"source.folder.path={src}", f"output={out}",
             "image_size=224", "shard_size=50", "overwrite=true"],
            capture=True,
        )  # fmt: skip
    if proc.returncode != 0:
        sys.exit(f"preprocess failed with {cpus} CPUs:\n{proc.stdout[-3000:]}")
    lines = PROGRESS.findall(proc.stdout)
    (t0, n0, _, _), (t1, n1, total, rate) = lines[0], lines[-1]
    assert n1 == total, proc.stdout[-3000:]
    seconds = (_time(t1) - _time(t0)).total_seconds()
    return {
        "cpus": cpus,
        "images": int(total),
        "images_per_s": float(rate),
        "steady_images_per_s": round((int(n1) - int(n0)) / seconds, 1),
    }


def _time(stamp: str) -> datetime.datetime:
    return datetime.datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=1200)
    parser.add_argument("--cpus", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "src"
        make_folder(src, args.images)
        results = [measure(src, Path(tmp) / f"out{c}", c) for c in args.cpus]
    first = results[0]
    print(f"\npreprocess, {args.images} JPEGs 512x384 -> 224 px")
    print(f"{'CPUs':>5} {'images/s':>10} {'ratio':>7} {'steady':>8} {'ratio':>7}")
    for r in results:
        r["ratio"] = round(r["images_per_s"] / first["images_per_s"], 2)
        r["steady_ratio"] = round(r["steady_images_per_s"] / first["steady_images_per_s"], 2)
        print(
            f"{r['cpus']:>5} {r['images_per_s']:>10.1f} {r['ratio']:>6.2f}x "
            f"{r['steady_images_per_s']:>8.1f} {r['steady_ratio']:>6.2f}x"
        )
    write_results("preprocess", results)


if __name__ == "__main__":
    main()
