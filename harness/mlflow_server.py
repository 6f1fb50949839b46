"""A real MLflow tracking server for the tests: `mlflow server` with SQLite as its backend store
and a local directory as its artifact store, on 127.0.0.1 and a free port.

The server (the full mlflow package, which the nodes never install) lives in a virtualenv of
its own, `.venv-mlflow` beside `.venv`, installed by uv from requirements/tracking-server.txt
and kept between runs: built once, then reused until that file changes. The server can be
stopped and started again on the same port and store, as an outage looks to its clients.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from harness.cluster import BUNDLE_ROOT, ends_with_its_starter, free_port
from harness.venvs import uv_venv, writing_bytecode

REQUIREMENTS = BUNDLE_ROOT / "requirements" / "tracking-server.txt"
VENV = BUNDLE_ROOT / ".venv-mlflow"


def ensure_venv(venv: Path = VENV) -> Path:
    """The virtualenv with the MLflow server installed: built when missing or when
    REQUIREMENTS changed since, reused otherwise. Returns its `bin/mlflow`."""
    return uv_venv(venv, REQUIREMENTS, "-r", str(REQUIREMENTS)) / "mlflow"


def _group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    # Reap the leader, our child, so that it does not linger in the group as a zombie.
    with contextlib.suppress(ChildProcessError):
        os.waitpid(group, os.WNOHANG)
    return True


class MLflowServer:
    """`with MLflowServer(directory) as server:` an MLflow server whose database and artifacts
    live in `directory`; `server.uri` is its address. `stop()` and `start()` again keep both."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.port = free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.log = directory / "server.log"
        self._proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 600) -> MLflowServer:
        """Start the server and wait until it answers (its first start makes the database)."""
        mlflow = ensure_venv()
        command = [
            str(mlflow),
            "server",
            *("--host", "127.0.0.1", "--port", str(self.port), "--workers", "1"),
            *("--backend-store-uri", f"sqlite:///{self.directory / 'mlflow.db'}"),
            *("--artifacts-destination", str(self.directory / "artifacts")),
        ]
        env = {k: v for k, v in writing_bytecode(os.environ).items() if not k.startswith("MLFLOW_")}
        # Its job runner (server-side jobs for GenAI features) would start three more processes.
        env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] = "false"
        with open(self.log, "a") as log:
            self._proc = subprocess.Popen(
                command,
                cwd=self.directory,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: stop() ends it and its workers
                preexec_fn=ends_with_its_starter(),
            )
        deadline = time.monotonic() + timeout_s
        while not self.answers():
            if self._proc.poll() is not None:
                raise RuntimeError(f"mlflow server exited {self._proc.returncode}:\n{self.tail()}")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"mlflow server not up after {timeout_s} s:\n{self.tail()}")
            time.sleep(0.5)
        return self

    def answers(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def stop(self) -> None:
        """Stop the server and its worker processes (SIGTERM, then SIGKILL after 30 s)."""
        if self._proc is None:
            return
        group, self._proc = self._proc.pid, None  # the group keeps its leader's id
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(group, sig)
            except ProcessLookupError:  # all of it gone already
                break
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and _group_alive(group):
                time.sleep(0.2)

    def client(self):
        """An MLflow client of this server, to read back what the jobs logged."""
        from mlflow import MlflowClient

        return MlflowClient(tracking_uri=self.uri, registry_uri=self.uri)

    def tail(self, lines: int = 30) -> str:
        return "\n".join(self.log.read_text().splitlines()[-lines:])

    def __enter__(self) -> MLflowServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
