"""The parity check: the exported programs against the PyTorch model they came from, on the same
batches of a dataset's val split, fed as training fed the network (`DevicePolicy`, fp32, CPU).

Each runtime passes when its top-1 class is PyTorch's on at least `min_agreement` of the images
and none of its class probabilities differs from PyTorch's by more than `tolerance`. What one
float32 program gives differs from another's in the last bits (other kernels, other orders of
summation): 1e-6 on these probabilities is usual, so the default tolerance, 1e-4, is met by a
faithful export and missed by one that computes something else.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

import numpy as np
import pyarrow as pa
import torch

from pipeline.core.errors import InputError
from pipeline.core.storage import Location
from pipeline.data.dataset import Manifest
from pipeline.data.images import decode_image
from pipeline.data.shards import read_footer, read_row_group
from pipeline.model.checkpoint import ModelInput
from pipeline.model.device import DevicePolicy

log = logging.getLogger(__name__)

SPLIT = "val"
REFERENCE = "pytorch"  # eager, eval mode, fp32, on the CPU


def val_batches(
    root: Location, manifest: Manifest, *, images: int | None, batch_size: int
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """The first `images` (None: all) of the val split, in the manifest's order, as batches of
    uint8 (N, 3, S, S) pixels, as stored, and their labels (N,)."""
    left = manifest.splits[SPLIT].rows if images is None else images
    for shard in manifest.splits[SPLIT].files:
        if left <= 0:
            return
        footer = read_footer(root, shard.path)
        groups = range(footer.metadata.num_row_groups)
        columns, classes = ["image", "label"], len(manifest.classes)
        tables = [read_row_group(footer, g, columns, classes=classes) for g in groups]
        table = pa.concat_tables(tables).slice(0, left)
        left -= table.num_rows
        for batch in table.to_batches(max_chunksize=batch_size):
            pixels = np.stack(
                [np.asarray(decode_image(b), dtype=np.uint8) for b in batch["image"].to_pylist()]
            )
            yield pixels.transpose(0, 3, 1, 2), batch["label"].to_numpy()


def compare(
    model: torch.nn.Module,
    runtimes: dict[str, Callable[[np.ndarray], np.ndarray]],
    batches: Iterator[tuple[np.ndarray, np.ndarray]],
    model_input: ModelInput,
) -> dict:
    """Each runtime's logits against `model`'s (eval mode, fp32) on the same inputs: per
    runtime the images compared, top-1 agreement, the largest probability and logit
    differences, and the accuracy of each on the labels."""
    policy = DevicePolicy.for_input(torch.device("cpu"), "fp32", model_input)
    model = model.eval().float()
    logits: dict[str, list[np.ndarray]] = {name: [] for name in [REFERENCE, *runtimes]}
    labels = []
    for pixels, label in batches:
        x = policy.inputs(torch.from_numpy(pixels)).contiguous()  # float32 (N, 3, S', S')
        with torch.inference_mode():
            logits[REFERENCE].append(model(x).numpy())
        for name, run in runtimes.items():
            logits[name].append(np.asarray(run(x.numpy()), dtype=np.float32))
        labels.append(label)
    if not labels:
        raise InputError("the parity check found no val images to compare")
    out = {name: np.concatenate(parts) for name, parts in logits.items()}
    truth = np.concatenate(labels)
    ref = out[REFERENCE]
    ref_probs = torch.from_numpy(ref).softmax(dim=1).numpy()
    report = {
        "images": len(truth),
        REFERENCE: {"accuracy": float(np.mean(ref.argmax(1) == truth))},
    }
    for name in runtimes:
        got = out[name]
        probs = torch.from_numpy(got).softmax(dim=1).numpy()
        report[name] = {
            "top1_agreement": float(np.mean(got.argmax(1) == ref.argmax(1))),
            "max_abs_prob_diff": float(np.abs(probs - ref_probs).max()),
            "max_abs_logit_diff": float(np.abs(got - ref).max()),
            "accuracy": float(np.mean(got.argmax(1) == truth)),
        }
    return report


def verdict(report: dict, runtimes: list[str], *, tolerance: float, min_agreement: float) -> dict:
    """`report` with each runtime's pass or fail and the bounds it was held to; raises
    InputError, naming each runtime that failed and by how much, if any did."""
    failed = []
    for name in runtimes:
        r = report[name]
        problems = []
        if r["top1_agreement"] < min_agreement:
            problems.append(
                f"top-1 agrees with PyTorch on {r['top1_agreement']:.2%} of {report['images']} "
                f"images, below min_agreement={min_agreement:.2%}"
            )
        if r["max_abs_prob_diff"] > tolerance:
            problems.append(
                f"a probability differs from PyTorch's by {r['max_abs_prob_diff']:.3g}, over "
                f"tolerance={tolerance:g}"
            )
        r["passed"] = not problems
        failed += [f"{name}: {'; '.join(problems)}"] if problems else []
    report = report | {"tolerance": tolerance, "min_agreement": min_agreement}
    if failed:
        raise InputError(
            "parity check failed: " + " | ".join(failed) + ". Nothing was written. The exported "
            "program computes something else than the checkpoint's network: export with another "
            "opset=, or report the model to the exporter's project"
        )
    return report
