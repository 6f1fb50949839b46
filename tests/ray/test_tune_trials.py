"""The sweep (pipeline.tune.sweep) with Ray in the test process, driven as the tune job drives
it (jobs.tune.main): ASHA stops the trailing trials, and the best run, tracked in MLflow, is the
one inference takes; a trial's killed worker is replaced inside its Train run, and a sweep whose
driver was stopped resumes with no epoch trained twice; a trial that fails for good is listed
while the sweep goes on, and tried again with retry_failed=true. (Bad spaces:
tests/bad_inputs.py.)"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import ray
from helpers import held_worker, history, in_background, latest_recorded, mlflow_run, wait_for
from in_process import train_workers_here
from ray.cluster_utils import Cluster

import jobs.tune
from harness.cluster import BUNDLE_ROOT, free_port
from harness.faults import arm
from pipeline.core import faults
from pipeline.core.config import load_config
from pipeline.core.storage import Location
from pipeline.model.checkpoint import WEIGHTS
from pipeline.model.runs import CURVES_PNG, HISTORY_CSV, RUN_SUMMARY
from pipeline.model.source import resolve_checkpoint
from pipeline.tracking.client import RUN_RECORD
from pipeline.tracking.sweep import BEST_RUN, PARENT
from pipeline.tune.config import SweepConfig
from pipeline.tune.sweep import SWEEP_SUMMARY, TRIALS_PNG, runtime_env

# The demo sweep's trials, smaller: a narrower network, 2 epochs.
TINY = ("train.model.kwargs.width=8", "train.epochs=2")


@pytest.fixture(scope="module")
def two_cpus():
    """A Ray instance of 2 CPUs with its dashboard (Ray Train's placement-group cleaner asks
    the state API whether a stopped trial's controller lives), this process its driver as the
    tune job's is: RAY_ADDRESS set, the Ray processes given the sweep's runtime env, their logs
    printed here."""
    cluster = started_head(num_cpus=2, include_dashboard=True, dashboard_port=free_port())
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAY_ADDRESS", cluster.address)
        try:
            ray.init(address=cluster.address, runtime_env=runtime_env(), log_to_driver=True)
            yield cluster
        finally:
            ray.shutdown()
            cluster.shutdown()


def started_head(attempts: int = 4, **head_args) -> Cluster:
    """A Cluster of one head node. Ray waits a fixed 30 s for its raylet to register, and a
    while for its GCS, which a loaded machine can exceed: it is started again, up to `attempts`
    (what a failed start left ends with this process, as Cluster's nodes do)."""
    for attempt in range(1, attempts + 1):
        try:
            return Cluster(initialize_head=True, head_node_args=head_args)
        except Exception as e:
            slow = ("timed out during startup", "Failed to start GCS")
            if attempt == attempts or not any(s in str(e) for s in slow):
                raise
    raise AssertionError("unreachable")


def tune_here(dataset, storage, *overrides, monkeypatch) -> str:
    """jobs.tune's body with the demo sweep's config, TINY and `overrides`, on this process's
    Ray: the line the job prints last."""
    args = [f"dataset={dataset}", f"storage_path={storage}", *TINY, *overrides]
    cfg = load_config(SweepConfig, BUNDLE_ROOT / "configs" / "demo-tune.yaml", args)
    monkeypatch.setattr(jobs.tune.ray, "init", job_init)
    return jobs.tune.main(cfg)


def job_init(**kwargs) -> None:
    """The job's `ray.init`, here: Ray is up, started with the runtime env the job asks."""
    assert ray.is_initialized() and kwargs == {"runtime_env": runtime_env()}, kwargs


def printed(capfd, settle_s: float = 3) -> str:
    """What this process printed since last asked, the Ray processes' logs included (they come
    a moment late)."""
    time.sleep(settle_s)
    out, err = capfd.readouterr()
    return out + err


def test_a_trial_that_fails_for_good_is_listed_and_the_sweep_goes_on(
    two_cpus, tiny_dataset, tmp_path, capfd, monkeypatch
):
    # The second trial's worker asks 3 CPUs of a 2-CPU instance: Ray Train cannot place it, and
    # with max_failures=0 its one attempt of 5 s is its last. Both trials at once (the sweep
    # would run one at a time, by the largest trial's ask): the first trains on meanwhile.
    args = (
        "name=failing",
        "num_samples=1",
        "asha.enabled=false",
        "max_concurrent_trials=2",
        "train.epochs=1",
        "train.max_failures=0",
        "train.scaling.startup_timeout_s=5",
        "space.scaling.cpus_per_worker={grid: [1, 3]}",
    )
    tune_here(tiny_dataset, tmp_path, *args, monkeypatch=monkeypatch)
    summary = json.loads((tmp_path / "failing" / SWEEP_SUMMARY).read_text())
    placed, unplaced = summary["trials"]
    assert placed["status"] == "finished" and summary["best_run"] == placed["run"]
    assert unplaced["status"] == "failed" and unplaced["epochs"] == 0, unplaced
    assert unplaced["error"].startswith(
        "ClusterError: the cluster could not place 1 training workers with {'CPU': 3} each"
    ), unplaced
    assert summary["counts"] == {"finished": 1, "stopped early": 0, "failed": 1}
    printed(capfd)  # the first sweep's
    # Resumed with retry_failed=true: the same trial (its id, its run) tries again, and fails
    # again; the finished one is not trained again.
    tune_here(tiny_dataset, tmp_path, *args, "retry_failed=true", monkeypatch=monkeypatch)
    again = printed(capfd)
    assert again.count("starting 1 workers with {'CPU': 3} each") == 1, again
    assert "starting 1 workers with {'CPU': 1} each" not in again
    retried = json.loads((tmp_path / "failing" / SWEEP_SUMMARY).read_text())
    assert [(t["trial"], t["status"]) for t in retried["trials"]] == [
        (placed["trial"], "finished"),
        (unplaced["trial"], "failed"),
    ]


# Ray's own `ray.init`: tune_here stands the job's in for it.
RAY_INIT = ray.init


def connect_driver(cluster, **env_vars: str) -> None:
    """This process's driver connected anew, as a new job: its Ray processes get the sweep's
    runtime env plus `env_vars`, as a job submitted with them in its runtime env does (a fault
    point armed: harness.faults.arm); their logs printed here."""
    ray.shutdown()
    env = runtime_env().get("env_vars", {}) | env_vars
    RAY_INIT(address=cluster.address, runtime_env={"env_vars": env}, log_to_driver=True)


class SweepStopped(Exception):
    """Raised in the sweep's driver loop: the sweep's driver ends where it stands."""


def stoppable_tune_loop(monkeypatch) -> threading.Event:
    """Once the returned event is set, the next step of Ray Tune's driver loop raises
    SweepStopped: Tune stops the running trial, and the sweep's body ends with the error before
    its summary, as the driver of a job stopped mid-sweep ends."""
    from ray.tune.execution.tune_controller import TuneController

    stop, step = threading.Event(), TuneController.step

    def stepped(controller):
        if stop.is_set():
            raise SweepStopped("the sweep's driver was stopped")
        return step(controller)

    monkeypatch.setattr(TuneController, "step", stepped)
    return stop


def test_asha_stops_trailing_trials_and_inference_takes_the_best_run(
    two_cpus, tiny_dataset, tmp_path, mlflow_server, caplog, monkeypatch
):
    # The fewest trials and epochs in which ASHA must stop one: 2 epochs, its one rung at 1
    # (grace_period 1, reduction_factor 2); 3 trials, 2 at once on 2 CPUs. Two learning rates
    # that learn, then one that barely moves the weights: the first two run first (in the
    # grid's order), and both reach the rung before the third starts (a slot frees only when
    # one of them ends, at the rung or after); the third reaches it behind them both and is
    # stopped there. Two trials would race: two at once, the first to reach the rung goes on.
    caplog.set_level(logging.INFO)
    lrs = "space.optimizer.lr={grid: [0.003, 0.002, 1.0e-7]}"
    tracked = (f"train.tracking.uri={mlflow_server.uri}", "train.tracking.registered_model=swept")
    args = ("name=asha", "num_samples=1", lrs, *tracked)
    last = tune_here(tiny_dataset, tmp_path, *args, monkeypatch=monkeypatch)
    assert "2 trial(s) at once: each asks 1 CPUs, the cluster has 2 CPUs" in caplog.text
    sweep = tmp_path / "asha"
    summary = json.loads((sweep / SWEEP_SUMMARY).read_text())
    trials = summary["trials"]
    assert len(trials) == 3
    by_lr = {t["config"]["optimizer.lr"]: t for t in trials}
    assert sorted(by_lr) == [1.0e-7, 0.002, 0.003]
    # ASHA keeps the better half at its rung (1 epoch): of the first two, the one that reaches
    # it first goes on, the other if it is better; the last trails them both.
    assert by_lr[0.003]["status"] == "finished" or by_lr[0.002]["status"] == "finished"
    stopped = [t for t in trials if t["status"] == "stopped early"]
    assert stopped and all(t["epochs"] == 1 for t in stopped), trials
    assert by_lr[1.0e-7]["status"] == "stopped early", trials
    assert summary["counts"] == {
        "finished": 3 - len(stopped),
        "stopped early": len(stopped),
        "failed": 0,
    }
    # Every trial is a run, with the train job's files; its best is its history's lowest val loss.
    scores = {}
    for t in trials:
        run = Path(t["run"])
        assert run.parent == sweep
        for name in (RUN_SUMMARY, HISTORY_CSV, CURVES_PNG):
            assert (run / name).is_file(), (run, name)
        h = history(run)
        assert len(h) == t["epochs"] and [r["epoch"] for r in h] == list(range(t["epochs"]))
        scores[t["run"]] = min(r["val_loss"] for r in h)
        assert t["best_score"] == pytest.approx(scores[t["run"]])
        assert t["worker_hours"] == pytest.approx(sum(r["worker_hours"] for r in h))
        assert t["worker_hours"] > 0
    # What the sweep cost: its trials' worker-hours, totalled.
    assert summary["worker_hours"] == pytest.approx(sum(t["worker_hours"] for t in trials))
    assert summary["gpu_hours"] == 0 and summary["cost"] is None  # CPU workers, no price
    assert summary["metric"] == "val_loss" and summary["mode"] == "min"
    assert summary["best_run"] == min(scores, key=scores.get)
    assert summary["best_score"] == pytest.approx(min(scores.values()))
    assert last == f"best run: {summary['best_run']}"  # the job's last line
    assert (sweep / TRIALS_PNG).is_file()

    # Tracked: the sweep is an MLflow run, each trial's run its child, finished (those ASHA
    # stopped too, by the sweep's driver) with each epoch once; the best checkpoint registered.
    client = mlflow_server.client()
    parent = json.loads((sweep / RUN_RECORD).read_text())["run_id"]
    swept = client.get_run(parent)
    assert swept.info.status == "FINISHED"
    assert swept.data.tags[BEST_RUN] == summary["best_run"]
    assert swept.data.metrics["best_val_loss"] == pytest.approx(summary["best_score"])
    for t in trials:
        child = mlflow_run(mlflow_server, Path(t["run"]))
        assert child.data.tags[PARENT] == parent and child.info.status == "FINISHED", t
        steps = [m.step for m in client.get_metric_history(child.info.run_id, "val_loss")]
        # A stopped trial's rank 0 may have run one epoch past the checkpoint Ray recorded.
        assert len(steps) == len(set(steps)) and set(range(t["epochs"])) <= set(steps), t
    (version,) = client.search_model_versions("name='swept'")
    assert version.run_id == parent

    # Inference, serving and export take the best run's directory alone, as any run's (their
    # jobs of a run: tests/jobs/test_infer.py): its best checkpoint.
    best = json.loads((Path(summary["best_run"]) / RUN_SUMMARY).read_text())
    loaded = resolve_checkpoint(Location.parse(summary["best_run"]))
    assert loaded.uri == best["best_checkpoint"]


def test_a_trial_replaces_a_killed_worker_and_a_stopped_sweep_resumes_training_nothing_twice(
    two_cpus, tiny_dataset, tmp_path, capfd, caplog, monkeypatch
):
    # One trial at a time: the first trains 2 epochs, the second 4 (time for the stop to land).
    # The first's worker is SIGKILLed once Ray has recorded its epoch 0 (the first trial's rank 0
    # is the first process to reach the armed point); its Train run's FailureConfig restarts it
    # from that checkpoint.
    # The sweep's driver is stopped once the first has finished and the second has a
    # checkpoint; the same sweep, unarmed, then resumes.
    caplog.set_level(logging.INFO)
    # The workers' lines are counted: Ray's driver would merge lines alike but for their
    # numbers ("training epochs 0 to 1", "training epochs 1 to 1") from several processes.
    monkeypatch.setattr(ray._private.ray_logging, "RAY_DEDUP_LOGS", False)
    args = (
        "name=resumed",
        "num_samples=1",
        "asha.enabled=false",
        "max_concurrent_trials=1",
        "space.epochs={grid: [2, 4]}",
    )
    sweep = tmp_path / "resumed"
    fault = tmp_path / "fault"
    fault.mkdir()
    printed(capfd, settle_s=0)  # what earlier tests left
    try:
        connect_driver(two_cpus, **arm(faults.CHECKPOINT_REPORTED, fault))
        stop = stoppable_tune_loop(monkeypatch)
        job = in_background(tune_here, tiny_dataset, tmp_path, *args, monkeypatch=monkeypatch)

        def trial_run(index: int) -> Path | None:
            return next(sweep.glob(f"*_{index:05d}"), None)

        pid = held_worker(fault / faults.CHECKPOINT_REPORTED, job)
        first = trial_run(0)
        wait_for(lambda: latest_recorded(first) == "epoch_0000", "epoch 0 in Ray's record", 60)
        assert trial_run(1) is None and not (first / "epoch_0001").exists()
        assert pid in {a["Pid"] for a in train_workers_here()}, pid
        os.kill(pid, signal.SIGKILL)

        def first_done_second_started() -> bool:
            second = trial_run(1)
            return bool((first / RUN_SUMMARY).exists() and second and latest_recorded(second))

        waited = "the first trial finished, the second checkpointed"
        wait_for(lambda: first_done_second_started() or job.done(), waited, 400)
        assert not job.done(), f"the sweep ended first: {job.result()}"
        stop.set()
        with pytest.raises(SweepStopped):
            job.result(timeout=120)
        out = printed(capfd)
        second = trial_run(1)
        stopped_at = latest_recorded(second)
        print(f"sweep stopped with the second trial at {stopped_at}")
        first_weights = (first / "epoch_0001" / WEIGHTS).stat().st_mtime_ns
        # The first trial's new worker resumed from epoch 0's checkpoint and trained epoch 1
        # only; the second trial's worker started once, on a new run.
        resumed = f"resumed from checkpoint {first / 'epoch_0000'} (epoch 0 done)"
        assert out.count(resumed) == 1, out
        assert out.count("training epochs 0 to 1:") == 1, out
        assert out.count("training epochs 1 to 1:") == 1, out
        assert out.count("training epochs 0 to 3:") == 1 and f"new run {second}" in out, out
        assert f"resumed from checkpoint {second}" not in out
    finally:
        connect_driver(two_cpus)  # unarmed, as the module's other tests expect

    caplog.clear()
    monkeypatch.undo()  # Tune's loop as it is; the log dedup off again below
    monkeypatch.setattr(ray._private.ray_logging, "RAY_DEDUP_LOGS", False)
    tune_here(tiny_dataset, tmp_path, *args, monkeypatch=monkeypatch)
    out = printed(capfd)
    assert "resuming from Ray Tune's record" in caplog.text
    # The finished trial is not trained again: Tune kept it finished (or, were it still
    # running in Tune's last record, its train job found the run complete).
    assert f"new run {first}" not in out and f"run {first} has" not in out, out
    assert (first / "epoch_0001" / WEIGHTS).stat().st_mtime_ns == first_weights
    # The running one trains on from its latest checkpoint (or was complete already).
    done = int(stopped_at.removeprefix("epoch_")) + 1
    if done < 4:
        expected = f"run {second} has {done} of 4 epochs: resuming from {second / stopped_at}"
        assert expected in out, out
    else:
        assert f"run {second} is complete" in out, out
    assert f"new run {second}" not in out
    # Every epoch of every trial once, both trials finished, and each listed once.
    assert [r["epoch"] for r in history(first)] == [0, 1]
    assert [r["epoch"] for r in history(second)] == [0, 1, 2, 3]
    summary = json.loads((sweep / SWEEP_SUMMARY).read_text())
    assert [(t["run"], t["status"], t["epochs"]) for t in summary["trials"]] == [
        (str(first), "finished", 2),
        (str(second), "finished", 4),
    ]
    assert summary["counts"] == {"finished": 2, "stopped early": 0, "failed": 0}
