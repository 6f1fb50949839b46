"""Raw images -> resize + center crop -> Parquet shards and a manifest, in parallel on Ray.

Ray tasks rather than Ray Data: each task owns one shard end to end (read, transform, write
exactly one file per split with row groups we size), reports what it skipped and why, and can be
retried safely because it only ever writes its own staged files. Ray Data's writer appends and
names files itself, and its image reader fails on the corrupt files we must skip and count.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from dataclasses import dataclass, field

import ray

from pipeline.core.capacity import wait_for_capacity
from pipeline.core.config import dump_config, validate_config
from pipeline.core.errors import ClusterError, InputError
from pipeline.core.storage import Location, is_transient
from pipeline.data.config import PreprocessConfig
from pipeline.data.dataset import (
    DATA,
    SPLITS,
    Manifest,
    ShardFile,
    Skipped,
    SplitInfo,
    check_replaceable,
    commit,
    read_manifest,
    remove_expired,
    start_version,
)
from pipeline.data.images import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    BadImageError,
    decode_image,
    encode_image,
    resize_center_crop,
)
from pipeline.data.shards import write_shard
from pipeline.data.sources import (
    Item,
    Reader,
    Source,
    assign_split,
    build_source,
    stable_fraction,
)

log = logging.getLogger(__name__)


@dataclass
class ShardResult:
    files: dict[str, ShardFile] = field(default_factory=dict)  # split -> staged file
    counts: dict[str, Counter] = field(default_factory=dict)  # split -> label -> rows
    skipped: list[Skipped] = field(default_factory=list)


def process_items(
    cfg: PreprocessConfig, classes: list[str], items: list[Item], reader: Reader
) -> tuple[dict[str, list[dict]], list[Skipped]]:
    """Rows per split for the items that decode; the others are skipped with a reason."""
    rows: dict[str, list[dict]] = {}
    skipped = []
    for item in items:
        data = read_source(reader, item)
        try:
            img = decode_image(data)
        except BadImageError as e:
            skipped.append(Skipped(source_id=item.source_id, reason=str(e)))
            continue
        img = resize_center_crop(img, size=cfg.image_size)
        data = encode_image(img, image_format=cfg.image_format, jpeg_quality=cfg.jpeg_quality)
        split = assign_split(item, cfg.val_fraction)
        rows.setdefault(split, []).append(
            {
                "image": data,
                "label": item.label,
                "label_name": classes[item.label],
                "source_id": item.source_id,
            }
        )
    return rows, skipped


def read_source(reader: Reader, item: Item) -> bytes:
    """The item's bytes. A storage error is not the image's fault: it fails the job (after the
    retries of pipeline.core.storage) rather than drop the image from the dataset for good."""
    try:
        return reader.read(item)
    except OSError as e:
        if is_transient(e):
            raise ClusterError(
                f"reading source image {item.source_id} kept failing ({e}): the storage may be "
                "unavailable. Submit the job again once it is"
            ) from None
        raise InputError(
            f"cannot read source image {item.source_id} ({e}): check that the job may read the "
            "source and that nothing removes files from it while the job runs"
        ) from None


def process_shard(
    cfg_dict: dict,
    classes: list[str],
    shard: int,
    items: list[Item],
    reader: Reader,
    root: Location,
    version: str,
) -> ShardResult:
    cfg = validate_config(PreprocessConfig, cfg_dict)
    rows, skipped = process_items(cfg, classes, items, reader)
    result = ShardResult(skipped=skipped)
    for split, split_rows in rows.items():
        rel = f"{DATA}/{version}/{split}/part-{shard:05d}.parquet"
        size = write_shard(root.child(rel), split_rows, row_group_size=cfg.row_group_size)
        result.files[split] = ShardFile(path=rel, rows=len(split_rows), size=size)
        result.counts[split] = Counter(r["label"] for r in split_rows)
    return result


# Retries cover lost workers and nodes; a shard rewrites only its own files, so a retry is safe.
_process_shard = ray.remote(num_cpus=1, max_retries=3)(process_shard)


def preprocess(cfg: PreprocessConfig, *, output: Location, in_process: bool = False) -> Manifest:
    """Build the dataset at `output` (Ray must be initialised); return its manifest.
    `in_process`: the shards one after another in this process, without Ray, for a dataset
    small enough to need no cluster (the tests' generated datasets)."""
    # With overwrite the newest manifest is not read: it may be the unreadable one to replace.
    existing = None if cfg.overwrite else read_manifest(output)
    if existing and existing.fingerprint == cfg.fingerprint():
        log.info(
            "%s is up to date (same config, version %s): skipping. Pass overwrite=true to rebuild.",
            *(output.uri, existing.version),
        )
        remove_expired(output, cfg.retention_hours)
        return existing
    check_replaceable(output, overwrite=cfg.overwrite)

    source = build_source(cfg.source)
    # Shards in a stable hashed order, not class by class: every row group then mixes the
    # classes, which lets training shuffle by row group (train/input/rows.py) and still see
    # them all.
    items = sorted(source.list_items(), key=lambda it: stable_fraction("order/" + it.source_id))
    classes = source.classes
    log.info("source %s: %d images in %d classes", cfg.source.kind, len(items), len(classes))

    # This job writes below data/<version>/ only; its entry in the versions log commits it.
    version = start_version(output)
    try:
        write = _write_shards_here if in_process else _write_shards
        results = write(cfg, classes, items, source, output, version)
        manifest = _build_manifest(cfg, classes, version, results, total=len(items))
    except BaseException:
        output.child(DATA, version).delete()
        raise
    manifest = commit(output, manifest, dump_config(cfg))
    remove_expired(output, cfg.retention_hours)
    return manifest


def in_flight_limit(source: Source, cpus: int) -> int | float:
    """How many shards to have submitted at once.

    Shards of ids (folders, generated data) all go at once: an autoscaling cluster sizes itself
    by pending demand, so holding them back would keep it small. Shards that carry their bytes
    stay a few ahead of the CPUs (re-checked as the cluster grows), or the object store would
    hold the whole dataset."""
    return max(4, 2 * cpus) if source.reads_on_driver else math.inf


def _shards(cfg: PreprocessConfig, items: list[Item]) -> list[list[Item]]:
    return [items[i : i + cfg.shard_size] for i in range(0, len(items), cfg.shard_size)]


def _write_shards_here(cfg, classes, items, source, root: Location, version: str):
    cfg_dict = cfg.model_dump(mode="json")
    return [
        process_shard(cfg_dict, classes, i, shard, source.reader(shard), root, version)
        for i, shard in enumerate(_shards(cfg, items))
    ]


def _write_shards(cfg, classes, items, source, root: Location, version: str) -> list[ShardResult]:
    shards = _shards(cfg, items)
    cfg_dict = cfg.model_dump(mode="json")
    log.info(
        "%d shards of up to %d images (shard_size) as Ray tasks, 1 CPU each; the cluster has "
        "%d CPUs now",
        len(shards),
        cfg.shard_size,
        int(ray.cluster_resources().get("CPU", 0)),
    )
    pending: dict[ray.ObjectRef, int] = {}
    results: list[ShardResult] = []
    done_images, skipped, started = 0, 0, time.monotonic()
    next_shard = 0
    waited_for_capacity = False
    try:
        while pending or next_shard < len(shards):
            limit = in_flight_limit(source, int(ray.cluster_resources().get("CPU", 0)))
            while next_shard < len(shards) and len(pending) < limit:
                shard_items = shards[next_shard]
                reader = source.reader(shard_items)
                ref = _process_shard.remote(
                    cfg_dict, classes, next_shard, shard_items, reader, root, version
                )
                pending[ref] = next_shard
                next_shard += 1
            if not waited_for_capacity:
                # After submitting: the pending shards are the demand an autoscaler scales for.
                wait_for_capacity(
                    {"CPU": 1},
                    cfg.capacity_timeout_s,
                    asked="each shard is a task of 1 CPU",
                    fix="add nodes with CPUs to the cluster",
                )
                waited_for_capacity = True
            [ref], _ = ray.wait(list(pending), num_returns=1)
            try:
                result = ray.get(ref)
            except ray.exceptions.RayTaskError as e:
                if isinstance(e.cause, (InputError, ClusterError)):
                    raise e.cause from None  # its message, not the task's traceback
                raise
            done_images += len(shards[pending.pop(ref)])
            skipped += len(result.skipped)
            results.append(result)
            elapsed = time.monotonic() - started
            log.info(
                "progress: %d/%d images (%.0f%%), %d skipped, %.1f images/s",
                done_images,
                len(items),
                100 * done_images / len(items),
                skipped,
                done_images / max(elapsed, 1e-9),
            )
    except BaseException:
        for ref in pending:
            ray.cancel(ref, force=True)
        raise
    return results


def _build_manifest(cfg, classes, version, results: list[ShardResult], *, total: int) -> Manifest:
    skipped = sorted((s for r in results for s in r.skipped), key=lambda s: s.source_id)
    splits = {}
    per_class: Counter = Counter()
    for split in SPLITS:
        counts: Counter = Counter()
        files = sorted((r.files[split] for r in results if split in r.files), key=lambda f: f.path)
        for r in results:
            counts.update(r.counts.get(split, {}))
        per_class.update(counts)
        splits[split] = SplitInfo(
            rows=sum(f.rows for f in files),
            counts={name: counts.get(i, 0) for i, name in enumerate(classes)},
            files=files,
        )
    if not per_class:
        reasons = Counter(s.reason.split(":")[0] for s in skipped).most_common(3)
        raise InputError(
            f"no usable images: all {total} inputs were skipped ({reasons}); check the source"
        )
    empty = [name for i, name in enumerate(classes) if per_class.get(i, 0) == 0]
    if empty:
        raise InputError(
            f"classes with no usable images: {empty}. Every class needs at least one image "
            "that decodes: fix or remove those classes"
        )
    for split, info in splits.items():
        if info.rows == 0:
            log.warning("split %r is empty (val_fraction=%s)", split, cfg.val_fraction)
    if skipped:
        log.warning("skipped %d of %d images (listed in the manifest)", len(skipped), total)
    return Manifest(
        version=version,
        created_at=Manifest.now(),
        fingerprint=cfg.fingerprint(),
        classes=classes,
        image_size=cfg.image_size,
        image_format=cfg.image_format,
        mean=IMAGENET_MEAN,
        std=IMAGENET_STD,
        splits=splits,
        skipped=skipped,
        config=cfg.model_dump(mode="json"),
    )
