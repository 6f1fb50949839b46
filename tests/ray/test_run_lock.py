"""A run's lock (pipeline.train.run_lock): one train job at a time trains a run. Its logic with
the jobs' liveness given, then two train drivers of one in-process Ray: one that trains the run,
and one refused while the first lives, which takes the run over once it is killed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import ray
from helpers import wait_for

from harness.cluster import BUNDLE_ROOT
from pipeline.core.config import load_config
from pipeline.core.errors import ConfigError, failure
from pipeline.core.storage import Location
from pipeline.train import driver, run_lock
from pipeline.train.config import TrainConfig
from pipeline.train.run_lock import LOCK, hold_run, read_lock


def job(job_id: str, submission_id: str | None = None) -> dict:
    return {
        "job_id": job_id,
        "started_ms": 1,
        "submission_id": submission_id,
        "host": "head",
        "pid": 7,
        "since": 0.0,
    }


@pytest.fixture
def quick(monkeypatch):
    monkeypatch.setattr(run_lock, "SETTLE_S", 0.0)
    monkeypatch.setattr(run_lock, "ENDING_S", 0.0)


def test_a_second_train_job_refuses_a_run_that_a_live_one_holds(tmp_path, quick):
    run = Location.parse(str(tmp_path / "r"))
    first, second = job("01000000", "raysubmit_first"), job("02000000")
    with hold_run(run, me=first, alive=lambda j: True):
        assert read_lock(run) == first
        with (
            pytest.raises(ConfigError) as refused,
            hold_run(run, me=second, alive=lambda j: j["job_id"] == "01000000"),
        ):
            raise AssertionError("the second job trained")
        assert read_lock(run) == first  # the holder's lock stays
    line = str(refused.value)
    assert "\n" not in line
    assert line.startswith(f"run {run.uri} is being trained by train job raysubmit_first (on ")
    assert "ray job stop raysubmit_first) and submit this job again to resume the run" in line
    assert failure(refused.value)[0] == 2
    assert not run.child(LOCK).exists()  # removed as the holder ended


def test_the_lock_of_a_job_that_has_ended_is_taken_over(tmp_path, quick, caplog):
    # Stopped, failed, killed (its lock left behind) or of a cluster started again: the next
    # train job of the run takes it over, so that submitting the job again resumes the run.
    run = Location.parse(str(tmp_path / "r"))
    run.child(LOCK).write_bytes(json.dumps(job("01000000", "raysubmit_killed")).encode())
    second = job("02000000")
    with hold_run(run, me=second, alive=lambda j: False):
        assert read_lock(run) == second
    assert not run.child(LOCK).exists()
    assert "train job raysubmit_killed (on head since" in caplog.text
    assert "has ended: this job takes the run over" in caplog.text


def test_a_holder_being_stopped_is_waited_for(tmp_path, monkeypatch):
    # `ray job stop` ends its driver within seconds; a job submitted again meanwhile goes on.
    monkeypatch.setattr(run_lock, "SETTLE_S", 0.0)
    run = Location.parse(str(tmp_path / "r"))
    run.child(LOCK).write_bytes(json.dumps(job("01000000")).encode())
    answers = iter([True, False])
    with hold_run(run, me=job("02000000"), alive=lambda j: next(answers)):
        assert read_lock(run)["job_id"] == "02000000"


def test_a_job_ends_holding_no_lock_it_lost(tmp_path, quick):
    # Its lock taken over (its job seen as ended): it leaves the new holder's in place.
    run = Location.parse(str(tmp_path / "r"))
    with hold_run(run, me=job("01000000"), alive=lambda j: False):
        run.child(LOCK).write_bytes(json.dumps(job("02000000")).encode())
    assert read_lock(run)["job_id"] == "02000000"


def test_a_job_refused_before_it_trains_leaves_no_run_behind(tmp_path, quick):
    # A new run's job that stops at a pre-flight check: the directory its lock made goes with
    # the lock; a run that was there before stays.
    run = Location.parse(str(tmp_path / "r"))
    with pytest.raises(ConfigError), hold_run(run, me=job("01000000"), alive=lambda j: False):
        raise ConfigError("a pre-flight check")
    assert not (tmp_path / "r").exists()
    (tmp_path / "r").mkdir()
    with hold_run(run, me=job("01000000"), alive=lambda j: False):
        pass
    assert (tmp_path / "r").is_dir()


# --- two train drivers of one Ray instance ------------------------------------------------------

# A second driver of the test's Ray instance that trains run `held` (its workers stood in for:
# until killed), and says so in a file, with its Ray job id.
HOLDER = textwrap.dedent(
    """
    import pathlib, sys, time, ray
    from pipeline.core.storage import Location
    from pipeline.train import driver
    from test_run_lock import train_config

    def fit(*args, **kwargs):
        pathlib.Path(sys.argv[4]).write_text(ray.get_runtime_context().get_job_id())
        time.sleep(600)

    ray.init(address=sys.argv[1], log_to_driver=False)
    driver.fit = fit
    cfg = train_config(sys.argv[2], sys.argv[3])
    driver.train(cfg, dataset=Location.parse(cfg.dataset), runs=Location.parse(cfg.storage_path))
    """
)


def train_config(dataset, storage) -> TrainConfig:
    return load_config(
        TrainConfig,
        None,
        [f"dataset={dataset}", f"storage_path={storage}", "name=held", "global_batch_size=4"],
    )


def test_a_train_job_refuses_the_run_another_live_train_job_trains(
    ray_in_process, small_dataset, tmp_path, monkeypatch, caplog
):
    trained = []
    monkeypatch.setattr(driver, "fit", lambda *_, **__: trained.append(True))
    monkeypatch.setattr(driver, "write_reports", lambda *_, **__: {})
    monkeypatch.setattr(run_lock, "ENDING_S", 0.0)
    cfg = train_config(small_dataset, tmp_path / "runs")
    args = {"dataset": Location.parse(cfg.dataset), "runs": Location.parse(cfg.storage_path)}
    said = tmp_path / "training"
    path = os.pathsep.join(
        map(str, [BUNDLE_ROOT, BUNDLE_ROOT / "tests", BUNDLE_ROOT / "tests" / "ray"])
    )
    address = ray.get_runtime_context().gcs_address
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, address, cfg.dataset, cfg.storage_path, str(said)],
        env={**os.environ, "PYTHONPATH": path},
        cwd=BUNDLE_ROOT,
    )
    try:
        wait_for(lambda: said.exists() or holder.poll() is not None, "first train job", 120)
        assert holder.poll() is None, "the first train job ended before it trained"
        holder_id = said.read_text()
        with pytest.raises(ConfigError, match=rf"being trained by train job {holder_id} \(on "):
            driver.train(cfg, **args)
        assert not trained
        run = Location.parse(cfg.storage_path).child("held")
        assert read_lock(run)["job_id"] == holder_id
        # Killed outright (SIGKILL, a node lost): its lock stays, its Ray job ends, and the
        # next train job of the run takes it over.
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
        stale = read_lock(run)
        wait_for(lambda: not run_lock.job_alive(stale), "the end of the first job", 60)
        driver.train(cfg, **args)
        assert trained and not run.child(LOCK).exists()
        assert f"train job {holder_id} (on " in caplog.text and "takes the run over" in caplog.text
    finally:
        holder.kill()
        holder.wait(timeout=30)
