"""The jobs' metrics as a team's Prometheus sees them (docs/metrics.md): a real Prometheus
(Debian's, harness/prometheus.py) scrapes a local cluster every second, found by the file
service discovery Ray writes, and answers PromQL. A train and an infer job on that cluster are
watched there and through the chain's `status` (docs/status.md)."""

from __future__ import annotations

import concurrent.futures
import json
import re
import subprocess
import sys
import time

import pytest
from helpers import history

from harness.cluster import BUNDLE_ROOT, LocalCluster
from harness.prometheus import Prometheus
from pipeline.chain.plan import step_command
from pipeline.core.progress import read_progress
from pipeline.core.storage import Location
from pipeline.model.runs import RUN_SUMMARY

# Ray exports a gauge only in the report interval it was set in (10 s by default): every
# second, as the jobs' own keep setting theirs (pipeline/core/metrics.py).
REPORT_ENV = {"RAY_metrics_report_interval_ms": "1000"}
# A driver that sets a gauge every half second, for at most two minutes.
GAUGE_DRIVER = """
import sys, time
import ray
from ray.util.metrics import Gauge

ray.init(address=sys.argv[1])
gauge = Gauge("cv_harness_probe", "The harness's own probe", tag_keys=("run",))
deadline = time.monotonic() + 120
while time.monotonic() < deadline:
    gauge.set(42, tags={"run": "probe"})
    time.sleep(0.5)
"""


@pytest.fixture(scope="module")
def scraped():
    """(a cluster whose head exports its metrics every second, a Prometheus that scrapes its
    nodes every second through Ray's file service discovery)."""
    cluster = LocalCluster(num_cpus=2, env=REPORT_ENV, metrics=True)
    with cluster, Prometheus(ray_temp_dir=cluster.temp_dir) as prometheus:
        yield cluster, prometheus


def test_prometheus_answers_promql_for_a_gauge_the_cluster_sets(scraped):
    cluster, prometheus = scraped
    driver = subprocess.Popen(
        [sys.executable, "-c", GAUGE_DRIVER, cluster.gcs_address], env=cluster.env
    )
    try:
        result = prometheus.wait_for('sum by (run) (ray_cv_harness_probe{run="probe"})', 90)
    finally:
        driver.kill()
        driver.wait()
    assert [(r["metric"], float(r["value"][1])) for r in result] == [({"run": "probe"}, 42.0)]
    # Found as docs/cluster.md says: the head's --metrics-export-port, from Ray's file.
    targets = prometheus.targets_up()
    head = [t for t in targets if t.endswith(f":{cluster.metrics_port}")]
    assert [targets[t] for t in head] == ["up"], targets
    with pytest.raises(ValueError, match="bad_data"):
        prometheus.query("sum by (run")


# A small dataset of generated shapes, and a run of 8 short epochs, long enough to be watched.
WATCHED = [
    "preprocess.source.synthetic.num_classes=3",
    "preprocess.source.synthetic.images_per_class=100",
    "preprocess.source.synthetic.raw_size=40",
    "preprocess.image_size=32",
    "train.name=watched",
    "train.epochs=8",
    "train.log_every_s=2",
    "train.cost.price_per_worker_hour=2.5",
]


IN_AN_EPOCH = ("training", "evaluating", "checkpointing")


def test_a_train_and_an_infer_job_are_watched_through_prometheus_and_status(scraped, tmp_path):
    cluster, prometheus = scraped
    root = tmp_path / "root"

    def chain(step: str, *more: str, timeout_s: float = 900) -> subprocess.CompletedProcess:
        *options, step = step_command(
            cluster.address, str(root), step, profile="demo", sets=WATCHED
        )
        return subprocess.run(
            [sys.executable if arg == "python" else arg for arg in options] + [step, *more],
            cwd=BUNDLE_ROOT,
            env=cluster.env,
            text=True,
            capture_output=True,
            timeout=timeout_s,
        )

    def status(*more: str) -> subprocess.CompletedProcess:
        return chain("status", *more, timeout_s=120)

    done = chain("preprocess")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        train = pool.submit(chain, "train")
        # Once two epochs are behind it: the ETA has measured an evaluation and a checkpoint.
        deadline = time.monotonic() + 600
        seen = []  # what each status answered, and in how long: shown if the run ends first
        while True:
            if train.done():
                ended = train.result()
                pytest.fail(
                    f"train ended before status saw epoch 1's checkpoint: {seen}\n"
                    f"{ended.stdout[-3000:]}{ended.stderr[-3000:]}"
                )
            assert time.monotonic() < deadline, f"the run never checkpointed epoch 1: {seen}"
            asked = time.monotonic()
            answer = status("--json")
            took = round(time.monotonic() - asked, 1)
            if answer.returncode != 0:
                seen.append((took, answer.returncode, answer.stderr[-300:]))
            else:
                record = json.loads(answer.stdout)["train"]
                checkpointed = (record.get("last_checkpoint") or {}).get("epoch", -1)
                seen.append((took, *(record.get(k) for k in ("state", "epoch", "step"))))
                # In any state once epoch 1's checkpoint is recorded: on a loaded machine a
                # status can take 20 s, and evaluations and checkpoints are much of an epoch
                # (whose number, while it checkpoints, is already the next one's).
                if record.get("state") in IN_AN_EPOCH and checkpointed >= 1:
                    break
            time.sleep(3)  # each status starts a Python process of its own
        print("status answers before epoch 1's checkpoint (s, state, epoch, step):", seen)
        asked_at = time.time()
        job_id = record["job_id"]
        assert record["job_status"] == "RUNNING" and record["epochs"] == 8
        assert record["images_per_s"] > 0 and 0 <= record["input_wait_share"] <= 1
        assert record["epoch"] >= 2 and record["best"]["metric"] == "val_loss"
        # The run's gauges, by its name and its job's id, as a team's Prometheus has them.
        label = f'run="watched", job_id="{job_id}"'
        queries = {
            "images/s": f"sum by (run) (ray_cv_train_images_per_second{{{label}}})",
            "input wait": f"max by (run) (ray_cv_train_input_wait_share{{{label}}})",
            "progress": f"max by (run) (ray_cv_train_progress{{{label}}})",
            "ETA": f"max by (run) (ray_cv_train_eta_seconds{{{label}}})",
        }
        found = {what: prometheus.wait_for(q, 60) for what, q in queries.items()}
        text = status()
        done = train.result()
    assert done.returncode == 0, done.stdout[-5000:] + done.stderr[-3000:]
    for what, result in found.items():
        [(labels, value)] = [(r["metric"], float(r["value"][1])) for r in result]
        assert labels == {"run": "watched"}, what
        assert value >= 0 and (value <= 1 or what in ("images/s", "ETA")), (what, value)
    # Past the first epoch: status saw epoch 1 checkpointed (2 of 8, 0.25); a scrape can lag
    # the gauge by its interval, on a loaded machine by seconds of training.
    assert float(found["progress"][0]["value"][1]) > 1 / 8
    # The ETA it gave, against the time the run then took.
    run = root / "runs" / "watched"
    final = read_progress(Location.parse(str(run)))
    took = final["updated_at"] - asked_at
    assert final["state"] == "finished" and final["progress"] == 1.0
    at = f"epoch {record['epoch']} step {record['step']}"
    print(f"ETA at {at}: {record['eta_s']:.0f} s; the run then took {took:.0f} s")
    # Of the run's order: the load of the machine it shares changes the pace the ETA measured
    # (155 s given, 82 s taken, as the other tests ended). Its arithmetic: unit/test_telemetry.
    assert took / 3 <= record["eta_s"] <= 3 * took, (record["eta_s"], took)
    lines = text.stdout.splitlines()
    assert lines[0].startswith(f"train run {run} (job {job_id}: RUNNING; "), text.stdout
    assert re.match(r"  epoch [2-7]/7, step \d+/\d+ \(\d+% of the run\), [\d.]+ images/s", lines[1])
    assert "ETA" in lines[1] and "epoch 1/7: batch" in done.stdout  # the chain shows progress
    assert re.search(r"epoch 1/7: train_loss .* worker-hours, ETA (\d+m)?\d+s", done.stdout)
    # What it cost: each epoch's, and the run's, at the config's price.
    summary = json.loads((run / RUN_SUMMARY).read_text())
    rows = history(run)
    assert summary["worker_hours"] == pytest.approx(sum(r["worker_hours"] for r in rows))
    assert summary["worker_hours"] > 0 and summary["gpu_hours"] == 0
    assert summary["cost"] == pytest.approx(2.5 * summary["worker_hours"])
    assert summary["currency"] == "USD"

    done = chain("infer")
    assert done.returncode == 0, done.stdout[-5000:] + done.stderr[-3000:]
    output = 'output="watched"'
    images = prometheus.wait_for(f"max_over_time(ray_cv_infer_images{{{output}}}[10m])", 60)
    progress = prometheus.wait_for(f"max_over_time(ray_cv_infer_progress{{{output}}}[10m])", 60)
    answer = json.loads(status("--json").stdout)
    infer, train_now = answer["infer"], answer["train"]
    assert infer["state"] == "finished" and infer["job_status"] == "SUCCEEDED"
    assert infer["images_done"] == infer["images"] == float(images[0]["value"][1]) > 0
    assert float(progress[0]["value"][1]) == 1.0
    assert train_now["job_status"] == "SUCCEEDED"
    assert train_now["last_checkpoint"]["epoch"] == 7  # the last epoch's, written after its end
