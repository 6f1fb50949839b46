"""The jobs' metrics as a team's Prometheus sees them (docs/metrics.md): a real Prometheus
(Debian's, harness/prometheus.py) scrapes a local cluster every second, found by the file
service discovery Ray writes, and answers PromQL."""

from __future__ import annotations

import subprocess
import sys

import pytest

from harness.cluster import LocalCluster
from harness.prometheus import Prometheus

pytestmark = pytest.mark.slow

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
