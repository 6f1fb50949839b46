"""The check's four GPU rows, from what each GPU node's probe found: the GPUs Ray counts and
torch sees, a matmul, a JPEG decoded as decode=gpu does, and the memory free. No Ray here."""

from __future__ import annotations

from typing import Any

from pipeline.check.report import Row, failed, passed, skipped
from pipeline.check.rows import Answers, Node, answered
from pipeline.train.config import TrainConfig

GPU_ROWS = ("gpus", "cuda_matmul", "gpu_decode", "gpu_memory")


def gpu_rows(train: TrainConfig, nodes: list[Node], gpu: Answers, *, free_gb: float) -> list[Row]:
    """The four GPU rows; on a cluster without GPUs, skipped, unless the train config uses them
    (then `gpus` fails, the other three skipped for it)."""
    with_gpus = [n for n in nodes if n.gpus > 0]
    if not with_gpus:
        if train.scaling.use_gpu:
            first = failed(
                "gpus",
                "the train config asks for GPUs (scaling.use_gpu=true) and no node has one: add "
                "GPU nodes (and their resources: ray start --num-gpus), or set "
                "scaling.use_gpu=false",
            )
            return [
                first,
                *(skipped(name, "no GPU on any node (see gpus)") for name in GPU_ROWS[1:]),
            ]
        why = "no GPU on any node; the train config does not use GPUs"
        return [skipped(name, why) for name in GPU_ROWS]
    return [
        visible_row(with_gpus, gpu),
        matmul_row(with_gpus, gpu),
        decode_row(with_gpus, gpu),
        memory_row(with_gpus, gpu, free_gb),
    ]


def _gpu_problems(nodes: list[Node], gpu: Answers) -> tuple[list[str], list]:
    """What kept a GPU probe from reporting, and the (node, facts) of those that did."""
    problems = []
    for n in nodes:
        if n.node_id not in gpu:
            problems.append(f"{n.label}: its GPU probe did not answer (its GPUs busy, or the node)")
        elif isinstance(gpu[n.node_id], str):
            problems.append(f"{n.label}: {gpu[n.node_id]}")
    return problems, answered(nodes, gpu)


def _devices(seen: list, problems: list[str]) -> list[tuple[str, dict[str, Any]]]:
    """(`<node> cuda:<i>`, the device's facts) of each GPU the probes saw; a problem for each
    node whose torch saw none."""
    devices = []
    for n, f in seen:
        if not f["devices"]:
            problems.append(f"{n.label}: torch sees no GPU")
        devices += [(f"{n.label} cuda:{d['index']}", d) for d in f["devices"]]
    return devices


def visible_row(nodes: list[Node], gpu: Answers) -> Row:
    problems, seen = _gpu_problems(nodes, gpu)
    for n, f in seen:
        if not f["cuda"] or f["count"] != int(n.gpus):
            problems.append(
                f"{n.label}: Ray counts {n.gpus:g} GPUs, torch sees {f['count']} (CUDA "
                f"{'available' if f['cuda'] else 'unavailable'}, torch built for CUDA "
                f"{f['torch_cuda']}): check the driver (nvidia-smi) and that torch is a CUDA "
                "build (requirements/cluster.lock)"
            )
    counts = {n.node_id: f["count"] for n, f in seen}
    if problems:
        return failed("gpus", "; ".join(problems), counts=counts)
    total = sum(counts.values())
    return passed("gpus", f"{total} GPUs on {len(seen)} nodes, as Ray counts them", counts=counts)


def matmul_row(nodes: list[Node], gpu: Answers) -> Row:
    problems, seen = _gpu_problems(nodes, gpu)
    speeds = []
    for where, d in _devices(seen, problems):
        m = d["matmul"]
        if "error" in m:
            problems.append(f"{where}: {m['error']}")
        elif not m["correct"]:
            problems.append(f"{where}: a wrong product (A @ I != A)")
        else:
            speeds.append(m["tflops"])
    if problems:
        return failed("cuda_matmul", "; ".join(problems) + ": check the GPU and its driver")
    return passed(
        "cuda_matmul",
        f"float32 matmul right on {len(speeds)} GPUs, {min(speeds):.1f}-{max(speeds):.1f} TFLOP/s",
        tflops=speeds,
    )


def decode_row(nodes: list[Node], gpu: Answers) -> Row:
    problems, seen = _gpu_problems(nodes, gpu)
    diffs = []
    for n, f in seen:
        d = f.get("decode", {"error": "torch sees no GPU"})
        if "error" in d:
            problems.append(f"{n.label}: {d['error']}")
        elif d["mean_diff"] > 4:
            problems.append(
                f"{n.label}: the decoded pixels differ from PIL's by {d['mean_diff']:.1f}"
            )
        else:
            diffs.append(d["mean_diff"])
    if problems:
        return failed(
            "gpu_decode",
            "; ".join(problems) + ": decode=gpu needs torchvision's nvJPEG (a CUDA build of "
            "torchvision for the node's torch); until then set decode=cpu",
        )
    return passed(
        "gpu_decode",
        f"a JPEG decoded as decode=gpu does on {len(diffs)} nodes, within {max(diffs):.2f} "
        "levels of PIL's on average",
    )


def memory_row(nodes: list[Node], gpu: Answers, free_gb: float) -> Row:
    problems, seen = _gpu_problems(nodes, gpu)
    shown = []
    for where, d in _devices(seen, problems):
        if "error" in d:
            problems.append(f"{where}: {d['error']}")
            continue
        free, total = d["free"] / 2**30, d["total"] / 2**30
        shown.append(f"{free:.0f}/{total:.0f}")
        if free < free_gb:
            problems.append(
                f"{where} ({d.get('name', '?')}): {free:.1f} of {total:.1f} GiB free, under "
                f"gpu_free_gb={free_gb:g}: another process holds it (nvidia-smi names it)"
            )
    if problems:
        return failed("gpu_memory", "; ".join(problems))
    return passed("gpu_memory", f"GiB free/total per GPU: {', '.join(shown)}")
