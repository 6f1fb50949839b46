"""A dataset survives its writer crashing at either side of the commit, and two writers at once,
on S3 (moto on loopback): preprocess jobs on a real cluster, their
drivers held at fault points (pipeline.core.faults) and killed or released there. (A new version
committed while training reads the old one: test_s3 and test_train_jobs.)"""

from __future__ import annotations

import os
import signal

import pyarrow.parquet as pq
import pytest
from helpers import armed_runtime_env, in_background, wait_for

from harness.faults import release
from pipeline.core import faults
from pipeline.core.storage import Location
from pipeline.data.dataset import DATA, Manifest, read_manifest

BUCKET = "publish-test"


@pytest.fixture(scope="module")
def s3(s3_server):
    s3_server.create_bucket(BUCKET)
    return s3_server


# On S3 alone: the fault points fall between the commit's writes, which come in the same order
# on every store, each whole on its own (Location.write_bytes: a rename on local disk, one PUT on
# S3); the versions a crash leaves, retention removes on both (test_versions), and both orders
# of two commits at once are forced in process there. What the jobs add (their exit codes and
# messages) does not depend on the store.
@pytest.fixture
def output(tmp_path, s3):
    """The dataset's URI: a fresh prefix on S3."""
    return f"s3://{BUCKET}/{tmp_path.name}"


def preprocess(cluster, output: str, image_size: int, *overrides, runtime_env=None):
    args = [
        "python",
        "-m",
        "jobs.preprocess",
        f"output={output}",
        "source.kind=synthetic",
        "source.synthetic.num_classes=3",
        "source.synthetic.images_per_class=10",
        "source.synthetic.raw_size=48",
        f"image_size={image_size}",
        "shard_size=10",
        *overrides,
    ]
    return cluster.run_job(args, capture=True, timeout_s=300, runtime_env=runtime_env)


def start_held(cluster, output, image_size, fault_dir, point=faults.DATASET_WRITTEN):
    """A preprocess job armed to hold at `point`: (the job, the marker its driver will write)."""
    fault_dir.mkdir()
    runtime_env, marker = armed_runtime_env(fault_dir, point)
    return in_background(preprocess, cluster, output, image_size, runtime_env=runtime_env), marker


def wait_held(job, marker) -> None:
    wait_for(lambda: marker.exists() or job.done(), f"a driver held at {marker.name}", 120)
    assert not job.done(), job.result().stdout


def held(cluster, output, image_size, fault_dir, point):
    """A preprocess job held at `point`: (the job, the marker holding its driver's pid)."""
    job, marker = start_held(cluster, output, image_size, fault_dir, point)
    wait_held(job, marker)
    return job, marker


def committed(s3, uri: str) -> Manifest:
    """What a reader finds at `uri`, checked whole: the manifest, and every row it lists."""
    with s3.client_env():
        root = Location.parse(uri)
        manifest = read_manifest(root)
        assert manifest is not None, f"no dataset at {uri}"
        for info in manifest.splits.values():
            rows = sum(
                pq.read_table(root.child(f.path).path, filesystem=root.fs).num_rows
                for f in info.files
            )
            assert rows == info.rows
        assert sum(i.rows for i in manifest.splits.values()) == 30
        return manifest


def versions_on_storage(s3, uri: str) -> list[str]:
    with s3.client_env():
        return [i.base_name for i in Location.parse(uri).child(DATA).list_dirs()]


def test_a_writer_killed_at_either_side_of_the_commit_leaves_one_whole_dataset(
    cluster_2cpu, s3, output, tmp_path
):
    cluster = cluster_2cpu
    old = preprocess(cluster, output, 32)
    assert old.returncode == 0, old.stdout
    before = committed(s3, output)

    # Killed before its manifest: the old dataset stands, the new files beside it.
    job, marker = held(cluster, output, 40, tmp_path / "written", faults.DATASET_WRITTEN)
    (crashed,) = set(versions_on_storage(s3, output)) - {before.version}
    os.kill(int(marker.read_text()), signal.SIGKILL)
    assert job.result().returncode != 0
    assert committed(s3, output) == before
    assert sorted(versions_on_storage(s3, output)) == sorted([before.version, crashed])

    # Killed after it: the new dataset stands, the older versions' files not yet removed.
    job, marker = held(cluster, output, 40, tmp_path / "committed", faults.DATASET_COMMITTED)
    (new_version,) = set(versions_on_storage(s3, output)) - {before.version, crashed}
    os.kill(int(marker.read_text()), signal.SIGKILL)
    assert job.result().returncode != 0
    after = committed(s3, output)
    assert (after.version, after.image_size) == (new_version, 40)
    assert sorted(versions_on_storage(s3, output)) == sorted([before.version, crashed, new_version])

    # Submitted again, the job finishes the work; with no retention asked for, the versions
    # before the newest go, the one killed before its commit too.
    again = preprocess(cluster, output, 40, "retention_hours=0")
    assert again.returncode == 0, again.stdout
    final = committed(s3, output)
    assert final == after
    assert versions_on_storage(s3, output) == [final.version]


def test_two_writers_at_once_leave_the_newer_dataset(cluster_2cpu, s3, output, tmp_path):
    # Both orders of commit at once, each on an output of its own: four jobs held at the commit
    # point, the older pair started (and named) before the newer pair.
    cluster = cluster_2cpu
    outputs = {first: f"{output}-{first}-first" for first in ("older", "newer")}
    jobs = {}
    for age, size in (("older", 32), ("newer", 40)):
        for first, out in outputs.items():
            jobs[first, age] = start_held(cluster, out, size, tmp_path / f"{first}-{age}")
        for first in outputs:
            wait_held(*jobs[first, age])

    # The older job commits; the newer one, still writing, keeps its files and then wins.
    (older, older_marker), (newer, newer_marker) = jobs["older", "older"], jobs["older", "newer"]
    release(older_marker)
    assert older.result().returncode == 0, older.result().stdout
    assert committed(s3, outputs["older"]).image_size == 32
    release(newer_marker)
    assert newer.result().returncode == 0, newer.result().stdout

    # The newer job commits; the older one then finds it and does not replace it.
    (older, older_marker), (newer, newer_marker) = jobs["newer", "older"], jobs["newer", "newer"]
    release(newer_marker)
    assert newer.result().returncode == 0, newer.result().stdout
    release(older_marker)
    proc = older.result()
    assert proc.returncode == 1, proc.stdout
    assert "was replaced while this job was writing" in proc.stdout

    # The newer dataset stands; the older one, committed first, stays for retention_hours.
    for first, out in outputs.items():
        final = committed(s3, out)
        assert final.image_size == 40
        assert versions_on_storage(s3, out)[-1] == final.version
        assert len(versions_on_storage(s3, out)) == (2 if first == "older" else 1)
