"""A worker's loaders, by `ingest` and `decode`: its share of the train split each epoch, in the
epoch's order (order.py), with its position (`EpochLoader`), and of the val split. Each is
composed here: the rows read (rows.RowGroupStream), decoded in the DataLoader processes
(decoding.Decoded) or left encoded for the device (device_decode), handed over by the ring.
"""

from __future__ import annotations

import logging

import torch

from pipeline.core.storage import Location
from pipeline.data.dataset import Manifest
from pipeline.train.augment import train_transform, transform_options
from pipeline.train.config import TrainConfig
from pipeline.train.input.decoding import Decoded
from pipeline.train.input.device_decode import DeviceDecoded, Encoded, pick_decode
from pipeline.train.input.ring import RingLoader
from pipeline.train.input.rows import RowGroupStream, StreamSpec

log = logging.getLogger(__name__)


def loader(
    rows: RowGroupStream, cfg: TrainConfig, device: torch.device, *, on_device: bool, transform
) -> RingLoader | DeviceDecoded:
    """`rows`' batches, made in `loader_workers` processes: decoded and augmented by `transform`
    there, or `on_device` (the processes only read rows)."""
    batches = Encoded(rows) if on_device else Decoded(rows, transform)
    ring = RingLoader(
        batches, processes=cfg.scaling.loader_workers, pin_memory=device.type == "cuda"
    )
    return DeviceDecoded(ring, device, transform, rows=rows) if on_device else ring


def train_data(
    cfg: TrainConfig,
    dataset: Location,
    manifest: Manifest,
    *,
    rank: int,
    world: int,
    device: torch.device,
) -> EpochLoader:
    """This worker's training batches (decode + augment in `loader_workers` processes, or on
    `device` by `decode`), with `set_epoch` to reshuffle, in the order of the config's
    partitions (the run's, which the driver pins). Ray Train needs no wrapping of it: the
    benchmark's plain loop uses it as it is."""
    transform = train_transform(**transform_options(cfg), image_size=manifest.image_size)
    spec = StreamSpec(
        batch_size=cfg.batch_size_per_worker(world),
        rank=rank,
        world=world,
        shuffle=True,
        seed=cfg.seed,
        partitions=cfg.partitions_at_start(),
    )
    rows = RowGroupStream(dataset, manifest, "train", spec)
    on_device = decodes_on_device(cfg, manifest, device)
    batches = loader(rows, cfg, device, on_device=on_device, transform=transform)
    return EpochLoader(batches, rows, layout=epoch_layout(cfg, world), logs=rank == 0)


def val_data(cfg: TrainConfig, dataset: Location, manifest: Manifest, *, rank, world, device):
    """This worker's contiguous share of the val split, unpadded (see `evaluate`), decoded
    where `decode` says."""
    spec = StreamSpec(batch_size=cfg.batch_size_per_worker(world), rank=rank, world=world)
    rows = RowGroupStream(dataset, manifest, "val", spec)
    on_device = decodes_on_device(cfg, manifest, device)
    return loader(rows, cfg, device, on_device=on_device, transform=None)


def decodes_on_device(cfg: TrainConfig, manifest: Manifest, device: torch.device) -> bool:
    """Whether `decode` decodes the images on `device` (decode=gpu), not in the processes."""
    return pick_decode(cfg.decode_setting(), device, manifest.image_format) == "gpu"


class EpochLoader:
    """A worker's train loader (decoding on the device, or not; or Ray Data's) and the stream
    whose `set_epoch` reshuffles it, with its position (`state_dict()`): the epoch, the steps
    of it trained, and what the epoch's order is a function of (order.EpochOrder; none for
    `ingest=ray_data`, which resumes no epoch inside). The layout is not among them: a
    position goes on at its next step on any worker count or loader processes."""

    def __init__(self, loader, stream, *, layout: str, logs: bool = False):
        self.loader, self.stream, self.layout = loader, stream, layout
        self.logs = logs  # rank 0's: says where a resumed epoch goes on
        self.epoch, self.step = 0, 0  # step: of the epoch, once the batch handed out is trained
        self._resume: tuple[int, int] | None = None  # load_state_dict's, until set_epoch

    def set_epoch(self, epoch: int, start_step: int = 0) -> None:
        """Epoch `epoch` from step `start_step`, or from the position `load_state_dict` gave,
        if it is in `epoch`."""
        if self._resume is not None and self._resume[0] == epoch:
            start_step = self._resume[1]
        self._resume = None
        self.stream.set_epoch(epoch, start_step)
        self.epoch, self.step = epoch, start_step

    def order(self) -> dict:
        """What the epoch's order is a function of, besides the epoch."""
        o = getattr(self.stream, "order", None)
        if o is None:
            return {}
        return {
            "partitions": o.partitions,
            "global_batch": o.global_batch,
            "seed": o.seed,
            "dataset_version": self.stream.version,
        }

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "step": self.step, "layout": self.layout, **self.order()}

    def load_state_dict(self, state: dict) -> None:
        """Resume at `state`'s position at the next `set_epoch` of its epoch. A position in
        another order (another seed, global batch, partition count or dataset version) fits
        no step of this one: its epoch starts over. The driver pins the run's partitions, so
        only a config changed since the checkpoint differs."""
        now = self.order()
        changed = [f"{k} {state.get(k)} -> {v}" for k, v in now.items() if state.get(k) != v]
        if changed:
            if self.logs and state["step"]:
                log.info(
                    "epoch %d starts over: its order changed since its step %d (%s)",
                    *(state["epoch"], state["step"], ", ".join(changed)),
                )
            return
        self._resume = (state["epoch"], state["step"])
        if self.logs and state["step"] and state["layout"] != self.layout:
            log.info(
                "epoch %d goes on after its step %d on %s (taken with %s)",
                *(state["epoch"], state["step"], self.layout, state["layout"]),
            )

    def __iter__(self):
        for batch in self.loader:
            self.step += 1
            yield batch

    def __len__(self) -> int:
        """The epoch's steps."""
        return len(self.loader)


def epoch_layout(cfg: TrainConfig, world: int) -> str:
    """How `world` workers read and decode an epoch, in words: it changes none of its steps."""
    batch, processes = cfg.global_batch_size // world, cfg.scaling.loader_workers
    return f"{world} workers of {batch} images, {processes} loader processes each"
