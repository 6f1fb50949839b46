"""The example DAG run by a real Airflow 3 (`airflow dags test`, SQLite) against a local Ray
cluster with S3 storage (moto, on loopback): the commands docs/schedule.md shows.
Airflow comes from its own virtualenv, built on first use (harness/airflow.py)."""

from __future__ import annotations

import ast
import re
import shlex
import sqlite3
from concurrent.futures import Future

import pytest
from helpers import in_background, wait_for

from harness.airflow import Airflow
from harness.cluster import BUNDLE_ROOT
from pipeline.chain.plan import STEPS, step_command
from pipeline.core.storage import Location
from pipeline.data.dataset import read_manifest
from pipeline.infer.predictions import SUMMARY, VERSIONS, read_predictions, read_summary
from pipeline.model.runs import RUN_SUMMARY

BUCKET = "airflow-test"
ROOT = f"s3://{BUCKET}/ray-cv"
# The demo configs, shrunk: 3 generated classes of 40 images at 32 px, 2 epochs.
SETTINGS = [
    "preprocess.source.synthetic.num_classes=3",
    "preprocess.source.synthetic.images_per_class=40",
    "preprocess.source.synthetic.raw_size=48",
    "preprocess.image_size=32",
    "preprocess.shard_size=60",
    "preprocess.row_group_size=20",
    "train.name=airflow",
    "train.epochs=2",
    # The example's small CNN: its checkpoints on S3 are about 1 MB, where ResNet-18's are 135 MB.
    "train.model.name=examples.custom_model.tiny_cnn:build",
    # One worker: the DAG's tasks are the point here, not how a run spreads over workers.
    "train.scaling.num_workers=1",
    "train.global_batch_size=16",
    "infer.batch_size=16",
]
LOGICAL_DATE = "2026-01-05T00:00:00+00:00"


@pytest.fixture(scope="module")
def s3(s3_server):
    s3_server.create_bucket(BUCKET)
    with s3_server.client_env():  # this process reads the outputs
        yield s3_server


@pytest.fixture(scope="module")
def airflow(s3, cluster_2cpu, tmp_path_factory):
    """Airflow with a migrated database and the DAG's settings in its environment. The cluster's
    token reaches the tasks only as the Airflow Variable `ray_auth_token` (here from the
    environment, AIRFLOW_VAR_*): nothing else in Airflow's environment holds it."""
    env = {k: v for k, v in cluster_2cpu.env.items() if not k.startswith("RAY_AUTH_")}
    env.update(
        AIRFLOW_VAR_RAY_AUTH_TOKEN=cluster_2cpu.token,
        RAY_CV_BUNDLE=str(BUNDLE_ROOT),
        RAY_CV_ADDRESS=cluster_2cpu.address,
        RAY_CV_ROOT=ROOT,
        RAY_CV_PROFILE="demo",
        RAY_CV_SET=shlex.join(SETTINGS),
        RAY_CV_RETRIES="0",  # a failed task fails the run now, not after retries 5 minutes apart
    )
    af = Airflow(tmp_path_factory.mktemp("airflow_home"), env)
    proc = af.run("db", "migrate")
    assert proc.returncode == 0, proc.stdout
    return af


def dags_test(airflow: Airflow, *args: str, env: dict[str, str] | None = None) -> Future:
    """`airflow dags test ray_cv <args>` in the background; the Future gives (exit code,
    output, {task_id: state} of the run), and `.lines` collects the output as it comes."""
    proc = airflow.popen("dags", "test", "ray_cv", *args, env=env)
    lines: list[str] = []

    def finish():
        lines.extend(proc.stdout)
        out = "".join(lines)
        return proc.wait(), out, task_states(airflow, out)

    future = in_background(finish)
    future.lines = lines
    return future


def task_states(airflow: Airflow, out: str) -> dict[str, str]:
    """The state of each task of the run that `airflow dags test` printed, from Airflow's
    metadata database."""
    found = re.search(r"DagRun Finished: dag_id=ray_cv, .*?run_id=([^,\s]+),", out)
    assert found, out[-5000:]
    with sqlite3.connect(airflow.home / "airflow.db") as db:
        rows = db.execute(
            "SELECT task_id, state FROM task_instance WHERE dag_id = 'ray_cv' AND run_id = ?",
            (found[1],),
        )
        return dict(rows.fetchall())


def commands_run(out: str) -> dict[str, str]:
    """{task_id: the bash command it ran}, in the order the tasks started."""
    started = re.findall(r"\[DAG TEST\] starting task_id=(\w+)", out)
    ran = re.findall(r"Running command: (\[.*?\]) \[airflow", out)
    assert len(started) == len(ran), out[-5000:]
    return {task: ast.literal_eval(cmd)[-1] for task, cmd in zip(started, ran, strict=True)}


@pytest.fixture(scope="module")
def chain(airflow):
    """The DAG run once, from nothing: (exit code, output, task states)."""
    return dags_test(airflow, LOGICAL_DATE).result(timeout=900)


def test_the_dag_runs_the_chain_on_a_ray_cluster_with_s3(chain, cluster_2cpu):
    code, out, states = chain
    assert code == 0, out[-5000:]
    assert states == dict.fromkeys(STEPS, "success")
    # Each task ran its step's `python -m jobs.submit`, in the chain's order.
    assert commands_run(out) == {
        step: shlex.join(
            step_command(cluster_2cpu.address, ROOT, step, profile="demo", sets=SETTINGS)
        )
        for step in STEPS
    }
    for step in STEPS:
        assert re.search(rf"\[{step}\] ray-cv-{step}-\S+ succeeded in", out), step
    assert cluster_2cpu.token not in out

    dataset = Location.parse(f"{ROOT}/dataset")
    manifest = read_manifest(dataset)
    assert manifest.splits["train"].rows + manifest.splits["val"].rows == 120
    # One dataset version through the tasks, though nothing passes between them: the infer task
    # reads the version the train task trained on, which the run's checkpoint records.
    assert f"new run {ROOT}/runs/airflow on dataset version {manifest.version}" in out
    assert (
        f"input={ROOT}/dataset is the dataset the checkpoint was trained on: reading version "
        f"{manifest.version}" in out
    )
    run = Location.parse(f"{ROOT}/runs/airflow")
    assert run.child(RUN_SUMMARY).exists()
    predictions = Location.parse(f"{ROOT}/predictions/airflow")
    assert predictions.child(SUMMARY).exists()
    assert read_predictions(predictions).num_rows == manifest.splits["val"].rows


def test_clearing_and_rerunning_the_tasks_is_safe(chain, airflow):
    """`airflow dags test` on the same logical date clears the run's tasks and runs each again,
    over the outputs of the first run: every step succeeds and leaves its outputs whole."""
    assert chain[0] == 0, "the first run failed"
    dataset = Location.parse(f"{ROOT}/dataset")
    run = Location.parse(f"{ROOT}/runs/airflow")
    predictions = Location.parse(f"{ROOT}/predictions/airflow")
    before = read_manifest(dataset)
    checkpoints = sorted(i.path for i in run.list_files() if i.path.endswith("/model.pt"))

    code, out, states = dags_test(airflow, LOGICAL_DATE).result(timeout=900)
    assert code == 0, out[-5000:]
    assert states == dict.fromkeys(STEPS, "success")
    assert "is up to date (same config" in out
    assert f"run {ROOT}/runs/airflow is complete (2 epochs" in out
    assert read_manifest(dataset) == before
    assert sorted(i.path for i in run.list_files() if i.path.endswith("/model.pt")) == checkpoints
    assert read_predictions(predictions).num_rows == before.splits["val"].rows
    # The rerun's version beside the one it replaced, which retention keeps; no other.
    summary = read_summary(predictions)
    versions = {i.base_name for i in predictions.child(VERSIONS).list_dirs()}
    assert versions == {summary["version"], summary["previous_version"]}


def test_a_failed_job_fails_its_task_with_the_jobs_exit_code(airflow):
    # A source folder that does not exist: the preprocess job exits 1 (unusable input).
    missing = f"s3://{BUCKET}/no-such-folder"
    sets = [*SETTINGS, "preprocess.source.kind=folder", f"preprocess.source.folder.path={missing}"]
    env = {"RAY_CV_ROOT": f"s3://{BUCKET}/broken", "RAY_CV_SET": shlex.join(sets)}
    code, out, states = dags_test(airflow, "2026-01-12", env=env).result(timeout=600)
    assert code != 0, out[-5000:]
    assert states == {
        "preprocess": "failed",
        "train": "upstream_failed",
        "infer": "upstream_failed",
    }
    assert f"{missing} does not exist" in out
    assert re.search(r"\[preprocess\] \S+ failed with exit code 1", out)
    assert "Bash command failed. The command returned a non-zero exit code 1." in out


def test_a_stopped_job_fails_its_task(chain, airflow, cluster_2cpu):
    """`ray job stop` on the training job while it runs: its task fails (the chain's exit 4),
    where a bare `ray job submit` would have exited 0."""
    assert chain[0] == 0, "the first run failed"
    env = {"RAY_CV_SET": shlex.join([*SETTINGS, "train.name=stopped", "train.epochs=50"])}
    # The dataset is there from the first run: preprocessing is marked done, not run again.
    run = dags_test(airflow, "2026-01-19", "--mark-success-pattern", "preprocess", env=env)

    def submitted() -> str | None:
        found = re.search(r"\[train\] submitted (\S+):", "".join(run.lines))
        return found and found[1]

    wait_for(lambda: submitted() or run.done(), "the training job's submission", 600)
    assert not run.done(), run.result()[1][-5000:]
    job = submitted()
    # By request: a `ray job status` process a poll would cost a second of CPU each.
    wait_for(
        lambda: cluster_2cpu.job(job)["status"] == "RUNNING" or run.done(),
        "job running",
    )
    cluster_2cpu.stop_job(job)
    code, out, states = run.result(timeout=300)
    assert code != 0, out[-5000:]
    assert states == {"preprocess": "success", "train": "failed", "infer": "upstream_failed"}
    assert f"[train] {job} was stopped" in out
    assert "Bash command failed. The command returned a non-zero exit code 4." in out
