"""Training input through Ray Data, for clusters whose training nodes lack the CPUs to decode.

`ingest=ray_data`: the driver reads the manifest's Parquet files with Ray Data and decodes and
augments them in `map_batches` tasks, which run on any node's spare CPUs (CPU-only nodes too);
each worker iterates its share with `iter_torch_batches`, so its own CPUs only feed the model.
The same transforms as the torch loader (`pipeline.train.augment`), the same exact
validation (val split with `equal=False`: every image to exactly one rank), the same resume
(by epoch, from the checkpoint). The tasks decode on CPUs whatever `decode` says: `decode=gpu`
is a config error with this ingest, and `auto` means cpu here.

Shuffling: train blocks (row groups) are read in an order Ray Data randomizes anew each epoch,
then rows are shuffled within a buffer of `SHUFFLE_BUFFER_BATCHES` batches on each worker,
seeded per epoch.
Train rows are split evenly over the ranks (Ray Data's `equal=True`), so every rank takes the
same number of steps; that leaves out fewer rows than there are ranks each epoch.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np
import pyarrow as pa
import ray.data
import ray.train
from ray.train import DataConfig

from pipeline.core.errors import InputError, task_error
from pipeline.core.logs import quiet_ray_data
from pipeline.core.storage import Location
from pipeline.data.dataset import Manifest
from pipeline.data.shards import ShardFooter, read_footer, read_row_group

SHUFFLE_BUFFER_BATCHES = 4
DECODE_BATCH = 64  # images per map_batches call


def read_split(dataset: Location, manifest: Manifest, split: str) -> ray.data.Dataset:
    """One split's rows (image bytes, label), a block per Parquet row group, each read as the
    torch loader reads it: its pages checked, its labels in range, damage an InputError naming
    it (`dataset.read_row_group`). The footers are read here, once."""
    footers = [read_footer(dataset, f.path) for f in manifest.splits[split].files]
    groups = [
        {"shard": s, "group": g}
        for s, footer in enumerate(footers)
        for g in range(footer.metadata.num_row_groups)
    ]
    # One item per block, so one task, and one block, per row group.
    items = ray.data.from_items(groups, override_num_blocks=max(len(groups), 1))
    kwargs = {"footers": footers, "classes": len(manifest.classes)}
    return items.map_batches(read_groups, fn_kwargs=kwargs, batch_size=None)


def read_groups(batch: dict, *, footers: list[ShardFooter], classes: int) -> dict:
    """Ray Data stage: (shard, row group) items -> the rows of those row groups."""
    tables = [
        read_row_group(footers[s], g, ["image", "label"], classes=classes)
        for s, g in zip(batch["shard"], batch["group"], strict=True)
    ]
    table = pa.concat_tables(tables)
    return {"image": table["image"].to_numpy(), "label": table["label"].to_numpy()}


def datasets(manifest: Manifest, dataset: Location, *, augment: str, seed: int, **options) -> dict:
    """The driver's `datasets=` for TorchTrainer: train decoded and augmented (`options`:
    `train_transform`'s other ones), val decoded."""
    quiet_ray_data()  # Ray Train hands this context to the actors that run the datasets
    # A damaged row group's InputError raised as it is (in Ray's RayTaskError), not wrapped in
    # Ray Data's UserCodeException, so the run ends on it rather than retrying the worker.
    ray.data.DataContext.get_current().raise_original_map_exception = True
    size = manifest.image_size
    # An integer seed gives every epoch the same block order; this one is reseeded per
    # execution (each epoch's pass over the split), so the order changes and still repeats
    # for a run started with the same seed.
    every_epoch = ray.data.RandomSeedConfig(seed=seed, reseed_after_execution=True)
    train = read_split(dataset, manifest, "train").randomize_block_order(seed=every_epoch)
    augmented = {"augment": augment, "image_size": size, **options}
    train = train.map_batches(decode_batch, fn_kwargs=augmented, batch_size=DECODE_BATCH)
    val = read_split(dataset, manifest, "val").map_batches(
        decode_batch, fn_kwargs={"augment": "none", "image_size": size}, batch_size=DECODE_BATCH
    )
    return {"train": train, "val": val}


def decode_batch(batch: dict, *, augment: str, image_size: int, **options) -> dict:
    """Ray Data stage: encoded images -> uint8 (N, 3, S, S), augmented as the torch loader does
    (`options`: `train_transform`'s auto_augment, scale, ratio, flip)."""
    # Imported here: the stage's worker processes need torchvision, the driver does not.
    from torchvision.transforms import v2

    from pipeline.data.images import decode_image
    from pipeline.train.augment import train_transform

    transform = train_transform(augment, image_size=image_size, **options)
    images = np.stack(
        [transform(v2.functional.pil_to_tensor(decode_image(b))).numpy() for b in batch["image"]]
    )
    return {"image": images, "label": batch["label"].astype(np.int64)}


class ExactValConfig(DataConfig):
    """Ray Train's DataConfig, but val split with `equal=False`: each image goes to exactly one
    rank, so the accuracy over all ranks counts every image once (`equal=True` would drop rows
    to even the ranks out)."""

    def configure(self, datasets, world_size, worker_handles, worker_node_ids, **kwargs):
        # Ray Train calls this once per dataset, with that one in `datasets`.
        others = {name: ds for name, ds in datasets.items() if name != "val"}
        output = super().configure(others, world_size, worker_handles, worker_node_ids, **kwargs)
        if "val" in datasets:
            val = datasets["val"].copy(datasets["val"])
            val.context.execution_options = self._resolve_execution_options("val")
            hints = worker_node_ids if self._enable_shard_locality else None
            splits = val.streaming_split(world_size, equal=False, locality_hints=hints)
            for shard, split in zip(output, splits, strict=True):
                shard["val"] = split
        return output


class ShardBatches:
    """A worker's share of a split as (uint8 images, labels) batches, like a DataLoader."""

    def __init__(self, split: str, *, batch_size: int, rows: int, world: int, shuffle_seed=None):
        self.shard = ray.train.get_dataset_shard(split)
        self.batch_size, self.shuffle_seed, self.epoch = batch_size, shuffle_seed, 0
        self.batches = max(rows // world // batch_size, 1) if shuffle_seed is not None else 0

    def set_epoch(self, epoch: int, start_step: int = 0) -> None:
        assert start_step == 0, "Ray Data resumes no iteration inside an epoch"
        self.epoch = epoch

    def __len__(self) -> int:
        """Train batches per epoch (even split, last partial batch dropped)."""
        return self.batches

    def __iter__(self) -> Iterator[tuple]:
        shuffle = self.shuffle_seed is not None
        batches = self.shard.iter_torch_batches(
            batch_size=self.batch_size,
            drop_last=shuffle,  # train: every rank the same steps; val: every image
            local_shuffle_buffer_size=SHUFFLE_BUFFER_BATCHES * self.batch_size if shuffle else None,
            local_shuffle_seed=self.shuffle_seed + self.epoch if shuffle else None,
        )
        for batch in input_errors_raised(batches):
            yield batch["image"], batch["label"]


def input_errors_raised(batches: Iterable) -> Iterator:
    """`batches`, where a read task's InputError (a damaged row group) is raised with its own
    message: Ray's RayTaskError of it carries the task's traceback in its message."""
    try:
        yield from batches
    except InputError as e:
        raise InputError(task_error(e) or str(e)) from None
