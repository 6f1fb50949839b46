"""The layout's rules, checked: the library carries no harness and no client, and Ray's private
modules are imported in one place, checked against the Ray version that runs."""

from __future__ import annotations

import ast
import pkgutil
import subprocess
import sys

import ray

import pipeline
from harness.cluster import BUNDLE_ROOT
from pipeline.core import ray_internals

LIBRARY = sorted(m.name for m in pkgutil.walk_packages(pipeline.__path__, "pipeline."))


def imports_of(path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_the_library_imports_neither_harness_nor_jobs():
    code = f"import sys; import {', '.join(LIBRARY)}; print('\\n'.join(sys.modules))"
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=BUNDLE_ROOT, capture_output=True, text=True, check=True
    )
    loaded = set(proc.stdout.split())
    assert "pipeline.train.worker" in loaded
    assert not {m for m in loaded if m.split(".")[0] in ("harness", "jobs", "tests", "bench")}


def test_rays_private_modules_are_imported_in_one_module_only():
    files = [
        f
        for folder in ("pipeline", "jobs", "harness", "tests", "bench", "scripts", "examples")
        for f in (BUNDLE_ROOT / folder).rglob("*.py")
    ]
    private = {
        str(f.relative_to(BUNDLE_ROOT))
        for f in files
        if any(name.startswith("ray.") and "._internal" in name for name in imports_of(f))
    }
    assert private == {"pipeline/core/ray_internals.py"}


def test_ray_internals_was_checked_against_the_ray_that_runs():
    # A Ray upgrade fails here first: check each name in ray_internals, then its version line.
    assert ray.__version__ == ray_internals.CHECKED_AGAINST, (
        f"Ray {ray.__version__} runs, but pipeline/core/ray_internals.py was checked against "
        f"{ray_internals.CHECKED_AGAINST}"
    )
