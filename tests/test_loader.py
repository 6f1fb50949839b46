"""The training data path: Parquet rows -> decoded, augmented tensors, and the samplers."""

import bisect
import collections

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from pipeline.dataset import read_manifest
from pipeline.errors import InputError
from pipeline.loader import BlockShuffleSampler, ParquetImages, ShardSampler, train_transform
from pipeline.step import normalize
from pipeline.storage import Location


@pytest.fixture
def dataset(tiny_dataset):
    root = Location.parse(str(tiny_dataset))
    return root, read_manifest(root)


def test_reads_every_row_of_a_split_with_its_label(dataset):
    root, manifest = dataset
    train = ParquetImages(root, manifest, "train")
    assert len(train) == manifest.splits["train"].rows
    labels = collections.Counter()
    for i in range(len(train)):
        image, label = train[i]
        assert image.dtype == torch.uint8 and image.shape == (3, 32, 32)
        labels[manifest.classes[label]] += 1
    assert labels == manifest.splits["train"].counts


def test_row_groups_mix_the_classes(dataset):
    # Shards are written in hash order, so shuffling by row group still sees every class.
    root, manifest = dataset
    train = ParquetImages(root, manifest, "train")
    first_group = {train[i][1] for i in range(train.group_sizes()[0])}
    assert len(first_group) == len(manifest.classes)


def test_transforms_keep_size_and_normalize_per_batch():
    image = torch.randint(0, 256, (3, 32, 32), dtype=torch.uint8)
    for kind in ("random_resized_crop", "crop_flip", "none"):
        out = train_transform(kind, image_size=32)(image)
        assert out.shape == (3, 32, 32) and out.dtype == torch.uint8
    batch = torch.full((2, 3, 4, 4), 255, dtype=torch.uint8)
    x = normalize(batch, mean=(0.5, 0.5, 0.5), std=(0.25, 0.25, 0.25))
    assert torch.allclose(x, torch.full_like(x, 2.0))


@pytest.mark.parametrize("world", [1, 2, 3])
def test_block_shuffle_sampler_splits_evenly_and_covers_all(dataset, world):
    root, manifest = dataset
    train = ParquetImages(root, manifest, "train")
    shards = [
        list(BlockShuffleSampler(train, num_replicas=world, rank=r, window=2)) for r in range(world)
    ]
    assert len({len(s) for s in shards}) == 1  # DDP needs the same steps on every rank
    seen = [i for s in shards for i in s]
    assert set(seen) == set(range(len(train)))
    assert len(seen) - len(train) < world  # padding: only to a multiple of the ranks


def test_block_shuffle_sampler_reshuffles_per_epoch_and_stays_local(dataset):
    root, manifest = dataset
    train = ParquetImages(root, manifest, "train")
    sampler = BlockShuffleSampler(train, num_replicas=1, rank=0, window=2)
    sampler.set_epoch(0)
    first = list(sampler)
    sampler.set_epoch(1)
    assert list(sampler) != first
    sampler.set_epoch(0)
    assert list(sampler) == first  # same epoch, same order: resuming repeats nothing
    # Each row group is read in one stretch (within a window of groups), not all over the epoch.
    positions = collections.defaultdict(list)
    for pos, i in enumerate(first):
        positions[bisect.bisect_right(train.starts, i) - 1].append(pos)
    longest = 2 * max(train.group_sizes())
    assert all(max(p) - min(p) < longest for p in positions.values())


def test_shard_sampler_counts_every_sample_exactly_once():
    for n, world in [(119, 2), (5, 4), (3, 8), (0, 2)]:
        shards = [list(ShardSampler(n, num_replicas=world, rank=r)) for r in range(world)]
        assert sorted(i for s in shards for i in s) == list(range(n))


def test_missing_shard_and_wrong_schema_are_clear_errors(dataset, tmp_path):
    root, manifest = dataset
    gone = manifest.model_copy(deep=True)
    gone.splits["train"].files[0].path = "train/part-99999.parquet"
    with pytest.raises(InputError, match="listed in the manifest but missing"):
        ParquetImages(root, gone, "train")

    other = Location.parse(str(tmp_path))
    for f in manifest.splits["train"].files:
        (tmp_path / f.path).parent.mkdir(parents=True, exist_ok=True)
        table = pq.read_table(root.child(f.path).path).drop_columns(["source_id"])
        pq.write_table(table.cast(pa.schema([*table.schema])), tmp_path / f.path)
    with pytest.raises(InputError, match="does not have the schema"):
        ParquetImages(other, manifest, "train")
