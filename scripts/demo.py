"""`make demo`: start a local Ray cluster, run the bundle's chain on it, stop it.

The chain is `python -m jobs.submit ... all`, exactly what a scheduler runs against a real
cluster: preprocess, train, infer, each a job submitted with runtime_env.yaml.
"""

import json
import logging
import os
import subprocess
import sys
import time

from harness.cluster import BUNDLE_ROOT, LocalCluster
from pipeline.infer.predictions import SUMMARY
from pipeline.model.runs import CURVES_PNG, HISTORY_CSV, RUN_SUMMARY

OUTPUT = BUNDLE_ROOT / "outputs" / "demo"


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    started = time.monotonic()
    with LocalCluster(num_cpus=os.cpu_count()) as cluster:
        print(
            f"Ray cluster up in {time.monotonic() - started:.0f} s; dashboard at {cluster.address}",
            flush=True,
        )
        chain = [
            sys.executable,
            "-m",
            "jobs.submit",
            "--address",
            cluster.address,
            "--root",
            str(OUTPUT),
            "--profile",
            "demo",
            "all",
        ]
        proc = subprocess.run(chain, cwd=BUNDLE_ROOT, env=cluster.env)
        if proc.returncode != 0:
            print(
                f"demo: the chain failed with exit code {proc.returncode} (its log is above)",
                file=sys.stderr,
            )
            return proc.returncode
    dataset, run = OUTPUT / "dataset", OUTPUT / "runs" / "demo"
    predictions = OUTPUT / "predictions" / "demo"
    summary = json.loads((run / RUN_SUMMARY).read_text())
    best = summary["best_metrics"]
    print(f"\nParquet dataset: {dataset} (versions/<version>.json, data/<version>/train/, val/)")
    print(f"Training run:    {summary['run']} ({RUN_SUMMARY}, {HISTORY_CSV}, {CURVES_PNG})")
    print(
        f"  final val accuracy {summary['final_accuracy']:.3f} after {summary['epochs']} epochs; "
        f"{summary['images_per_s']:.0f} images/s, {summary['worker_hours'] or 0:.3f} worker-hours"
    )
    print(
        f"  best checkpoint {summary['best_checkpoint']} "
        f"(epoch {best['epoch']} by {summary['checkpoint_metric']}: val loss "
        f"{best['val_loss']:.3f}, val accuracy {best['val_accuracy']:.3f})"
    )
    infer = json.loads((predictions / SUMMARY).read_text())
    print(f"Inference:       {predictions / infer['predictions']}")
    print(
        f"  {infer['images']} val images, accuracy {infer['accuracy']:.3f}, "
        f"{infer['images_per_s']:.0f} images/s ({predictions / SUMMARY}, "
        f"{predictions / infer['confusion_matrix_png']})"
    )
    print(f"Total: {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
