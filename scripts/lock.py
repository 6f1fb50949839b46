"""`make lock`: requirements/cluster.lock, the exact versions (with hashes) that every cluster
node and every client installs, compiled by uv from requirements/cluster.txt.

    make lock                  # keeps the versions already locked where they still fit
    make lock UPGRADE=1        # the newest versions that fit

The lock records the requirements it was compiled from; tests/unit/test_cluster_yaml.py compares
that record, and the locked versions, with requirements/ (`lock_problems`).
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
SOURCE = "requirements/cluster.txt"
CONSTRAINTS = "requirements/cluster-constraints.txt"
LOCK = "requirements/cluster.lock"
# The lowest Python of any node: cluster.yaml's AMI (Ubuntu 22.04 Deep Learning Base) runs 3.10.
PYTHON_FLOOR = "3.10"
COMMAND = [
    "uv",
    "pip",
    "compile",
    SOURCE,
    "--universal",
    "--python-version",
    PYTHON_FLOOR,
    "--fork-strategy",
    "fewest",
    "--constraint",
    CONSTRAINTS,
    "--generate-hashes",
    "--no-header",
    "--quiet",  # the lock goes to its file only, not to the terminal as well
    "--output-file",
    LOCK,
]
INPUT_LINE = "# Compiled from:"
HEADER = f"""\
# The version and hashes of every package that each node of cluster.yaml and
# cluster-onprem.yaml, and each client's `make install`, installs:
#   pip install --require-hashes -r {LOCK}
# Do not edit: `make lock` writes it from {SOURCE} (and the files that
# includes), bounded by {CONSTRAINTS}, with
#   {shlex.join(COMMAND)}
# Universal: the nodes run Linux x86_64 and install the Linux wheels (torch with CUDA), while a
# client's `make demo` may run on macOS too; the markers say which package each platform needs.
# One version of each package for every Python from {PYTHON_FLOOR} on (--fork-strategy fewest):
# cluster.yaml's nodes run Python {PYTHON_FLOOR} (the Ubuntu 22.04 Deep Learning AMI), those of
# cluster-onprem.yaml whatever python3 they have, clients theirs, and all get the same versions
# (lines marked python_full_version < '3.11' are backports that newer Pythons have built in).
# A release that dropped Python {PYTHON_FLOOR} is not picked until PYTHON_FLOOR in
# scripts/lock.py rises with every node's Python.
"""


def requirements_file(path: Path) -> list[Requirement]:
    """The requirements in a pip requirements file (or lock), following its `-r` lines and
    leaving out options such as `--hash`."""
    reqs = []
    text = path.read_text().replace("\\\n", " ")
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line.startswith("-r"):
            reqs += requirements_file(path.parent / line[2:].strip())
        elif line:
            reqs.append(Requirement(line.split(" --", 1)[0].strip()))
    return reqs


def recorded_input(lock: Path) -> list[str]:
    """The requirements the lock says it was compiled from."""
    lines = lock.read_text().splitlines()
    if INPUT_LINE not in lines:
        return []
    start = lines.index(INPUT_LINE) + 1
    recorded = []
    for line in lines[start:]:
        if not line.startswith("#   "):
            break
        recorded.append(line[4:])
    return recorded


def input_lines(source: Path, constraints: Path) -> list[str]:
    """What the lock is compiled from, as its header records it."""
    return [
        *sorted(str(r) for r in requirements_file(source)),
        *sorted(f"{r} (constraint)" for r in requirements_file(constraints)),
    ]


def lock_problems(lock: Path, source: Path, constraints: Path) -> list[str]:
    """What makes `lock` stale for `source` and `constraints`: none when it is up to date."""
    problems = []
    recorded, now = recorded_input(lock), input_lines(source, constraints)
    if recorded != now:
        gone, new = sorted(set(recorded) - set(now)), sorted(set(now) - set(recorded))
        problems.append(f"compiled from other requirements: now {new}, then {gone}")
    pins: dict[str, list[Requirement]] = {}
    for pin in requirements_file(lock):
        pins.setdefault(canonicalize_name(pin.name), []).append(pin)
    for req in [*requirements_file(source), *requirements_file(constraints)]:
        found = pins.get(canonicalize_name(req.name), [])
        if not found and req in requirements_file(source):
            problems.append(f"{req} is not in the lock")
        for pin in found:
            (spec,) = pin.specifier
            if spec.operator != "==" or Version(spec.version) not in req.specifier:
                problems.append(f"{req}: the lock has {pin}")
    return problems


def write_lock(upgrade: bool) -> bool:
    """Compile the lock; whether it changed."""
    lock = ROOT / LOCK
    before = lock.read_text() if lock.exists() else None
    stat = lock.stat() if lock.exists() else None
    uv = Path(sys.executable).parent / "uv"
    command = [str(uv), *COMMAND[1:], *(["--upgrade"] if upgrade else [])]
    subprocess.run(command, cwd=ROOT, check=True)
    inputs = "".join(f"#   {line}\n" for line in input_lines(ROOT / SOURCE, ROOT / CONSTRAINTS))
    after = f"{HEADER}{INPUT_LINE}\n{inputs}\n{lock.read_text()}"
    lock.write_text(after)
    if after == before:
        # The same lock keeps its time: make would otherwise rebuild .venv for nothing.
        os.utime(lock, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    return after != before


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--upgrade", action="store_true", help="the newest versions that fit")
    parser.add_argument("--check", action="store_true", help="exit 1 if the lock is stale")
    args = parser.parse_args()
    if args.check:
        problems = lock_problems(ROOT / LOCK, ROOT / SOURCE, ROOT / CONSTRAINTS)
        for problem in problems:
            print(f"{LOCK} is stale (run `make lock`): {problem}", file=sys.stderr)
        return 1 if problems else 0
    print(f"wrote {LOCK}" if write_lock(args.upgrade) else f"{LOCK} is unchanged")
    return 0


if __name__ == "__main__":
    sys.exit(main())
