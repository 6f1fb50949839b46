"""`make demo`: start a local Ray cluster, submit the bundle's jobs to it, stop it.

Each job goes through `ray job submit`, exactly as a user sends it to a real cluster.
"""

import json
import logging
import os
import sys

from pipeline.cluster import BUNDLE_ROOT, LocalCluster

OUTPUT = BUNDLE_ROOT / "outputs" / "demo"


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    dataset, runs, predictions = OUTPUT / "dataset", OUTPUT / "runs", OUTPUT / "predictions"
    steps = [
        ("preprocess", "configs/demo-preprocess.yaml", [f"output={dataset}"]),
        ("train", "configs/demo-train.yaml", [f"dataset={dataset}", f"storage_path={runs}"]),
        ("infer", "configs/demo-infer.yaml",
         [f"model={runs / 'demo'}", f"input={dataset}", f"output={predictions}"]),
    ]  # fmt: skip
    with LocalCluster(num_cpus=os.cpu_count()) as cluster:
        print(f"Ray cluster up; dashboard at {cluster.address}", flush=True)
        for job, config, overrides in steps:
            proc = cluster.submit(["python", "-m", f"jobs.{job}", "--config", config, *overrides])
            if proc.returncode != 0:
                print(f"demo: the {job} job failed (its log is above)", file=sys.stderr)
                return proc.returncode
    summary = json.loads((runs / "demo" / "summary.json").read_text())
    best = summary["best_metrics"]
    print(f"\nParquet dataset: {dataset} (manifest.json, train/, val/)")
    print(f"Training run:    {summary['run']} (summary.json, history.csv, curves.png)")
    print(f"  final val accuracy {summary['final_accuracy']:.3f} after {summary['epochs']} epochs; "
          f"{summary['images_per_s']:.0f} images/s")  # fmt: skip
    print(f"  best checkpoint {summary['best_checkpoint']} "
          f"(epoch {best['epoch']}, val accuracy {best['val_accuracy']:.3f})")  # fmt: skip
    infer = json.loads((predictions / "summary.json").read_text())
    print(f"Inference:       {predictions / 'predictions.parquet'}")
    print(f"  {infer['images']} val images, accuracy {infer['accuracy']:.3f}, "
          f"{infer['images_per_s']:.0f} images/s (summary.json, confusion_matrix.png)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
