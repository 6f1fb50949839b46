"""The training loader: a preprocessed Parquet split as a torch Dataset, a row group at a time.

A worker holds at most a few row groups of encoded images, never the split: memory does not grow
with the dataset. `BlockShuffleSampler` keeps that cheap by visiting row groups in a shuffled
order and shuffling rows within a window of groups, so each read serves many samples in a row.
Preprocessing writes shards in hash order, so every row group already mixes the classes.
"""

from __future__ import annotations

import bisect
import math
from collections import OrderedDict
from collections.abc import Iterator

import pyarrow.parquet as pq
import torch
from torch.utils.data import Dataset, DistributedSampler, Sampler
from torchvision.transforms import v2

from pipeline.dataset import SCHEMA, Manifest
from pipeline.errors import InputError
from pipeline.storage import Location
from pipeline.transforms import decode_image


def train_transform(kind: str, *, image_size: int) -> v2.Transform:
    """Augmentation on uint8 (3, H, W); the images are already `image_size` squares."""
    if kind == "random_resized_crop":
        return v2.Compose(
            [v2.RandomResizedCrop(image_size, scale=(0.25, 1.0)), v2.RandomHorizontalFlip()]
        )
    if kind == "crop_flip":
        pad = max(1, image_size // 8)
        return v2.Compose([v2.RandomCrop(image_size, padding=pad), v2.RandomHorizontalFlip()])
    if kind == "none":
        return v2.Identity()
    raise ValueError(f"unknown augment {kind!r}: use random_resized_crop, crop_flip or none")


class ParquetImages(Dataset):
    """(uint8 image, label) pairs of one split, from the files its manifest lists."""

    def __init__(self, root: Location, manifest: Manifest, split: str, transform=None, cache=4):
        self.root, self.transform, self.cache_size = root, transform, cache
        # One entry per row group: (file path, row group index); `starts` are global row offsets.
        self.groups: list[tuple[str, int]] = []
        self.starts: list[int] = [0]
        for f in manifest.splits[split].files:
            loc = root.child(f.path)
            try:
                with loc.fs.open_input_file(loc.path) as fh:
                    meta = pq.ParquetFile(fh).metadata
            except FileNotFoundError:
                raise InputError(
                    f"{loc.uri} is listed in the manifest but missing: the dataset is damaged; "
                    "re-run preprocessing with overwrite=true"
                ) from None
            if not meta.schema.to_arrow_schema().equals(SCHEMA, check_metadata=False):
                raise InputError(
                    f"{loc.uri} does not have the schema this code reads "
                    f"({SCHEMA.names}); re-run preprocessing with overwrite=true"
                )
            for g in range(meta.num_row_groups):
                self.groups.append((loc.path, g))
                self.starts.append(self.starts[-1] + meta.row_group(g).num_rows)
        if self.starts[-1] != manifest.splits[split].rows:
            raise InputError(
                f"split {split!r} of {root.uri} has {self.starts[-1]} rows on storage but the "
                f"manifest says {manifest.splits[split].rows}; re-run preprocessing"
            )
        self._cache: OrderedDict[int, tuple[list[bytes], list[int]]] = OrderedDict()

    def __len__(self) -> int:
        return self.starts[-1]

    def group_sizes(self) -> list[int]:
        return [b - a for a, b in zip(self.starts, self.starts[1:], strict=False)]

    def _group(self, g: int) -> tuple[list[bytes], list[int]]:
        # Per process (each DataLoader worker has its own copy): the last few groups read.
        if g in self._cache:
            self._cache.move_to_end(g)
            return self._cache[g]
        path, index = self.groups[g]
        with self.root.fs.open_input_file(path) as fh:
            table = pq.ParquetFile(fh).read_row_group(index, columns=["image", "label"])
        rows = (table.column("image").to_pylist(), table.column("label").to_pylist())
        self._cache[g] = rows
        if len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return rows

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        g = bisect.bisect_right(self.starts, i) - 1
        images, labels = self._group(g)
        image = v2.functional.pil_to_tensor(decode_image(images[i - self.starts[g]]))
        if self.transform is not None:
            image = self.transform(image)
        return image, labels[i - self.starts[g]]


class BlockShuffleSampler(DistributedSampler):
    """A DistributedSampler (so Ray's `prepare_data_loader` keeps it) that shuffles row groups,
    then rows within windows of `window` groups, and gives each rank a contiguous run of that
    order: every rank gets the same number of samples (padded by repeats, as DistributedSampler
    does, so DDP steps stay in lockstep) while reading few distinct row groups."""

    def __init__(self, dataset: ParquetImages, *, num_replicas, rank, seed=0, window=8):
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed)
        self.starts = dataset.starts  # row offset of each row group, then the total
        self.window = window

    def __iter__(self) -> Iterator[int]:
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        starts = self.starts
        order = torch.randperm(len(starts) - 1, generator=g).tolist()
        indices: list[int] = []
        for w in range(0, len(order), self.window):
            groups = order[w : w + self.window]
            block = [i for grp in groups for i in range(starts[grp], starts[grp + 1])]
            indices += [block[j] for j in torch.randperm(len(block), generator=g).tolist()]
        indices += indices[: self.total_size - len(indices)]  # pad to a multiple of the ranks
        return iter(indices[self.rank * self.num_samples : (self.rank + 1) * self.num_samples])


class ShardSampler(Sampler[int]):
    """Rank `rank`'s contiguous share of `range(n)`, with no padding: evaluated over all ranks,
    every sample counts exactly once (a DistributedSampler would count some twice)."""

    def __init__(self, n: int, *, num_replicas: int, rank: int):
        per = math.ceil(n / num_replicas) if n else 0
        self.begin, self.end = min(n, rank * per), min(n, (rank + 1) * per)

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.begin, self.end))

    def __len__(self) -> int:
        return self.end - self.begin
