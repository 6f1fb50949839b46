"""What a training run of a train config asks of a node: workers, /dev/shm, object store, as
estimates from the config and the stored images, each with the sum it came from."""

from __future__ import annotations

import math
from dataclasses import dataclass

from pipeline.train.config import TrainConfig
from pipeline.train.input.ring import PREFETCH

# The size the preprocess job stores images at by default (PreprocessConfig.image_size): what
# the estimates assume until a dataset is there to say.
DEFAULT_IMAGE_SIZE = 224
# ingest=ray_data: decoded batches a worker's Ray Data input keeps in the object store, its
# read tasks' output waiting to be taken and the batch it prefetches. An estimate, not a bound:
# Ray Data's streaming executor holds back its reads once the store fills.
RAY_DATA_BATCHES = 4
GB = 1e9


@dataclass(frozen=True)
class Need:
    bytes: int
    why: str  # the sum, in words


def workers(cfg: TrainConfig) -> int:
    """The training workers a run starts with: the config's count, the minimum of an elastic
    [min, max] (such a run starts with what the cluster holds)."""
    return cfg.scaling.min_workers


def workers_on_node(cfg: TrainConfig, cpus: float, gpus: float) -> int:
    """The most training workers a node of `cpus` and `gpus` holds."""
    s = cfg.scaling
    fit = int(cpus // s.cpus_per_worker)
    if s.use_gpu:
        fit = min(fit, int(gpus))
    return max(0, min(fit, s.max_workers))


def decodes_on_device(cfg: TrainConfig, image_format: str | None) -> bool:
    """Whether the workers decode on their GPUs (train/input/device_decode.py's rule): then the
    loader processes hand over encoded images, which take next to no shared memory. With no
    dataset yet (`image_format` None), auto counts as the CPU: the larger need."""
    decode = cfg.decode_setting()
    return decode == "gpu" or (decode == "auto" and cfg.scaling.use_gpu and image_format == "jpeg")


def loader_shm(cfg: TrainConfig, image_size: int, image_format: str | None) -> Need:
    """/dev/shm the loader of one worker maps (train/input/ring.py): per process, PREFETCH + 1
    slots of its part of a train batch for each part it runs ahead, and PREFETCH + 1 whole val
    batches."""
    processes = cfg.scaling.loader_workers
    if cfg.ingest != "torch":
        return Need(0, "ingest=ray_data: no loader processes")
    if processes == 0:
        return Need(0, "loader_workers=0: decoded in the worker's own process")
    if decodes_on_device(cfg, image_format):
        return Need(0, "decode on the GPU: the loader hands over encoded images")
    batch = cfg.batch_size_per_worker(workers(cfg))  # the largest share: the fewest workers
    image = image_size * image_size * 3
    parts = processes if processes > 1 else 1
    train = processes * (PREFETCH * parts + 1) * math.ceil(batch / parts) * image
    val = processes * (PREFETCH + 1) * batch * image
    why = (
        f"{processes} loader processes x ({PREFETCH * parts + 1} train slots of "
        f"{math.ceil(batch / parts)} images + {PREFETCH + 1} val slots of {batch}) x "
        f"{image_size}x{image_size}x3 bytes = {(train + val) / GB:.2f} GB a worker"
    )
    return Need(train + val, why)


def object_store_need(cfg: TrainConfig, image_size: int, on_node: int) -> Need:
    """Object store the data path of `on_node` workers uses on their node."""
    if cfg.ingest == "torch":
        return Need(0, "ingest=torch: batches go through /dev/shm, not the object store")
    batch = cfg.batch_size_per_worker(workers(cfg)) * image_size * image_size * 3
    need = on_node * RAY_DATA_BATCHES * batch
    why = (
        f"ingest=ray_data: {on_node} workers x {RAY_DATA_BATCHES} decoded batches of "
        f"{batch / GB:.3f} GB = {need / GB:.2f} GB"
    )
    return Need(need, why)


def shm_need(loader: Need, on_node: int, object_store: int, shm_total: int) -> tuple[Need, bool]:
    """/dev/shm a node needs: its workers' loaders, and the object store where Ray maps it
    there (it does when /dev/shm is larger than the store; else it takes /tmp, slower).
    Returns the need and whether the store counts in it."""
    loaders = on_node * loader.bytes
    in_shm = object_store <= shm_total
    total = loaders + (object_store if in_shm else 0)
    where = (
        f"the object store ({object_store / GB:.2f} GB)"
        if in_shm
        else f"not the object store ({object_store / GB:.2f} GB: in /tmp, slower)"
    )
    why = f"{on_node} x a worker's loader ({loaders / GB:.2f} GB) + {where}"
    return Need(total, why), in_shm
