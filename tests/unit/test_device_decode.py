"""decode=gpu: the DataLoader processes read rows, the worker decodes and augments each batch
on its device. On a CPU device it gives exactly the CPU path's batches (same rows, draws and
pixels); on CUDA (marked gpu) the same rows and draws, pixels within nvJPEG's difference."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from corpus import damage_stored_image, rewrite_shard
from torch.utils.data import DataLoader
from torchvision.io import ImageReadMode, decode_jpeg

from pipeline.core.config import load_config
from pipeline.core.errors import ConfigError, InputError
from pipeline.core.storage import Location
from pipeline.data.dataset import VERSIONS, read_manifest
from pipeline.model.device import DevicePolicy, pick_precision
from pipeline.model.networks import build_model
from pipeline.train.augment import train_transform
from pipeline.train.config import TrainConfig
from pipeline.train.epoch import train_one_epoch
from pipeline.train.input.decoding import Decoded, augmented
from pipeline.train.input.device_decode import (
    DeviceDecoded,
    Encoded,
    EncodedBatch,
    pick_decode,
)
from pipeline.train.input.loaders import EpochLoader, train_data, val_data
from pipeline.train.input.ring import RingLoader
from pipeline.train.input.rows import RowGroupStream, StreamSpec
from pipeline.train.optim import build_optimizer
from pipeline.train.preflight import check_dataset

CPU = torch.device("cpu")


def config(dataset, *overrides) -> TrainConfig:
    args = [f"dataset={dataset}", "storage_path=/tmp/unused", "global_batch_size=32", *overrides]
    return load_config(TrainConfig, None, args)


def loaders(tiny_dataset, decode, *overrides, device=CPU, rank=1, world=2):
    """(train, val) of rank `rank` of `world`, decoded as `decode` says."""
    cfg = config(tiny_dataset, f"decode={decode}", f"scaling.num_workers={world}", *overrides)
    root = Location.parse(str(tiny_dataset))
    manifest = read_manifest(root)
    shard = {"rank": rank, "world": world, "device": device}
    return train_data(cfg, root, manifest, **shard), val_data(cfg, root, manifest, **shard)


def batches(loader) -> list[tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)  # as every rank does; the draws must not depend on it
    return [(images.cpu(), labels) for images, labels in loader]


def assert_same(a: list, b: list) -> None:
    assert len(a) == len(b) > 0
    for (images_a, labels_a), (images_b, labels_b) in zip(a, b, strict=True):
        assert images_a.dtype == images_b.dtype == torch.uint8
        assert images_a.shape == images_b.shape and images_a.shape[1:] == (3, 32, 32)
        assert torch.equal(labels_a, labels_b)
        assert torch.equal(images_a, images_b)


@pytest.mark.parametrize(
    ("augment", "auto_augment", "workers"),
    [
        ("random_resized_crop", "none", 0),
        ("random_resized_crop", "none", 2),
        ("crop_flip", "trivial_augment_wide", 0),
        ("none", "rand_augment", 0),
    ],
)
def test_on_the_cpu_the_device_path_gives_the_cpu_paths_batches(
    tiny_dataset, augment, auto_augment, workers
):
    overrides = (f"augment={augment}", f"auto_augment={auto_augment}")
    overrides += (f"scaling.loader_workers={workers}",)
    cpu_train, cpu_val = loaders(tiny_dataset, "cpu", *overrides)
    gpu_train, gpu_val = loaders(tiny_dataset, "gpu", *overrides)
    assert isinstance(gpu_train.loader, DeviceDecoded) and isinstance(gpu_val, DeviceDecoded)
    assert not isinstance(cpu_train.loader, DeviceDecoded)
    for epoch in (0, 1):
        cpu_train.set_epoch(epoch)
        gpu_train.set_epoch(epoch)
        expected = batches(cpu_train)
        # The same rows, crops, flips and policy ops, drawn from the same keys.
        assert_same(batches(gpu_train), expected)
    assert_same(batches(gpu_val), batches(cpu_val))


def test_a_stored_image_that_does_not_decode_is_named_as_the_cpu_path_names_it(
    tiny_dataset, tmp_path
):
    copy = tmp_path / "damaged"
    shutil.copytree(tiny_dataset, copy)
    root = Location.parse(str(copy))
    manifest = read_manifest(root)
    shard = Path(root.child(manifest.splits["val"].files[0].path).path)
    # Written without page checksums (as before shards carried them), so the damage reaches
    # the decoders rather than failing its page's checksum.
    rewrite_shard(shard, page_checksums=False)
    damage_stored_image(shard, 0, 5)
    errors = []
    stream = RowGroupStream(root, manifest, "val", StreamSpec(batch_size=16))
    for encoded in (True, False):
        batches = RingLoader(Encoded(stream) if encoded else Decoded(stream), processes=2)
        with pytest.raises(InputError, match=r"is damaged: row 5 of row group 0 of ") as raised:
            list(DeviceDecoded(batches, CPU, rows=stream) if encoded else batches)
        errors.append(str(raised.value))
    assert errors[0] == errors[1]


def test_the_loader_processes_only_read_rows(tiny_dataset):
    root = Location.parse(str(tiny_dataset))
    manifest = read_manifest(root)
    stream = RowGroupStream(root, manifest, "val", StreamSpec(batch_size=16))
    encoded = DataLoader(Encoded(stream), batch_size=None, num_workers=2)
    decoded = RingLoader(Decoded(stream), processes=2)
    for (batch, labels), (images, expected) in zip(encoded, decoded, strict=True):
        assert isinstance(batch, EncodedBatch) and batch.data.dtype == torch.uint8
        assert len(batch.sizes) == len(labels) and sum(batch.sizes) == len(batch.data)
        assert all(t[:2].tolist() == [0xFF, 0xD8] for t in batch.tensors())  # JPEG's SOI
        assert torch.equal(labels, expected)
        ((out, _),) = list(DeviceDecoded([(batch, labels)], CPU, rows=stream))
        assert torch.equal(out, images)


@pytest.mark.parametrize("workers", [0, 2])
def test_an_epoch_resumed_at_a_batch_yields_the_rest_of_the_uninterrupted_one(
    tiny_dataset, workers
):
    train, _ = loaders(tiny_dataset, "gpu", f"scaling.loader_workers={workers}")
    train.set_epoch(1)
    whole = batches(train)
    n = len(whole)
    assert n == len(train) > 6
    train.set_epoch(1)
    assert_same(batches(train), whole)  # the same seed: the same batches
    for start in sorted({1, n // 2, n - 1, n}):
        train.set_epoch(1, start)
        rest = batches(train)
        if start < n:
            assert_same(rest, whole[start:])
        else:
            assert rest == []
    train.set_epoch(2)
    assert not torch.equal(batches(train)[0][0], whole[0][0])  # a new epoch, new draws


def test_auto_decodes_on_a_cuda_device_with_jpeg_images():
    cuda = torch.device("cuda", 0)
    assert pick_decode("auto", cuda, "jpeg") == "gpu"
    assert pick_decode("auto", cuda, "png") == "cpu"
    assert pick_decode("auto", CPU, "jpeg") == "cpu"
    assert pick_decode("gpu", CPU, "jpeg") == "gpu"  # asked for: the device's own decode
    assert pick_decode("cpu", cuda, "jpeg") == "cpu"


def test_decode_gpu_is_refused_with_ray_data_and_png_datasets(tiny_dataset, tmp_path):
    with pytest.raises(ConfigError, match="decode=gpu needs ingest=torch"):
        config(tiny_dataset, "decode=gpu", "ingest=ray_data")
    assert config(tiny_dataset, "decode=auto", "ingest=ray_data").decode == "auto"
    png = tmp_path / "png"
    shutil.copytree(tiny_dataset, png)
    for path in (png / VERSIONS).glob("*.json"):
        path.write_text(json.dumps(json.loads(path.read_text()) | {"image_format": "png"}))
    root = Location.parse(str(png))
    version = read_manifest(root).version
    with pytest.raises(ConfigError, match=r"decode=gpu decodes JPEG images only, and dataset"):
        check_dataset(config(png, "decode=gpu"), root, version)
    for decode in ("auto", "cpu"):
        assert check_dataset(config(png, f"decode={decode}"), root, version).image_format == "png"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(
    ("augment", "auto_augment"),
    [("random_resized_crop", "none"), ("crop_flip", "trivial_augment_wide"), ("none", "none")],
)
def test_on_cuda_each_batch_is_decoded_and_augmented_there_with_the_cpu_paths_draws(
    tiny_dataset, augment, auto_augment
):
    cuda = torch.device("cuda", torch.cuda.current_device())
    root = Location.parse(str(tiny_dataset))
    manifest = read_manifest(root)
    transform = train_transform(augment, image_size=32, auto_augment=auto_augment)
    stream = RowGroupStream(
        root, manifest, "train", StreamSpec(batch_size=16, shuffle=True, seed=3)
    )
    decoded = DeviceDecoded(Encoded(stream), cuda, transform, rows=stream)
    for (batch, labels), (images, same_labels) in zip(Encoded(stream), decoded, strict=True):
        assert images.device == cuda and images.dtype == torch.uint8
        assert images.shape == (len(labels), 3, 32, 32) and torch.equal(labels, same_labels)
        # The CPU path's transform, with the same key's draws, on the same nvJPEG pixels: the
        # same crops, flips and ops (interpolation on the GPU rounds within a level or so;
        # another draw would move most pixels by far more).
        on_gpu = decode_jpeg(batch.tensors(), mode=ImageReadMode.RGB, device=cuda)
        expected = torch.stack(augmented(transform, [i.cpu() for i in on_gpu], batch.seeds))
        diff = (images.cpu().int() - expected.int()).abs()
        assert (diff > 2).float().mean() < 0.03, diff.float().mean()
        # nvJPEG decodes the image libjpeg-turbo does, within a few levels.
        on_cpu = torch.stack(decode_jpeg(batch.tensors(), mode=ImageReadMode.RGB))
        assert (torch.stack(on_gpu).cpu().float() - on_cpu.float()).abs().mean() < 4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_the_batches_repeat_and_a_resumed_epoch_yields_the_rest(tiny_dataset):
    cuda = torch.device("cuda", torch.cuda.current_device())
    overrides = ("auto_augment=trivial_augment_wide", "scaling.loader_workers=2")
    (cpu, _), (gpu, val) = (
        loaders(tiny_dataset, d, *overrides, device=cuda) for d in ("cpu", "gpu")
    )
    gpu.set_epoch(1)
    cpu.set_epoch(1)
    whole = batches(gpu)
    assert_same(batches(gpu), whole)  # nvJPEG and the augmentation repeat, bit for bit
    assert [labels.tolist() for _, labels in whole] == [y.tolist() for _, y in batches(cpu)]
    gpu.set_epoch(1, 3)
    assert_same(batches(gpu), whole[3:])
    images, _ = next(iter(val))
    assert images.device == cuda and images.shape[1:] == (3, 32, 32)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_the_step_loop_trains_on_batches_decoded_there(tiny_dataset):
    cuda = torch.device("cuda", torch.cuda.current_device())
    train, _ = loaders(tiny_dataset, "gpu", device=cuda, rank=0, world=1)
    assert isinstance(train, EpochLoader) and train.loader.stream is not None
    manifest = read_manifest(Location.parse(str(tiny_dataset)))
    policy = DevicePolicy(cuda, pick_precision("auto", cuda), manifest.mean, manifest.std)
    model = policy.prepare(build_model(len(manifest.classes)).to(cuda))
    optimizer, _ = build_optimizer(model, config(tiny_dataset))
    t = train_one_epoch(model, train, optimizer, torch.nn.CrossEntropyLoss(), policy=policy)
    assert t["images"] == len(train) * 32 and torch.isfinite(torch.tensor(t["loss_sum"]))
