"""The run context: what a training worker needs from whoever runs it (its rank and device, the
checkpoint the run's record names, reports, the model made ready for its ranks, a preemption
notice), as one small protocol with two implementations: Ray Train's (`RayContext`, the only
place in the worker's path that calls ray.train) and one for a loop run in this process
(`LocalContext`: one process, or a torch.distributed process group the caller set up).

As Composer's `dist` degrades every collective to one process, the loop runs the same code
under both: a test runs it for real without Ray.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import ray.train
import ray.train.torch
import torch
import torch.distributed as dist

from pipeline.core.storage import Location

CPU = torch.device("cpu")


class RunContext(Protocol):
    """What a worker asks of its runner."""

    rank: int  # this worker's rank among all of them
    world: int  # how many there are
    local_rank: int  # its rank on its node
    device: torch.device  # where it trains

    def recorded_checkpoint(self) -> str | None:
        """The path of the run's newest checkpoint that the runner's record holds, if any."""

    def report(
        self,
        metrics: dict,
        checkpoint: Location | None = None,
        *,
        write: Callable[[], None] | None = None,
    ) -> None:
        """This rank's `metrics` of an epoch, every rank alike; rank 0 names the epoch's
        `checkpoint`, which `write()` puts in place off the training loop (None: it is in place
        already)."""

    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """`model` on this worker's device, wrapped in DDP where there are several ranks."""

    def preemption(self):
        """A notice that this worker's node goes soon (`preempted_ranks`, `deadline_ms`), or
        None. Every rank asks the same number of times: under Ray it is a barrier."""


class RayContext:
    """A Ray Train worker's: Ray's rank, device, record of checkpoints and reports."""

    def __init__(self):
        ctx = ray.train.get_context()
        self.rank, self.world = ctx.get_world_rank(), ctx.get_world_size()
        self.local_rank = ctx.get_local_rank()
        self.device = ray.train.torch.get_device()

    def recorded_checkpoint(self) -> str | None:
        recorded = ray.train.get_checkpoint()
        return recorded.path if recorded is not None else None

    def report(
        self,
        metrics: dict,
        checkpoint: Location | None = None,
        *,
        write: Callable[[], None] | None = None,
    ) -> None:
        """Reports `metrics`; with `checkpoint`, Ray's record takes it where it is on storage
        (Ray's path of its name): Ray uploads an empty directory by our `upload`, which runs
        `write` in Ray's upload thread (`checkpoint_upload_mode=ASYNC`), and the checkpoint is
        queued for the controller only once written."""
        if checkpoint is None:
            ray.train.report(metrics)
            return
        storage = ray.train.get_context().get_storage()  # here: the upload thread has none
        path = storage.build_checkpoint_path_from_name(checkpoint.name)
        in_place = ray.train.Checkpoint(path, filesystem=storage.storage_filesystem)

        def upload(_: ray.train.Checkpoint, _name: str) -> ray.train.Checkpoint:
            if write is not None:
                write()
            return in_place

        # Written off the loop, in Ray's upload thread; one in place already is recorded as is.
        mode = ray.train.CheckpointUploadMode.ASYNC if write is not None else None
        ray.train.report(
            metrics,
            checkpoint=ray.train.Checkpoint.from_directory(tempfile.mkdtemp(prefix="epoch-")),
            checkpoint_dir_name=checkpoint.name,
            checkpoint_upload_fn=upload,
            delete_local_checkpoint_after_upload=True,  # the (empty) directory given here
            **({"checkpoint_upload_mode": mode} if mode is not None else {}),
        )

    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return ray.train.torch.prepare_model(model)

    def preemption(self):
        return ray.train.get_preemption_info()


@dataclass
class LocalContext:
    """A loop run in this process: rank 0 of 1, or this process's rank in the torch.distributed
    process group the caller set up (`in_process_group`). `recorded`: the checkpoint a record
    names as the run's newest, as Ray's would after a restart (None: a new run's record); the
    checkpoints reported since replace it. `reports` holds what was reported, in order:
    (metrics, checkpoint or None)."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = CPU
    recorded: str | None = None
    reports: list[tuple[dict, Location | None]] = field(default_factory=list)

    @classmethod
    def in_process_group(cls, device: torch.device = CPU, **fields) -> LocalContext:
        """This process's, in the default process group (initialised by the caller)."""
        rank, world = dist.get_rank(), dist.get_world_size()
        return cls(rank=rank, world=world, local_rank=rank, device=device, **fields)

    def recorded_checkpoint(self) -> str | None:
        return self.recorded

    def report(
        self,
        metrics: dict,
        checkpoint: Location | None = None,
        *,
        write: Callable[[], None] | None = None,
    ) -> None:
        """Records the report; `write()` runs here and now, before it returns."""
        if write is not None:
            write()
        if checkpoint is not None:
            self.recorded = checkpoint.path
        self.reports.append((dict(metrics), checkpoint))

    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """As Ray's: on the device, and in DDP over the process group's ranks."""
        model = model.to(self.device)
        if self.world == 1:
            return model
        ids = {} if self.device.type == "cpu" else {"device_ids": [self.device]}
        return torch.nn.parallel.DistributedDataParallel(model, **ids)

    def preemption(self):
        return None
