"""An all-reduce across as many processes as the run has training workers, placed as the train
job's are (a CPU count each, a GPU each with use_gpu) and joined by the backend Ray Train gives
them (NCCL on GPUs, gloo on CPUs): it works, its result is right, and how fast it is."""

from __future__ import annotations

import datetime
import socket
import time
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

REPEATS = 5  # timed all-reduces, after one that sets the backend's connections up


class Member:
    """One process of the group: a Ray actor of a training worker's resources."""

    def node(self) -> tuple[str, str]:
        """(Ray's node id, an address of this node that the others reach)."""
        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()

    def free_port(self) -> int:
        with socket.socket() as s:
            s.bind(("", 0))
            return s.getsockname()[1]

    def all_reduce(
        self, init: str, rank: int, world: int, backend: str, numel: int, timeout_s: float
    ) -> dict[str, Any]:
        """Join the group at `init`, all-reduce `numel` float32 values REPEATS times; whether the
        first sum was right and the mean time of the rest."""
        import torch
        import torch.distributed as dist

        dist.init_process_group(
            backend,
            init_method=init,
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        try:
            # Ray gives an actor of one GPU that GPU as cuda:0 (CUDA_VISIBLE_DEVICES).
            device = torch.device("cuda", 0) if backend == "nccl" else torch.device("cpu")
            tensor = torch.full((numel,), float(rank + 1), device=device)
            dist.all_reduce(tensor)
            correct = bool((tensor == world * (world + 1) / 2).all())
            sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
            dist.barrier()
            sync()
            started = time.perf_counter()
            for _ in range(REPEATS):
                dist.all_reduce(tensor)
            sync()
            seconds = (time.perf_counter() - started) / REPEATS
        finally:
            dist.destroy_process_group()
        return {"correct": correct, "seconds": seconds, "device": str(device)}


def all_reduce(
    workers: int, *, cpus: int, gpu: bool, megabytes: float, timeout_s: float
) -> dict[str, Any]:
    """The group's result: {"placed": False, ...} when the cluster could not place the workers
    within `timeout_s`; else each member's node and all_reduce result, or the error."""
    bundle = {"CPU": cpus, **({"GPU": 1} if gpu else {})}
    # SPREAD: the members on as many nodes as hold them, so that the all-reduce crosses the
    # network between nodes wherever it can.
    group = placement_group([bundle] * workers, strategy="SPREAD")
    try:
        ready, _ = ray.wait([group.ready()], timeout=timeout_s)
        if not ready:
            return {"placed": False, "bundle": bundle}
        actor = ray.remote(Member)
        members = [
            actor.options(
                num_cpus=cpus,
                num_gpus=1 if gpu else 0,
                max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(group, i),
            ).remote()
            for i in range(workers)
        ]
        try:
            return _run(members, gpu, megabytes, timeout_s) | {"placed": True, "bundle": bundle}
        finally:
            for member in members:
                ray.kill(member)
    finally:
        remove_placement_group(group)


def _run(members: list, gpu: bool, megabytes: float, timeout_s: float) -> dict[str, Any]:
    started = time.monotonic()
    try:
        nodes = ray.get([m.node.remote() for m in members], timeout=timeout_s)
        port = ray.get(members[0].free_port.remote(), timeout=timeout_s)
    except ray.exceptions.RayError as e:  # GetTimeoutError is one
        return {"error": f"the workers did not start: {type(e).__name__}"}
    init = f"tcp://{nodes[0][1]}:{port}"
    numel = int(megabytes * 1e6 / 4)
    backend = "nccl" if gpu else "gloo"
    calls = [
        m.all_reduce.remote(init, rank, len(members), backend, numel, timeout_s)
        for rank, m in enumerate(members)
    ]
    left = max(1.0, 2 * timeout_s - (time.monotonic() - started))
    try:
        results = ray.get(calls, timeout=left)
    except ray.exceptions.GetTimeoutError:
        return {"error": f"the all-reduce did not end within {left:.0f} s", "backend": backend}
    except ray.exceptions.RayError as e:
        return {"error": _cause(e), "backend": backend}
    return {
        "backend": backend,
        "bytes": numel * 4,
        "nodes": [node for node, _ in nodes],
        "members": results,
    }


def _cause(error: Exception) -> str:
    cause = getattr(error, "cause", None)
    text = str(cause if cause is not None else error).strip().splitlines()
    return text[0] if text else type(error).__name__
