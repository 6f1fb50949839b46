"""The cluster check as a job (`ray job submit ... -- python -m jobs.check`) on a head and a
worker node of this machine: it passes where the bundle runs (the GPU rows skipped, with the
reason, on these CPUs), and each fault fails its own row with the check's exit code: storage
that refuses writes, a package one node lacks, a node that is gone. One cluster for the module;
each test starts with its worker node alive."""

from __future__ import annotations

import json
import uuid

import pytest
from helpers import FAST_NODE_DEATH, wait_for, with_worker_nodes

from harness.cluster import LocalCluster

CHECK = ["python", "-m", "jobs.check", "--config", "configs/demo-check.yaml"]
GPU_ROWS = ("gpus", "cuda_matmul", "gpu_decode", "gpu_memory")
# Importable on the head only: its folder is on the head's PYTHONPATH, not the worker node's.
HEAD_ONLY = "check_head_only_pkg"
# Shipped with every job (the bundle's working dir): importable on every node.
SHIPPED = "examples.custom_model"


@pytest.fixture(scope="module")
def head_and_node(tmp_path_factory):
    """A head of 1 CPU whose processes import HEAD_ONLY, and (per test, `cluster`) one worker
    node of 1 CPU that does not. The demo's two training workers take a CPU of each."""
    packages = tmp_path_factory.mktemp("head-only")
    (packages / HEAD_ONLY).mkdir()
    (packages / HEAD_ONLY / "__init__.py").write_text("")
    env = {**FAST_NODE_DEATH, "PYTHONPATH": str(packages)}
    cluster = LocalCluster(num_cpus=1, env=env).start()
    del cluster.extra_env["PYTHONPATH"]  # the nodes added from here on lack it
    yield cluster
    cluster.stop()


@pytest.fixture
def cluster(head_and_node):
    return with_worker_nodes(head_and_node, 1)


def run_check(cluster, *overrides: str, timeout_s: float = 300, cli: bool = False):
    """The check submitted as a job: (its exit code, its report, its output)."""
    submission = f"check-{uuid.uuid4().hex[:8]}"
    args = [*CHECK, *overrides]
    if cli:  # the users' own command line
        proc = cluster.submit(args, submission_id=submission, capture=True, timeout_s=timeout_s)
    else:
        proc = cluster.run_job(args, submission_id=submission, capture=True, timeout_s=timeout_s)
    code = cluster.job(submission)["driver_exit_code"]
    # The report, as one JSON line (a failed job's status message repeats the log's end).
    lines = {line for line in proc.stdout.splitlines() if line.startswith('{"id":')}
    assert len(lines) == 1, proc.stdout
    return code, json.loads(lines.pop()), proc.stdout


def by_name(report) -> dict[str, dict]:
    return {row["name"]: row for row in report["rows"]}


def test_the_check_passes_on_a_two_node_cluster(cluster, tiny_dataset, tmp_path):
    storage = tmp_path / "storage"
    code, report, out = run_check(
        cluster,
        f"storage={storage}",
        f"dataset={tiny_dataset}",
        f"packages=[{SHIPPED}]",
        "min_nodes=2",
        cli=True,
    )
    assert code == 0, out
    rows = by_name(report)
    assert list(rows) == [
        "nodes",
        "versions",
        "packages",
        *GPU_ROWS,
        "collective",
        "storage",
        "dataset",
        "shm",
        "object_store",
        "auth",
    ]
    assert {r["status"] for n, r in rows.items() if n not in GPU_ROWS} == {"pass"}, out
    for name in GPU_ROWS:
        assert rows[name]["status"] == "skipped"
        assert rows[name]["detail"] == "no GPU on any node; the train config does not use GPUs"
    assert rows["nodes"]["facts"] == {"alive": 2, "answered": 2}
    collective = rows["collective"]["facts"]
    assert (collective["backend"], collective["workers"], collective["nodes"]) == ("gloo", 2, 2)
    assert collective["bytes"] == 8_000_000 and collective["busbw_gbps"] > 0
    assert len(rows["storage"]["facts"]["read_mbps"]) == 2  # read back on both nodes
    assert rows["dataset"]["facts"]["classes"] == 4
    assert "token auth on" in rows["auth"]["detail"]
    assert cluster.token not in out
    # The table in the job's log, the scratch object gone, the report where it says.
    assert "collective    pass     gloo all-reduce of 8 MB over 2 workers" in out
    assert not list(storage.glob(".check-*"))
    assert report["report"] == str(storage / "checks" / f"{report['id']}.json")
    assert json.loads((storage / "checks" / f"{report['id']}.json").read_text()) == report
    assert report["exit_code"] == 0 and report["verdict"].startswith("cluster check passed")


def test_storage_that_refuses_writes_fails_the_storage_row(cluster, tiny_dataset, tmp_path):
    # A path below a file: refused for good (no retry can make it a directory), the input's to
    # fix, so exit 1.
    (tmp_path / "a-file").write_text("not a directory")
    storage = tmp_path / "a-file" / "runs"
    code, report, out = run_check(
        cluster, f"storage={storage}", f"dataset={tiny_dataset}", "timeout_s=30"
    )
    rows = by_name(report)
    assert [name for name, r in rows.items() if r["status"] == "fail"] == ["storage"], out
    detail = rows["storage"]["detail"]
    assert rows["storage"]["owner"] == "input", detail
    assert detail.startswith(f"writing {storage}/.check-{report['id']}/scratch.bin failed: ")
    assert (
        "Not a directory" in detail and "fix the storage URI, its bucket or permissions" in detail
    )
    assert code == 1
    assert "error: cluster check: 1 of 13 rows failed: storage" in out
    assert report["report"] is None  # the report could not go there either; the JSON line did


def test_a_package_one_node_lacks_fails_the_packages_row(cluster, tmp_path, tiny_dataset):
    code, report, out = run_check(
        cluster,
        f"storage={tmp_path}",
        f"dataset={tiny_dataset}",
        f"packages=[{SHIPPED}, {HEAD_ONLY}]",
        "timeout_s=30",
    )
    rows = by_name(report)
    assert [name for name, r in rows.items() if r["status"] == "fail"] == ["packages"], out
    worker = [n for n in report["nodes"] if n["node_id"] != head_id(cluster)]
    (missing,) = rows["packages"]["facts"]["missing"]
    assert missing.startswith(f"{HEAD_ONLY} on {worker[0]['ip']} ({worker[0]['node_id'][:8]})")
    assert f"No module named '{HEAD_ONLY}'" in missing
    assert code == 3
    assert "error: cluster check: 1 of 13 rows failed: packages" in out


def test_a_node_gone_fails_the_nodes_row(cluster, tmp_path, tiny_dataset):
    node = cluster.nodes[-1]
    node.kill()  # the machine dies: its raylet, object store and workers
    code, report, out = run_check(
        cluster,
        f"storage={tmp_path}",
        f"dataset={tiny_dataset}",
        "min_nodes=2",
        "timeout_s=15",
    )
    rows = by_name(report)
    failed = [name for name, r in rows.items() if r["status"] == "fail"]
    # Alive in the GCS's record still (a probe that never answers) or declared dead already
    # (fewer nodes than min_nodes): either way, the nodes row; and the two training workers no
    # longer have two CPUs.
    assert failed == ["nodes", "collective"], out
    assert (
        "did not answer a probe within timeout_s=15 s" in rows["nodes"]["detail"]
        or "1 node(s) alive, fewer than min_nodes=2" in rows["nodes"]["detail"]
    ), rows["nodes"]
    assert "could not place 2 workers of {'CPU': 1}" in rows["collective"]["detail"]
    assert code == 3
    assert "error: cluster check: 2 of 13 rows failed: nodes, collective" in out
    wait_for(lambda: node.proc.poll() is not None, "the killed node's process ended", 30)


def head_id(cluster) -> str:
    (head,) = [n for n in cluster.state("nodes", "state=ALIVE") if n["is_head_node"]]
    return head["node_id"]
