"""Virtualenvs of their own for the servers the tests run beside the bundle (Airflow, MLflow),
whose dependencies must not move the versions the bundle's .venv locks."""

from __future__ import annotations

import fcntl
import hashlib
import shutil
import subprocess
import sys
from pathlib import Path


def uv_venv(venv: Path, pins: Path, *install: str) -> Path:
    """The virtualenv `venv` with `uv pip install <install>` done: built when missing or when
    the file `pins` (what fixes the versions) changed since, reused otherwise. Returns its bin/."""
    digest = hashlib.sha256(pins.read_bytes()).hexdigest()[:12]
    stamp = venv / f".installed-{digest}"  # written last: a half-built venv is rebuilt
    # One builder at a time: `make test` runs two pytest processes, and both may need it.
    with open(venv.with_name(venv.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not stamp.exists():
            shutil.rmtree(venv, ignore_errors=True)
            # uv (a dev dependency): the same pinned install as pip's, in seconds, not minutes.
            uv = str(Path(sys.executable).with_name("uv"))
            python = ["--python", sys.executable]
            subprocess.run([uv, "venv", "--quiet", *python, str(venv)], check=True)
            command = [uv, "pip", "install", "--quiet", "--python", str(venv / "bin" / "python")]
            subprocess.run([*command, *install], check=True, timeout=1800)
            stamp.touch()
    return venv / "bin"
