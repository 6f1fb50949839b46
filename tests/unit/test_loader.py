"""The training data path: Parquet rows -> decoded, augmented batches, split over ranks and
DataLoader processes, each row read about once per epoch."""

import collections
import math
import multiprocessing
import os
import random
import shutil
import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest
import torch
from corpus import (
    damage_footer,
    damage_page_header,
    damage_stored_image,
    damaged,
    resized_header,
    rewrite_shard,
)
from helpers import checkpoint_meta, small_run_config
from numbered import (
    CLASSES,
    GROUP_ROWS,
    SIZE,
    damaged_copy,
    numbered_dataset,
)
from torchvision.transforms import v2

from harness.baseline import PillowDecoded, torchvisions_crop
from harness.counting import ByteCounter, FlakyHandler
from harness.images import VARIANTS, exif, rgb, save
from pipeline.core import storage
from pipeline.core.errors import InputError, failure
from pipeline.core.storage import Location
from pipeline.data.dataset import read_manifest
from pipeline.data.images import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    BadImageError,
    JpegHeader,
    decode_image,
    jpeg_header,
)
from pipeline.model.device import DevicePolicy, normalize
from pipeline.train.augment import train_transform
from pipeline.train.epoch import train_one_epoch
from pipeline.train.input import decoding
from pipeline.train.input.decoding import Decoded, decode
from pipeline.train.input.loaders import train_data
from pipeline.train.input.ring import BatchRing, Reused, RingLoader
from pipeline.train.input.rows import RowGroupStream, StreamSpec
from pipeline.train.optim import build_optimizer
from pipeline.train.preflight import with_partitions


@pytest.fixture
def dataset(tiny_dataset):
    root = Location.parse(str(tiny_dataset))
    return root, read_manifest(root)


@pytest.fixture(scope="module")
def numbered(tmp_path_factory):
    """(root, manifest, {split: all row ids}) of a dataset whose images carry their row id."""
    return numbered_dataset(tmp_path_factory.mktemp("numbered"))


def row_ids(images: torch.Tensor) -> list[int]:
    """(B, 3, S, S) uint8 of the numbered dataset -> the row id of each image."""
    return (images[:, 0, 0, 0].long() + 256 * images[:, 1, 0, 0].long()).tolist()


def flat(batches: list[list[int]]) -> list[int]:
    return [i for b in batches for i in b]


def group_of(row_id: int) -> tuple[int, int]:
    return row_id // 100, row_id % 100 // GROUP_ROWS


def decoded(root, manifest, split, *, transform=None, **spec) -> Decoded:
    """`split`'s rows read as `spec` says (StreamSpec), decoded as the CPU path decodes them."""
    return Decoded(RowGroupStream(root, manifest, split, StreamSpec(**spec)), transform)


def epoch_batches(stream: Decoded, workers: int) -> list[list[int]]:
    """One epoch of the stream through the training loader: the row ids of each batch, in order."""
    loader = RingLoader(stream, processes=workers)
    batches = []
    for images, labels in loader:
        assert images.dtype == torch.uint8 and images.shape[1:] == (3, SIZE, SIZE)
        assert labels.dtype == torch.int64
        ids = row_ids(images)
        assert labels.tolist() == [i % len(CLASSES) for i in ids]  # each image with its label
        batches.append(ids)
    assert len(batches) == len(loader) == len(stream)
    return batches


def streams(root, manifest, split, world, **kwargs) -> list[Decoded]:
    return [decoded(root, manifest, split, rank=r, world=world, **kwargs) for r in range(world)]


# --- the numbered dataset: which rows, where, in which order ----------------------------------


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_train_ranks_get_every_row_once_in_full_batches(numbered, world, workers):
    root, manifest, ids = numbered
    ranks = [
        epoch_batches(s, workers)
        for s in streams(root, manifest, "train", world, batch_size=16, shuffle=True)
    ]
    n = len(ids["train"])
    steps = math.ceil(n / (16 * world))
    # DDP needs the same steps on every rank; BatchNorm, no batch of a few images.
    assert [len(r) for r in ranks] == [steps] * world
    assert all(len(b) == 16 for r in ranks for b in r)
    served = collections.Counter(i for r in ranks for i in flat(r))
    assert sorted(served) == sorted(ids["train"])
    # The last step is filled with rows trained already (the sequence's last ones).
    assert sum(c - 1 for c in served.values()) == steps * 16 * world - n


@pytest.mark.parametrize("workers", [0, 2])
def test_train_order_changes_per_epoch_and_repeats_for_the_same_epoch(numbered, workers):
    root, manifest, _ = numbered
    stream = decoded(root, manifest, "train", batch_size=16, shuffle=True, seed=3)
    stream.rows.set_epoch(0)
    first = epoch_batches(stream, workers)
    stream.rows.set_epoch(1)
    second = epoch_batches(stream, workers)
    assert second != first and set(flat(second)) == set(flat(first))
    stream.rows.set_epoch(0)
    assert epoch_batches(stream, workers) == first  # same epoch, same order: a resume repeats it
    other_seed = decoded(root, manifest, "train", batch_size=16, shuffle=True, seed=4)
    assert epoch_batches(other_seed, workers) != first


def test_train_batches_mix_row_groups(numbered):
    root, manifest, _ = numbered
    stream = decoded(root, manifest, "train", batch_size=16, shuffle=True)
    batches = epoch_batches(stream, 0)
    # A batch draws from each partition's buffer of row groups, not one group after another.
    assert len({group_of(i) for i in batches[0]}) >= 3
    assert min(len({group_of(i) for i in b}) for b in batches[:-1]) >= 2


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_val_counts_every_row_exactly_once_over_the_ranks(numbered, world, workers):
    root, manifest, ids = numbered
    ranks = [
        flat(epoch_batches(s, workers))
        for s in streams(root, manifest, "val", world, batch_size=16)
    ]
    assert sorted(i for r in ranks for i in r) == ids["val"]
    if workers == 0:  # one process per rank: contiguous shares in manifest order
        assert [i for r in ranks for i in r] == ids["val"]


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_an_epoch_reads_about_the_split_once(numbered, tmp_path, world, workers):
    # All ranks and DataLoader processes together read each row group about once: only groups
    # that two readers' partitions share, and the padding's, are read twice.
    root, manifest, _ = numbered
    counter = ByteCounter(pafs.LocalFileSystem(), tmp_path / "reads")
    counted = counter.location(root)
    ranks = streams(counted, manifest, "train", world, batch_size=16, shuffle=True)
    before = counter.total()
    for s in ranks:
        epoch_batches(s, workers)
    split_bytes = sum(
        os.path.getsize(root.child(f.path).path) for f in manifest.splits["train"].files
    )
    ratio = (counter.total() - before) / split_bytes
    assert 0.8 < ratio <= 1.1, ratio


@pytest.mark.parametrize("workers", [0, 2])
def test_a_failed_read_raises_in_the_consumer(numbered, tmp_path, workers):
    root, manifest, _ = numbered
    copy = Location.parse(str(tmp_path / "copy"))
    shutil.copytree(root.path, copy.path)
    stream = decoded(copy, manifest, "train", batch_size=16, shuffle=True)
    os.remove(copy.child(manifest.splits["train"].files[5].path).path)
    loader = RingLoader(stream, processes=workers)
    with pytest.raises(
        InputError, match=r"part-00005\.parquet is listed in the manifest but missing"
    ):
        list(loader)


def loader_error(stream: Decoded, workers: int) -> str:
    """The InputError an epoch through the training loader ends in: the job's exit code 1."""
    with pytest.raises(InputError) as raised:  # at once: no retry reads other bytes
        list(RingLoader(stream, processes=workers))
    assert failure(raised.value) == (1, str(raised.value))
    return str(raised.value)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_row_damaged_in_storage_is_one_error_naming_its_row_group(numbered, tmp_path, workers):
    manifest = numbered[1]
    copy, path = damaged_copy(
        numbered, tmp_path, "val", 1, lambda shard: damage_stored_image(shard, 2, 3)
    )
    # Its page's checksum finds it.
    assert loader_error(decoded(copy, manifest, "val", batch_size=16), workers) == (
        f"dataset {copy.uri} is damaged: row group 2 of {copy.uri}/{path}: it does not read as "
        "Parquet (could not verify page integrity, CRC checksum verification failed for "
        "page_ordinal 0); re-run preprocessing with overwrite=true"
    )


@pytest.mark.parametrize("workers", [0, 2])
def test_a_shard_written_without_checksums_reads_and_names_a_damaged_row(
    numbered, tmp_path, workers
):
    # Shards preprocessed before they carried page checksums: read as ever, and an image
    # damaged in one is named by its row, which fails to decode.
    root, manifest, ids = numbered
    copy = Location.parse(str(tmp_path / "copy"))
    shutil.copytree(root.path, copy.path)
    for f in manifest.splits["val"].files:
        rewrite_shard(Path(copy.child(f.path).path), page_checksums=False)
    (stream,) = streams(copy, manifest, "val", 1, batch_size=16)
    assert sorted(flat(epoch_batches(stream, workers))) == ids["val"]
    path = manifest.splits["val"].files[1].path
    damage_stored_image(Path(copy.child(path).path), 2, 3)
    assert loader_error(decoded(copy, manifest, "val", batch_size=16), workers) == (
        f"dataset {copy.uri} is damaged: row 3 of row group 2 of {copy.uri}/{path}: not an image "
        "(unrecognised format): the formats read are JPEG, PNG, GIF, WEBP, TIFF, BMP, QOI, PPM, "
        "AVIF; re-run preprocessing with overwrite=true"
    )


def test_a_footer_damaged_in_place_is_one_error_naming_the_shard(numbered, tmp_path):
    # Its size unchanged: the driver's check passes, and the worker's stream reads it.
    copy, path = damaged_copy(numbered, tmp_path, "train", 3, damage_footer)
    with pytest.raises(InputError) as raised:
        decoded(copy, numbered[1], "train", batch_size=16)
    error = str(raised.value)
    assert failure(raised.value) == (1, error)
    assert error.startswith(
        f"dataset {copy.uri} is damaged: {copy.uri}/{path}: its footer does not read as Parquet "
        "(Couldn't deserialize thrift"
    ), error
    assert error.endswith("; re-run preprocessing with overwrite=true")


@pytest.mark.parametrize("workers", [0, 2])
def test_a_label_that_is_no_class_is_one_error_naming_its_row(numbered, tmp_path, workers):
    # Written so (a bug, or another dataset's shard): the loss would fail on it, or a CUDA
    # device assert; a valid class it is not.
    copy, path = damaged_copy(
        numbered,
        tmp_path,
        "train",
        2,
        lambda shard: rewrite_shard(shard, page_checksums=True, label=(45, 253)),
    )
    stream = decoded(copy, numbered[1], "train", batch_size=16, shuffle=True)
    assert loader_error(stream, workers) == (
        f"dataset {copy.uri} is damaged: row 5 of row group 4 of {copy.uri}/{path}: label 253, "
        f"but the dataset has {len(CLASSES)} classes; re-run preprocessing with overwrite=true"
    )


@pytest.mark.parametrize("workers", [0, 2])
def test_a_row_group_damaged_in_storage_is_one_error_naming_it(numbered, tmp_path, workers):
    copy, path = damaged_copy(
        numbered, tmp_path, "val", 0, lambda shard: damage_page_header(shard, 4)
    )
    assert loader_error(decoded(copy, numbered[1], "val", batch_size=16), workers) == (
        f"dataset {copy.uri} is damaged: row group 4 of {copy.uri}/{path}: it does not read as "
        "Parquet (Couldn't deserialize thrift: TProtocolException: Invalid data); re-run "
        "preprocessing with overwrite=true"
    )


@pytest.mark.parametrize("workers", [0, 2])
def test_storage_errors_that_pass_cost_no_row(numbered, tmp_path, workers, monkeypatch):
    monkeypatch.setattr(storage, "FIRST_WAIT_S", 0.01)
    root, manifest, ids = numbered
    dropped = OSError("AWS Error NETWORK_CONNECTION during GetObject operation: curlCode: 28")
    # In each process (this one reads the footers): every third open fails.
    handler = FlakyHandler(
        pafs.LocalFileSystem(), tmp_path / "r", error=dropped, failures=0, every=3
    )
    flaky = Location(pafs.PyFileSystem(handler), root.path, root.uri)
    (stream,) = streams(flaky, manifest, "val", 1, batch_size=16)
    assert sorted(flat(epoch_batches(stream, workers))) == sorted(ids["val"])


def test_a_consumer_that_stops_early_leaves_no_thread_behind(numbered):
    root, manifest, _ = numbered
    stream = decoded(root, manifest, "train", batch_size=4, prefetch_groups=1)
    batches = iter(stream)
    next(batches)
    batches.close()  # as a DataLoader process does when the loop breaks
    for t in threading.enumerate():
        if t.name == "row-group-prefetch":
            t.join(timeout=5)
            assert not t.is_alive()


@pytest.mark.parametrize("processes", [2, 3])
def test_the_ring_hands_a_slow_consumer_every_batch_intact(numbered, processes):
    # 61 batches, each joined of a part from every process, which run ahead as far as their
    # slots let them.
    root, manifest, _ = numbered
    stream = decoded(root, manifest, "train", batch_size=16, shuffle=True)
    expected = [row_ids(images) for images, _ in RingLoader(stream, processes=0)]
    assert len(expected) == 61
    got = []
    for images, labels in RingLoader(stream, processes=processes):
        time.sleep(0.02)  # the processes run ahead, as far as their slots let them
        got.append(row_ids(images))
        assert labels.tolist() == [i % len(CLASSES) for i in got[-1]]
    assert got == expected


def test_a_batch_is_copied_out_into_memory_that_no_tensor_holds():
    reused = Reused()
    first = reused.empty((2, 3))
    at = first.data_ptr()
    second = reused.empty((2, 3))
    assert second.data_ptr() != at  # the first batch is held
    view = first[1:].float()[0]  # a tensor computed from it holds nothing of it...
    kept = first.permute(1, 0)[1:]  # ...a view of it does
    del first
    assert reused.empty((2, 3)).data_ptr() not in (at, second.data_ptr())
    del kept
    assert reused.empty((1, 3)).data_ptr() == at and view.shape == (3,)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_ring_hands_pinned_batches_to_a_gpu_worker(numbered):
    root, manifest, _ = numbered
    stream = decoded(root, manifest, "train", batch_size=16, shuffle=True)
    plain = RingLoader(stream, processes=0)
    for (images, labels), (expected, _) in zip(
        RingLoader(stream, processes=2, pin_memory=True), plain, strict=True
    ):
        assert images.is_pinned() and labels.is_pinned()
        assert torch.equal(images, expected)


def test_a_process_waits_for_a_free_slot_of_its_ring():
    ring = BatchRing(1, batch=2, size=4, slots=3)
    ring.attach(0)  # this process plays the DataLoader's
    handed, claimed = [], threading.Semaphore(0)

    def fill(batches: int) -> None:
        for b in range(batches):
            slot, out = ring.claim(2)
            out.fill_(b)
            handed.append(ring.handed(slot, [b, b]))
            claimed.release()

    thread = threading.Thread(target=fill, args=(4,), daemon=True)
    thread.start()
    for _ in range(3):
        assert claimed.acquire(timeout=30)
    assert not claimed.acquire(timeout=1)  # all 3 slots hold batches not taken yet
    images, labels = handed[0].take()
    assert images.eq(0).all() and labels.tolist() == [0, 0]
    assert claimed.acquire(timeout=30)  # the slot taken first holds the 4th batch
    assert handed[3].slot == handed[0].slot and handed[1].take()[0].eq(1).all()
    thread = threading.Thread(target=fill, args=(3,), daemon=True)
    thread.start()
    assert claimed.acquire(timeout=30) and not claimed.acquire(timeout=1)
    ring.release_all()  # the consumer is gone: nothing waits for it
    thread.join(timeout=30)
    assert not thread.is_alive()


def test_a_consumer_that_stops_the_ring_early_leaves_no_process_waiting(numbered):
    root, manifest, _ = numbered
    stream = decoded(root, manifest, "train", batch_size=8, shuffle=True)
    loader = RingLoader(stream, processes=2)
    batches = iter(loader)
    next(batches)
    time.sleep(1)  # each process has filled its slots and waits for a free one
    processes = multiprocessing.active_children()
    assert len(processes) == 2
    batches.close()
    for process in processes:
        process.join(timeout=30)
        assert process.exitcode == 0  # ended, not terminated by the DataLoader's shutdown
    # The next epoch's processes write into the same memory, which nothing else writes to now.
    assert loader.spare is not None
    stream.rows.set_epoch(1)
    plain = RingLoader(stream, processes=0)
    assert [row_ids(x) for x, _ in loader] == [row_ids(x) for x, _ in plain]


def test_the_same_seed_trains_the_same_weights_with_0_1_or_2_loader_processes(dataset, tmp_path):
    root, manifest = dataset
    cpu = torch.device("cpu")
    weights = []
    for processes in (0, 1, 2):
        # Each a new run, its partitions left to the default: the layout it starts with does
        # not pick its order.
        cfg = small_run_config(Path(root.path), tmp_path, f"scaling.loader_workers={processes}")
        torch.manual_seed(cfg.seed)
        model = torch.nn.Sequential(  # small, and with BatchNorm: a batch's rows all count
            torch.nn.Conv2d(3, 8, 3),
            torch.nn.BatchNorm2d(8),
            torch.nn.ReLU(),
            torch.nn.AdaptiveAvgPool2d(1),
            torch.nn.Flatten(),
            torch.nn.Linear(8, len(manifest.classes)),
        )
        optimizer, _ = build_optimizer(model, cfg)
        loader = train_data(cfg, root, manifest, rank=0, world=1, device=cpu)
        loader.set_epoch(0)
        policy = DevicePolicy(cpu, "fp32", manifest.mean, manifest.std)
        t = train_one_epoch(model, loader, optimizer, torch.nn.CrossEntropyLoss(), policy=policy)
        assert t["images"] == 8 * len(loader) >= 480
        weights.append(model.state_dict())
    for other in weights[1:]:
        assert all(torch.equal(weights[0][k], other[k]) for k in other)


# --- the tiny dataset of the other tests: real preprocessed images ----------------------------


def test_reads_every_row_of_a_split_with_its_label(dataset):
    root, manifest = dataset
    labels = collections.Counter()
    for images, batch_labels in decoded(root, manifest, "train", batch_size=64):
        assert images.dtype == torch.uint8 and images.shape[1:] == (3, 32, 32)
        labels.update(manifest.classes[label] for label in batch_labels.tolist())
    assert labels == manifest.splits["train"].counts


def test_row_groups_mix_the_classes(dataset):
    # Shards are written in hash order, so shuffling by row group still sees every class.
    root, manifest = dataset
    stream = decoded(root, manifest, "train", batch_size=25)  # row groups of 25
    _, first_group = next(iter(stream))
    assert len(set(first_group.tolist())) == len(manifest.classes)


def test_transforms_keep_size_and_normalize_per_batch():
    image = torch.randint(0, 256, (3, 32, 32), dtype=torch.uint8)
    for kind in ("random_resized_crop", "crop_flip", "none"):
        out = train_transform(kind, image_size=32)(image)
        assert out.shape == (3, 32, 32) and out.dtype == torch.uint8
    for policy in ("trivial_augment_wide", "rand_augment"):
        transform = train_transform("none", image_size=32, auto_augment=policy)
        outs = [transform(image) for _ in range(8)]
        assert all(o.shape == (3, 32, 32) and o.dtype == torch.uint8 for o in outs)
        assert any(not torch.equal(o, image) for o in outs)
    batch = torch.full((2, 3, 4, 4), 255, dtype=torch.uint8)
    x = normalize(batch, mean=(0.5, 0.5, 0.5), std=(0.25, 0.25, 0.25))
    assert torch.allclose(x, torch.full_like(x, 2.0))


def test_missing_shard_and_wrong_schema_are_clear_errors(dataset, tmp_path):
    root, manifest = dataset
    gone = manifest.model_copy(deep=True)
    gone.splits["train"].files[0].path = "train/part-99999.parquet"
    with pytest.raises(InputError, match="listed in the manifest but missing"):
        decoded(root, gone, "train", batch_size=8)

    other = Location.parse(str(tmp_path))
    for f in manifest.splits["train"].files:
        (tmp_path / f.path).parent.mkdir(parents=True, exist_ok=True)
        table = pq.read_table(root.child(f.path).path).drop_columns(["source_id"])
        pq.write_table(table.cast(pa.schema([*table.schema])), tmp_path / f.path)
    with pytest.raises(InputError, match="does not have the schema"):
        decoded(other, manifest, "train", batch_size=8)


# --- decoding: decode_image's pixels, faster --------------------------------------------------

# XMP that says to turn the image: Pillow reads an orientation from it as from EXIF.
XMP_TURNED = (
    b'<x:xmpmeta xmlns:x="adobe:ns:meta/"><rdf:RDF '
    b'xmlns:rdf="http://www.w3.org/1999/02/22-rdf-syntax-ns#"><rdf:Description '
    b'xmlns:tiff="http://ns.adobe.com/tiff/1.0/" tiff:Orientation="6"/></rdf:RDF></x:xmpmeta>'
)


def square_files(side: int) -> dict[str, bytes]:
    """Every variant decode_image reads at `side` x `side`, whole, damaged and with a header
    over the pixel limit; and JPEGs that Pillow turns by their EXIF or XMP."""
    rng = random.Random(0)
    files = {"jpeg-exif-3": save(rgb(side, side), "JPEG", exif=exif(3))}
    files["jpeg-xmp-turned"] = save(rgb(side, side), "JPEG", xmp=XMP_TURNED)
    files["jpeg-restarts"] = save(rgb(side, side), "JPEG", restart_marker_blocks=1)
    for name, make in VARIANTS.items():
        data = files[name] = make(side, side)
        files.update({f"{name}/{how}": d for how, d in damaged(data, rng).items()})
        files[f"{name}/says-20000x20000"] = resized_header(data, 20_000, 20_000)
    return files


def pixels_or_error(fn, data: bytes):
    try:
        return fn(data)
    except BadImageError as e:
        return f"BadImageError: {e}"


@pytest.mark.filterwarnings("ignore::UserWarning")  # PIL's own, on the damaged EXIF
def test_the_loaders_decode_gives_decode_images_pixels_or_its_error(monkeypatch):
    side, calls = 24, []
    decode_jpeg = decoding.decode_jpeg
    monkeypatch.setattr(
        decoding, "decode_jpeg", lambda *a, **k: calls.append(1) or decode_jpeg(*a, **k)
    )
    files, fast = square_files(side), set()
    for name, data in files.items():
        before = len(calls)
        ours = pixels_or_error(lambda d: decode(d, side), data)
        if len(calls) > before:
            fast.add(name)
        theirs = pixels_or_error(lambda d: v2.functional.pil_to_tensor(decode_image(d)), data)
        if isinstance(theirs, str):
            assert ours == theirs, name
        else:
            assert isinstance(ours, torch.Tensor) and torch.equal(ours, theirs), name
    # decode_jpeg decoded what preprocessing writes, damaged copies of it too...
    assert {"jpeg", "jpeg-progressive-444", "jpeg-restarts"} <= fast
    assert len([n for n in fast if n.startswith("jpeg/")]) > 5
    # ...and nothing Pillow turns, converts, or refuses from the header.
    turned = {"jpeg-exif-3", "jpeg-xmp-turned", "jpeg-exif-turned", "jpeg-grey", "jpeg-cmyk"}
    assert not fast & turned and not [n for n in fast if "says-20000x20000" in n]
    # Pillow turns by an XMP orientation as by EXIF's: decode_jpeg alone would not have.
    xmp = files["jpeg-xmp-turned"]
    assert not torch.equal(
        decode(xmp, side),
        decode_jpeg(torch.frombuffer(bytearray(xmp), dtype=torch.uint8), mode="RGB"),
    )


def test_jpeg_header_reads_the_frame_without_decoding():
    img = rgb(40, 30)
    assert jpeg_header(save(img, "JPEG")) == JpegHeader(40, 30, 3, 8, plain=True)
    progressive = save(img, "JPEG", progressive=True, exif=exif(6))
    assert jpeg_header(progressive) == JpegHeader(40, 30, 3, 8, plain=False)
    assert jpeg_header(save(img.convert("L"), "JPEG")) == JpegHeader(40, 30, 1, 8, plain=True)
    data = save(img, "JPEG")
    assert jpeg_header(data[: data.find(b"\xff\xda")]) is None  # no scan: the markers ran out
    assert jpeg_header(save(img, "PNG")) is None
    assert jpeg_header(b"") is None


@pytest.mark.parametrize("workers", [0, 2])
def test_batches_are_the_previous_paths_pixel_for_pixel_in_channels_last(dataset, workers):
    root, manifest = dataset
    assert manifest.image_format == "jpeg"
    kwargs, size = dict(batch_size=16, shuffle=True, seed=3), manifest.image_size
    rows = RowGroupStream(root, manifest, "train", StreamSpec(**kwargs))
    ours = Decoded(rows, train_transform("random_resized_crop", image_size=size))
    theirs = PillowDecoded(rows, torchvisions_crop(size))
    ours = list(RingLoader(ours, processes=workers))
    theirs = list(RingLoader(theirs, processes=workers))
    assert len(ours) == len(theirs) > 3
    for (x, y), (px, py) in zip(ours, theirs, strict=True):
        assert torch.equal(x, px) and torch.equal(y, py)
        assert x.is_contiguous(memory_format=torch.channels_last)
    # Off the GPU, the network takes them contiguous, as before.
    policy = DevicePolicy(torch.device("cpu"), "fp32", IMAGENET_MEAN, IMAGENET_STD)
    x = policy.inputs(ours[0][0])
    assert x.is_contiguous()
    assert torch.equal(x, normalize(theirs[0][0], mean=IMAGENET_MEAN, std=IMAGENET_STD))


def test_the_random_resized_crop_draws_and_crops_as_torchvisions_crop():
    channels_last = decode(save(rgb(48, 48), "JPEG"), 48)
    assert channels_last.permute(1, 2, 0).is_contiguous()
    ours = train_transform("random_resized_crop", image_size=32)
    for image in (channels_last, channels_last.contiguous(), channels_last[None]):
        for seed in range(20):
            torch.manual_seed(seed)
            out = ours(image)
            after = torch.rand(1)  # the draws after it: as many were taken
            torch.manual_seed(seed)
            assert torch.equal(out, torchvisions_crop(32)(image))
            assert torch.equal(after, torch.rand(1))
            if image is channels_last:
                assert out.permute(1, 2, 0).is_contiguous()  # stacked with plain copies


# --- augmentation and Ray Data's block order: different per rank, process and epoch ----------


def tagged(image: torch.Tensor) -> torch.Tensor:
    """Stands in for an augmentation: the image, with the number it draws in its blue corner."""
    out = image.clone()
    out[2, 0, 0] = int(torch.randint(0, 256, ()))
    return out


# (workers, DataLoader processes each): layouts of the same run, global batch 24, 6 partitions.
LAYOUTS = [(1, 0), (1, 2), (2, 0), (2, 1), (2, 3), (3, 2), (3, 3)]


def global_steps(numbered, layout, *, epoch=1, start=0, partitions=6) -> list[list[tuple]]:
    """Epoch `epoch` of a run at global batch 24 in `layout`, from step `start`: each global
    step's (row id, augmentation draw) pairs, the ranks' batches end to end."""
    root, manifest, _ = numbered
    workers, processes = layout
    ranks = []
    for stream in streams(
        root,
        manifest,
        "train",
        workers,
        batch_size=24 // workers,
        shuffle=True,
        transform=tagged,
        partitions=partitions,
    ):
        stream.rows.set_epoch(epoch, start)
        torch.manual_seed(0)  # as every rank does, for the model's initial weights
        loader = RingLoader(stream, processes=processes)
        ranks.append(
            [list(zip(row_ids(x), x[:, 2, 0, 0].tolist(), strict=True)) for x, _ in loader]
        )
    assert len({len(r) for r in ranks}) == 1  # DDP steps in lockstep
    return [[row for rank in step for row in rank] for step in zip(*ranks, strict=True)]


def test_a_global_step_trains_the_same_rows_with_the_same_draws_whatever_the_layout(numbered):
    whole = global_steps(numbered, LAYOUTS[0])
    assert len(whole) == math.ceil(970 / 24)
    for layout in LAYOUTS[1:]:
        assert global_steps(numbered, layout) == whole, layout
    draws = [d for step in whole for _, d in step]
    assert len(set(draws)) > 200  # a draw per row, not one per batch or process
    # Another epoch, another order and other draws; the same epoch again, the same.
    other = global_steps(numbered, LAYOUTS[3], epoch=2)
    rows = [{r for step in epoch for r, _ in step} for epoch in (whole, other)]
    assert other != whole and rows[0] == rows[1] == set(numbered[2]["train"])
    assert global_steps(numbered, LAYOUTS[3]) == whole


@pytest.mark.parametrize(("before", "after"), [(LAYOUTS[4], LAYOUTS[0]), (LAYOUTS[2], LAYOUTS[5])])
def test_an_epoch_resumed_at_a_step_on_another_layout_yields_the_rest_of_the_uninterrupted_one(
    numbered, before, after
):
    whole = global_steps(numbered, before)
    n = len(whole)
    for start in (1, 13, n - 1, n):
        assert global_steps(numbered, after, start=start) == whole[start:], start


def test_the_partitions_order_the_epoch_and_must_split_the_global_batch(numbered):
    assert global_steps(numbered, (2, 0), partitions=3) != global_steps(numbered, (2, 0))
    root, manifest, _ = numbered
    with pytest.raises(ValueError, match="5 partitions do not split a global batch of 24"):
        spec = StreamSpec(batch_size=24, shuffle=True, partitions=5)
        RowGroupStream(root, manifest, "train", spec)


@pytest.mark.parametrize("loader_workers", [0, 2, 8])
@pytest.mark.parametrize("num_workers", ["1", "3", "[2,4]"])
def test_a_new_runs_partitions_are_its_global_batchs_whatever_its_layout(
    tmp_path, num_workers, loader_workers
):
    layout = [f"scaling.num_workers={num_workers}", f"scaling.loader_workers={loader_workers}"]
    for batch, partitions in ((48, 48), (192, 64), (96, 48), (7, 7)):
        if batch == 7 and num_workers != "1":
            continue  # 7 splits over none of the other worker counts
        cfg = small_run_config(tmp_path, tmp_path, f"global_batch_size={batch}", *layout)
        assert cfg.partitions_at_start() == partitions, batch


def test_a_resumed_run_keeps_the_partitions_it_started_with(tmp_path):
    # A run started when the default was another (4 here, of its loader processes then).
    cfg = small_run_config(tmp_path, tmp_path, "scaling.loader_workers=2")
    started = checkpoint_meta(config={**cfg.model_dump(mode="json"), "partitions": 4})
    assert with_partitions(cfg, started).partitions == 4
    assert with_partitions(cfg, None).partitions == cfg.partitions_at_start() == 8
