"""The `anyscale` CLI's own config models, in a virtualenv of their own (`.venv-anyscale`, built
on first use as harness/airflow.py builds Airflow's, then reused): they load the bundle's
Anyscale files offline, as `anyscale job submit -f` and the rest would before calling Anyscale.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from harness.cluster import BUNDLE_ROOT
from harness.venvs import uv_venv

ANYSCALE_VERSION = "0.26.112"
VENV = BUNDLE_ROOT / ".venv-anyscale"
LOADER = Path(__file__).with_name("anyscale_load.py")


def ensure_venv(venv: Path = VENV) -> Path:
    """The virtualenv with the pinned anyscale: built when missing or when this file (which
    pins it) changed, reused otherwise. Returns its `bin/python`."""
    return uv_venv(venv, Path(__file__), f"anyscale=={ANYSCALE_VERSION}") / "python"


def load(files: dict[str, str]) -> dict[str, str]:
    """{path: model name} -> {path: "ok" or the model's error}, every file in one process run
    from the bundle root (the files' relative paths are the bundle's)."""
    proc = subprocess.run(
        [str(ensure_venv()), str(LOADER)],
        input=json.dumps(files),
        capture_output=True,
        text=True,
        cwd=BUNDLE_ROOT,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)
