"""A team's platform values, and the files `make platforms` renders from them: shared by the
platform tests of each tier."""

from __future__ import annotations

from pathlib import Path

import yaml

from scripts.platforms.__main__ import main
from scripts.platforms.render import EXAMPLE
from scripts.platforms.validate import CRDS

# A team's values, as a platform team on GKE writes them.
TEAM = {
    "name": "vision",
    "storage": "gs://acme-ml/vision",
    "image": {
        "registry": "europe-docker.pkg.dev/acme/ml",
        "repository": "vision-ray",
        "tag": "2026.11.1",
        "pull_secrets": ["acme-registry"],
    },
    "head": {"cpus": 4, "memory_gi": 16, "instance_types": {"gcp": "n2-standard-8"}},
    "worker_groups": [
        {
            "name": "cpu",
            "cpus": 15,
            "memory_gi": 60,
            "max_nodes": 8,
            "instance_types": {"gcp": "n2-standard-16"},
        },
        {
            "name": "l4",
            "cpus": 7,
            "memory_gi": 28,
            "gpus": 1,
            "max_nodes": 4,
            "instance_types": {"gcp": "g2-standard-8"},
            "node_selector": {"cloud.google.com/gke-accelerator": "nvidia-l4"},
            "tolerations": [{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}],
        },
    ],
    "jobs": {
        "set": [
            "train.epochs=30",
            "train.model.name=custom_model.tiny_cnn:build",
            "train.model.weights=null",
        ]
    },
    "package": {"path": "examples/custom_model"},
    "kubernetes": {
        "namespace": "ml-vision",
        "service_account": "vision-runner",
        "node_selector": {"pool": "ml"},
        "tolerations": [{"key": "dedicated", "value": "ml", "effect": "NoExecute"}],
        "priority_class": "batch-low",
        "pod_labels": {"team": "vision"},
        "env": {"GOOGLE_CLOUD_PROJECT": "acme"},
        "monitor_labels": {"release": "prometheus"},
        "ray_cron_job": True,
    },
    "anyscale": {"cloud": "acme-gcp", "storage": "gs://acme-ml/vision-anyscale"},
}


def render(tmp_path: Path, values: dict, *overrides: str) -> Path:
    """The files `make platforms VALUES=<values>` writes, under tmp_path/out."""
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    out = tmp_path / "out"
    assert main(["--values", str(path), "--out", str(out), *overrides]) == 0
    return out


def files(root: Path) -> list[Path]:
    """Every rendered file under root (not the vendored CRDs nor the values)."""
    return sorted(
        p
        for p in root.rglob("*")
        if p.is_file() and CRDS not in p.parents and p != root / EXAMPLE.name
    )
