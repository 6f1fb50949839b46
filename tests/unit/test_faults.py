"""Fault points (pipeline.core.faults), in plain processes: unarmed, or armed for another point, a
point passes; armed, the first process to reach it is held there, and the ones after it pass."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from helpers import wait_for

from harness.cluster import BUNDLE_ROOT
from harness.faults import arm, release
from pipeline.core import faults

REACH = (
    "from pipeline.core import faults; faults.point(faults.CHECKPOINT_REPORTED); print('passed')"
)


def reach(env: dict[str, str]) -> subprocess.Popen:
    """A process that reaches CHECKPOINT_REPORTED, then prints 'passed' and exits."""
    command = [sys.executable, "-c", REACH]
    env = {**os.environ, **env}
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    return subprocess.Popen(command, cwd=BUNDLE_ROOT, env=env, **pipes)


def test_points_pass_unless_armed(monkeypatch, tmp_path):
    monkeypatch.delenv(faults.ENV, raising=False)
    faults.point(faults.CHECKPOINT_REPORTED)
    for name, value in arm(faults.CHECKPOINT_UPLOADED, tmp_path).items():
        monkeypatch.setenv(name, value)
    faults.point(faults.CHECKPOINT_REPORTED)
    assert list(tmp_path.iterdir()) == []


def test_an_armed_point_holds_the_first_process_only(tmp_path):
    armed = arm(faults.CHECKPOINT_REPORTED, tmp_path)
    marker = tmp_path / faults.CHECKPOINT_REPORTED
    first = reach(armed)
    try:
        wait_for(lambda: marker.exists() or first.poll() is not None, "the marker", 60)
        assert int(marker.read_text()) == first.pid
        time.sleep(1)  # a point that did not hold would have printed and exited by now
        assert first.poll() is None
    finally:
        first.kill()
    _, said = first.communicate(timeout=60)
    assert f"fault point checkpoint_reported: holding this process (pid {first.pid})" in said
    # The replacement passes: the marker says the point fired in this run.
    second = reach(armed)
    assert second.communicate(timeout=60)[0].strip() == "passed"
    assert second.returncode == 0


def test_a_held_process_goes_on_once_released(tmp_path):
    held = reach(arm(faults.CHECKPOINT_REPORTED, tmp_path))
    marker = tmp_path / faults.CHECKPOINT_REPORTED
    try:
        wait_for(lambda: marker.exists() or held.poll() is not None, "the marker", 60)
        time.sleep(1)
        assert held.poll() is None
        release(marker)
        out, said = held.communicate(timeout=60)
    finally:
        held.kill()
    assert out.strip() == "passed" and held.returncode == 0
    assert "fault point checkpoint_reported: released" in said


def test_an_unknown_point_is_an_error(monkeypatch, tmp_path):
    monkeypatch.setenv(faults.ENV, f"checkpoint_saved:{tmp_path}")
    with pytest.raises(ValueError, match=r"one of checkpoint_uploaded, checkpoint_reported"):
        faults.point(faults.CHECKPOINT_REPORTED)
