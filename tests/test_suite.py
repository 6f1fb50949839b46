"""The suite's own guarantee: no test waits for ever. A test that hangs, here in its fixture's
setup, is failed with every thread's stack once past its timeout, and `make test`'s scheduling
(tests/conftest.py) goes on with the rest of its module on a new worker. Run as `make test` runs,
on probe tests of a directory of their own."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import uuid

from harness.cluster import BUNDLE_ROOT

PROBE = """
import time

import pytest


@pytest.fixture
def hangs():
    time.sleep(3600)


def test_with_a_fixture_that_hangs(hangs):
    pass


def test_after_it():
    pass
"""
OTHER = """
def test_of_another_module():
    pass
"""


def test_a_test_that_hangs_in_a_fixture_fails_with_its_stack_and_the_rest_runs():
    # Below tests/, so that the suite's conftest.py applies; a dot directory, which the suite's
    # own collection passes over.
    probes = BUNDLE_ROOT / "tests" / f".hang-probe-{uuid.uuid4().hex[:8]}"
    probes.mkdir()
    try:
        (probes / "test_probe.py").write_text(PROBE)
        (probes / "test_other.py").write_text(OTHER)
        env = {k: v for k, v in os.environ.items() if k not in ("CPU_REPORT",)}
        args = ["-n", "3", "--light-worker", "--dist", "loadscope", "-v", "-p", "no:cacheprovider"]
        limits = ["-o", "timeout=30", "-o", "faulthandler_timeout=15"]
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", *args, *limits, str(probes)],
            cwd=BUNDLE_ROOT,
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            timeout=600,  # the guarantee under test: the run ends
        )
    finally:
        shutil.rmtree(probes)
    out = proc.stdout
    assert proc.returncode == 1, out
    assert "crashed while running 'tests/" in out and "test_with_a_fixture_that_hangs'" in out, out
    assert "Timeout (0:00:15)!" in out, out  # every thread's stack, the fixture's among them:
    assert re.search(r'test_probe\.py", line \d+ in hangs', out), out
    assert "1 failed, 2 passed" in out, out  # the hung test failed once; the others ran
