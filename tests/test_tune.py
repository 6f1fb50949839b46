"""The sweep job on a real local Ray cluster, sent with `ray job submit`: ASHA's early stops and
the best run, and a sweep stopped and submitted again. (Bad spaces: tests/test_bad_inputs.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import history

from pipeline.model.runs import CURVES_PNG, HISTORY_CSV, RUN_SUMMARY
from pipeline.tune.sweep import SWEEP_SUMMARY, TRIALS_PNG

pytestmark = pytest.mark.slow

TUNE = ["python", "-m", "jobs.tune", "--config", "configs/demo-tune.yaml"]
# The demo sweep's trials, smaller: a narrower network, 2 epochs.
TINY = ("train.model.kwargs.width=8", "train.epochs=2")


def tune_job(cluster, dataset, storage, *overrides, **submit):
    args = [*TUNE, f"dataset={dataset}", f"storage_path={storage}", *TINY, *overrides]
    return cluster.submit(args, capture=True, timeout_s=600, **submit)


def test_asha_stops_trailing_trials_and_the_summary_names_the_best_run(
    cluster_2cpu, tiny_dataset, tmp_path
):
    # Two learning rates that learn, then two that barely move the weights: the first two run
    # first (two trials at once, in the grid's order), so the last two reach ASHA's first rung
    # behind them, and are stopped there.
    lrs = "space.optimizer.lr={grid: [0.003, 0.002, 1.0e-7, 2.0e-7]}"
    proc = tune_job(cluster_2cpu, tiny_dataset, tmp_path, "name=asha", lrs)
    assert proc.returncode == 0, proc.stdout
    assert "2 trial(s) at once: each asks 1 CPUs, the cluster has 2 CPUs" in proc.stdout
    sweep = tmp_path / "asha"
    summary = json.loads((sweep / SWEEP_SUMMARY).read_text())
    trials = summary["trials"]
    assert len(trials) == 4
    by_lr = {t["config"]["optimizer.lr"]: t for t in trials}
    assert sorted(by_lr) == [1.0e-7, 2.0e-7, 0.002, 0.003]
    assert [by_lr[lr]["status"] for lr in (0.003, 0.002)] == ["finished", "finished"]
    stopped = [t for t in trials if t["status"] == "stopped early"]
    assert stopped and all(t["epochs"] == 1 for t in stopped), trials
    assert summary["counts"] == {
        "finished": 4 - len(stopped),
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
    assert summary["metric"] == "val_loss" and summary["mode"] == "min"
    assert summary["best_run"] == min(scores, key=scores.get)
    assert summary["best_score"] == pytest.approx(min(scores.values()))
    assert proc.stdout.strip().splitlines()[-1] == f"best run: {summary['best_run']}"
    assert (sweep / TRIALS_PNG).is_file()
