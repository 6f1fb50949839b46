"""The layout's rules, checked: the library carries no harness and no client, and Ray's private
modules are imported in one place, checked against the Ray version that runs."""

from __future__ import annotations

import ast
import pkgutil
import subprocess
import sys
from pathlib import Path

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


# The import graph of pipeline/, read from the source: every import, those inside functions and
# under `if TYPE_CHECKING:` included. docs/layout.md states these layers.
LAYERS = {
    "core": 0,
    "data": 1,
    "model": 2,
    "tracking": 3,
    "train": 4,
    "infer": 4,
    "export": 4,
    "serve": 4,
    "check": 5,
    "tune": 5,
    "chain": 6,
}


def library_modules() -> dict[str, Path]:
    modules = {}
    for path in sorted((BUNDLE_ROOT / "pipeline").rglob("*.py")):
        parts = path.relative_to(BUNDLE_ROOT).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def import_graph() -> dict[str, set[str]]:
    """Each module of pipeline/ -> the modules of pipeline/ it imports."""
    modules = library_modules()
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, *([node.module] if node.module else [])])
                targets.add(base)
                targets.update(f"{base}.{a.name}" for a in node.names)
        graph[name] = set()
        for target in targets:
            while target and target not in modules:  # a name imported from a module
                target = target.rpartition(".")[0]
            if target and target != name:
                graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = stack[stack.index(v) :]
            del stack[stack.index(v) :]
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def wing(module: str) -> str:
    return module.split(".")[1] if module.count(".") else ""


def is_schema(module: str) -> bool:
    """A job's config schema (`<wing>/config.py`): what every layer may read (the chain plans
    with them, tracking logs them). A schema itself imports as its wing does."""
    return module.endswith(".config")


def test_the_library_has_no_import_circle():
    assert cycles(import_graph()) == []


def test_each_wing_imports_only_the_layers_below_it_and_the_schemas():
    broken = [
        f"{module} -> {target}"
        for module, targets in import_graph().items()
        for target in targets
        if wing(module) and wing(target) != wing(module) and not is_schema(target)
        if LAYERS[wing(target)] >= LAYERS[wing(module)]
    ]
    assert broken == []


def test_the_layers_cover_every_wing_and_the_layout_page_names_every_module():
    modules = library_modules()
    assert {wing(m) for m in modules if wing(m)} == set(LAYERS)
    page = (BUNDLE_ROOT / "docs" / "layout.md").read_text()
    missing = [
        m
        for m, path in modules.items()
        if path.name != "__init__.py"
        and f"`{m.removeprefix('pipeline.').replace('.', '/')}.py`" not in page
    ]
    assert missing == []


def test_no_job_but_the_chains_entry_point_imports_the_chain():
    importers = {
        path.name
        for path in (BUNDLE_ROOT / "jobs").glob("*.py")
        if any(name.startswith("pipeline.chain") for name in imports_of(path))
    }
    assert importers == {"submit.py"}


def test_functions_and_modules_stay_short_enough_to_hold():
    """No function of pipeline/ or jobs/ over 60 lines, no module of pipeline/ over 400: past
    them, a reader cannot hold one in mind, and a concern hides inside another."""
    long_functions, long_modules = [], []
    for path in sorted(
        [*(BUNDLE_ROOT / "pipeline").rglob("*.py"), *(BUNDLE_ROOT / "jobs").glob("*.py")]
    ):
        text = path.read_text()
        name = str(path.relative_to(BUNDLE_ROOT))
        if name.startswith("pipeline/") and text.count("\n") > 400:
            long_modules.append(name)
        for node in ast.walk(ast.parse(text)):
            function = isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            if function and node.end_lineno - node.lineno + 1 > 60:
                long_functions.append(f"{name}:{node.lineno} {node.name}")
    assert (long_functions, long_modules) == ([], [])
