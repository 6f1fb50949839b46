"""Each row of the check but the GPUs' (pipeline.check.gpus), from what the probes found: pass,
fail (what is wrong, what to fix) or skipped (why); the nodes as the probes see them. Plain
functions of plain data: no Ray here."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from pipeline.check import needs
from pipeline.check.probes import PINNED
from pipeline.check.report import Row, failed, passed, skipped
from pipeline.train.config import TrainConfig

GB, MB = 1e9, 1e6
LOCK = "requirements/cluster.lock"
INSTALL = f"install {LOCK} on every node (pip install --require-hashes -r {LOCK})"


@dataclass(frozen=True)
class Node:
    """An alive node as Ray's GCS lists it."""

    node_id: str
    ip: str
    cpus: float
    gpus: float
    object_store: int  # bytes

    @property
    def label(self) -> str:
        return f"{self.ip} ({self.node_id[:8]})"


# A node's probe: its facts, the error its task ended in, or absent where it did not answer.
Answers = dict[str, "dict[str, Any] | str"]


def answered(nodes: list[Node], answers: Answers) -> list[tuple[Node, dict[str, Any]]]:
    return [(n, answers[n.node_id]) for n in nodes if isinstance(answers.get(n.node_id), dict)]


def _labels(nodes: list[Node]) -> str:
    return ", ".join(n.label for n in nodes)


def nodes_row(
    nodes: list[Node], answers: Answers, *, min_nodes: int, timeout_s: float, seconds: float
) -> Row:
    silent = [n for n in nodes if n.node_id not in answers]
    broken = [(n, answers[n.node_id]) for n in nodes if isinstance(answers.get(n.node_id), str)]
    facts = {"alive": len(nodes), "answered": len(nodes) - len(silent) - len(broken)}
    problems = []
    if silent:
        problems.append(
            f"{_labels(silent)} did not answer a probe within timeout_s={timeout_s:g} s: check "
            "that the machine is up and its raylet runs (ray status), and restart Ray there or "
            "remove the node"
        )
    problems += [f"the probe on {n.label} failed: {why}" for n, why in broken]
    if len(nodes) < min_nodes:
        problems.append(
            f"{len(nodes)} node(s) alive, fewer than min_nodes={min_nodes}: start the missing "
            "nodes (ray start --address=<head>:6379 on each), or lower min_nodes"
        )
    if problems:
        return failed("nodes", "; ".join(problems), silent=[n.node_id for n in silent], **facts)
    return passed(
        "nodes",
        f"{len(nodes)} of {len(nodes)} nodes answered in {seconds:.1f} s (min_nodes={min_nodes})",
        **facts,
    )


def lock_pins(text: str | None) -> dict[str, set[str]]:
    """The versions the lock pins for each PINNED package (several where markers split it)."""
    pins: dict[str, set[str]] = {}
    for line in (text or "").splitlines():
        if m := re.match(r"^([A-Za-z0-9_.-]+)==([^\s;\\]+)", line):
            name = m.group(1).lower()
            if name in PINNED:
                pins.setdefault(name, set()).add(m.group(2))
    return pins


def public(version: str | None) -> str | None:
    """A version without its local part: 2.14.1+cu130 -> 2.14.1 (the CUDA build may differ
    between a CPU head and GPU workers)."""
    return version.partition("+")[0] if version else version


def versions_row(driver: dict[str, str | None], lock: str | None, nodes, answers) -> Row:
    pins = lock_pins(lock)
    problems, seen = [], answered(nodes, answers)
    for node, facts in seen:
        mine = facts["versions"]
        for name in PINNED:
            got, want = public(mine.get(name)), public(driver.get(name))
            pinned = pins.get(name)
            if got != want or (pinned and got not in pinned):
                lock_says = f", {LOCK} {'/'.join(sorted(pinned))}" if pinned else ""
                problems.append(
                    f"{node.label}: {name} {got or 'not installed'} (driver {want}{lock_says})"
                )
        if mine["python"].rsplit(".", 1)[0] != driver["python"].rsplit(".", 1)[0]:
            problems.append(f"{node.label}: Python {mine['python']} (driver {driver['python']})")
    by_node = {n.node_id: f["versions"] for n, f in seen}
    if problems:
        return failed("versions", f"{'; '.join(problems)}: {INSTALL}", nodes=by_node)
    shown = ", ".join(f"{name} {public(driver[name])}" for name in PINNED)
    against = f"the driver and {LOCK}" if pins else f"the driver (no {LOCK} in the working dir)"
    return passed(
        "versions",
        f"{shown}, Python {driver['python']} on all {len(seen)} nodes that answered, as {against}",
        nodes=by_node,
        lock={k: sorted(v) for k, v in pins.items()},
    )


def packages_row(packages: tuple[str, ...], nodes, answers) -> Row:
    if not packages:
        return skipped("packages", "no packages listed: set packages=[yourpkg] to check yours")
    missing = [
        f"{name} on {node.label} ({why})"
        for node, facts in answered(nodes, answers)
        for name, why in facts["imports"].items()
        if why is not None
    ]
    if missing:
        return failed(
            "packages",
            f"does not import: {'; '.join(missing)}. Ship it with the jobs (--py-module PATH, "
            "or runtime_env py_modules) or install it on every node",
            missing=missing,
        )
    count = len(answered(nodes, answers))
    return passed("packages", f"{', '.join(packages)} import on all {count} nodes that answered")


def collective_row(train: TrainConfig, result: dict[str, Any], timeout_s: float) -> Row:
    workers, s = needs.workers(train), train.scaling
    what = f"{workers} workers of {result['bundle']}"
    if not result["placed"]:
        return failed(
            "collective",
            f"the cluster could not place {what} within timeout_s={timeout_s:g} s: add nodes "
            f"with room for them, or lower scaling.num_workers / cpus_per_worker"
            + (" / use_gpu" if s.use_gpu else ""),
        )
    backend = result.get("backend", "nccl" if s.use_gpu else "gloo")
    if "error" in result:
        return failed(
            "collective",
            f"{backend} all-reduce of {what}: {result['error']}: the nodes must reach each "
            "other on any port (a firewall, a security group)"
            + (" and NCCL its network (NCCL_DEBUG=INFO says which)" if s.use_gpu else ""),
            backend=backend,
        )
    members = result["members"]
    if not all(m["correct"] for m in members):
        return failed("collective", f"{backend} all-reduce of {what} summed wrong", backend=backend)
    seconds = max(m["seconds"] for m in members)
    size = result["bytes"]
    algbw = size / seconds / GB
    busbw = algbw * 2 * (workers - 1) / workers  # what each link carries, as nccl-tests report
    nodes = len(set(result["nodes"]))
    return passed(
        "collective",
        f"{backend} all-reduce of {size / MB:.0f} MB over {what} on {nodes} nodes: "
        f"{seconds * 1000:.0f} ms, {algbw:.2f} GB/s ({busbw:.2f} GB/s bus bandwidth)",
        backend=backend,
        workers=workers,
        nodes=nodes,
        bytes=size,
        seconds=seconds,
        algbw_gbps=algbw,
        busbw_gbps=busbw,
    )


def storage_row(uri: str, write: dict[str, Any], nodes: list[Node], answers: Answers) -> Row:
    """The scratch object: written (and later deleted) by the driver, listed and read back on
    every node."""
    if "error" in write:
        return failed(
            "storage",
            f"{write['step']} {write['where']} failed: {write['error']}: fix the storage URI, "
            "its bucket or permissions, or the nodes' credentials",
            owner="input" if write["permanent"] else "cluster",
        )
    size = write["bytes"]
    problems, reads = [], []
    for n, f in answered(nodes, answers):
        r = f["read"]
        if "error" in r:
            problems.append(f"{n.label} cannot read it: {r['error']}")
        elif r["listed"] != size or r["read"] != size:
            problems.append(f"{n.label} lists {r['listed']} and reads {r['read']} of {size} bytes")
        else:
            reads.append(size / r["seconds"] / MB)
    if problems:
        return failed(
            "storage",
            f"{uri} is not shared by every node: {'; '.join(problems)}. Use storage every node "
            "reaches (s3://..., or a filesystem mounted on every node)",
        )
    if not reads:  # no node answered in time: the nodes row fails, naming them
        return skipped("storage", f"written to {uri}, but no node answered to read it back")
    write_mbps = size / write["seconds"] / MB
    return passed(
        "storage",
        f"{size / MB:.0f} MB written ({write_mbps:.0f} MB/s), listed and read back on "
        f"{len(reads)} nodes ({min(reads):.0f}-{max(reads):.0f} MB/s), deleted, at {uri}",
        write_mbps=write_mbps,
        read_mbps=reads,
    )


def dataset_row(uri: str, found: dict[str, Any]) -> Row:
    if "error" in found:
        return failed(
            "dataset",
            f"{uri} is there but unreadable: {found['error']}",
            owner="input" if found["permanent"] else "cluster",
        )
    if found.get("version") is None:
        return skipped("dataset", f"no dataset at {uri} yet: the preprocess job writes it")
    return passed(
        "dataset",
        f"version {found['version']} at {uri}: {found['classes']} classes, "
        f"{found['train']} train and {found['val']} val images of {found['image_size']} px "
        f"({found['image_format']}), every shard there",
        **found,
    )


def memory_rows(
    train: TrainConfig, nodes, answers, *, image_size: int, image_format: str | None
) -> list[Row]:
    """/dev/shm and the object store on each node that answered, against what the run's
    workers there would use."""
    loader = needs.loader_shm(train, image_size, image_format)
    assumed = "" if image_format else f"; {image_size} px images assumed: no dataset yet"
    shm_bad, shm_ok, shm_facts = [], [], {}
    store_bad, store_ok, store_facts = [], [], {}
    for n, f in answered(nodes, answers):
        on_node = needs.workers_on_node(train, n.cpus, n.gpus)
        if "shm_total" not in f:
            shm_bad.append(f"{n.label} has no /dev/shm")
        else:
            need, _ = needs.shm_need(loader, on_node, n.object_store, f["shm_total"])
            shm_facts[n.node_id] = {"total": f["shm_total"], "need": need.bytes, "why": need.why}
            has = f"{n.label}: {f['shm_total'] / GB:.2f} GB for {need.bytes / GB:.2f} GB"
            (shm_bad if f["shm_total"] < need.bytes else shm_ok).append(f"{has} ({need.why})")
        store = needs.object_store_need(train, image_size, on_node)
        store_facts[n.node_id] = {"size": n.object_store, "need": store.bytes, "why": store.why}
        has = f"{n.label}: {n.object_store / GB:.2f} GB for {store.bytes / GB:.2f} GB"
        has += f" ({store.why})" if store.bytes else ""
        (store_bad if n.object_store < store.bytes else store_ok).append(has)
    per_worker = f"a worker's loader: {loader.why}{assumed}"
    if shm_bad:
        shm = failed(
            "shm",
            f"/dev/shm too small: {'; '.join(shm_bad)}; {per_worker}. Give the nodes more "
            "/dev/shm (docker run --shm-size, a Memory emptyDir on Kubernetes), or lower "
            "scaling.loader_workers or the batch",
            nodes=shm_facts,
        )
    else:
        shm = passed("shm", f"{'; '.join(shm_ok)}; {per_worker}", nodes=shm_facts)
    torch_ingest = (
        "" if train.ingest != "torch" else f" ({needs.object_store_need(train, 0, 0).why})"
    )
    if store_bad:
        store_row = failed(
            "object_store",
            f"object store too small: {'; '.join(store_bad)}. Start Ray with a larger "
            "--object-store-memory, or use ingest=torch",
            nodes=store_facts,
        )
    else:
        store_row = passed("object_store", "; ".join(store_ok) + torch_ingest, nodes=store_facts)
    return [shm, store_row]


def auth_row(mode: str | None, refused: bool | None, source: str) -> Row:
    """Token authentication, as this job sees it: RAY_AUTH_MODE, whether the dashboard refuses
    a request without the token, and where the token came from (never the token)."""
    if refused is None:
        what = "the dashboard did not answer a request without the token"
    elif refused:
        what = "the cluster has token auth on: its dashboard refuses a request without the token"
    else:
        what = (
            "the cluster has token auth off: anyone who reaches its dashboard can run code on it"
            " (Ray 2.60's `ray start` turns it on unless RAY_AUTH_MODE=disabled)"
        )
    return passed(
        "auth",
        f"RAY_AUTH_MODE={mode or '(unset)'}; {what}; this job's token: {source}",
        mode=mode,
        token_required=refused,
        token_source=source,
    )
