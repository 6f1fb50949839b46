"""Preprocessing throughput with 1 and 2 CPUs, and against a plain PIL + pyarrow loop.

    make bench        # or: .venv/bin/python -m bench.preprocess_throughput --images 1200

Builds one folder of food-photo-sized JPEGs (512x384), then:
- plain: this process, one core: PIL decode, resize + center crop to 224 px, JPEG encode,
  Parquet shards of the same size written with pyarrow (no manifest, no split, no checks);
- for each CPU count, a fresh local cluster and the same preprocess job (224 px, JPEG out)
  submitted with `ray job submit`. Two figures per run, both from the job's own log: `images/s`
  from the first shard submitted to the last one written (worker start-up and torch import
  included, as a user sees it), and `steady` from the first shard done to the last.
Targets: 2 CPUs >= 1.7x 1 CPU; the job >= 0.9x plain per core.
Results go to bench/results/preprocess.json.
"""

import argparse
import datetime
import io
import re
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

from bench.common import write_results
from harness.cluster import LocalCluster
from pipeline.data.sources import render_synthetic

PROGRESS = re.compile(
    r"^(\S+ \S+) INFO pipeline.data.preprocess: progress: (\d+)/(\d+) images .* ([\d.]+) images/s$",
    re.MULTILINE,
)


def make_folder(root: Path, images: int, classes: int = 6) -> None:
    for i in range(images):
        name = [
            "red_circle",
            "green_square",
            "blue_triangle",
            "yellow_circle",
            "cyan_square",
            "orange_triangle",
        ][i % classes]
        (root / name).mkdir(parents=True, exist_ok=True)
        img = render_synthetic(name, size=512, seed=0, index=i).crop((0, 0, 512, 384))
        img.save(root / name / f"{i:05d}.jpg", quality=90)


SIZE, SHARD_SIZE = 224, 50  # for the job and the plain loop alike


def plain(src: Path, out: Path, size: int = SIZE, shard_size: int = SHARD_SIZE) -> dict:
    """What a hand-written loop does: no Ray, one core."""
    out.mkdir()
    started, rows, shards = time.monotonic(), [], 0
    paths = sorted(src.glob("*/*.jpg"))
    for i, path in enumerate(paths):
        img = Image.open(path).convert("RGB")
        scale = size / min(img.size)
        w, h = round(img.width * scale), round(img.height * scale)
        img = img.resize((w, h), Image.BILINEAR)
        left, top = (w - size) // 2, (h - size) // 2
        buf = io.BytesIO()
        img.crop((left, top, left + size, top + size)).save(buf, format="JPEG", quality=95)
        rows.append({"image": buf.getvalue(), "label_name": path.parent.name})
        if len(rows) == shard_size or i == len(paths) - 1:
            pq.write_table(pa.Table.from_pylist(rows), out / f"shard-{shards:05d}.parquet")
            rows, shards = [], shards + 1
    return {
        "images": len(paths),
        "images_per_s": round(len(paths) / (time.monotonic() - started), 1),
    }


def measure(src: Path, out: Path, cpus: int) -> dict:
    with LocalCluster(num_cpus=cpus) as cluster:
        proc = cluster.submit(
            [
                "python",
                "-m",
                "jobs.preprocess",
                "--config",
                "configs/demo-preprocess.yaml",
                "source.kind=folder",
                f"source.folder.path={src}",
                f"output={out}",
                f"image_size={SIZE}",
                f"shard_size={SHARD_SIZE}",
                "overwrite=true",
            ],
            capture=True,
        )
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
        base = plain(src, Path(tmp) / "plain")
        results = [measure(src, Path(tmp) / f"out{c}", c) for c in args.cpus]
    first = results[0]
    print(f"\npreprocess, {args.images} JPEGs 512x384 -> {SIZE} px")
    print(f"plain PIL + pyarrow loop, 1 core: {base['images_per_s']:.1f} images/s")
    print(
        f"{'CPUs':>5} {'images/s':>10} {'ratio':>7} {'steady':>8} {'ratio':>7} "
        f"{'steady per CPU / plain':>23}"
    )
    for r in results:
        r["ratio"] = round(r["images_per_s"] / first["images_per_s"], 2)
        r["steady_ratio"] = round(r["steady_images_per_s"] / first["steady_images_per_s"], 2)
        r["steady_per_cpu_over_plain"] = round(
            r["steady_images_per_s"] / r["cpus"] / base["images_per_s"], 2
        )
        print(
            f"{r['cpus']:>5} {r['images_per_s']:>10.1f} {r['ratio']:>6.2f}x "
            f"{r['steady_images_per_s']:>8.1f} {r['steady_ratio']:>6.2f}x "
            f"{r['steady_per_cpu_over_plain']:>22.2f}x"
        )
    targets = {"two_over_one_cpu": 1.7, "per_cpu_over_plain": 0.9}
    write_results(
        "preprocess", {"args": vars(args), "plain": base, "results": results, "targets": targets}
    )


if __name__ == "__main__":
    main()
