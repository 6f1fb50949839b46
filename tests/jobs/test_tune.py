"""The sweep job on a real local Ray cluster, sent with `ray job submit`: ASHA's early stops and
the best run; a trial's worker killed, which its Train run replaces, then the sweep stopped and
submitted again. (A trial that fails for good, in process: tests/ray/test_tune_trials.py. Bad
spaces: tests/bad_inputs.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import (
    armed_runtime_env,
    held_worker,
    history,
    in_background,
    kill_worker,
    latest_recorded,
    mlflow_run,
    wait_for,
)

from pipeline.core import faults
from pipeline.core.storage import Location
from pipeline.model.checkpoint import WEIGHTS
from pipeline.model.runs import CURVES_PNG, HISTORY_CSV, RUN_SUMMARY
from pipeline.model.source import resolve_checkpoint
from pipeline.tracking.client import RUN_RECORD
from pipeline.tracking.sweep import BEST_RUN, PARENT
from pipeline.tune.sweep import SWEEP_SUMMARY, TRIALS_PNG

TUNE = ["python", "-m", "jobs.tune", "--config", "configs/demo-tune.yaml"]
# The demo sweep's trials, smaller: a narrower network, 2 epochs.
TINY = ("train.model.kwargs.width=8", "train.epochs=2")


def tune_job(cluster, dataset, storage, *overrides, **submit):
    args = [*TUNE, f"dataset={dataset}", f"storage_path={storage}", *TINY, *overrides]
    return cluster.run_job(args, capture=True, timeout_s=600, **submit)


def test_asha_stops_trailing_trials_and_inference_takes_the_best_run(
    cluster_2cpu, tiny_dataset, tmp_path, mlflow_server
):
    # Two learning rates that learn, then one that barely moves the weights: the first two run
    # first (two trials at once, in the grid's order), so the last reaches ASHA's first rung
    # behind them both, and is stopped there.
    lrs = "space.optimizer.lr={grid: [0.003, 0.002, 1.0e-7]}"
    tracked = (f"train.tracking.uri={mlflow_server.uri}", "train.tracking.registered_model=swept")
    proc = tune_job(
        cluster_2cpu, tiny_dataset, tmp_path, "name=asha", "num_samples=1", lrs, *tracked
    )
    assert proc.returncode == 0, proc.stdout
    assert "2 trial(s) at once: each asks 1 CPUs, the cluster has 2 CPUs" in proc.stdout
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
    assert f"best run: {summary['best_run']}" in proc.stdout.splitlines()  # the job's last line
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

    # Inference, serving and export take the best run's directory alone, as any run's (a job
    # of it: test_infer): its best checkpoint.
    best = json.loads((Path(summary["best_run"]) / RUN_SUMMARY).read_text())
    loaded = resolve_checkpoint(Location.parse(summary["best_run"]))
    assert loaded.uri == best["best_checkpoint"]


def test_a_trial_replaces_a_killed_worker_and_a_stopped_sweep_resumes_training_nothing_twice(
    cluster_2cpu, tiny_dataset, tmp_path
):
    # One trial at a time: the first trains 2 epochs, the second 4 (time for the stop to land).
    # The first's worker is SIGKILLed once Ray has recorded its epoch 0 (the first trial's rank 0
    # is the first process to reach the armed point); its Train run's FailureConfig restarts it
    # from that checkpoint.
    # The driver is stopped once the first has finished and the second has a checkpoint; the
    # same command, unarmed, then resumes.
    args = [
        *TUNE,
        f"dataset={tiny_dataset}",
        f"storage_path={tmp_path}",
        *TINY,
        "name=resumed",
        "num_samples=1",
        "asha.enabled=false",
        "max_concurrent_trials=1",
        "space.epochs={grid: [2, 4]}",
    ]
    sweep = tmp_path / "resumed"
    fault = tmp_path / "fault"
    fault.mkdir()
    runtime_env, marker = armed_runtime_env(fault, faults.CHECKPOINT_REPORTED)
    submit = {"submission_id": "tune-stopped", "runtime_env": runtime_env, "capture": True}
    job = in_background(cluster_2cpu.submit, args, timeout_s=900, **submit)

    def trial_run(index: int) -> Path | None:
        return next(sweep.glob(f"*_{index:05d}"), None)

    pid = held_worker(marker, job)
    first = trial_run(0)
    wait_for(lambda: latest_recorded(first) == "epoch_0000", "epoch 0 in Ray's record", 60)
    assert trial_run(1) is None and not (first / "epoch_0001").exists()
    kill_worker(cluster_2cpu, pid)

    def first_done_second_started() -> bool:
        second = trial_run(1)
        return bool((first / RUN_SUMMARY).exists() and second and latest_recorded(second))

    waited = "the first trial finished, the second checkpointed"
    wait_for(lambda: first_done_second_started() or job.done(), waited, 600)
    assert not job.done(), f"the sweep ended first:\n{job.result().stdout}"
    assert cluster_2cpu.stop_job("tune-stopped") == "STOPPED"
    out = job.result().stdout
    second = trial_run(1)
    stopped_at = latest_recorded(second)
    print(f"sweep stopped with the second trial at {stopped_at}")
    first_weights = (first / "epoch_0001" / WEIGHTS).stat().st_mtime_ns
    # The first trial's new worker resumed from epoch 0's checkpoint and trained epoch 1 only;
    # the second trial's worker started once, on a new run.
    resumed = f"resumed from checkpoint {first / 'epoch_0000'} (epoch 0 done)"
    assert out.count(resumed) == 1, out
    assert out.count("training epochs 0 to 1:") == 1 and out.count("training epochs 1 to 1:") == 1
    assert out.count("training epochs 0 to 3:") == 1 and f"new run {second}" in out
    assert f"resumed from checkpoint {second}" not in out

    proc = cluster_2cpu.run_job(args, capture=True, timeout_s=600)
    assert proc.returncode == 0, proc.stdout
    out = proc.stdout
    assert "resuming from Ray Tune's record" in out
    # The finished trial is not trained again: Tune kept it finished (or, were it still
    # running in Tune's last record, its train job found the run complete).
    assert f"new run {first}" not in out and f"run {first} has" not in out
    assert (first / "epoch_0001" / WEIGHTS).stat().st_mtime_ns == first_weights
    # The running one trains on from its latest checkpoint (or was complete already).
    done = int(stopped_at.removeprefix("epoch_")) + 1
    if done < 4:
        assert f"run {second} has {done} of 4 epochs: resuming from {second / stopped_at}" in out
    else:
        assert f"run {second} is complete" in out
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
