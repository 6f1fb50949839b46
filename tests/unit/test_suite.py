"""The suite's own guarantees: each test has its tier's timeout, a module's tests run in one
process (which makes its module fixtures once), and no test waits for ever. A test that hangs, in
its fixture's setup here, fails with every thread's stack once past its timeout and the run goes
on; one stuck where no signal reaches it (a native wait) ends its process with the stacks, which
xdist reports. Run as `make test` runs, on probe tests of a directory of their own."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import uuid
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest
import tiers

from harness.cluster import BUNDLE_ROOT

HANGS = """
import time

import pytest


@pytest.fixture
def hangs():
    time.sleep(3600)


@pytest.mark.timeout(5)
def test_with_a_fixture_that_hangs(hangs):
    pass


def test_after_it():
    pass
"""
OTHER = """
def test_of_another_module():
    pass
"""
# SIGALRM blocked: pytest-timeout's signal never arrives, as in a wait inside native code.
NATIVE = """
import signal
import time

import pytest


@pytest.mark.timeout(3)
def test_stuck_where_no_signal_reaches():
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
    time.sleep(3600)
"""


@contextmanager
def probes(**modules: str):
    """A directory of probe modules below tests/, so that the suite's conftest.py applies; a
    dot directory, which the suite's own collection passes over."""
    root = BUNDLE_ROOT / "tests" / f".probe-{uuid.uuid4().hex[:8]}"
    root.mkdir()
    try:
        for name, text in modules.items():
            (root / f"{name}.py").write_text(text)
        yield root
    finally:
        shutil.rmtree(root)


def pytest_run(root: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "CPU_REPORT"}
    return subprocess.run(
        [sys.executable, "-m", "pytest", *args, "-v", "-p", "no:cacheprovider", str(root)],
        cwd=BUNDLE_ROOT,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        timeout=300,  # the guarantee under test: the run ends
    )


def test_a_test_that_hangs_in_a_fixture_fails_with_its_stack_and_the_rest_runs():
    with probes(test_probe=HANGS, test_other=OTHER) as root:
        proc = pytest_run(root, "-n", "2", "--dist", "loadgroup")
    out = proc.stdout
    assert proc.returncode == 1, out
    assert "Timeout (>5.0s) from pytest-timeout" in out, out
    # The fixture's frame, where it hung, and every thread's stack beside it.
    assert re.search(r"def hangs\(\):\n>\s+time\.sleep\(3600\)", out), out
    assert "Stack of" in out, out
    assert "2 passed, 1 error" in out, out  # the hung test's setup failed; the others ran


# Four quick tests a module: three modules, three processes.
QUICK = "\n".join(f"def test_{n}():\n    pass\n\n" for n in ("a", "b", "c", "d"))


def test_a_modules_tests_run_in_one_process():
    # xdist's loadgroup groups by the nodeid suffix its collection hook writes from each test's
    # xdist_group mark: tiers.mark's marks must be there before it, and pytest must keep the
    # suffix (9.2 drops it: pytest-xdist#1386), or each test goes its own way.
    with probes(test_one=QUICK, test_two=QUICK, test_three=QUICK) as root:
        proc = pytest_run(root, "-n", "3", "--dist", "loadgroup")
    assert proc.returncode == 0, proc.stdout
    ran = re.findall(r"\[(gw\d+)\] \[\s*\d+%\] PASSED \S+/(test_\w+)\.py::test_\w@", proc.stdout)
    processes = {module: {gw for gw, m in ran if m == module} for _, module in ran}
    assert len(ran) == 12 and all(len(gws) == 1 for gws in processes.values()), proc.stdout


def test_a_test_no_signal_reaches_ends_its_process_with_every_stack():
    with probes(test_native=NATIVE) as root:
        proc = pytest_run(root, "-n", "1", "--max-worker-restart", "0")
    out = proc.stdout
    assert proc.returncode != 0, out
    assert "Timeout (0:00:06)!" in out, out  # faulthandler's header: timeout + grace
    assert re.search(r'test_native\.py", line \d+ in test_stuck_where_no_signal_reaches', out), out
    assert "crashed while running" in out and "test_stuck_where_no_signal_reaches" in out, out


@pytest.mark.parametrize(
    ("path", "seconds"),
    [
        ("unit/test_a.py", 300),
        ("ray/test_a.py", 600),
        ("jobs/test_a.py", 1200),
        ("deploy/test_a.py", 1500),
    ],
)
def test_each_tier_has_its_timeout_and_a_module_its_process(path, seconds):
    marks = []
    item = SimpleNamespace(
        path=Path(tiers.__file__).parent / path,
        nodeid=f"tests/{path}::test_x",
        get_closest_marker=lambda name: next((m for m in marks if m.name == name), None),
        add_marker=marks.append,
    )
    tiers.mark([item])
    timeout, group = (m for m in marks)
    assert timeout.args == (seconds,)
    assert group.args == (f"tests/{path}",)


def test_a_usage_error_is_printed_not_only_its_exit_code(tmp_path):
    # conftest.py leaves a finished run with os._exit; pytest prints a usage error after that.
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-p",
        "no:xdist",
        "-k",
        "(",
        "tests/unit/test_config.py",
    ]
    # The run's CPU report, as `make test` names it: a pytest run by a test leaves it alone.
    report = tmp_path / "cpu-report.jsonl"
    report.write_text('{"test": "tests/jobs/test_harness.py::a_test_before"}\n')
    env = {**os.environ, "CPU_REPORT": str(report)}
    proc = subprocess.run(
        command, cwd=BUNDLE_ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 4, proc.stdout + proc.stderr
    assert "Wrong expression passed to '-k'" in proc.stderr, proc.stdout + proc.stderr
    assert report.read_text() == '{"test": "tests/jobs/test_harness.py::a_test_before"}\n'
