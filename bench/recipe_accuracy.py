"""A training recipe's accuracy against the plain one, on real photographs, same epochs.

    .venv/bin/python -m bench.recipe_accuracy --epochs 30 --seeds 0 1

The photographs are bench.photos' (CIFAR-10 cats and dogs, 2,000 at 32 px), preprocessed once
by the real job. Then, on one 2-CPU local cluster, the train job runs the plain demo config
(configs/demo-train.yaml: AdamW, crop and flip) and the same config with a recipe layered over
it (`--config configs/recipes/<recipe>.yaml`), for the same epochs, batch, model and seeds. The
recipe's learning rate is scaled from its 256 images to this batch, as its file says. From
scratch: no pretrained weights can be downloaded here. Results go to
bench/results/recipe_accuracy.json.
"""

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from bench.common import command, write_results
from harness.cluster import BUNDLE_ROOT, LocalCluster

BATCH = 64


def submit(cluster: LocalCluster, args: list[str]) -> None:
    proc = cluster.submit(["python", "-m", *args], capture=True, timeout_s=7200)
    if proc.returncode != 0:
        sys.exit(f"{args[0]} failed:\n{proc.stdout[-3000:]}")


def train(cluster, dataset: Path, runs: Path, name: str, files: list[str], sets: list[str]):
    """One training run; its summary and its history's last row."""
    configs = [arg for f in ["configs/demo-train.yaml", *files] for arg in ("--config", f)]
    submit(
        cluster,
        [
            "jobs.train",
            *configs,
            f"dataset={dataset}",
            f"storage_path={runs}",
            f"name={name}",
            f"global_batch_size={BATCH}",
            *sets,
        ],
    )
    summary = json.loads((runs / name / "summary.json").read_text())
    with open(runs / name / "history.csv") as f:
        header, *rows = [line.strip().split(",") for line in f]
    return summary, dict(zip(header, rows[-1], strict=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--recipe", default="scratch", help="a name in configs/recipes/")
    parser.add_argument("--photos", type=Path, help="bench.photos' folder (default: made here)")
    args = parser.parse_args()

    recipe = f"configs/recipes/{args.recipe}.yaml"
    lr = yaml.safe_load((BUNDLE_ROOT / recipe).read_text())["optimizer"]["lr"] * BATCH / 256
    work = Path(tempfile.mkdtemp(prefix="recipe-accuracy-"))
    photos = args.photos or work / "photos"
    if not args.photos:
        subprocess.run([sys.executable, "-m", "bench.photos", "--out", str(photos)], check=True)
    dataset, runs = work / "dataset", work / "runs"
    results = {"recipe": recipe, "epochs": args.epochs, "global_batch_size": BATCH, "runs": []}
    with LocalCluster(num_cpus=2) as cluster:
        submit(
            cluster,
            command(
                "jobs.preprocess --config configs/demo-preprocess.yaml"
                " source.kind=folder image_size=32",
                f"source.folder.path={photos}",
                f"output={dataset}",
            ),
        )
        for seed in args.seeds:
            common = [f"epochs={args.epochs}", f"seed={seed}"]
            for name, files, sets in [
                ("plain", [], common),
                (args.recipe, [recipe], [*common, f"optimizer.lr={lr:g}"]),
            ]:
                started = time.monotonic()
                summary, last = train(cluster, dataset, runs, f"{name}-{seed}", files, sets)
                row = {"recipe": name, "seed": seed, "wall_s": round(time.monotonic() - started)}
                row |= {k: round(float(v), 4) for k, v in last.items() if "val_accuracy" in k}
                row["best_val_accuracy"] = summary["best_metrics"]["val_accuracy"]
                results["runs"].append(row)
                print(json.dumps(row), flush=True)
    write_results("recipe_accuracy", results)


if __name__ == "__main__":
    main()
