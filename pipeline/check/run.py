"""The check, end to end: probes on every node, the training workers' collective, storage and
the dataset, each into its rows; the report written and returned."""

from __future__ import annotations

import contextlib
import datetime
import io
import logging
import os
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from pipeline.check import collective, gpus, probes, rows
from pipeline.check.config import CheckConfig
from pipeline.check.needs import DEFAULT_IMAGE_SIZE
from pipeline.check.report import Row, one_line, report, table, verdict
from pipeline.core.errors import InputError, first_line, is_transient
from pipeline.core.storage import Location, new_version
from pipeline.data.dataset import read_manifest
from pipeline.data.shards import check_files
from pipeline.train.config import TrainConfig

log = logging.getLogger(__name__)

SCRATCH = "scratch.bin"


def check(cfg: CheckConfig, train: TrainConfig, *, dashboard: str | None) -> dict[str, Any]:
    """Run every row against the cluster this process is connected to (its dashboard at
    `dashboard`, host:port); the report, written to `cfg.report` (default
    <storage>/checks/<id>.json) where storage takes it."""
    check_id, started = new_version(), time.monotonic()
    storage, dataset = Location.parse(train.storage_path), Location.parse(train.dataset)
    nodes = alive_nodes()
    log.info("checking %d nodes against %s", len(nodes), ", ".join(cfg.train))
    probed = probe_nodes(cfg, nodes, storage.child(f".check-{check_id}"))
    found = read_dataset(dataset)
    table_rows = check_rows(cfg, train, nodes, probed, found, dashboard=dashboard)
    target = (
        Location.parse(cfg.report) if cfg.report else storage.child("checks", f"{check_id}.json")
    )
    data = report(
        table_rows,
        id=check_id,
        finished=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        seconds=round(time.monotonic() - started, 1),
        report=target.uri,
        config=cfg.model_dump(mode="json"),
        train={
            "workers": train.scaling.min_workers,
            "use_gpu": train.scaling.use_gpu,
            "cpus_per_worker": train.scaling.cpus_per_worker,
            "loader_workers": train.scaling.loader_workers,
            "global_batch_size": train.global_batch_size,
            "ingest": train.ingest,
            "decode": train.decode,
            "storage_path": storage.uri,
            "dataset": dataset.uri,
        },
        nodes=[vars(n) for n in nodes],
    )
    log.info("the cluster check's rows:\n%s", table(table_rows))
    log.info(verdict(table_rows))
    return write_report(data, target)


@dataclass(frozen=True)
class Probed:
    """What the probes found: each node's answer, each GPU node's, the seconds the nodes took,
    and the scratch object's write (its failure, if it failed)."""

    answers: rows.Answers
    gpu: rows.Answers
    seconds: float
    write: dict[str, Any]


def probe_nodes(cfg: CheckConfig, nodes: list[rows.Node], scratch_dir: Location) -> Probed:
    """The probes on every node (and on each GPU node, its GPUs'), around the scratch object
    written to storage for them to read back, deleted after."""
    write, scratch = write_scratch(scratch_dir.child(SCRATCH), int(cfg.scratch_mb * 1e6))
    try:
        node_calls = {
            n.node_id: pinned(probes.node_facts, n.node_id).remote(
                cfg.packages, scratch, write.get("bytes", 0)
            )
            for n in nodes
        }
        gpu_calls = {
            n.node_id: pinned(probes.gpu_facts, n.node_id, gpus=n.gpus).remote(sample_jpeg())
            for n in nodes
            if n.gpus > 0
        }
        answers, seconds = gather(node_calls, cfg.timeout_s)
        gpu, _ = gather(gpu_calls, cfg.timeout_s)
    finally:
        if scratch is not None:
            write |= delete_scratch(scratch_dir)
    return Probed(answers, gpu, seconds, write)


def check_rows(
    cfg: CheckConfig,
    train: TrainConfig,
    nodes: list[rows.Node],
    probed: Probed,
    found: dict[str, Any],
    *,
    dashboard: str | None,
) -> list[Row]:
    """The table's rows, in its order; the collective runs here, after the probes."""
    answers, storage = probed.answers, Location.parse(train.storage_path)
    return [
        rows.nodes_row(
            nodes, answers, min_nodes=cfg.min_nodes, timeout_s=cfg.timeout_s, seconds=probed.seconds
        ),
        rows.versions_row(probes.versions(), read_lock(), nodes, answers),
        rows.packages_row(cfg.packages, nodes, answers),
        *gpus.gpu_rows(train, nodes, probed.gpu, free_gb=cfg.gpu_free_gb),
        collective_row(cfg, train),
        rows.storage_row(storage.uri, probed.write, nodes, answers),
        rows.dataset_row(Location.parse(train.dataset).uri, found),
        *rows.memory_rows(
            train,
            nodes,
            answers,
            image_size=found.get("image_size", DEFAULT_IMAGE_SIZE),
            image_format=found.get("image_format"),
        ),
        auth_row(dashboard),
    ]


def write_report(data: dict[str, Any], target: Location) -> dict[str, Any]:
    """`data` written to `target` as one line of JSON; where storage refuses it, logged and
    its `report` None."""
    try:
        target.write_bytes((one_line(data) + "\n").encode())
        log.info("report: %s", target.uri)
    except OSError as e:
        log.warning("the report could not be written to %s: %s", target.uri, first_line(e))
        data["report"] = None
    return data


def alive_nodes() -> list[rows.Node]:
    """The cluster's alive nodes, as the GCS lists them."""
    return [
        rows.Node(
            node_id=n["NodeID"],
            ip=n["NodeManagerAddress"],
            cpus=n["Resources"].get("CPU", 0),
            gpus=n["Resources"].get("GPU", 0),
            object_store=int(n["Resources"].get("object_store_memory", 0)),
        )
        for n in ray.nodes()
        if n["Alive"]
    ]


def pinned(fn, node_id: str, gpus: float = 0):
    """`fn` as a task that runs on node `node_id` or nowhere, on none of its CPUs (a probe must
    not wait for a busy node's CPUs), never retried."""
    return ray.remote(fn).options(
        num_cpus=0,
        num_gpus=gpus,
        max_retries=0,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
    )


def gather(calls: dict[str, Any], timeout_s: float) -> tuple[rows.Answers, float]:
    """Each call's result by its key: the task's value, or its error's first line; those not
    done within `timeout_s` are left out (and cancelled). Also the seconds it took."""
    started = time.monotonic()
    ready, late = ray.wait(list(calls.values()), num_returns=len(calls), timeout=timeout_s)
    for ref in late:
        ray.cancel(ref, force=True)
    answers: rows.Answers = {}
    for key, ref in calls.items():
        if ref in ready:
            try:
                answers[key] = ray.get(ref)
            except ray.exceptions.RayError as e:
                answers[key] = f"{type(e).__name__}: {first_line(getattr(e, 'cause', None) or e)}"
    return answers, time.monotonic() - started


def write_scratch(scratch: Location, size: int) -> tuple[dict[str, Any], Location | None]:
    """`size` random bytes written to `scratch`, timed; the scratch once written, else None."""
    data = os.urandom(size)
    try:
        started = time.perf_counter()
        scratch.write_bytes(data)
        seconds = time.perf_counter() - started
    except OSError as e:
        with contextlib.suppress(OSError):  # what the write made before it failed
            delete_scratch(scratch.parent)
        return failure("writing", scratch.uri, e), None
    return {"bytes": size, "seconds": seconds}, scratch


def delete_scratch(directory: Location) -> dict[str, Any]:
    """The check's scratch object deleted, then its directory if nothing else is in it: the
    check deletes nothing it did not write. {} once done; else the failure."""
    try:
        directory.child(SCRATCH).delete()
        if directory.exists() and not directory.list_files():
            directory.delete()
    except OSError as e:
        return failure("deleting", directory.uri, e)
    return {}


def failure(step: str, where: str, error: OSError) -> dict[str, Any]:
    return {
        "step": step,
        "where": where,
        "error": first_line(error),
        "permanent": not is_transient(error),
    }


def read_dataset(dataset: Location) -> dict[str, Any]:
    """The dataset's newest version, read and its shards looked up; {} when there is none."""
    try:
        manifest = read_manifest(dataset)
        if manifest is None:
            return {}
        check_files(dataset, manifest)
    except InputError as e:
        return {"error": first_line(e), "permanent": True}
    except OSError as e:
        return {"error": f"storage: {first_line(e)}", "permanent": not is_transient(e)}
    return {
        "version": manifest.version,
        "classes": len(manifest.classes),
        "train": manifest.splits["train"].rows,
        "val": manifest.splits["val"].rows,
        "image_size": manifest.image_size,
        "image_format": manifest.image_format,
    }


def read_lock() -> str | None:
    """requirements/cluster.lock of the job's working dir, where it ships."""
    path = Path(rows.LOCK)
    return path.read_text() if path.is_file() else None


def sample_jpeg(size: int = DEFAULT_IMAGE_SIZE) -> bytes:
    """A JPEG of `size` px squares of noise, what decode=gpu decodes in the probe."""
    import numpy
    from PIL import Image

    pixels = numpy.random.default_rng(0).integers(0, 256, (size, size, 3), dtype=numpy.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


def collective_row(cfg: CheckConfig, train: TrainConfig) -> Row:
    s = train.scaling
    result = collective.all_reduce(
        s.min_workers,
        cpus=s.cpus_per_worker,
        gpu=s.use_gpu,
        megabytes=cfg.collective_mb,
        timeout_s=cfg.timeout_s,
    )
    return rows.collective_row(train, result, cfg.timeout_s)


def auth_row(dashboard: str | None) -> Row:
    mode = os.environ.get("RAY_AUTH_MODE")
    if os.environ.get("RAY_AUTH_TOKEN"):
        source = "RAY_AUTH_TOKEN in its environment (not shown)"
    elif os.environ.get("RAY_AUTH_TOKEN_PATH"):
        source = "the file RAY_AUTH_TOKEN_PATH names (not shown)"
    elif (Path.home() / ".ray" / "auth_token").is_file():
        source = "~/.ray/auth_token (not shown)"
    else:
        source = "none found"
    return rows.auth_row(mode, refuses_without_token(dashboard) if dashboard else None, source)


def refuses_without_token(dashboard: str, timeout_s: float = 10) -> bool | None:
    """Whether the dashboard at `dashboard` (host:port) refuses a request that carries no
    token, as it does with token auth on; None where it does not answer."""
    url = dashboard if "://" in dashboard else f"http://{dashboard}"
    try:
        with urllib.request.urlopen(f"{url}/api/jobs/", timeout=timeout_s):
            return False
    except urllib.error.HTTPError as e:
        return e.code in (401, 403)
    except OSError:  # URLError is one: nothing listens, or no answer in time
        return None
