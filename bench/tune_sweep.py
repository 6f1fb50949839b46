"""A 4-trial sweep against the same 4 train configs submitted as train jobs one after another.

    .venv/bin/python -m bench.tune_sweep
    .venv/bin/python -m bench.tune_sweep --epochs 3 --images-per-class 200

On one fresh 2-CPU local cluster, after the demo's generated images are preprocessed on it
(which uploads the bundle's package once, for both sides):
- sweep: `python -m jobs.tune --config configs/demo-tune.yaml` over a grid of 4 learning rates,
  num_samples=1 and ASHA off, so that every trial trains every epoch: 2 trials at once, each one
  worker of 1 CPU;
- jobs: each trial's train config (the sweep's `train:` with that learning rate, written to a
  file) submitted as `python -m jobs.train`, one job after the other.
Each side is timed from its first `ray job submit` to its last one's exit; the figure is jobs /
sweep. Both sides train the same configs from the same seed, so each trial's history should
equal its job's (`same_histories`). The load average is recorded before and after each side.
Results go to bench/results/tune_sweep.json.
"""

import argparse
import csv
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import yaml

from bench.common import command, preprocess_generated, write_results
from harness.cluster import BUNDLE_ROOT, LocalCluster
from pipeline.core.config import load_config
from pipeline.model.runs import HISTORY_CSV
from pipeline.tune.config import SweepConfig
from pipeline.tune.summary import SWEEP_SUMMARY

CONFIG = BUNDLE_ROOT / "configs" / "demo-tune.yaml"
LRS = (0.003, 0.002, 0.001, 0.0005)


def timed(cluster: LocalCluster, args: list[str]) -> float:
    """Seconds from `ray job submit` of `args` to its exit; exits if the job fails."""
    started = time.monotonic()
    proc = cluster.submit(args, capture=True)
    took = time.monotonic() - started
    if proc.returncode != 0:
        sys.exit(f"job {args} failed:\n{proc.stdout[-3000:]}")
    return round(took, 1)


def load() -> list[float]:
    """The load average over 1, 5 and 15 minutes: other work on the machine shares its cores."""
    return [round(x, 2) for x in os.getloadavg()]


def val_losses(run: Path) -> list[float]:
    """Each epoch's val_loss, from the run's history.csv."""
    with open(run / HISTORY_CSV) as f:
        return [float(r["val_loss"]) for r in csv.DictReader(f)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--images-per-class", type=int, default=200, help="6 classes, 64 px")
    args = parser.parse_args()
    grid = "{grid: [" + ", ".join(map(str, LRS)) + "]}"
    with tempfile.TemporaryDirectory() as tmp, LocalCluster(num_cpus=2) as cluster:
        dataset, runs = Path(tmp) / "dataset", Path(tmp) / "runs"
        per_class = f"source.synthetic.images_per_class={args.images_per_class}"
        preprocess_generated(dataset, per_class, cluster=cluster)
        overrides = [
            f"dataset={dataset}",
            f"storage_path={runs}",
            "name=sweep",
            "num_samples=1",
            "asha.enabled=false",
            f"train.epochs={args.epochs}",
            f"space.optimizer.lr={grid}",
        ]
        cfg = load_config(SweepConfig, CONFIG, overrides)
        jobs = []
        for i, lr in enumerate(LRS):
            train = cfg.train_dict() | {"name": f"job{i}"}
            train["optimizer"] = {**train.get("optimizer", {}), "lr": lr}
            path = Path(tmp) / f"job{i}.yaml"
            path.write_text(yaml.safe_dump(train))
            jobs.append(command("python -m jobs.train --config", str(path)))

        sweep = {"load_before": load()}
        sweep["wall_s"] = timed(
            cluster, command("python -m jobs.tune --config", str(CONFIG), *overrides)
        )
        sweep["load_after"] = load()
        one_by_one = {"load_before": load(), "each_s": [timed(cluster, job) for job in jobs]}
        one_by_one["load_after"] = load()
        one_by_one["wall_s"] = round(sum(one_by_one["each_s"]), 1)

        summary = json.loads((runs / "sweep" / SWEEP_SUMMARY).read_text())
        by_lr = {t["config"]["optimizer.lr"]: Path(t["run"]) for t in summary["trials"]}
        histories = {
            lr: {"sweep": val_losses(by_lr[lr]), "job": val_losses(runs / f"job{i}")}
            for i, lr in enumerate(LRS)
        }
    ratio = round(one_by_one["wall_s"] / sweep["wall_s"], 2)
    same = all(h["sweep"] == h["job"] for h in histories.values())
    print(f"\n4 configs x {args.epochs} epochs, 6 classes x {args.images_per_class} images, 64 px")
    print(f"sweep (2 trials at once): {sweep['wall_s']} s, load {sweep['load_before']}")
    each = ", ".join(map(str, one_by_one["each_s"]))
    jobs_line = f"{one_by_one['wall_s']} s ({each}), load {one_by_one['load_before']}"
    print(f"train jobs one by one:    {jobs_line}")
    print(f"jobs / sweep: {ratio}x; same histories: {same}")
    write_results(
        "tune_sweep",
        {
            "epochs": args.epochs,
            "images_per_class": args.images_per_class,
            "learning_rates": LRS,
            "sweep": sweep,
            "jobs": one_by_one,
            "jobs_over_sweep": ratio,
            "same_histories": same,
            "val_loss": {str(lr): h for lr, h in histories.items()},
        },
    )


if __name__ == "__main__":
    main()
