"""The bundle at the dataset sizes users have: 1k, 10k and 100k images, on local disk and on an
S3-compatible server (moto on loopback), side by side in one run.

    .venv/bin/python -m bench.scale --sizes 1000 10000 100000

Per size and storage, each a fresh 2-CPU local cluster:
- preprocess: the real job over generated 32 px images (10 classes, shards of 1,000, row
  groups of 128); images/s from its log, the driver's peak memory from its last line.
- ingest=ray_data: one epoch of the training input through Ray Data (read the manifest's files,
  decode + augment in map_batches on the cluster's CPUs, iter_torch_batches in this process, as
  a worker does); images/s and this process's peak memory.
Flat in N is the target for images/s and memory; S3 over local images/s says what storage
latency costs. Results go to bench/results/scale.json.
"""

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

from bench.common import command, write_results
from harness.cluster import BUNDLE_ROOT, LocalCluster
from harness.s3 import S3Server

BUCKET = "bench-scale"
CLASSES = 10
PROGRESS = re.compile(r"progress: (\d+)/\d+ images .* ([\d.]+) images/s")
DONE = re.compile(r"done in (\d+) s; driver peak memory (\d+) MiB")


def preprocess(cluster: LocalCluster, output: str, images: int) -> dict:
    """The preprocess job over `images` generated images into `output`."""
    args = command(
        "python -m jobs.preprocess --config configs/demo-preprocess.yaml"
        " source.synthetic.raw_size=32 image_size=32 shard_size=1000 row_group_size=128",
        f"output={output}",
        f"source.synthetic.num_classes={CLASSES}",
        f"source.synthetic.images_per_class={images // CLASSES}",
    )
    proc = cluster.submit(args, capture=True, timeout_s=3600)
    if proc.returncode != 0:
        sys.exit(f"preprocess of {images} images failed:\n{proc.stdout[-3000:]}")
    done, rate = DONE.search(proc.stdout), PROGRESS.findall(proc.stdout)[-1]
    return {"images_per_s": float(rate[1]), "driver_peak_mib": int(done[2]), "job_s": int(done[1])}


RAY_DATA_EPOCH = """
import json, resource, sys, time
import ray
from pipeline.data.dataset import read_manifest
from pipeline.train.input.ray_data import datasets
from pipeline.core.storage import Location
root = Location.parse(sys.argv[1])
ray.init(address=sys.argv[2], log_to_driver=False)
train = datasets(read_manifest(root), root, augment="random_resized_crop", seed=0)["train"]
started, images, first = time.monotonic(), 0, None
for batch in train.iter_torch_batches(batch_size=128, local_shuffle_buffer_size=512):
    images += len(batch["label"])
    first = first or time.monotonic()
end = time.monotonic()
print(json.dumps({"images": images, "images_per_s": round(images / (end - started), 1),
                  "steady_images_per_s": round(images / (end - first), 1),
                  "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024}))
"""


def ray_data_epoch(cluster: LocalCluster, dataset: str) -> dict:
    """One epoch of ingest=ray_data's train input, consumed in a fresh process as a worker
    would: its images/s and peak memory."""
    out = subprocess.run(
        [sys.executable, "-c", RAY_DATA_EPOCH, dataset, cluster.gcs_address],
        cwd=BUNDLE_ROOT,
        env=cluster.env,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    if out.returncode != 0:
        sys.exit(f"ray_data epoch over {dataset} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 10000, 100000])
    parser.add_argument("--data", type=Path, default=BUNDLE_ROOT / "data" / "scale")
    args = parser.parse_args()
    results = []
    with S3Server() as s3:
        s3.create_bucket(BUCKET)
        for n in args.sizes:
            for storage, root in [
                ("local", str(args.data / f"n{n}")),
                ("s3", f"s3://{BUCKET}/n{n}"),
            ]:
                with LocalCluster(num_cpus=2, env=s3.env) as cluster:
                    row = {"images": n, "storage": storage}
                    row["preprocess"] = preprocess(cluster, root, n)
                    row["ray_data"] = ray_data_epoch(cluster, root)
                results.append(row)
                print(json.dumps(row), flush=True)
    write_results("scale", {"args": {"sizes": args.sizes}, "results": results})


if __name__ == "__main__":
    main()
