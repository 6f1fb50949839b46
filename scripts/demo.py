"""`make demo`: start a local Ray cluster, submit the bundle's jobs to it, stop it.

Each job goes through `ray job submit`, exactly as a user sends it to a real cluster.
"""

import logging
import os
import sys

from pipeline.cluster import BUNDLE_ROOT, LocalCluster

OUTPUT = BUNDLE_ROOT / "outputs" / "demo"


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    dataset = OUTPUT / "dataset"
    with LocalCluster(num_cpus=os.cpu_count()) as cluster:
        print(f"Ray cluster up; dashboard at {cluster.address}", flush=True)
        job = cluster.submit(
            ["python", "-m", "jobs.preprocess", "--config", "configs/demo-preprocess.yaml",
             f"output={dataset}"]
        )  # fmt: skip
        if job.returncode != 0:
            print("demo: the preprocess job failed (its log is above)", file=sys.stderr)
            return job.returncode
    print(f"\nParquet dataset written to {dataset}")
    print(f"  manifest: {dataset / 'manifest.json'}")
    print(f"  shards:   {dataset / 'train'}/, {dataset / 'val'}/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
