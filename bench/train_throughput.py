"""Ray Train's overhead: TorchTrainer with 1 worker against a plain PyTorch loop, 2 workers
against 1, and the time from `ray job submit` to the first training step.

    .venv/bin/python -m bench.train_throughput --image-size 64 --epochs 3

Preprocesses generated images once, then:
- plain: one process, the same model, loader (`pipeline.train.input.loaders.train_data`, the
  worker's own), batch size, optimizer and train step as a worker, torch threads = 1;
- for each worker count, a fresh local cluster with that many CPUs and the train job (1 CPU
  per worker, no DataLoader processes) submitted with `ray job submit`.
Images/s are medians over the epochs after the first (which pays for warm-up): for the job, from
its history.csv, all workers together. With --repeat N, N rounds of all of it, and the ratios'
medians. Start-up is timed from the submission to lines of the
job's log: the driver ready ("new run"), the workers up (rank 0's "workers on"), the first step
(rank 0's "training epochs"). Targets: 1 worker >= 0.95x plain, submission to first
step < 15 s. Results go to bench/results/train.json.
"""

import argparse
import csv
import json
import statistics
import tempfile
from pathlib import Path

import torch

from bench.common import preprocess_generated, submit_timed, write_results
from harness.cluster import BUNDLE_ROOT, LocalCluster
from pipeline.core.config import load_config
from pipeline.core.storage import Location
from pipeline.data.dataset import read_manifest
from pipeline.model.device import DevicePolicy
from pipeline.model.networks import build_model
from pipeline.model.runs import HISTORY_CSV
from pipeline.train.config import TrainConfig
from pipeline.train.epoch import train_one_epoch
from pipeline.train.input.loaders import train_data
from pipeline.train.optim import build_optimizer

MILESTONES = {
    "driver_ready_s": "new run",
    "workers_up_s": "workers on",
    "first_step_s": "training epochs",
}


def plain(dataset: Path, epochs: int, overrides: list[str]) -> dict:
    """The worker's training step in this process, without Ray."""
    torch.set_num_threads(1)
    cfg = load_config(
        TrainConfig,
        BUNDLE_ROOT / "configs/demo-train.yaml",
        [
            f"dataset={dataset}",
            f"storage_path={dataset.parent}",
            "scaling.num_workers=1",
            *overrides,
        ],
    )
    root = Location.parse(cfg.dataset)
    manifest = read_manifest(root)
    cpu = torch.device("cpu")
    policy = DevicePolicy(cpu, "fp32", manifest.mean, manifest.std)
    torch.manual_seed(cfg.seed)
    model = build_model(len(manifest.classes))
    optimizer, _ = build_optimizer(model, cfg)
    loader = train_data(cfg, root, manifest, rank=0, world=1, device=cpu)
    criterion = torch.nn.CrossEntropyLoss(label_smoothing=cfg.optimizer.label_smoothing)
    rates = []
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        t = train_one_epoch(model, loader, optimizer, criterion, policy=policy)
        rates.append(t["images"] / t["seconds"])
    return {"images_per_s": round(statistics.median(rates[1:]), 1)}


def measure(
    dataset: Path, runs: Path, workers: int, epochs: int, overrides: list[str], name: str
) -> dict:
    args = [
        "python",
        "-m",
        "jobs.train",
        "--config",
        "configs/demo-train.yaml",
        f"dataset={dataset}",
        f"storage_path={runs}",
        f"name={name}",
        f"epochs={epochs}",
        f"scaling.num_workers={workers}",
        *overrides,
    ]
    with LocalCluster(num_cpus=workers) as cluster:
        seen = submit_timed(cluster, args, MILESTONES)
    with open(runs / name / HISTORY_CSV) as f:
        steady = list(csv.DictReader(f))[1:]
    return {
        "workers": workers,
        "images_per_s": round(statistics.median(float(r["images_per_s"]) for r in steady), 1),
        "images_per_s_per_worker": round(
            statistics.median(float(r["images_per_s_per_worker"]) for r in steady), 1
        ),
        **seen,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--images-per-class", type=int, default=100)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeat", type=int, default=1, help="rounds; ratios are their medians")
    args = parser.parse_args()
    overrides = ["global_batch_size=32"]
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        dataset = Path(tmp) / "dataset"
        size, per_class = args.image_size, args.images_per_class
        preprocess_generated(
            dataset,
            f"image_size={size}",
            f"source.synthetic.raw_size={size}",
            f"source.synthetic.images_per_class={per_class}",
        )
        for i in range(args.repeat):
            base = plain(dataset, args.epochs, overrides)
            jobs = [
                measure(dataset, Path(tmp) / "runs", w, args.epochs, overrides, f"w{w}r{i}")
                for w in args.workers
            ]
            for r in jobs:
                r["over_plain"] = round(r["images_per_s"] / base["images_per_s"], 2)
                r["over_first"] = round(r["images_per_s"] / jobs[0]["images_per_s"], 2)
            rounds.append({"plain": base, "jobs": jobs})
    print(f"\ntrain ResNet-18, {args.image_size} px, 6 classes x {args.images_per_class} images")
    print(
        f"{'round':>5} {'plain':>6} {'workers':>8} {'images/s':>9} {'/plain':>7} "
        f"{'/1 worker':>10}  seconds from submission to: "
        "driver ready, workers up, first step"
    )
    for i, r in enumerate(rounds):
        for j in r["jobs"]:
            print(
                f"{i:>5} {r['plain']['images_per_s']:>6.1f} {j['workers']:>8} "
                f"{j['images_per_s']:>9.1f} {j['over_plain']:>6.2f}x {j['over_first']:>9.2f}x"
                f"  {j['driver_ready_s']}, {j['workers_up_s']}, {j['first_step_s']}"
            )
    medians = {}
    for k, w in enumerate(args.workers):
        medians[f"{w}_workers"] = {
            key: statistics.median(r["jobs"][k][key] for r in rounds)
            for key in ("over_plain", "over_first", *MILESTONES)
        }
    print(f"medians over {args.repeat} rounds: {json.dumps(medians)}")
    targets = {"one_worker_over_plain": 0.95, "first_step_s": 15}
    write_results(
        "train", {"args": vars(args), "rounds": rounds, "medians": medians, "targets": targets}
    )


if __name__ == "__main__":
    main()
