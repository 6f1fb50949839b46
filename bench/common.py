"""What the benchmarks share: generated input data, and where results go."""

import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

from harness.cluster import BUNDLE_ROOT, LocalCluster
from pipeline.core.storage import Location
from pipeline.data.dataset import read_manifest
from pipeline.model.checkpoint import CheckpointMeta, save_checkpoint
from pipeline.model.networks import build_model


def command(line: str, *args: str) -> list[str]:
    """A command line: its fixed words written as one `line`, then `args` (paths, overrides)
    each kept whole."""
    return [*shlex.split(line), *args]


def preprocess_generated(
    out: Path, *overrides: str, cpus: int = 2, cluster: LocalCluster | None = None
) -> None:
    """The demo's generated dataset at `out` (with `overrides`), by the real preprocess job on
    `cluster`, or on a fresh local cluster of `cpus` CPUs."""
    args = command(
        "python -m jobs.preprocess --config configs/demo-preprocess.yaml",
        f"output={out}",
        *overrides,
    )
    if cluster is None:
        with LocalCluster(num_cpus=cpus) as fresh:
            proc = fresh.submit(args, capture=True)
    else:
        proc = cluster.submit(args, capture=True)
    if proc.returncode != 0:
        sys.exit(f"preprocess failed:\n{proc.stdout[-3000:]}")


def random_checkpoint(dataset: Path, out: Path) -> Path:
    """A ResNet-18 checkpoint at `out` for `dataset`'s classes and image size, with random
    weights: inference speed and memory do not depend on them, and training would take long."""
    m = read_manifest(Location.parse(str(dataset)))
    out.mkdir()
    meta = CheckpointMeta(
        epoch=0,
        classes=m.classes,
        image_size=m.image_size,
        mean=m.mean,
        std=m.std,
        dataset_fingerprint=m.fingerprint,
        dataset_version=m.version,
        metrics={},
        history=[],
        config={"checkpoint": {"metric": "val_loss"}},
    )
    save_checkpoint(out, build_model(len(m.classes)).state_dict(), meta, {})
    return out


def write_results(name: str, results) -> Path:
    """bench/results/<name>.json, and say so."""
    path = BUNDLE_ROOT / "bench" / "results" / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2))
    print(f"written to {path}")
    return path


def submit_timed(
    cluster: LocalCluster, args: list[str], milestones: dict[str, str], *, tree: Path = BUNDLE_ROOT
) -> dict[str, float]:
    """Submit `args` as a job of the bundle at `tree`, streaming its log: seconds from the
    submission to the first line that holds each milestone's text. Exits if the job fails."""
    argv = cluster.submit_command(args, runtime_env=tree / "runtime_env.yaml")
    submitted, seen, output = time.monotonic(), {}, []
    proc = subprocess.Popen(
        argv,
        cwd=tree,
        env=cluster.env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    for line in proc.stdout:
        output.append(line)
        for key, text in milestones.items():
            if key not in seen and text in line:
                seen[key] = round(time.monotonic() - submitted, 1)
    if proc.wait() != 0 or len(seen) < len(milestones):
        sys.exit(f"job {args} of {tree} failed:\n{''.join(output)[-3000:]}")
    return seen
