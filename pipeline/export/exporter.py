"""Export a checkpoint for runtimes outside PyTorch, verify it, then commit it.

Layout of `<output>/` (default `<run>/export/<checkpoint name>`):
    model.onnx          the network in ONNX (ONNX_DATA beside it for weights near 2 GiB)
    model.pt2           the network as torch.export's program
    parity.json         what the parity check compared and found (pipeline.export.parity)
    preprocessing.json  how to feed the programs exactly as training fed the network, and where
                        they came from; written last

Both programs take an already preprocessed batch, float32 NCHW, normalised, at the network's
input size, and return logits: the graph is the network alone, as TensorRT, ExecuTorch and
quantisers expect it, and the same graph serves any image source. The steps before it are
a few lines in any language (preprocessing.json lists them), and baking them in would bring an
antialiased resize that ONNX opsets and runtimes implement unevenly.

Everything is made and checked in a local temporary directory first; only an export that passes
the parity check is published to `output` (core.storage.publish_directory), which must not
exist: on local disk by one rename, on object stores with preprocessing.json, the commit point,
written last. An output that holds an export of the same checkpoint and weights already is left
as it is (a retried job succeeds); one of another checkpoint, or of other files, is refused.
"""

from __future__ import annotations

import json
import logging
import tempfile
from pathlib import Path

import ray
import torch

from pipeline.core.capacity import wait_for_capacity
from pipeline.core.errors import ConfigError, InputError
from pipeline.core.storage import Location, foreign_entries, publish_directory
from pipeline.data.dataset import Manifest, read_manifest
from pipeline.data.shards import check_files
from pipeline.export import formats, parity
from pipeline.export.config import ExportConfig
from pipeline.model.checkpoint import (
    CheckpointMeta,
    check_weights,
    read_meta,
    served_weights,
    weights_by,
    weights_scores,
)
from pipeline.model.loading import load_model
from pipeline.model.source import resolve_checkpoint, trained_version
from pipeline.model.trust import check_model_code

log = logging.getLogger(__name__)

EXPORTS = "export"  # below a run: <run>/export/<checkpoint name>
PREPROCESSING, PARITY = "preprocessing.json", "parity.json"
FILES = (formats.ONNX, formats.ONNX_DATA, formats.PT2, PARITY, PREPROCESSING)
SPEC_FORMAT = 1  # preprocessing.json's own format


def default_output(checkpoint: Location) -> Location:
    """`<run>/export/<checkpoint name>`: beside the run's checkpoints."""
    return checkpoint.parent.child(EXPORTS, checkpoint.name)


def committed(output: Location) -> dict | None:
    """The preprocessing.json of the export committed at `output`, if one is."""
    path = output.child(PREPROCESSING)
    if not path.exists():
        return None
    try:
        return json.loads(path.read_bytes())
    except ValueError as e:
        raise InputError(f"{path.uri} is not an export's {PREPROCESSING}: {e}") from None


def check_output(output: Location, checkpoint: Location, weights: str) -> dict | None:
    """None where `output` is free to export into; the export's preprocessing.json where it
    holds this checkpoint's export with these weights already. Raises InputError where it holds
    anything else."""
    if not output.exists():
        return None
    if not output.is_dir():
        raise InputError(f"output={output.uri} is a file: point output at a new directory")
    done = committed(output)
    if done is not None:
        if (done.get("checkpoint"), done.get("weights")) == (checkpoint.uri, weights):
            return done
        raise InputError(
            f"output {output.uri} holds an export of {done.get('checkpoint')} "
            f"({done.get('weights')} weights) already; an export is never replaced. Choose "
            "another output=, or delete that directory first"
        )
    foreign = foreign_entries(output, FILES)
    if foreign:
        raise InputError(
            f"output {output.uri} holds files this bundle did not write "
            f"({', '.join(foreign[:5])}). Choose a new directory for output="
        )
    if output.list_files():  # an export stopped while publishing to an object store, unfinished
        log.warning(
            "output %s holds an unfinished export (no %s): replacing it", output.uri, PREPROCESSING
        )
    return None


def parity_dataset(cfg: ExportConfig, meta: CheckpointMeta) -> tuple[Location, Manifest]:
    """The dataset whose val split the parity check reads: dataset=, else the checkpoint's."""
    trained_on = meta.config.get("dataset")
    uri = cfg.dataset or trained_on
    if not uri:
        raise ConfigError("the checkpoint records no dataset: set dataset= for the parity check")
    root = Location.parse(uri)
    # The val split the checkpoint was scored on, where it is its own dataset: a version
    # committed since may hold other images, or store them at another size.
    manifest = read_manifest(root, trained_version(meta, root, cfg.dataset_version, key="dataset"))
    if manifest is None:
        raise InputError(
            f"no dataset at dataset={root.uri}, whose val split the parity check classifies: "
            f"point dataset= at a preprocessed dataset (the checkpoint was trained on {trained_on})"
        )
    if manifest.image_size != meta.image_size:
        raise InputError(
            f"dataset {root.uri} stores {manifest.image_size} px images, but the checkpoint was "
            f"trained on {meta.image_size} px ones: point dataset= at data of that size"
        )
    if not manifest.splits[parity.SPLIT].rows:
        raise InputError(f"dataset {root.uri} has no {parity.SPLIT} images to check the export on")
    check_files(root, manifest, [parity.SPLIT])
    return root, manifest


def preprocessing_spec(
    meta: CheckpointMeta, checkpoint: Location, weights: str, *, opset: int, files: list[str]
) -> dict:
    """preprocessing.json: what a runtime needs to feed the programs as training fed the
    network, from the checkpoint's own record of its input, and where they came from."""
    net = meta.model_input
    size, stored = net.image_size, meta.image_size
    steps = [
        {"op": "decode", "to": "RGB", "exif_orientation": True},
        {"op": "resize_short_side", "size": stored, "interpolation": "bilinear", "antialias": True},
        {"op": "center_crop", "size": stored},
        {"op": "to_float", "divide_by": 255},
        {"op": "normalize", "mean": list(net.mean), "std": list(net.std)},
    ]
    if size != stored:  # as training did: the stored image, normalised, then resized in float
        steps.append(
            {"op": "resize", "size": size, "interpolation": net.interpolation, "antialias": True}
        )
    steps.append({"op": "to_layout", "layout": "NCHW", "dtype": "float32"})
    return {
        "format": SPEC_FORMAT,
        "input": {
            "name": formats.INPUT,
            "shape": ["batch", 3, size, size],
            "dtype": "float32",
            "layout": "NCHW",
            "channel_order": "RGB",
            "image_size": size,
            "mean": list(net.mean),
            "std": list(net.std),
            "what": "images preprocessed by `steps`: (pixel / 255 - mean) / std per channel",
        },
        "output": {
            "name": formats.OUTPUT,
            "shape": ["batch", len(meta.classes)],
            "dtype": "float32",
            "what": "logits, in the order of `classes`; softmax gives probabilities",
        },
        "classes": meta.classes,
        "stored_image_size": stored,
        "interpolation": net.interpolation,
        "steps": steps,
        "checkpoint": checkpoint.uri,
        "epoch": meta.epoch,
        "weights": weights,
        "weights_by": weights_by(meta),
        "weights_scores": weights_scores(meta),
        "model": meta.model.model_dump(mode="json"),
        "files": files,
        "onnx_opset": opset,
        "versions": formats.versions(),
    }


def export_checkpoint(cfg: ExportConfig, *, checkpoint: Location, output: Location) -> dict:
    """Export `checkpoint` (its served weights, as inference picks them) to ONNX and
    torch.export, check both against PyTorch on the val split, and publish them to `output`;
    returns the summary. Nothing is published if a check fails (InputError)."""
    meta = read_meta(checkpoint)
    check_model_code(meta.model, allow_modules=cfg.allow_modules)  # before it reads any data
    weights = served_weights(meta)
    summary = {"output": output.uri, "checkpoint": checkpoint.uri, "weights": weights}
    if check_output(output, checkpoint, weights) is not None:
        log.info("output %s holds this export already: nothing to do", output.uri)
        report = json.loads(output.child(PARITY).read_bytes())
        return summary | {"already_exported": True, "parity": report}
    root, manifest = parity_dataset(cfg, meta)
    model, meta = load_model(checkpoint, weights=weights, allow_modules=cfg.allow_modules)
    model = model.float().eval()
    log.info("exporting %s (%s, %s weights)", checkpoint.uri, meta.model.name, weights)
    with tempfile.TemporaryDirectory(prefix="export-") as tmp:
        staged = Path(tmp)
        example = formats.example_batch(meta.model_input.image_size)
        export_s = formats.export_both(model, example, staged, opset=cfg.opset)
        runtimes = {
            formats.OnnxRuntime.name: formats.OnnxRuntime(staged / formats.ONNX, threads=cfg.cpus),
            formats.ExportedProgram.name: formats.ExportedProgram(staged / formats.PT2),
        }
        batches = parity.val_batches(root, manifest, images=cfg.images, batch_size=cfg.batch_size)
        found = {"dataset": root.uri, "dataset_version": manifest.version, "split": parity.SPLIT}
        found |= parity.compare(model, runtimes, batches, meta.model_input)
        report = parity.verdict(
            found, list(runtimes), tolerance=cfg.tolerance, min_agreement=cfg.min_agreement
        )
        (staged / PARITY).write_text(json.dumps(report, indent=2))
        files = [*sorted(p.name for p in staged.iterdir()), PREPROCESSING]
        spec = preprocessing_spec(meta, checkpoint, weights, opset=cfg.opset, files=files)
        (staged / PREPROCESSING).write_text(json.dumps(spec, indent=2))
        publish(staged, output)
    for name in runtimes:
        log.info(
            "%s: top-1 as PyTorch on %.2f%% of %d val images, probabilities within %.2g",
            *(name, 100 * report[name]["top1_agreement"], report["images"]),
            report[name]["max_abs_prob_diff"],
        )
    log.info(
        "exported in %.1f s (ONNX) and %.1f s (torch.export)", export_s["onnx"], export_s["pt2"]
    )
    return summary | {"export_s": export_s, "parity": report}


def publish(staged: Path, output: Location) -> None:
    """The checked export in `staged` made `output`, unless another job's stands there now."""
    try:
        publish_directory(staged, output, last=PREPROCESSING)
    except OSError as e:
        if not output.exists() or (committed(output) is None and not output.list_files()):
            raise
        raise InputError(
            f"output {output.uri} was written by another job while this one exported: it "
            "stands, and nothing of this one was written. Run one export per output at a time"
        ) from e


@ray.remote
def _export_task(cfg: ExportConfig, checkpoint: Location, output: Location) -> dict:
    torch.set_num_threads(cfg.cpus)
    return export_checkpoint(cfg, checkpoint=checkpoint, output=output)


def export(cfg: ExportConfig) -> dict:
    """The export job (Ray initialised): model= resolved and the output checked here, then the
    work in one Ray task of `cfg.cpus` CPUs on any node (a cluster's head runs drivers only)."""
    checkpoint = resolve_checkpoint(Location.parse(cfg.model))
    output = Location.parse(cfg.output) if cfg.output else default_output(checkpoint)
    meta = read_meta(checkpoint)
    if check_output(output, checkpoint, served_weights(meta)) is not None:
        return export_checkpoint(cfg, checkpoint=checkpoint, output=output)  # writes nothing
    parity_dataset(cfg, meta)  # a missing or damaged dataset fails here, before any work
    check_weights(checkpoint, meta)
    fix = "lower cpus"
    wait_for_capacity({"CPU": cfg.cpus}, cfg.capacity_timeout_s, asked=f"cpus={cfg.cpus}", fix=fix)
    task = _export_task.options(num_cpus=cfg.cpus)
    try:
        return ray.get(task.remote(cfg, checkpoint, output))
    except ray.exceptions.RayTaskError as e:
        if isinstance(e.cause, InputError | ConfigError):
            raise e.cause from None  # the user's to fix: its message, not a traceback
        raise
