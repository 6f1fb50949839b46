"""Batch inference as the input grows: images/s and the job driver's peak memory and CPU time at
each size, on local disk and on an S3-compatible server, side by side.

    .venv/bin/python -m bench.infer_scale --data-dir /tmp/infer-scale   # 1k, 100k, 300k images
    .venv/bin/python -m bench.infer_scale --sizes 1000 10000 --no-s3     # a quick look

For each size, preprocesses generated images at 32 px with the real preprocess job (every image in
the train split, in shards of `--shard-size` images: 250 by default, whose blocks of predictions are
small enough to be kept in the driver's own memory, the harder case) and classifies that split with
a ResNet-18 of random weights (speed and memory do not depend on them). The infer job runs through
`ray job submit` on one local cluster, for each size, on local disk, then on a moto S3 server on
loopback (`--no-s3` to skip). From each run's summary.json: images/s over the whole run and after
the first batch, and the driver's peak RSS and CPU seconds, which the job records itself.
`--data-dir` keeps the datasets for the next run: generating 300,000 images takes about 6 minutes
here, and an up-to-date dataset is not rebuilt. Everything at the default sizes: about 25 minutes on
2 cores, 15 with the datasets kept.
The driver's peak RSS holds constants (torch, matplotlib for the plot) and, during the first
minute of a run, Ray Data's own warm-up (about 15 MiB): what must not grow with the input is the
step between the two largest sizes.
Targets, the two largest sizes: driver peak RSS grows <= 10 MiB; steady images/s >= 0.9x.
Results go to bench/results/infer_scale.json.
"""

import argparse
import itertools
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.fs as pafs

from bench.common import preprocess_generated, random_checkpoint, write_results
from harness.cluster import LocalCluster, free_port
from pipeline.core.storage import Location
from pipeline.infer.predictions import SUMMARY

CLASSES = 10
BUCKET = "bench"
TARGETS = {"rss_growth_mib": 10, "steady_ratio": 0.9}


def make_dataset(root: Path, images: int, image_size: int, shard_size: int, cpus: int) -> Path:
    dataset = root / f"images-{images}-shards-{shard_size}" / "dataset"
    preprocess_generated(
        dataset,
        f"source.synthetic.num_classes={CLASSES}",
        f"source.synthetic.images_per_class={images // CLASSES}",
        f"image_size={image_size}",
        f"source.synthetic.raw_size={image_size + image_size // 7}",
        "val_fraction=0",
        f"shard_size={shard_size}",
        "row_group_size=128",
        cpus=cpus,
    )
    return dataset


def s3_server() -> tuple[object, dict[str, str]]:
    """A moto S3 server in this process, and the environment that points AWS clients at it."""
    from moto.server import ThreadedMotoServer

    # moto's web server logs every request at INFO; the benchmark's table would drown in them.
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=free_port(), verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {
        "AWS_ENDPOINT_URL": f"http://{host}:{port}",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_REGION": "us-east-1",
    }
    os.environ.update(env)
    fs, _ = pafs.FileSystem.from_uri(f"s3://{BUCKET}?allow_bucket_creation=true")
    fs.create_dir(BUCKET)
    return server, env


def upload(local: Path, key: str) -> str:
    fs, _ = pafs.FileSystem.from_uri(f"s3://{BUCKET}")
    pafs.copy_files(str(local), f"{BUCKET}/{key}", destination_filesystem=fs)
    return f"s3://{BUCKET}/{key}"


def infer(cluster: LocalCluster, model: str, source: str, output: str, args) -> dict:
    started = time.monotonic()
    proc = cluster.submit(
        [
            "python",
            "-m",
            "jobs.infer",
            "--config",
            "configs/demo-infer.yaml",
            f"model={model}",
            f"input={source}",
            f"output={output}",
            "split=train",
            f"batch_size={args.batch_size}",
            f"num_actors={args.cpus}",
            "cpus_per_actor=1",
            *args.set,
        ],
        capture=True,
    )
    if proc.returncode != 0:
        sys.exit(f"inference of {source} failed:\n{proc.stdout[-3000:]}")
    summary = json.loads(Location.parse(output).child(SUMMARY).read_bytes())
    keys = ("images", "images_per_s", "steady_images_per_s", "first_batch_s")
    return {
        **{k: round(summary[k], 1) for k in keys},
        "driver_peak_rss_mib": summary["driver_peak_rss_mib"],
        "driver_cpu_s": summary["driver_cpu_s"],
        "job_s": round(time.monotonic() - started, 1),
    }


def step(a: dict, b: dict, size_a: int, size_b: int) -> dict:
    """What changed from one size to the next."""
    return {
        "from": size_a,
        "to": size_b,
        "rss_growth_mib": round(b["driver_peak_rss_mib"] - a["driver_peak_rss_mib"], 1),
        "cpu_ratio": round(b["driver_cpu_s"] / a["driver_cpu_s"], 2),
        "steady_ratio": round(b["steady_images_per_s"] / a["steady_images_per_s"], 2)
        if a["steady_images_per_s"]
        else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 100_000, 300_000])
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--cpus", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument(
        "--shard-size", type=int, default=250, help="images per Parquet shard (Ray Data block)"
    )
    parser.add_argument("--no-s3", action="store_true", help="local disk only")
    parser.add_argument(
        "--set", nargs="*", default=[], metavar="KEY=VALUE", help="more settings of the infer job"
    )
    parser.add_argument("--data-dir", type=Path, help="keep the datasets here (default: temp)")
    args = parser.parse_args()
    sizes = sorted(args.sizes)
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        data = args.data_dir or Path(tmp)
        datasets = {
            n: make_dataset(data, n, args.image_size, args.shard_size, args.cpus) for n in sizes
        }
        checkpoint = random_checkpoint(datasets[sizes[0]], Path(tmp) / "checkpoint")
        print(f"datasets ready after {time.monotonic() - started:.0f} s", flush=True)
        server, env = (None, {}) if args.no_s3 else s3_server()
        results: dict[str, dict[int, dict]] = {"local": {}}
        try:
            with LocalCluster(num_cpus=args.cpus, env=env) as cluster:
                for n in sizes:
                    out = str(Path(tmp) / f"predictions-{n}")
                    results["local"][n] = infer(
                        cluster, str(checkpoint), str(datasets[n]), out, args
                    )
                    print(f"local {n}: {results['local'][n]}", flush=True)
                if server is not None:
                    results["s3"] = {}
                    model = upload(checkpoint, "checkpoint")
                    for n in sizes:
                        source = upload(datasets[n], f"images-{n}")
                        out = f"s3://{BUCKET}/predictions-{n}"
                        results["s3"][n] = infer(cluster, model, source, out, args)
                        print(f"s3 {n}: {results['s3'][n]}", flush=True)
        finally:
            if server is not None:
                server.stop()
    steps = {
        storage: [step(by_size[a], by_size[b], a, b) for a, b in itertools.pairwise(sizes)]
        for storage, by_size in results.items()
    }
    print(f"\nbatch inference, ResNet-18 at {args.image_size} px, {args.cpus} CPUs")
    print(
        f"{'storage':>7} {'images':>7} {'images/s':>9} {'steady':>7} {'first s':>7} "
        f"{'RSS MiB':>8} {'CPU s':>6}"
    )
    for storage, by_size in results.items():
        for n, r in by_size.items():
            print(
                f"{storage:>7} {n:>7} {r['images_per_s']:>9.1f} {r['steady_images_per_s']:>7.1f} "
                f"{r['first_batch_s']:>7.1f} {r['driver_peak_rss_mib']:>8.1f} "
                f"{r['driver_cpu_s']:>6.1f}"
            )
    for storage, by_step in steps.items():
        for st in by_step:
            print(
                f"{storage}, {st['from']} -> {st['to']} images: driver RSS "
                f"{st['rss_growth_mib']:+.1f} MiB, CPU {st['cpu_ratio']}x, "
                f"steady images/s {st['steady_ratio']}x"
            )
    print(f"total {time.monotonic() - started:.0f} s")
    write_results(
        "infer_scale",
        {
            "args": {**vars(args), "data_dir": str(args.data_dir)},
            "results": results,
            "steps": steps,
            "targets": TARGETS,
            "total_s": round(time.monotonic() - started),
        },
    )


if __name__ == "__main__":
    main()
