"""Batch inference from a training run's best checkpoint, with Ray Data.

read (Parquet rows or image files) -> prepare (decode, resize + center crop to the checkpoint's
image size: the very functions preprocessing used) -> predict (an actor pool; each actor loads
the model once, on its GPU with use_gpu) -> write (Parquet parts written by Ray Data write tasks
into a new version of the output, pipeline.infer.predictions) -> the driver commits that version
with summary.json once all are written.
One image file instead goes through a single Ray task and is printed: the quick check.
"""

from __future__ import annotations

import functools
import logging
import time

import numpy as np
import ray
import ray.data
import torch

from pipeline.core import faults
from pipeline.core.capacity import wait_for_capacity
from pipeline.core.errors import InputError
from pipeline.core.logs import quiet_ray_data
from pipeline.core.plots import plot_confusion
from pipeline.core.storage import Location
from pipeline.data.images import BadImageError, decode_image
from pipeline.infer.config import InferConfig
from pipeline.infer.inputs import list_input, read_input
from pipeline.infer.predictions import (
    PREDICTIONS,
    VERSIONS,
    check_input,
    check_output,
    publish,
    start_version,
)
from pipeline.infer.resume import Partial, carry, find_partial, job_alive, prediction_key, this_job
from pipeline.infer.sink import WRITE_TASKS, PredictionSink, Tally, batch_table
from pipeline.infer.summary import driver_usage, summarize
from pipeline.infer.telemetry import BatchCounter, InferTelemetry
from pipeline.model.checkpoint import (
    CheckpointMeta,
    check_weights,
    read_meta,
    served_weights,
    weights_by,
    weights_scores,
)
from pipeline.model.classifier import Classifier, prepare_image, top_classes
from pipeline.model.source import resolve_checkpoint, trained_version
from pipeline.model.trust import check_model_code

log = logging.getLogger(__name__)

# The fault test's: a predictor actor stops at the start of its fourth batch (BATCH_STALLED),
# once the stall watch is armed (pipeline.infer.telemetry.ARMED_AFTER).
STALLED_BATCH = 4


def prepare_batch(batch: dict, *, image_size: int) -> dict:
    """Ray Data stage: encoded images -> pixels, with the reason for any that fail to decode."""
    n = len(batch["data"])
    pixels = np.zeros((n, 3, image_size, image_size), dtype=np.uint8)
    errors = np.full(n, "", dtype=object)
    for i, data in enumerate(batch["data"]):
        try:
            pixels[i] = prepare_image(data, image_size=image_size)
        except BadImageError as e:
            errors[i] = str(e)
    return {
        "pixels": pixels,
        "source_id": batch["source_id"],
        "label_name": batch["label_name"],
        "error": errors,
    }


class Predictor:
    """Ray Data actor: loads the model once, then classifies batch after batch (of pixels, or
    of encoded images that it decodes itself when given `decode_size`)."""

    def __init__(
        self,
        checkpoint: Location,
        *,
        use_gpu: bool,
        precision: str,
        top_k: int,
        decode_size: int | None = None,
        threads: int | None = None,
        allow_modules: tuple[str, ...] = (),
        tally=None,
    ):
        # Told of each batch, for the run's progress and its stall watch (pipeline.infer.telemetry).
        self.count = BatchCounter(tally) if tally is not None else None
        if threads:
            torch.set_num_threads(threads)
        self.decode_size = decode_size
        self.classifier = Classifier(
            checkpoint, use_gpu=use_gpu, precision=precision, allow_modules=allow_modules
        )
        self.classes = self.classifier.meta.classes
        self.index = {name: i for i, name in enumerate(self.classes)}
        self.top_k = min(top_k, len(self.classes))
        self.batches = 0

    def __call__(self, batch: dict) -> dict:
        if self.count is not None:
            self.count.started()
            self.batches += 1
            if self.batches == STALLED_BATCH:
                faults.point(faults.BATCH_STALLED)
        if self.decode_size:
            batch = prepare_batch(batch, image_size=self.decode_size)
        probs, top = self.classifier.probabilities(batch["pixels"]).topk(self.top_k, dim=1)
        if self.count is not None:
            self.count.finished(len(batch["source_id"]))
        return batch_table(
            source_id=batch["source_id"],
            label=np.array([self.index.get(n, -1) for n in batch["label_name"]], dtype=np.int64),
            label_name=batch["label_name"],
            top_k=top.numpy(),
            top_k_prob=probs.numpy(),
            error=batch["error"],
            classes=self.classes,
            predicted_at=time.time(),
        )


def log_weights(checkpoint: Location, meta) -> None:
    """Say which of the checkpoint's weights classify, and why."""
    scores = weights_scores(meta)
    if len(scores) < 2:
        return
    served = served_weights(meta)
    log.info(
        "checkpoint %s holds raw and EMA weights: classifying with the %s weights (%s: %s)",
        checkpoint.uri,
        served,
        weights_by(meta),
        ", ".join(f"{name} {score:.4f}" for name, score in scores.items()),
    )


def classes_unknown(input_classes: list[str], classes: list[str]) -> list[str]:
    """The input's classes that are not the checkpoint's, with a warning: their images keep
    their labels in the predictions but count in no accuracy."""
    known = set(classes)
    unknown = [c for c in input_classes if c not in known]
    if not unknown:
        return []
    if len(unknown) == len(input_classes):
        log.warning(
            "none of the input's classes %s is a class of the checkpoint %s: no accuracy. The "
            "predictions keep the input's labels (label_name), with no label index",
            *(_some(input_classes), _some(classes)),
        )
    else:
        log.warning(
            "%d of the input's classes are not classes of the checkpoint %s: %s. Their images "
            "keep their labels (label_name), with no label index, and count in no accuracy",
            *(len(unknown), _some(classes), _some(unknown)),
        )
    return unknown


def _some(names: list[str], shown: int = 8) -> str:
    """A list of names for a log line: the first `shown`, and how many more."""
    more = f", ... {len(names) - shown} more" if len(names) > shown else ""
    return f"[{', '.join(names[:shown])}{more}]"


def wait_for_gpu(timeout_s: float) -> int:
    """GPUs in the cluster, waiting up to `timeout_s` for an autoscaler to add one."""
    return wait_for_capacity(
        {"GPU": 1},
        timeout_s,
        asked="use_gpu=true",
        fix="run on a cluster with GPU nodes or set use_gpu=false",
    )


# --- batch -------------------------------------------------------------------------------------


def infer(cfg: InferConfig, *, model: Location, source: Location, output: Location) -> dict:
    """Classify `source` (a dataset or an image folder) with `model` (a run or a checkpoint)
    into a new version at `output`; return the summary in place (Ray initialised): this run's,
    or that of a run started after it with the same checkpoint and input, committed first.
    What an uncommitted run of the same key wrote (a job stopped or failed midway) is carried
    over, not inferred again."""
    check_output(output)
    checkpoint, meta = checked_checkpoint(cfg, model)
    quiet_ray_data()
    asked = trained_version(meta, source, cfg.dataset_version, key="input")
    inp = list_input(source, split=cfg.split, version=asked)
    split = cfg.split if inp.version is not None else None  # a folder has no split
    check_input(output, source.uri, split)
    unknown = classes_unknown(inp.classes, meta.classes)
    num_classes = len(meta.classes)
    key = prediction_key(cfg, checkpoint, inp)
    partial = find_partial(output, key, num_classes=num_classes, alive=job_alive)
    # This run writes below versions/<version>/ only, and publish commits that.
    version = start_version(output, {"key": key, "job": this_job()})
    carried = carry_over(output, partial, version, num_classes=num_classes, images=inp.images)
    ds = read_input(inp, skip=None if partial is None else partial.ids)
    sink = PredictionSink(
        output.child(VERSIONS, version, PREDICTIONS),
        num_classes=num_classes,
        rows_per_file=cfg.rows_per_file,
    )
    # Wall clock, not monotonic: the batches are stamped in the actors' processes.
    started = time.time()
    telemetry = InferTelemetry(output, images=inp.images, carried=carried.images, stall=cfg.stall)
    predict_watched(cfg, ds, sink, telemetry, checkpoint=checkpoint, image_size=meta.image_size)
    seconds = time.time() - started
    tally = Tally.empty(num_classes)
    tally.merge(carried)
    tally.merge(sink.tally)
    summary = summarize(meta, checkpoint, source, inp.version, tally, sink.tally, started, seconds)
    if split is not None:
        summary["split"] = split
    if partial is not None:
        summary |= {"resumed": partial.versions, "images_resumed": carried.images}
    if unknown:
        summary["classes_unknown"] = unknown
    png = None
    if "confusion_matrix" in summary:
        png = plot_confusion(summary["confusion_matrix"], meta.classes)
    summary |= driver_usage()  # last but the commit: everything the driver did counts
    resumed = [] if partial is None else partial.versions
    return publish(output, version, tally, summary, png, resumed=resumed)


def checked_checkpoint(cfg: InferConfig, model: Location) -> tuple[Location, CheckpointMeta]:
    """The checkpoint that `model` names and its metadata, checked on the driver: the code it
    names (before any actor imports it) and its weights (here, not in each actor that loads
    them); which weights classify is logged."""
    checkpoint = resolve_checkpoint(model)
    meta = read_meta(checkpoint)
    check_model_code(meta.model, allow_modules=cfg.allow_modules)
    check_weights(checkpoint, meta)
    log_weights(checkpoint, meta)
    return checkpoint, meta


def carry_over(
    output: Location, partial: Partial | None, version: str, *, num_classes: int, images: int
) -> Tally:
    """The predictions of the `partial` work this run resumes, copied into its `version` (of
    an input of `images`): their Tally, empty where there is none."""
    if partial is None:
        return Tally.empty(num_classes)
    carried = carry(output, partial, version)
    log.info(
        "resuming: %d of %d images already inferred (version %s); inferring the rest",
        *(carried.images, images, ", ".join(partial.versions)),
    )
    return carried


def predict_watched(
    cfg: InferConfig,
    ds: ray.data.Dataset | None,
    sink: PredictionSink,
    telemetry: InferTelemetry,
    *,
    checkpoint: Location,
    image_size: int,
) -> None:
    """`predict` the rows `ds` into `sink` under `telemetry`'s watch, which is closed as
    finished or failed; with no rows (every image was inferred before), an empty tally."""
    try:
        if ds is None:
            sink.tally = Tally.empty(sink.num_classes)
        else:
            options = {"checkpoint": checkpoint, "image_size": image_size}
            telemetry.run(functools.partial(predict, cfg, ds, sink, **options, count=telemetry))
    except BaseException:
        telemetry.close("failed")
        raise
    telemetry.close("finished", images_done=sink.tally.images)


def predict(
    cfg: InferConfig,
    ds: ray.data.Dataset,
    sink: PredictionSink,
    *,
    checkpoint,
    image_size: int,
    count: InferTelemetry | None = None,
) -> None:
    """Classify the input rows `ds` with the predictor actors and write them with `sink`; the
    actors tell `count` of each batch."""
    predictor = {
        "tally": count.tally if count is not None else None,
        "checkpoint": checkpoint,
        "use_gpu": cfg.use_gpu,
        "precision": cfg.precision,
        "top_k": cfg.top_k,
        "allow_modules": cfg.allow_modules,
    }
    if cfg.use_gpu:
        actors = min(cfg.num_actors, wait_for_gpu(cfg.capacity_timeout_s))
        per_actor = {"num_gpus": 1, "num_cpus": 1}
        # CPU tasks decode while the GPUs classify.
        ds = ds.map_batches(
            prepare_batch, fn_kwargs={"image_size": image_size}, batch_size=cfg.batch_size
        )
    else:
        # Each actor decodes its own batches with its CPUs, then runs the model on all of them
        # (torch threads = cpus_per_actor): a separate decoding stage would need CPUs that the
        # actors hold, and decoding is a few percent of a CPU forward pass.
        cpus = cfg.cpus_per_actor
        fits = wait_for_capacity(
            {"CPU": cpus},
            cfg.capacity_timeout_s,
            asked=f"cpus_per_actor={cpus}",
            fix="lower cpus_per_actor",
        )
        actors = min(cfg.num_actors, fits)
        per_actor = {"num_cpus": cpus}
        predictor |= {"decode_size": image_size, "threads": cpus}
    # As many actors as the cluster holds now, growing up to num_actors as nodes join.
    log.info(
        "checkpoint %s; %d to %d predictor actors with %s each, batches of %d",
        checkpoint.uri,
        actors,
        cfg.num_actors,
        per_actor,
        cfg.batch_size,
    )
    ds = ds.map_batches(
        Predictor,
        fn_constructor_kwargs=predictor,
        batch_size=cfg.batch_size,
        compute=ray.data.ActorPoolStrategy(min_size=actors, max_size=cfg.num_actors),
        **per_actor,
    )
    # The write tasks take no CPU, like the reads: on CPUs the actors hold every one.
    ds.write_datasink(sink, ray_remote_args={"num_cpus": 0}, concurrency=WRITE_TASKS)


# --- one image ---------------------------------------------------------------------------------


@ray.remote
def _classify_one(
    checkpoint: Location, data: bytes, use_gpu: bool, precision: str, k: int, allow: tuple
):
    classifier = Classifier(checkpoint, use_gpu=use_gpu, precision=precision, allow_modules=allow)
    pixels = prepare_image(data, image_size=classifier.meta.image_size)[None]
    return top_classes(classifier.probabilities(pixels)[0], classifier.meta.classes, k)


def classify_image(cfg: InferConfig, *, model: Location, image: Location) -> dict:
    """One image file through one Ray task (on a GPU with use_gpu): its top-k classes."""
    checkpoint = resolve_checkpoint(model)
    meta = read_meta(checkpoint)
    check_model_code(meta.model, allow_modules=cfg.allow_modules)
    log_weights(checkpoint, meta)
    if cfg.use_gpu:
        wait_for_gpu(cfg.capacity_timeout_s)
    data = image.read_bytes()
    try:
        decode_image(data)  # fail here, with what is wrong, rather than in the task
    except BadImageError as e:
        raise InputError(f"input={image.uri}: {e}") from None
    task = _classify_one.options(num_gpus=1 if cfg.use_gpu else 0)
    args = (cfg.use_gpu, cfg.precision, cfg.top_k, cfg.allow_modules)
    top = ray.get(task.remote(checkpoint, data, *args))
    return {
        "input": image.uri,
        "checkpoint": checkpoint.uri,
        "weights": served_weights(meta),
        "top_k": top,
    }
