"""The online classifier: a Ray Serve application, started from a Serve config file.

    serve run configs/serve.yaml                                   # on this machine, blocking
    serve deploy configs/serve.yaml --address http://127.0.0.1:8265   # to a running cluster

`POST /` with an image's bytes answers its top-k classes as JSON. Each replica loads the
checkpoint once; requests that arrive together go through the model as one batch
(`@serve.batch`). The checkpoint is resolved when the application is built, so every replica,
including those the autoscaler adds later, serves the same one until the next deploy: a run's
best checkpoint, or a registered model version (an alias pinned to the version it names then),
which each replica downloads from MLflow for itself.
"""

from __future__ import annotations

import asyncio
import logging
import math
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import ray
import torch
from ray import serve
from starlette.requests import Request
from starlette.responses import JSONResponse

from pipeline.core.config import REGISTERED_MODEL, parse_yaml, validate_config
from pipeline.core.storage import Location
from pipeline.data.images import BadImageError
from pipeline.model.checkpoint import read_meta
from pipeline.model.classifier import Classifier, prepare_image, top_classes
from pipeline.model.source import resolve_checkpoint
from pipeline.model.trust import check_model_code
from pipeline.serve.config import ServeConfig

log = logging.getLogger(__name__)

DEPLOYMENT = "ImageClassifier"
# The HTTP status of an image that does not decode, by how its reason starts; any other is 400.
BAD_IMAGE_STATUS = {"not an image": 415, "too large": 413}
HOW_TO_POST = "POST one image file's bytes as the body, e.g. curl --data-binary @photo.jpg"


class BadRequest(Exception):
    """A request this endpoint cannot classify: its HTTP status and what to change."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def use_threads(cpus: float) -> None:
    """Torch threads for the CPUs this replica holds, as batch inference sizes its actors'."""
    # Not inline in the replica's methods: Serve pickles the deployment class by value, and
    # cloudpickle would take `torch.classes` for a submodule to ship, because a method reads an
    # attribute named `classes`.
    torch.set_num_threads(max(1, round(cpus)))


@serve.deployment(name=DEPLOYMENT)
class ImageClassifier:
    """One replica: the checkpoint's model on this replica's device (a GPU when Ray gave it one),
    classifying the images of concurrent requests in batches."""

    def __init__(self, model: str, config: dict[str, Any]):
        self.cfg = validate_config(ServeConfig, config, "the application's args")
        assigned = ray.get_runtime_context().get_assigned_resources()
        use_gpu = bool(ray.get_gpu_ids())
        if not use_gpu:
            use_threads(assigned.get("CPU", 1))
        # Decoding is CPU work: as many images at once as the replica holds CPUs. The event
        # loop's default pool runs up to 32, each image up to its decode's memory bound
        # (docs/errors.md), for no more throughput.
        self.decodes_at_once = max(1, math.ceil(assigned.get("CPU", 1)))
        self.decoders = ThreadPoolExecutor(self.decodes_at_once, thread_name_prefix="decode")
        # What answers name: the checkpoint, or the registered version as models:/name/version.
        self.model = model
        if model.startswith(REGISTERED_MODEL):
            from pipeline.tracking import registered_checkpoint

            # This replica's own copy, removed with the replica.
            self.download = tempfile.TemporaryDirectory(prefix="ray-cv-serve-")
            checkpoint = registered_checkpoint(
                model, uri=self.cfg.tracking_uri, dst=self.download.name
            )
        else:
            checkpoint = Location.parse(model)
        self.classifier = Classifier(
            checkpoint,
            use_gpu=use_gpu,
            precision=self.cfg.precision,
            allow_modules=self.cfg.allow_modules,
        )
        self.meta = self.classifier.meta
        self.classify.set_max_batch_size(self.cfg.max_batch_size)
        self.classify.set_batch_wait_timeout_s(self.cfg.batch_wait_timeout_s)
        log.info(
            "serving %s: %d classes at %d px on %s (%s), batches of up to %d",
            self.model,
            len(self.meta.classes),
            self.meta.image_size,
            "GPU" if use_gpu else f"{assigned.get('CPU', 0):g} CPU",
            self.classifier.precision,
            self.cfg.max_batch_size,
        )

    async def __call__(self, request: Request) -> JSONResponse:
        if request.method == "GET":
            return JSONResponse(self.describe())
        try:
            if request.method != "POST":
                raise BadRequest(405, f"{request.method} is not served here; {HOW_TO_POST}")
            started = time.perf_counter()
            data = await read_body(request, self.cfg.max_request_bytes)
            loop = asyncio.get_running_loop()
            pixels = await loop.run_in_executor(self.decoders, self.prepare, data)
        except BadRequest as e:
            return JSONResponse({"error": str(e)}, status_code=e.status)
        queued = time.perf_counter()
        probs, batch_started, forward_s, batch_size = await self.classify((pixels, queued))
        answer = {
            "checkpoint": self.model,
            "top_k": top_classes(probs, self.meta.classes, self.cfg.top_k),
        }
        # Where this request's time went inside the replica, for clients and bench/serve.py.
        timing = {
            "decode": queued - started,
            "queue": batch_started - queued,
            "forward": forward_s,
        }
        headers = {
            "server-timing": ", ".join(f"{k};dur={v * 1000:.3f}" for k, v in timing.items()),
            "x-batch-size": str(batch_size),
        }
        return JSONResponse(answer, headers=headers)

    def prepare(self, data: bytes) -> np.ndarray:
        """The body -> uint8 (3, S, S) pixels, as batch inference prepares an image file."""
        if not data:
            raise BadRequest(400, f"empty request body; {HOW_TO_POST}")
        try:
            return prepare_image(data, image_size=self.meta.image_size)
        except BadImageError as e:
            reason = str(e)
            status = next((s for p, s in BAD_IMAGE_STATUS.items() if reason.startswith(p)), 400)
            raise BadRequest(status, f"{reason}; {HOW_TO_POST}") from None

    @serve.batch
    async def classify(self, items: list[tuple[np.ndarray, float]]) -> list[tuple]:
        """Pixels of concurrent requests -> per request: its probabilities (C,), when its batch
        started, the batch's forward seconds, and the batch's size."""
        started = time.perf_counter()
        pixels = np.stack([p for p, _ in items])
        # In a thread: the event loop keeps reading and decoding the next requests meanwhile.
        probs = await asyncio.to_thread(self.classifier.probabilities, pixels)
        forward_s = time.perf_counter() - started
        return [(probs[i], started, forward_s, len(items)) for i in range(len(items))]

    def describe(self) -> dict[str, Any]:
        return {
            "checkpoint": self.model,
            "classes": self.meta.classes,
            "image_size": self.meta.image_size,
            "precision": self.classifier.precision,
            "top_k": self.cfg.top_k,
            "max_request_bytes": self.cfg.max_request_bytes,
            "decodes_at_once": self.decodes_at_once,
        }


async def read_body(request: Request, limit: int) -> bytes:
    """The request's body, refused with 413 as soon as it is known to exceed `limit` bytes."""
    too_large = BadRequest(
        413,
        f"request body larger than max_request_bytes={limit}: send a smaller image, or raise "
        "max_request_bytes in the application's args",
    )
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise too_large
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise too_large
    return bytes(body)


def build_app(args: dict[str, Any]) -> serve.Application:
    """The application for a Serve config's `import_path: pipeline.serve.app:build_app`; its
    `args` are ServeConfig's keys (`serve run pipeline.serve.app:build_app model=...` passes
    them as strings, read as YAML values, as the jobs read `key=value`)."""
    values = {k: parse_yaml(v) if isinstance(v, str) else v for k, v in args.items()}
    cfg = validate_config(ServeConfig, values, "the application's args")
    if cfg.model.startswith(REGISTERED_MODEL):
        # The registry's metadata now: a version that is missing or not a checkpoint of this
        # bundle fails the deploy here, and the old replicas serve on.
        from pipeline.tracking import registered_version

        model, meta = registered_version(cfg.model, uri=cfg.tracking_uri)
        log.info("%s is %s: %s, %d classes", cfg.model, model, meta.model.name, len(meta.classes))
    else:
        checkpoint = resolve_checkpoint(Location.parse(cfg.model))
        model, meta = checkpoint.uri, read_meta(checkpoint)
    # Here too, so that a deploy fails before any replica starts: the replicas check again.
    check_model_code(meta.model, allow_modules=cfg.allow_modules)
    # Requests past this wait in the proxy, which retries a full replica with a backoff of up to
    # 0.5 s: at 64 clients and twice the batch size, requests/s fell to a fifth of the limit
    # (bench/serve.py). Waiting in the replica's batch queue instead costs nothing; autoscaling
    # still adds replicas by target_ongoing_requests. A deployment option in the config file
    # overrides it.
    deployment = ImageClassifier.options(max_ongoing_requests=4 * cfg.max_batch_size)
    return deployment.bind(model, cfg.model_dump(mode="json"))
