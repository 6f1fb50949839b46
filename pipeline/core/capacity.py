"""Waiting for a cluster idle at zero to hold a job's first task.

An autoscaling cluster at rest has no worker nodes (`cluster.yaml`: a head with `CPU: 0`,
workers from `min_workers: 0`), so a job starts on a cluster with no CPUs and its first task
waits for the autoscaler to add a node. Ray would wait forever; a scheduler needs the job to fail
after a bounded time, with exit code 3, and say why.
"""

from __future__ import annotations

import logging
import time

import ray
from ray.autoscaler.sdk import request_resources

from pipeline.core.errors import ClusterError

log = logging.getLogger(__name__)

POLL_S = 1.0


def wait_for_capacity(
    bundle: dict[str, int],
    timeout_s: float,
    *,
    asked: str,
    fix: str,
    key: str = "capacity_timeout_s",
) -> dict[str, int]:
    """The cluster's totals of the resources in `bundle` once it has at least `bundle` (one
    task's or actor's worth), waiting up to `timeout_s` (the config's `key`) for an autoscaler
    to add nodes.

    While it waits, it asks the autoscaler for `bundle` (`request_resources`): a job that waits
    before it submits anything shows the autoscaler no demand of its own. The request is
    withdrawn when the wait ends, so it never keeps nodes up after the job."""
    deadline = time.monotonic() + timeout_s
    requested = False
    try:
        while not all((have := _totals(bundle))[r] >= n for r, n in bundle.items()):
            if time.monotonic() > deadline:
                short = ", ".join(f"{have[r]} {r}s" for r, n in bundle.items() if have[r] < n)
                raise ClusterError(
                    f"{asked}, but the cluster has {short} (waited {timeout_s:.0f} s, {key}): "
                    f"{fix}, or raise {key} if the cluster is autoscaling and its nodes take "
                    "longer to start"
                )
            if not requested:
                log.info(
                    "waiting up to %.0f s (%s) for the cluster to hold %s: it has %s",
                    *(timeout_s, key, _show(bundle), _show(have)),
                )
                request_resources(bundles=[bundle])
                requested = True
            time.sleep(POLL_S)
    finally:
        if requested:
            request_resources(bundles=[])
    if requested:
        log.info("the cluster has %s now", _show(have))
    return have


def _totals(bundle: dict[str, int]) -> dict[str, int]:
    total = ray.cluster_resources()
    return {r: int(total.get(r, 0)) for r in bundle}


def _show(amounts: dict[str, int]) -> str:
    return ", ".join(f"{n} {r}(s)" for r, n in amounts.items())
