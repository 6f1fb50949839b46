"""A real Airflow 3 for the tests: its own virtualenv and an AIRFLOW_HOME with SQLite.

Airflow lives in a virtualenv of its own (`.venv-airflow`, beside `.venv`), installed with the
bundle's constraints file by uv and kept between runs: built once, then reused until the
constraints change. Its tasks run `python -m jobs.submit` with the `python` first on PATH,
the bundle's: Airflow's environment holds no Ray and no torch.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from harness.cluster import BUNDLE_ROOT
from harness.venvs import uv_venv, writing_bytecode

AIRFLOW_VERSION = "3.3.2"
DAGS_FOLDER = BUNDLE_ROOT / "examples" / "airflow"
CONSTRAINTS = DAGS_FOLDER / f"constraints-airflow-{AIRFLOW_VERSION}.txt"
VENV = BUNDLE_ROOT / ".venv-airflow"


def ensure_venv(venv: Path = VENV) -> Path:
    """The virtualenv with apache-airflow installed under CONSTRAINTS: built when missing or
    when the constraints changed since, reused otherwise. Returns its `bin/airflow`."""
    install = [f"apache-airflow=={AIRFLOW_VERSION}", "--constraint", str(CONSTRAINTS)]
    return uv_venv(venv, CONSTRAINTS, *install) / "airflow"


class Airflow:
    """The `airflow` CLI on an AIRFLOW_HOME of its own: SQLite, no examples, the bundle's
    examples/airflow/ as the DAGs folder. `env`: the environment its tasks inherit."""

    def __init__(self, home: Path, env: dict[str, str]):
        self.cli = str(ensure_venv())
        self.home = home
        self.env = {
            **writing_bytecode(env),
            "AIRFLOW_HOME": str(home),
            "AIRFLOW__CORE__DAGS_FOLDER": str(DAGS_FOLDER),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        }

    def popen(self, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        """`airflow <args>` in the background, its output (stdout and stderr) on a pipe."""
        return subprocess.Popen(
            [self.cli, *args],
            env={**self.env, **(env or {})},
            cwd=self.home,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )

    def run(self, *args: str, timeout_s: float = 900) -> subprocess.CompletedProcess:
        """`airflow <args>`, waited for; stdout holds its output and stderr's."""
        proc = self.popen(*args)
        try:
            out, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
        return subprocess.CompletedProcess(proc.args, proc.returncode, out)
