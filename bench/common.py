"""What the benchmarks share: generated input data, and where results go."""

import json
import sys
from pathlib import Path

from harness.cluster import BUNDLE_ROOT, LocalCluster


def preprocess_generated(out: Path, *overrides: str, cpus: int = 2) -> None:
    """The demo's generated dataset at `out` (with `overrides`), by the real preprocess job."""
    with LocalCluster(num_cpus=cpus) as cluster:
        proc = cluster.submit(
            [
                "python",
                "-m",
                "jobs.preprocess",
                "--config",
                "configs/demo-preprocess.yaml",
                f"output={out}",
                *overrides,
            ],
            capture=True,
        )
    if proc.returncode != 0:
        sys.exit(f"preprocess failed:\n{proc.stdout[-3000:]}")


def write_results(name: str, results) -> Path:
    """bench/results/<name>.json, and say so."""
    path = BUNDLE_ROOT / "bench" / "results" / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2))
    print(f"written to {path}")
    return path
