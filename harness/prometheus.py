"""A throwaway Prometheus on 127.0.0.1 that scrapes a LocalCluster every second, for the tests
of the jobs' metrics (docs/metrics.md): the PromQL a team's Grafana runs, against a real server.

Debian's `prometheus` package, installed with apt-get where /usr/bin/prometheus is missing (as
tests/deploy/test_deploy.py installs sshd). It finds the cluster's nodes as docs/cluster.md tells a
`ray up` cluster's Prometheus to: by the file service discovery Ray writes in its temp dir.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import yaml

from harness.cluster import end_process, ends_with_its_starter, free_port

PROMETHEUS = "/usr/bin/prometheus"
# Ray's file of its nodes' metrics addresses, in its temp dir (`/tmp/ray/` by default).
SERVICE_DISCOVERY = "prom_metrics_service_discovery.json"
# What Prometheus logs when its port was taken between free_port() and its own bind.
PORT_TAKEN = "address already in use"


def ensure_installed() -> None:
    """Debian's prometheus, where missing (apt-get, as on a fresh CI machine); its service is
    not started (Docker's policy-rc.d) and not needed: each test starts its own."""
    if Path(PROMETHEUS).exists():
        return
    if os.geteuid() != 0:
        raise RuntimeError(f"{PROMETHEUS} is missing: apt-get install prometheus (needs root)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-q"], env=env, check=True, capture_output=True)
    subprocess.run(
        ["apt-get", "install", "-y", "-q", "--no-install-recommends", "prometheus"],
        env=env,
        check=True,
        capture_output=True,
    )


class Prometheus:
    """`with Prometheus(ray_temp_dir=cluster.temp_dir) as prom: prom.query("up")`.

    Scrapes, every `interval_s`, the nodes Ray's file service discovery lists in
    `ray_temp_dir`, and any `targets` ("host:port") besides. The file also lists the
    dashboard's and the autoscaler's metrics, on fixed ports (44227, 44217) that another
    cluster on this machine may hold: query the jobs' metrics, which only the nodes export."""

    def __init__(
        self, *, ray_temp_dir: str = "", targets: tuple[str, ...] = (), interval_s: float = 1
    ):
        self.ray_temp_dir, self.targets, self.interval_s = ray_temp_dir, targets, interval_s
        self.dir = ""
        self.port = 0
        self._proc: subprocess.Popen | None = None
        self._log = None

    @property
    def address(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def config(self) -> dict:
        """The scrape config: Ray's file service discovery and the static targets."""
        job = {"job_name": "ray"}
        if self.ray_temp_dir:
            sd = str(Path(self.ray_temp_dir, SERVICE_DISCOVERY))
            # Ray rewrites the file every 5 s; read it as often (the default is 5 min).
            job["file_sd_configs"] = [{"files": [sd], "refresh_interval": "2s"}]
        if self.targets:
            job["static_configs"] = [{"targets": list(self.targets)}]
        interval = f"{self.interval_s}s"
        return {
            "global": {"scrape_interval": interval, "evaluation_interval": interval},
            "scrape_configs": [job],
        }

    def start(self, timeout_s: float = 60, attempts: int = 3) -> Prometheus:
        """Start it; ready once /-/ready answers. A port taken before it bound starts it again
        on another."""
        ensure_installed()
        self.dir = tempfile.mkdtemp(prefix="prometheus-")
        config = Path(self.dir, "prometheus.yml")
        config.write_text(yaml.safe_dump(self.config(), sort_keys=False))
        for attempt in range(1, attempts + 1):
            self.port = free_port()
            self._log = open(Path(self.dir, "prometheus.log"), "wb")  # noqa: SIM115
            self._proc = subprocess.Popen(
                [
                    PROMETHEUS,
                    f"--config.file={config}",
                    f"--storage.tsdb.path={Path(self.dir, 'data')}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                ],
                stdout=self._log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=ends_with_its_starter(),
            )
            try:
                self._wait_ready(timeout_s)
                return self
            except RuntimeError as e:
                self._end()
                if PORT_TAKEN not in str(e) or attempt == attempts:
                    self.stop()
                    raise
        return self

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self._proc.returncode}:\n{self.log()}")
            try:
                with urllib.request.urlopen(f"{self.address}/-/ready", timeout=2) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.2)
        raise TimeoutError(f"prometheus not ready after {timeout_s:.0f}s:\n{self.log()}")

    def query(self, promql: str) -> list[dict]:
        """The instant query's result: [{"metric": {label: value}, "value": [time, "value"]}]."""
        url = f"{self.address}/api/v1/query?{urllib.parse.urlencode({'query': promql})}"
        try:
            with urllib.request.urlopen(url, timeout=30) as response:
                body = json.load(response)
        except urllib.error.HTTPError as e:  # a bad query: Prometheus says why in the body
            body = json.load(e)
        if body["status"] != "success":
            raise ValueError(f"{promql}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]["result"]

    def wait_for(self, promql: str, timeout_s: float = 60) -> list[dict]:
        """The query's result once it has one; TimeoutError, with the targets' health, if it
        has none after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while not (result := self.query(promql)):
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"no result for {promql} after {timeout_s:.0f}s; targets: {self.targets_up()}"
                )
            time.sleep(self.interval_s)
        return result

    def targets_up(self) -> dict[str, str]:
        """{scraped address: its health, and the last scrape's error if any}."""
        with urllib.request.urlopen(f"{self.address}/api/v1/targets", timeout=30) as response:
            active = json.load(response)["data"]["activeTargets"]
        found = {}
        for t in active:
            error = f" ({t['lastError']})" if t["lastError"] else ""
            found[t["labels"]["instance"]] = t["health"] + error
        return found

    def log(self, lines: int = 30) -> str:
        path = Path(self.dir, "prometheus.log")
        return "".join(path.read_text(errors="replace").splitlines(True)[-lines:])

    def _end(self) -> None:
        if self._proc is not None:
            end_process(self._proc, grace_s=10)
            self._proc = None
        if self._log is not None:
            self._log.close()
            self._log = None

    def stop(self) -> None:
        self._end()
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> Prometheus:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
