"""The sweep (pipeline.tune.sweep) with Ray in the test process, driven as the tune job drives
it (jobs.tune.main): a trial that fails for good is listed while the sweep goes on, and tried
again with retry_failed=true. (ASHA, and a stopped sweep submitted again: tests/jobs/test_tune.py.
Bad spaces: tests/bad_inputs.py.)"""

from __future__ import annotations

import json
import time

import pytest
import ray
from ray.cluster_utils import Cluster

import jobs.tune
from harness.cluster import BUNDLE_ROOT, free_port
from pipeline.core.config import load_config
from pipeline.tune.config import SweepConfig
from pipeline.tune.sweep import SWEEP_SUMMARY, runtime_env

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
