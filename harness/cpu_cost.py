"""What each test costs in CPU-seconds, Ray's processes included.

On two busy cores `make test`'s wall time follows the CPU its tests spend (docs/development.md),
and a test's own process is a small part of that: its clusters' daemons, workers and jobs are
the rest. cgroup v1's `cpuacct` counts a process and everything it starts: a test process joins
a group of its own, and the CPU its group spends during a test is that test's, with whatever the
test's clusters spent meanwhile, idle or not.

`CPU_REPORT=<file> make test` appends one JSON line per test to the file and prints the costliest
units at the end. Where cgroup v1 is not writable (no root, cgroup v2 only) it says so and counts
nothing.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections import defaultdict
from pathlib import Path

CPUACCT = Path("/sys/fs/cgroup/cpuacct")


class Meter:
    """This process's cgroup: `usage()` is the CPU-seconds it and its descendants spent."""

    def __init__(self, group: Path):
        self.group = group

    @classmethod
    def join(cls, name: str) -> Meter | None:
        """Move this process into a new group `name`, or None where that cannot be done."""
        group = _join(CPUACCT / name, {})
        return cls(group) if group else None

    def usage(self) -> float:
        return int((self.group / "cpuacct.usage").read_text()) / 1e9

    def leave(self) -> None:
        """Back to the root group, and the group removed unless something still runs in it."""
        leave(self.group)


def _join(group: Path, settings: dict[str, str]) -> Path | None:
    """This process moved into `group`, a new cgroup v1 group given `settings` first; None where
    that cannot be done."""
    try:
        group.mkdir(exist_ok=True)
        for key, value in settings.items():
            (group / key).write_text(value)
        _move(group)
    except OSError:
        return None
    return group


def leave(group: Path) -> None:
    """This process back to the root of `group`'s hierarchy, and `group` removed unless something
    still runs in it."""
    with contextlib.suppress(OSError):
        _move(group.parent)
        group.rmdir()


def _move(group: Path) -> None:
    """This process into cgroup v1 `group` (a hierarchy's root included); what it starts after
    starts there."""
    (group / "cgroup.procs").write_text(str(os.getpid()))


def record(report: Path, nodeid: str, cpu_s: float, started: float, ended: float) -> None:
    """One test's line: its CPU-seconds, and when it started and ended (`time.time()`)."""
    test = {"test": nodeid, "cpu_s": round(cpu_s, 2), "wall_s": round(ended - started, 2)}
    line = json.dumps(test | {"started": round(started, 2), "ended": round(ended, 2)})
    with open(report, "a") as f:  # one write per line: test processes append side by side
        f.write(line + "\n")


def summary(report: Path, top: int = 30) -> list[str]:
    """The costliest modules and tests in `report`, as lines for the terminal."""
    tests = [json.loads(line) for line in report.read_text().splitlines() if line]
    if not tests:
        return []
    modules: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for t in tests:
        module = modules[t["test"].split("::")[0]]
        module[0] += t["cpu_s"]
        module[1] += t["wall_s"]
    total = sum(t["cpu_s"] for t in tests)
    span = max(t["ended"] for t in tests) - min(t["started"] for t in tests)
    cores = os.cpu_count() or 1
    lines = [
        f"{total:.0f} CPU-s in {len(tests)} tests, over {span:.0f} s on {cores} cores: "
        f"{total / (span * cores):.0%} of what the cores could give",
        "the costliest modules (CPU-s, wall s):",
    ]
    for name, (cpu, wall) in sorted(modules.items(), key=lambda m: -m[1][0])[:top]:
        lines.append(f"{cpu:9.1f} {wall:8.1f}  {name}")
    lines.append("the costliest tests (CPU-s, wall s, setup included):")
    for t in sorted(tests, key=lambda t: -t["cpu_s"])[:top]:
        lines.append(f"{t['cpu_s']:9.1f} {t['wall_s']:8.1f}  {t['test']}")
    return lines
