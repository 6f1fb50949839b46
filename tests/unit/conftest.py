"""The unit tier starts no Ray: a test here that would start a Ray instance or a cluster fails
at once, naming the tier it belongs to."""

from __future__ import annotations

import pytest
import ray
import ray._private.worker

from harness.cluster import LocalCluster

WHY = "tests/unit starts no Ray; a test that needs Ray belongs in tests/ray or tests/jobs"


def _refuse(*args, **kwargs):
    raise RuntimeError(WHY)


@pytest.fixture(autouse=True)
def no_ray(monkeypatch):
    # ray.init, and the worker's own, which Ray Data and the Ray Train APIs call to start one.
    monkeypatch.setattr(ray, "init", _refuse)
    monkeypatch.setattr(ray._private.worker, "init", _refuse)
    monkeypatch.setattr(LocalCluster, "start", _refuse)
