"""The rendered platform files run: each KubeRay job's own entrypoint and runtime env, as its
submitter pod submits them from the image, on a local Ray cluster whose storage is a loopback S3
server, in the chain's order (check, preprocess, train, infer, export), with the team's package
shipped as the files ship it; and an Anyscale job's entrypoint, whose shell expands the
cloud's artifact storage, and stops when it is unset. The image is a folder laid out by the
Dockerfile's own COPY lines."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
import yaml
from ray.job_submission import JobStatus, JobSubmissionClient

from harness.cluster import BUNDLE_ROOT, LocalCluster
from pipeline.core.storage import Location
from pipeline.infer.predictions import read_predictions
from pipeline.model.runs import RUN_SUMMARY, checkpoint_dir_name
from scripts.platforms.__main__ import main
from scripts.platforms.validate import documents

BUCKET = "platform-jobs"
ROOT = f"s3://{BUCKET}/team"
RUN = "platform-run"
# The team's values: the demo's configs made small, its network from the team's package.
VALUES = {
    "storage": ROOT,
    "image": {"registry": "registry.example.com/ml", "repository": "vision", "tag": "1"},
    "head": {"instance_types": {"aws": "m5.xlarge"}},
    "worker_groups": [
        {
            "name": "cpu",
            "cpus": 2,
            "memory_gi": 8,
            "max_nodes": 1,
            "instance_types": {"aws": "m5.large"},
        }
    ],
    "package": {"path": "examples/custom_model"},
    "jobs": {
        "profile": "demo",
        "set": [
            "preprocess.source.synthetic.images_per_class=12",
            "preprocess.source.synthetic.raw_size=32",
            "preprocess.image_size=32",
            "preprocess.shard_size=30",
            "preprocess.row_group_size=10",
            f"train.name={RUN}",
            "train.epochs=1",
            "train.global_batch_size=16",
            "train.model.name=custom_model.tiny_cnn:build",
            "train.model.weights=null",
            "infer.batch_size=16",
        ],
    },
    "anyscale": {"storage": "$ANYSCALE_ARTIFACT_STORAGE/anyscale"},
}
STEPS = ("check", "preprocess", "train", "infer", "export")


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("platforms")
    (out / "values.yaml").write_text(yaml.safe_dump(VALUES))
    assert main(["--values", str(out / "values.yaml"), "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def image(rendered, tmp_path_factory) -> Path:
    """The image's WORKDIR, laid out by the rendered Dockerfile's COPY lines into it."""
    workdir = tmp_path_factory.mktemp("image")
    copies = [
        line.split()[1:]
        for line in (rendered / "Dockerfile").read_text().splitlines()
        if line.startswith("COPY ")
    ]
    for *sources, target in copies:
        if target.startswith("/"):
            continue  # the lock, for the image's pip install
        for source in sources:
            path = BUNDLE_ROOT / source
            into = (
                workdir / target / path.name
                if target.endswith("/") and path.is_file()
                else (workdir / target)
            )
            if path.is_dir():
                shutil.copytree(path, into, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                into.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(path, into)
    return workdir


def run(cluster: LocalCluster, workdir: Path, entrypoint: str, runtime_env: dict) -> str:
    """Submit as the submitter pod does, from `workdir`: the entrypoint's text, the runtime env
    with its paths relative to there; returns the job's log, asserting it succeeded."""
    env = dict(runtime_env)
    env["working_dir"] = str(workdir / env["working_dir"])
    env["py_modules"] = [str(workdir / m) for m in env.get("py_modules", [])]
    client = JobSubmissionClient(
        cluster.address, headers={"Authorization": f"Bearer {cluster.token}"}
    )
    job = client.submit_job(entrypoint=entrypoint, runtime_env=env)
    deadline = time.monotonic() + 600
    while not (status := client.get_job_status(job)).is_terminal():
        assert time.monotonic() < deadline, client.get_job_logs(job)[-3000:]
        time.sleep(1)
    log = client.get_job_logs(job)
    assert status == JobStatus.SUCCEEDED, log[-4000:]
    return log


def test_each_rendered_kuberay_job_runs_on_a_cluster_with_s3_storage(
    cluster_2cpu, s3_server, rendered, image
):
    with s3_server.client_env():
        s3_server.create_bucket(BUCKET)
        logs = {}
        for step in STEPS:
            (job,) = documents(rendered / "kuberay" / f"rayjob-{step}.yaml")
            spec = job["spec"]
            logs[step] = run(
                cluster_2cpu, image, spec["entrypoint"], yaml.safe_load(spec["runtimeEnvYAML"])
            )
        report = json.loads(
            next(line for line in logs["check"].splitlines()[::-1] if line.startswith("{"))
        )
        rows = {row["name"]: row for row in report["rows"]}
        assert "fail" not in {row["status"] for row in rows.values()}, report
        # The team's package imports where the jobs run: shipped as the files ship it.
        assert rows["packages"]["status"] == "pass", rows["packages"]
        assert "custom_model" in rows["packages"]["detail"]
        root = Location.parse(ROOT)
        run_dir = root.child("runs", RUN)
        assert run_dir.child(RUN_SUMMARY).exists()
        # The checkpoint names the team's network, which inference and export rebuilt from it.
        meta = run_dir.child(checkpoint_dir_name(0), "metadata.json").read_bytes().decode()
        assert "custom_model.tiny_cnn:build" in meta
        predictions = read_predictions(root.child("predictions", RUN).uri)
        assert predictions.num_rows > 0
        exports = run_dir.child("export").list_dirs()
        assert exports, logs["export"][-2000:]


def test_an_anyscale_job_runs_on_the_clouds_artifact_storage_and_stops_without_it(
    cluster_2cpu, s3_server, rendered
):
    """Anyscale runs the job's entrypoint with ANYSCALE_ARTIFACT_STORAGE set on every node (here:
    in the job's env); unset, the job's shell stops it before any of its code runs."""
    job = yaml.safe_load((rendered / "anyscale" / "jobs" / "check.yaml").read_text())
    env = {k: job[k] for k in ("working_dir", "excludes", "env_vars", "py_modules")}
    env["working_dir"] = "."  # what `anyscale job submit` uploads: the bundle it runs from
    with s3_server.client_env():
        s3_server.create_bucket(BUCKET)
        artifacts = {**env, "env_vars": {**env["env_vars"], "ANYSCALE_ARTIFACT_STORAGE": ROOT}}
        log = run(cluster_2cpu, BUNDLE_ROOT, job["entrypoint"], artifacts)
        assert f"{ROOT}/anyscale" in log
        client = JobSubmissionClient(
            cluster_2cpu.address, headers={"Authorization": f"Bearer {cluster_2cpu.token}"}
        )
        runtime_env = {**env, "working_dir": str(BUNDLE_ROOT)}
        runtime_env["py_modules"] = [str(BUNDLE_ROOT / m) for m in env["py_modules"]]
        unset = client.submit_job(entrypoint=job["entrypoint"], runtime_env=runtime_env)
        deadline = time.monotonic() + 300
        while not client.get_job_status(unset).is_terminal():
            assert time.monotonic() < deadline
            time.sleep(1)
        info = client.get_job_info(unset)
        assert info.status == JobStatus.FAILED and info.driver_exit_code == 2, info
        assert "ANYSCALE_ARTIFACT_STORAGE: is not set" in client.get_job_logs(unset)
        assert "cluster check" not in client.get_job_logs(unset).lower()
