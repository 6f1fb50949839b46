"""The suite's tiers: the folder under tests/ a test is in, and each tier's timeout; and the
markers `tests/conftest.py` gives every test from them."""

from __future__ import annotations

from pathlib import Path

import pytest

# Each tier's timeout in seconds, for a test that names none (@pytest.mark.timeout): past it,
# pytest-timeout fails the test with every thread's stack, fixtures' setup included, and the
# run goes on. A test's time includes the setup of the session fixtures it is the first to ask
# for (a generated dataset, the MLflow server's venv on a fresh machine); the jobs tier's longest
# (a cluster, a training run and its jobs) take minutes on two loaded cores.
TIMEOUT_S = {"unit": 300, "ray": 600, "jobs": 1200, "deploy": 1500}
# A test stuck where Python never regains control (a native wait) is past the signal's reach:
# this long after its timeout (or its timeout again, if shorter), faulthandler writes every
# thread's stack and ends the process, and xdist reports the test as crashed.
NATIVE_GRACE_S = 120


def tier(item) -> str:
    """The tier of a test: the folder under tests/ that holds it."""
    try:
        return Path(item.path).relative_to(Path(__file__).parent).parts[0]
    except ValueError:  # a test file named from elsewhere
        return "jobs"


def mark(items) -> None:
    """A test without its own timeout gets its tier's. Under `--dist loadgroup` a module's tests
    go to one process, which makes its module-scoped fixtures once; modules that share a costly
    fixture name one group (`pytestmark = pytest.mark.xdist_group(...)`)."""
    for item in items:
        if item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(TIMEOUT_S.get(tier(item), TIMEOUT_S["jobs"])))
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))
