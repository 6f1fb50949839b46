"""What the check runs on each node: plain functions, run there as Ray tasks pinned to the node
(run.py). Each returns plain data; a failure on the node is part of what it returns, with the
error's first line, since it is what the check is there to find."""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import platform
import socket
import time
from typing import Any

from pipeline.core.errors import first_line
from pipeline.core.storage import Location

# The packages whose versions every node must share with the driver and the lock.
PINNED = ("ray", "torch", "torchvision")
SHM = "/dev/shm"


def installed(name: str) -> str | None:
    """The installed version of distribution `name`, or None."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def versions() -> dict[str, str | None]:
    """Python's and each PINNED package's version, as installed here."""
    return {"python": platform.python_version(), **{name: installed(name) for name in PINNED}}


def node_facts(packages: tuple[str, ...], scratch: Location | None, size: int) -> dict[str, Any]:
    """This node's versions, /dev/shm, whether each of `packages` imports, and the scratch
    object (of `size` bytes) read back from storage, if given."""
    facts: dict[str, Any] = {"host": socket.gethostname(), "versions": versions()}
    if os.path.isdir(SHM):
        st = os.statvfs(SHM)
        facts["shm_total"], facts["shm_free"] = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
    facts["imports"] = {name: imports(name) for name in packages}
    if scratch is not None:
        facts["read"] = read_back(scratch, size)
    return facts


def imports(module: str) -> str | None:
    """None if `module` imports here; else why not, in one line."""
    try:
        importlib.import_module(module)
    except Exception as e:  # any error of the user's module is the finding: ImportError or not
        return f"{type(e).__name__}: {first_line(e)}"
    return None


def read_back(scratch: Location, size: int) -> dict[str, Any]:
    """The scratch object listed and read from this node: its size as listed and read, and the
    read's time; or the error."""
    try:
        listed = {info.path: info.size for info in scratch.parent.list_files()}
        started = time.perf_counter()
        data = scratch.read_bytes()
        seconds = time.perf_counter() - started
    except OSError as e:
        return {"error": first_line(e)}
    return {"listed": listed.get(scratch.path), "read": len(data), "seconds": seconds}


def gpu_facts(jpeg: bytes, matmul_n: int = 4096) -> dict[str, Any]:
    """In a task given all of its node's GPUs: what torch sees, a timed matmul on each device,
    `jpeg` decoded as decode=gpu does on the first, and each device's memory."""
    import torch

    facts: dict[str, Any] = {
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "cuda": torch.cuda.is_available(),
        "count": torch.cuda.device_count(),
        "torch_cuda": torch.version.cuda,
        "devices": [],
    }
    for index in range(facts["count"]):
        device = torch.device("cuda", index)
        entry: dict[str, Any] = {"index": index}
        try:
            entry["name"] = torch.cuda.get_device_name(device)
            entry["free"], entry["total"] = torch.cuda.mem_get_info(device)
        except RuntimeError as e:
            entry["error"] = first_line(e)
        entry["matmul"] = matmul(device, matmul_n)
        facts["devices"].append(entry)
    if facts["count"]:
        facts["decode"] = gpu_decode(jpeg, torch.device("cuda", 0))
    return facts


def matmul(device, n: int, repeats: int = 5) -> dict[str, Any]:
    """A float32 `n` x `n` matmul on `device`, checked against the identity, and its TFLOP/s
    (of the CPU too, where `device` is one: what the tests run)."""
    import torch

    try:
        a = torch.randn(n, n, device=device)
        eye = torch.eye(n, device=device)
        exact = bool(torch.allclose(a @ eye, a, atol=1e-3))
        synchronize(device)
        started = time.perf_counter()
        for _ in range(repeats):
            a @ a
        synchronize(device)
        seconds = (time.perf_counter() - started) / repeats
    except RuntimeError as e:  # CUDA errors: no kernel image for this device, out of memory
        return {"error": first_line(e)}
    return {"n": n, "correct": exact, "tflops": 2 * n**3 / seconds / 1e12}


def gpu_decode(jpeg: bytes, device) -> dict[str, Any]:
    """`jpeg` decoded on `device` by decode=gpu's own call, compared with PIL's decode (on a
    CPU device, the same call decodes with libjpeg-turbo, as PIL does)."""
    import io

    import numpy
    import torch
    from PIL import Image

    from pipeline.train.input.device_decode import EncodedBatch, decode_batch

    batch = EncodedBatch(
        torch.frombuffer(bytearray(jpeg), dtype=torch.uint8), [len(jpeg)], None, []
    )
    try:
        images = decode_batch(batch, device)
        synchronize(device)
    except RuntimeError as e:
        return {"error": first_line(e)}
    expected = torch.from_numpy(numpy.array(Image.open(io.BytesIO(jpeg)).convert("RGB")))
    got = images[0].permute(1, 2, 0).cpu()
    if got.shape != expected.shape:
        return {"error": f"decoded to {tuple(got.shape)}, PIL to {tuple(expected.shape)}"}
    # nvJPEG's IDCT may differ from libjpeg-turbo's by a few levels (device_decode.py).
    return {"shape": list(got.shape), "mean_diff": float((got.float() - expected).abs().mean())}


def synchronize(device) -> None:
    """Wait for `device`'s queued kernels (a CPU has none)."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
