"""The preprocessing library on an in-process Ray instance: output layout, skips, reruns."""

import io
import math
import os
import sys
from collections import Counter

import pyarrow.parquet as pq
import pytest
import ray
from helpers import CLASSES, make_image_folder
from PIL import Image

from pipeline.core.config import load_config
from pipeline.core.errors import InputError
from pipeline.core.storage import VERSION_MARKER, Location, mark_version
from pipeline.data import preprocess
from pipeline.data.config import FolderSourceConfig, HuggingFaceSourceConfig, PreprocessConfig
from pipeline.data.dataset import DATA, read_manifest
from pipeline.data.preprocess import in_flight_limit
from pipeline.data.shards import SCHEMA
from pipeline.data.sources import (
    FolderSource,
    HuggingFaceSource,
    Item,
    SyntheticSource,
    assign_split,
)

pytestmark = pytest.mark.usefixtures("ray_in_process")


def build(cfg: PreprocessConfig):
    """The preprocess run, as the job calls it."""
    return preprocess.preprocess(cfg, output=Location.parse(cfg.output))


def config(output, *overrides) -> PreprocessConfig:
    base = ["image_size=32", "shard_size=16", "row_group_size=8", "val_fraction=0.25"]
    return load_config(PreprocessConfig, overrides=[f"output={output}", *base, *overrides])


def folder_config(src, out, *overrides):
    return config(out, "source.kind=folder", f"source.folder.path={src}", *overrides)


def read_rows(root, manifest):
    """Every row of every file the manifest lists, with its split and file."""
    rows = []
    for split, info in manifest.splits.items():
        for f in info.files:
            table = pq.read_table(root / f.path)
            assert table.schema.equals(SCHEMA)
            assert table.num_rows == f.rows
            rows += [dict(r, split=split, file=f.path) for r in table.to_pylist()]
    return rows


def test_folder_to_parquet(tmp_path):
    bad = make_image_folder(tmp_path / "src", per_class=20)
    cfg = folder_config(tmp_path / "src", tmp_path / "out")
    manifest = build(cfg)
    out = tmp_path / "out"

    assert manifest.classes == sorted(CLASSES)
    assert manifest.image_size == 32 and len(manifest.mean) == 3
    assert {s.source_id: s.reason for s in manifest.skipped}.keys() == bad.keys()
    for s in manifest.skipped:
        assert bad[s.source_id] in s.reason

    rows = read_rows(out, manifest)
    assert len(rows) == 3 * 20
    assert sorted(p.name for p in out.iterdir()) == ["data", "versions"]
    assert [p.name for p in (out / "versions").iterdir()] == [f"{manifest.version}.json"]
    version = out / "data" / manifest.version
    assert [p.name for p in (out / "data").iterdir()] == [manifest.version]
    assert sorted(p.name for p in version.iterdir()) == [
        VERSION_MARKER,
        "config.yaml",
        "train",
        "val",
    ]
    for r in rows:
        assert Image.open(io.BytesIO(r["image"])).size == (32, 32)
        assert manifest.classes[r["label"]] == r["label_name"] == r["source_id"].split("/")[0]
        assert r["split"] == assign_split(Item(r["source_id"], r["label"]), 0.25)
    assert len({r["source_id"] for r in rows}) == len(rows)
    for split, info in manifest.splits.items():
        assert info.rows == sum(1 for r in rows if r["split"] == split)
        assert info.counts == dict(Counter(r["label_name"] for r in rows if r["split"] == split))
    # Several files with small row groups: a reader can fetch a few images without a whole file.
    assert len(manifest.splits["train"].files) >= 3
    for f in manifest.splits["train"].files:
        meta = pq.ParquetFile(out / f.path).metadata
        assert all(meta.row_group(i).num_rows <= 8 for i in range(meta.num_row_groups))
    assert load_config(PreprocessConfig, version / "config.yaml") == cfg


def test_rerun_skips_overwrite_replaces(tmp_path):
    make_image_folder(tmp_path / "src", per_class=10, corrupt=False)
    out = tmp_path / "out"
    first = build(folder_config(tmp_path / "src", out))
    files = sorted(out.rglob("*.parquet"))
    mtimes = [f.stat().st_mtime_ns for f in files]

    assert build(folder_config(tmp_path / "src", out)) == first  # up to date: nothing rewritten
    assert [f.stat().st_mtime_ns for f in files] == mtimes

    again = build(folder_config(tmp_path / "src", out, "overwrite=true"))
    assert again.version > first.version
    assert len(read_rows(out, again)) == 30  # replaced, not appended
    # The version it replaced stays readable for the jobs reading it, retention_hours long.
    assert read_manifest(Location.parse(str(out)), first.version) == first
    assert len(read_rows(out, first)) == 30

    # Past its retention, what the newer commit replaced goes; the newest stays.
    bigger = build(folder_config(tmp_path / "src", out, "shard_size=100", "retention_hours=0"))
    assert len(read_rows(out, bigger)) == 30
    assert len(list(out.rglob("*.parquet"))) == 2
    assert [p.name for p in (out / "data").iterdir()] == [bigger.version]
    assert [p.name for p in (out / "versions").iterdir()] == [f"{bigger.version}.json"]


def test_unreadable_manifest_says_so_and_overwrite_replaces_it(tmp_path):
    make_image_folder(tmp_path / "src", per_class=4, corrupt=False)
    out = tmp_path / "out"
    (out / "versions").mkdir(parents=True)
    (out / "versions" / "20240101T000000000000Z-0badc0de.json").write_text('{"schema_version": 1}')
    with pytest.raises(InputError, match=r"is not a manifest this code can read.*overwrite=true"):
        build(folder_config(tmp_path / "src", out))
    rebuilt = build(folder_config(tmp_path / "src", out, "overwrite=true"))
    assert read_manifest(Location.parse(str(out))) == rebuilt


def test_a_damaged_older_version_fails_no_later_run(tmp_path, caplog):
    # Two versions, the newer damaged: the run told to replace it commits a new one, and it
    # and every later run succeed; retention leaves the damaged one alone, and says so.
    make_image_folder(tmp_path / "src", per_class=4, corrupt=False)
    out = tmp_path / "out"
    build(folder_config(tmp_path / "src", out))
    damaged = build(folder_config(tmp_path / "src", out, "overwrite=true"))
    entry = out / "versions" / f"{damaged.version}.json"
    entry.write_text(entry.read_text()[:40])
    with pytest.raises(InputError, match=r"is not a manifest this code can read.*overwrite=true"):
        build(folder_config(tmp_path / "src", out))
    rebuilt = build(folder_config(tmp_path / "src", out, "overwrite=true"))
    assert f"retention skips version {damaged.version}" in caplog.text
    assert build(folder_config(tmp_path / "src", out)) == rebuilt  # up to date
    assert read_manifest(Location.parse(str(out))) == rebuilt
    assert entry.exists() and (out / "data" / damaged.version).is_dir()


def test_failed_run_keeps_previous_dataset(tmp_path):
    make_image_folder(tmp_path / "src", per_class=5, corrupt=False)
    out = tmp_path / "out"
    good = build(folder_config(tmp_path / "src", out))
    # Now every image of one class is broken: the run must fail and leave `out` as it was.
    for f in (tmp_path / "src" / CLASSES[2]).iterdir():
        f.write_bytes(b"garbage")
    with pytest.raises(InputError, match=rf"no usable images: \['{CLASSES[2]}'\]"):
        build(folder_config(tmp_path / "src", out, "overwrite=true"))
    assert read_manifest(Location.parse(str(out))) == good
    assert len(read_rows(out, good)) == 15
    assert [p.name for p in (out / "data").iterdir()] == [good.version]


def test_refuses_to_replace_foreign_directory(tmp_path):
    make_image_folder(tmp_path / "src", per_class=4, corrupt=False)
    out = tmp_path / "out"
    (out / "train" / "cats").mkdir(parents=True)  # the user's own images, laid out like ours
    (out / "train" / "cats" / "1.jpg").write_bytes(b"precious")
    with pytest.raises(InputError, match=r"holds files this bundle did not write \(train\)"):
        build(folder_config(tmp_path / "src", out))
    assert (out / "train" / "cats" / "1.jpg").read_bytes() == b"precious"

    # Folders below data/ are the user's unless they carry the bundle's marker, whatever their
    # names: a name that sorts like a version proves nothing.
    theirs = ["01_raw", "2024-photos", ".cache", "Photos", "20240101T000000000000Z-0badc0de"]
    for name in theirs:
        (out / "data" / name).mkdir(parents=True)
        (out / "data" / name / "x.jpg").write_bytes(b"precious")
    with pytest.raises(InputError, match=r"did not write \(data/.cache, data/01_raw, data/2"):
        build(folder_config(tmp_path / "src", out))

    # Leftovers of a first job that crashed before its commit are ours: no need to force.
    out2 = Location.parse(str(tmp_path / "out2"))
    mark_version(out2.child(DATA, "20240101T000000000000Z-0badc0de"))
    assert build(folder_config(tmp_path / "src", out2.path)).splits["train"].rows > 0

    # Asked for explicitly: the dataset is written beside what the directory holds, and even
    # with no retention, nothing the bundle did not write is removed.
    (out / "notes.txt").write_text("keep me")
    for _ in range(2):
        build(folder_config(tmp_path / "src", out, "overwrite=true", "retention_hours=0"))
    assert (out / "train" / "cats" / "1.jpg").read_bytes() == b"precious"
    assert (out / "notes.txt").read_text() == "keep me"
    for name in theirs:
        assert (out / "data" / name / "x.jpg").read_bytes() == b"precious"
    assert len(list((out / "versions").iterdir())) == 1


def test_zero_usable_images_fails(tmp_path):
    for c in CLASSES:
        (tmp_path / "src" / c).mkdir(parents=True)
        (tmp_path / "src" / c / "a.jpg").write_bytes(b"")
    with pytest.raises(InputError, match="no usable images: all 3 inputs were skipped"):
        build(folder_config(tmp_path / "src", tmp_path / "out"))
    assert not (tmp_path / "out" / "versions").exists()


def test_in_flight_limit_shows_autoscaler_the_whole_job():
    folder = FolderSource(FolderSourceConfig(path="/data"))
    hf = HuggingFaceSource(HuggingFaceSourceConfig())
    assert in_flight_limit(folder, cpus=0) == math.inf  # e.g. a head with CPU 0, no workers yet
    assert in_flight_limit(hf, cpus=0) == 4
    assert in_flight_limit(hf, cpus=16) == 32  # grows with the cluster


class CrashOnceSource:
    """Generated images, but the first read anywhere kills its worker process, as a lost node
    would. A marker file (same machine) makes it happen once."""

    reads_on_driver = False

    def __init__(self, inner, marker):
        self.inner, self.marker, self.classes = inner, str(marker), inner.classes

    def list_items(self):
        return self.inner.list_items()

    def reader(self, items):
        return self

    def read(self, item):
        if not os.path.exists(self.marker):
            open(self.marker, "w").close()
            os._exit(1)
        return self.inner.read(item)


def test_worker_death_is_retried_without_duplicates(tmp_path, monkeypatch):
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers can't import tests
    cfg = config(
        tmp_path / "out",
        "source.kind=synthetic",
        "source.synthetic.num_classes=2",
        "source.synthetic.images_per_class=40",
    )
    inner = SyntheticSource(cfg.source.synthetic)
    monkeypatch.setattr(
        preprocess, "build_source", lambda _: CrashOnceSource(inner, tmp_path / "x")
    )
    m = build(cfg)
    assert (tmp_path / "x").exists()  # it did crash
    rows = read_rows(tmp_path / "out", m)
    assert sorted(r["source_id"] for r in rows) == sorted(i.source_id for i in inner.list_items())


def test_synthetic_source(tmp_path):
    m = build(
        config(
            tmp_path / "out",
            "source.kind=synthetic",
            "source.synthetic.num_classes=4",
            "source.synthetic.images_per_class=12",
            "image_format=png",
        )
    )
    assert m.classes == ["red_circle", "red_square", "red_triangle", "green_circle"]
    assert sum(s.rows for s in m.splits.values()) == 48 and not m.skipped
    assert read_rows(tmp_path / "out", m)[0]["image"].startswith(b"\x89PNG")


def test_huggingface_source_keeps_its_splits(tmp_path, hf_dataset):
    m = build(
        config(
            tmp_path / "out",
            "source.kind=huggingface",
            f"source.huggingface.dataset={hf_dataset}",
            "source.huggingface.classes=[steak, pizza]",
        )
    )
    assert m.classes == ["steak", "pizza"]
    assert m.splits["train"].counts == {"steak": 10, "pizza": 10}
    assert m.splits["val"].counts == {"steak": 4, "pizza": 4}
    rows = read_rows(tmp_path / "out", m)
    assert {r["source_id"].split("/")[0] for r in rows if r["split"] == "val"} == {"validation"}
