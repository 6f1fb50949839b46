"""Jobs sent the way users send them: `ray job submit` to a real `ray start` cluster."""

import io
import re
import shutil
import zipfile
from pathlib import Path

import pyarrow.parquet as pq
import yaml
from helpers import CLASSES, make_image_folder
from PIL import Image
from ray._private.runtime_env.packaging import create_package

from harness.cluster import BUNDLE_ROOT
from pipeline.core.storage import Location
from pipeline.data.dataset import read_manifest


def preprocess(cluster, *overrides):
    args = ["python", "-m", "jobs.preprocess", "--config", "configs/demo-preprocess.yaml"]
    return cluster.submit([*args, *overrides], capture=True, timeout_s=300)


def test_preprocess_job_on_folder_with_corrupt_files(cluster_2cpu, tmp_path):
    bad = make_image_folder(tmp_path / "src", per_class=30)
    out = tmp_path / "out"
    proc = preprocess(
        cluster_2cpu,
        "source.kind=folder",
        f"source.folder.path={tmp_path / 'src'}",
        f"output={out}",
        "image_size=48",
        "shard_size=20",
    )
    assert proc.returncode == 0, proc.stdout
    assert "progress: 93/93 images (100%), 3 skipped" in proc.stdout
    assert re.search(r"INFO jobs: done in \d+ s; driver peak memory \d+ MiB", proc.stdout)

    manifest = read_manifest(Location.parse(str(out)))
    assert manifest.classes == sorted(CLASSES)
    assert {s.source_id for s in manifest.skipped} == set(bad)
    total = 0
    for info in manifest.splits.values():
        for f in info.files:
            table = pq.read_table(out / f.path)
            total += table.num_rows
            for row in table.to_pylist():
                assert Image.open(io.BytesIO(row["image"])).size == (48, 48)
                assert row["label_name"] == manifest.classes[row["label"]]
    assert total == 90 == sum(sum(s.counts.values()) for s in manifest.splits.values())


def test_failing_job_exits_nonzero_with_reason(cluster_2cpu, tmp_path):
    proc = preprocess(
        cluster_2cpu,
        "source.kind=folder",
        f"source.folder.path={tmp_path / 'nope'}",
        f"output={tmp_path / 'out'}",
    )
    assert proc.returncode != 0
    assert f"source.folder.path {tmp_path / 'nope'} does not exist" in proc.stdout
    assert not (tmp_path / "out").exists()


def test_bad_config_exits_nonzero_naming_key(cluster_2cpu, tmp_path):
    proc = preprocess(cluster_2cpu, f"output={tmp_path}", "image_sise=64")
    assert proc.returncode != 0
    assert "image_sise: unknown key" in proc.stdout


def package(root: Path, tmp_path: Path) -> zipfile.ZipFile:
    """Zip `root` exactly as `ray job submit` does with runtime_env.yaml's excludes."""
    env = yaml.safe_load((BUNDLE_ROOT / "runtime_env.yaml").read_text())
    target = tmp_path / f"{root.name}.zip"
    create_package(str(root), target, include_gitignore=False, excludes=env["excludes"])
    return zipfile.ZipFile(target)


def test_runtime_env_uploads_code_not_data(tmp_path):
    copy = tmp_path / "bundle"
    ignore = shutil.ignore_patterns(".venv", ".venv-*", ".git", "outputs")
    shutil.copytree(BUNDLE_ROOT, copy, ignore=ignore)
    decoys = [
        ".venv/lib/torch.so",
        ".venv-anyscale/lib/anyscale.py",
        ".git/objects/ab",
        "data/food/1.jpg",
        "outputs/x/train.parquet",
        "pipeline/__pycache__/x.pyc",
        "model.pt",
        "bench/results/r.json",
        "site/index.html",
    ]
    for d in decoys:
        (copy / d).parent.mkdir(parents=True, exist_ok=True)
        (copy / d).write_bytes(b"x" * 1000)
    names = set(package(copy, tmp_path).namelist())
    assert {"jobs/preprocess.py", "pipeline/data/preprocess.py", "configs/preprocess.yaml"} <= names
    assert not [n for n in names if any(n.startswith(d) for d in decoys)]
    # The cluster runs the library and the jobs; the harness, tests, benchmarks, the bundle's own
    # scripts (the demo, the lock, the platforms' files) and those files (their CRDs are
    # megabytes) stay here.
    stay = ("harness/", "tests/", "bench/", "docs/", "platforms/", "scripts/", ".ci/")
    assert not [n for n in names if n.startswith(stay)]


def test_runtime_env_upload_of_this_checkout_is_small(tmp_path):
    # The checkout has a multi-GB .venv and test outputs beside the code: none may travel. What
    # does is the library, the jobs, the configs and the lock (its hashes a third of it), under
    # 1.1 MB today: 2 MB leaves the code room to grow and is still a thousandth of a venv.
    zipped = package(BUNDLE_ROOT, tmp_path)
    size = sum(i.compress_size for i in zipped.infolist())
    assert size < 2_000_000, sorted(zipped.namelist())
