"""Virtualenvs of their own for the servers the tests run beside the bundle (Airflow, MLflow),
whose dependencies must not move the versions the bundle's .venv locks."""

from __future__ import annotations

import fcntl
import hashlib
import shutil
import subprocess
import sys
from collections.abc import Mapping
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


def writing_bytecode(env: Mapping[str, str]) -> dict[str, str]:
    """`env` for a process of a venv uv_venv built: uv installs no bytecode, so where the
    environment forbids writing it (PYTHONDONTWRITEBYTECODE) every start compiled what it
    imports again; without it, the first start writes it. An MLflow server start: 20.2 CPU-s,
    11.5 once the first had written it."""
    return {k: v for k, v in env.items() if k != "PYTHONDONTWRITEBYTECODE"}
