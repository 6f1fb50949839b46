"""Waiting for a cluster idle at zero to hold a job's first task.

An autoscaling cluster at rest has no worker nodes (`cluster.yaml`: a head with `CPU: 0`,
workers from `min_workers: 0`), so a job starts on a cluster with no CPUs and its first task
waits for the autoscaler to add a node. Ray would wait forever; a scheduler needs the job to fail
after a bounded time, with exit code 3, and say why.

One task or actor runs on one node, so the wait is for a node that holds the whole bundle: two
nodes of 1 CPU hold no actor of 2, and Ray would wait for one forever.

While it waits, the job asks the autoscaler for its bundle (`request_resources`). That request
is cluster-wide, and each call replaces the last one, whoever made it: Ray Data's autoscaling
coordinator (a detached actor that outlives the job that started it) sends its own every 20 s.
So the job reads the standing requests at each poll and, when its bundle is gone, writes it
back beside the others; when the wait ends it takes out one bundle of its own, and only if one
is still there. Ray offers no request of one's own: two callers that write at the same instant
can still lose one write, until the next poll puts ours back (and the coordinator's next tick
its own).
"""

from __future__ import annotations

import json
import logging
import time

import ray
from ray.autoscaler.sdk import request_resources

from pipeline.core import ray_internals
from pipeline.core.errors import ClusterError

log = logging.getLogger(__name__)

POLL_S = 1.0

# A standing request: one bundle, and its label selector ({} for none).
Request = tuple[dict[str, float], dict[str, str]]


def wait_for_capacity(
    bundle: dict[str, int],
    timeout_s: float,
    *,
    asked: str,
    fix: str,
    key: str = "capacity_timeout_s",
) -> int:
    """How many `bundle`s (one task's or actor's worth) the cluster's nodes hold, one node each,
    once one node holds one, waiting up to `timeout_s` (the config's `key`) for an autoscaler
    to add nodes. Refuses at once a bundle that no node type the autoscaler reports holds.

    While it waits, it keeps a request for `bundle` standing with the autoscaler: a job that
    waits before it submits anything shows the autoscaler no demand of its own. The request is
    withdrawn when the wait ends, so it never keeps nodes up after the job."""
    deadline = time.monotonic() + timeout_s
    _refuse_what_no_node_type_holds(bundle, asked=asked, fix=fix)
    requested = False
    try:
        while not (fits := _fits(bundle, nodes := _live_nodes())):
            if time.monotonic() > deadline:
                raise ClusterError(_too_small(bundle, nodes, asked, fix, timeout_s, key))
            if not requested:
                log.info(
                    "waiting up to %.0f s (%s) for the cluster to hold %s: it has %s",
                    *(timeout_s, key, _show(bundle), _show(_totals(bundle, nodes))),
                )
                requested = True
            _keep_requested(bundle)
            time.sleep(POLL_S)
    finally:
        if requested:
            _withdraw(bundle)
    if requested:
        log.info("the cluster has %s now", _show(_totals(bundle, nodes)))
    return fits


def standing_requests() -> list[Request]:
    """The resource requests the autoscaler holds now, from whichever caller, one per bundle."""
    if ray_internals.is_autoscaler_v2():
        state = ray_internals.get_cluster_resource_state(ray_internals.internal_kv_get_gcs_client())
        return [
            (dict(each.request.resources_bundle), _selector(each.request.label_selectors))
            for constraint in state.cluster_resource_constraints
            for each in constraint.resource_requests
            for _ in range(each.count)
        ]
    raw = ray_internals._internal_kv_get(ray_internals.AUTOSCALER_RESOURCE_REQUEST_CHANNEL)
    return [(dict(bundle), {}) for bundle in json.loads(raw or b"[]")]


def _keep_requested(bundle: dict[str, int]) -> None:
    """Put `bundle` among the standing requests unless it is there: added, never replacing."""
    standing = standing_requests()
    if not any(b == bundle and not s for b, s in standing):
        _replace_requests([*standing, (dict(bundle), {})])


def _withdraw(bundle: dict[str, int]) -> None:
    """Take one `bundle` out of the standing requests, if one is still there; the rest stay."""
    standing = standing_requests()
    ours = next((i for i, (b, s) in enumerate(standing) if b == bundle and not s), None)
    if ours is not None:
        _replace_requests(standing[:ours] + standing[ours + 1 :])


def _replace_requests(requests: list[Request]) -> None:
    bundles, selectors = [b for b, _ in requests], [s for _, s in requests]
    request_resources(bundles=bundles, bundle_label_selectors=selectors if any(selectors) else None)


def _selector(label_selectors) -> dict[str, str]:
    """A v2 request's label selector as `request_resources` takes it: {"key": "in(a,b)"}."""
    return {
        c.label_key: ("!" if c.operator == 2 else "") + f"in({','.join(c.label_values)})"
        for selector in label_selectors
        for c in selector.label_constraints
    }


def _live_nodes() -> list[dict[str, float]]:
    return [n["Resources"] for n in ray.nodes() if n["Alive"]]


def _node_types() -> list[dict[str, float]]:
    """The resources of each node type an autoscaler reports it can add; [] where none does."""
    config = ray_internals.gcs_state.get_cluster_config()
    groups = config.node_group_configs if config else []
    return [dict(g.resources) for g in groups if g.max_count != 0]


def _holds(node: dict[str, float], bundle: dict[str, int]) -> int:
    return min(int(node.get(r, 0) // n) for r, n in bundle.items())


def _fits(bundle: dict[str, int], nodes: list[dict[str, float]]) -> int:
    return sum(_holds(node, bundle) for node in nodes)


def _largest(bundle: dict[str, int], nodes: list[dict[str, float]]) -> dict[str, int]:
    return {r: max((int(node.get(r, 0)) for node in nodes), default=0) for r in bundle}


def _totals(bundle: dict[str, int], nodes: list[dict[str, float]]) -> dict[str, int]:
    return {r: int(sum(node.get(r, 0) for node in nodes)) for r in bundle}


def _refuse_what_no_node_type_holds(bundle: dict[str, int], *, asked: str, fix: str) -> None:
    """Fail now where the autoscaler has told the cluster what it can add and neither that nor
    a node there holds `bundle`. Ray's own launcher does not tell it: there the wait decides."""
    types = _node_types()
    if types and not _fits(bundle, candidates := types + _live_nodes()):
        largest = _largest(bundle, candidates)
        raise ClusterError(
            f"{asked} asks for {_show(bundle)} on one node, but the largest node the cluster "
            f"has or can add has {_show(largest)}: {fix}, or give the cluster a node type with "
            f"at least {_show(bundle)}"
        )


def _too_small(bundle, nodes, asked: str, fix: str, timeout_s: float, key: str) -> str:
    have = _totals(bundle, nodes)
    waited = f"waited {timeout_s:.0f} s, {key}"
    retry = f"or raise {key} if the cluster is autoscaling and its nodes take longer to start"
    if all(have[r] >= n for r, n in bundle.items()):
        # Enough in all, but no node holds one bundle: more of the same nodes would not help.
        return (
            f"{asked} asks for {_show(bundle)} on one node, but the largest node has "
            f"{_show(_largest(bundle, nodes))} (the cluster has {_show(have)} in all; {waited}): "
            f"{fix}, or add nodes with at least {_show(bundle)}"
        )
    short = ", ".join(f"{have[r]} {r}s" for r, n in bundle.items() if have[r] < n)
    return f"{asked}, but the cluster has {short} ({waited}): {fix}, {retry}"


def _show(amounts: dict[str, int]) -> str:
    return ", ".join(f"{n} {r}(s)" for r, n in amounts.items())
