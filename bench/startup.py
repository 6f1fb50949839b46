"""Seconds from `ray job submit` of the train job to its first training step, part by part.

    .venv/bin/python -m bench.startup --repeat 3
    .venv/bin/python -m bench.startup --repeat 3 --compare ../other-checkout   # side by side

Each round starts a fresh 2-CPU local cluster and submits a 2-worker, 1-epoch train job (64 px
generated images, no DataLoader processes), timing when lines of its streamed log arrive:
- driver started: the job supervisor ran the entrypoint (runtime env ready);
- driver ready: the driver imported the training code, joined the cluster, checked the data;
- workers up: Ray Train's controller placed and started the workers, which imported the
  training loop and formed the process group;
- first step: each worker built the model, restored, and opened its loaders.
With --compare, the same rounds also run the jobs of another checkout of this bundle (its
jobs/ and pipeline/, uploaded from there), alternating, so both see the same machine. Target:
first step < 15 s. Results go to bench/results/startup.json.
"""

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from bench.common import command, preprocess_generated, submit_timed, write_results
from harness.cluster import BUNDLE_ROOT, LocalCluster

MILESTONES = {
    "driver_started_s": "Running entrypoint",
    "driver_ready_s": "new run",
    "workers_up_s": "workers on",
    "first_step_s": "training epochs",
}


def measure(tree: Path, dataset: Path, runs: Path, name: str) -> dict:
    """One submission of `tree`'s train job to a fresh cluster; seconds to each milestone."""
    args = command(
        "python -m jobs.train --config configs/demo-train.yaml"
        " epochs=1 global_batch_size=32 scaling.num_workers=2",
        f"dataset={dataset}",
        f"storage_path={runs}",
        f"name={name}",
    )
    with LocalCluster(num_cpus=2) as cluster:
        return submit_timed(cluster, args, MILESTONES, tree=tree)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--compare", type=Path, help="another checkout of this bundle")
    args = parser.parse_args()
    trees = {"this": BUNDLE_ROOT} | ({"compared": args.compare.resolve()} if args.compare else {})
    rounds = {label: [] for label in trees}
    with tempfile.TemporaryDirectory() as tmp:
        dataset = Path(tmp) / "dataset"
        preprocess_generated(dataset, "image_size=64", "source.synthetic.raw_size=64")
        for i in range(args.repeat):
            for label, tree in trees.items():
                result = measure(tree, dataset, Path(tmp) / "runs", f"{label}{i}")
                rounds[label].append(result)
                print(f"round {i} {label}: {json.dumps(result)}", flush=True)
    medians = {
        label: {key: statistics.median(r[key] for r in results) for key in MILESTONES}
        for label, results in rounds.items()
    }
    print(f"\nmedians over {args.repeat} rounds, seconds from submission: {json.dumps(medians)}")
    trees_text = {label: str(tree) for label, tree in trees.items()}
    write_results("startup", {"trees": trees_text, "rounds": rounds, "medians": medians})


if __name__ == "__main__":
    main()
