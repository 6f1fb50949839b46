"""Dataset versions: commits that cannot race, retention that keeps what readers may still read
and touches only what the bundle wrote, a run's pin on the version it trains on, and inference
and export of its dataset reading that version. In one process, on local disk and on S3 (moto
on loopback), with the interleavings forced."""

from __future__ import annotations

import datetime
import logging
import os
import shutil
from pathlib import Path

import pytest
from helpers import checkpoint_meta

from pipeline.core.config import load_config
from pipeline.core.errors import ConfigError, InputError
from pipeline.core.storage import Location, is_marked, mark_version, new_version
from pipeline.data import dataset
from pipeline.data.dataset import (
    DATA,
    VERSIONS,
    Manifest,
    ShardFile,
    SplitInfo,
    commit,
    committed_versions,
    read_manifest,
    remove_expired,
)
from pipeline.data.shards import check_files, write_shard
from pipeline.export.config import ExportConfig
from pipeline.export.exporter import parity_dataset
from pipeline.model.checkpoint import save_checkpoint
from pipeline.model.runs import STEPS, checkpoint_dir_name, step_dir_name
from pipeline.model.source import trained_version
from pipeline.train.config import TrainConfig
from pipeline.train.preflight import newest_meta, pick_dataset_version

BUCKET = "versions-test"


@pytest.fixture(params=["local", "s3"])
def root(request, tmp_path):
    """A fresh dataset location: a local directory or a prefix on the session's S3 server."""
    if request.param == "local":
        yield Location.parse(str(tmp_path / "dataset"))
        return
    s3_server = request.getfixturevalue("s3_server")
    s3_server.create_bucket(BUCKET)
    with s3_server.client_env():
        yield Location.parse(f"s3://{BUCKET}/{tmp_path.name}")


def at(hours_ago: float) -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(hours=hours_ago)


def written(root: Location, version: str, *, fingerprint: str = "f", age_h: float = 0) -> Manifest:
    """A version's files, as a preprocess job leaves them before its commit; returns the
    manifest that commits them, made `age_h` hours ago."""
    mark_version(root.child(DATA, version))
    splits = {}
    for split in ("train", "val"):
        path = f"{DATA}/{version}/{split}/part-00000.parquet"
        row = {"image": b"x", "label": 0, "label_name": "a", "source_id": f"{split}/1"}
        write_shard(root.child(path), [row], row_group_size=10)
        splits[split] = SplitInfo(rows=1, counts={"a": 1}, files=[ShardFile(path=path, rows=1)])
    return Manifest(
        version=version,
        created_at=at(age_h).isoformat(timespec="microseconds"),
        fingerprint=fingerprint,
        classes=["a"],
        image_size=32,
        image_format="jpeg",
        mean=(0.5, 0.5, 0.5),
        std=(0.2, 0.2, 0.2),
        splits=splits,
        skipped=[],
        config={},
    )


def whole(root: Location, manifest: Manifest) -> bool:
    """Every file `manifest` lists is on storage."""
    return all(root.child(f.path).exists() for s in manifest.splits.values() for f in s.files)


OLDER, NEWER = "20260101T000000000000Z-aaaaaaaa", "20260101T000001000000Z-bbbbbbbb"


def test_a_commit_between_the_check_and_the_write_leaves_the_newer_version(root, monkeypatch):
    # The older job checks the log and finds nothing newer; the newer job commits; the older
    # job writes its entry. Readers take the newer version, and both stay whole.
    older, newer = written(root, OLDER, fingerprint="old"), written(root, NEWER, fingerprint="new")
    check = dataset.read_manifest

    def newer_commits_after_the_check(*args, **kwargs):
        found = check(*args, **kwargs)
        monkeypatch.setattr(dataset, "read_manifest", check)
        commit(root, newer, "new")
        return found

    monkeypatch.setattr(dataset, "read_manifest", newer_commits_after_the_check)
    assert commit(root, older, "old") == older
    assert committed_versions(root) == [OLDER, NEWER]
    assert read_manifest(root) == newer
    assert whole(root, newer) and whole(root, older)


def test_a_writer_that_finds_a_newer_version_committed_does_not_commit(root):
    older, newer = written(root, OLDER, fingerprint="old"), written(root, NEWER, fingerprint="new")
    assert commit(root, newer, "new") == newer
    with pytest.raises(InputError, match=r"was replaced while this job was writing"):
        commit(root, older, "old")
    assert committed_versions(root) == [NEWER]
    assert read_manifest(root) == newer and whole(root, newer)
    assert not root.child(DATA, OLDER).exists()  # never committed: no reader has its files

    # The same dataset committed meanwhile is no error: the job's work is done.
    same = written(root, "20260101T000000500000Z-cccccccc", fingerprint="new")
    assert commit(root, same, "new") == newer


def test_in_the_other_order_the_newer_version_replaces_the_older(root):
    older, newer = written(root, OLDER, fingerprint="old"), written(root, NEWER, fingerprint="new")
    assert commit(root, older, "old") == older
    assert commit(root, newer, "new") == newer
    assert read_manifest(root) == newer
    # The older stays readable by name for the jobs that pinned it.
    assert read_manifest(root, OLDER) == older and whole(root, older)


def test_retention_keeps_what_readers_may_need_and_only_touches_the_bundles_own(root):
    # Three committed versions: v1 replaced 5 h ago, v2 replaced 30 min ago, v3 the newest.
    v1, v2, v3 = (new_version(at(h)) for h in (7, 5.5, 0.9))
    for version, age_h in ((v1, 6), (v2, 5), (v3, 0.5)):
        root.child(VERSIONS, f"{version}.json").write_bytes(
            written(root, version, age_h=age_h).model_dump_json().encode()
        )
    # Jobs that crashed before their commit, 3 h and 57 min ago; one that may still be writing
    # (started after v3); a folder of the user's that sorts among the versions; a user's file.
    crashed, recent, writing = (new_version(at(h)) for h in (3, 0.95, 0.2))
    for version in (crashed, recent, writing):
        mark_version(root.child(DATA, version))
    theirs = [root.child(DATA, "01_raw", "x.jpg"), root.child(DATA, "notes.txt")]
    for file in theirs:
        file.write_bytes(b"precious")

    assert remove_expired(root, retention_hours=1) == sorted([v1, crashed])
    assert committed_versions(root) == [v2, v3]
    assert not root.child(DATA, v1).exists() and not root.child(DATA, crashed).exists()
    assert is_marked(root.child(DATA, recent)) and is_marked(root.child(DATA, writing))
    assert all(f.read_bytes() == b"precious" for f in theirs)

    # With no retention, everything but the newest and what may still be written goes.
    assert remove_expired(root, retention_hours=0) == sorted([v2, recent])
    assert committed_versions(root) == [v3] and whole(root, read_manifest(root))
    assert is_marked(root.child(DATA, writing))
    assert all(f.read_bytes() == b"precious" for f in theirs)


def test_retention_skips_a_version_it_cannot_read_and_keeps_it(root, caplog):
    # v1 replaced by v2, whose manifest is damaged; v3, the newest, committed 30 min ago.
    v1, v2, v3 = (new_version(at(h)) for h in (7, 5.5, 0.9))
    for version, age_h in ((v1, 6), (v2, 5), (v3, 0.5)):
        root.child(VERSIONS, f"{version}.json").write_bytes(
            written(root, version, age_h=age_h).model_dump_json().encode()
        )
    root.child(VERSIONS, f"{v2}.json").write_bytes(b'{"schema_version": 3, "vers')
    with caplog.at_level(logging.WARNING, logger=dataset.__name__):
        # When v2 replaced v1 is unknown: no earlier than v3's commit, 30 min ago.
        assert remove_expired(root, retention_hours=1) == []
    assert f"retention skips version {v2}: " in caplog.text
    assert "is not a manifest this code can read" in caplog.text
    assert f"removed by hand ({root.child(VERSIONS, v2).uri}.json and " in caplog.text
    assert committed_versions(root) == [v1, v2, v3]
    # Past that, v1 goes; v2 stays, files and all, for a person to look at.
    assert remove_expired(root, retention_hours=0) == [v1]
    assert committed_versions(root) == [v2, v3]
    assert is_marked(root.child(DATA, v2)) and root.child(DATA, v2, "train").exists()


def train_config(tmp_path, *overrides) -> TrainConfig:
    args = [f"dataset={tmp_path}/d", f"storage_path={tmp_path}/runs", *overrides]
    return load_config(TrainConfig, None, args)


def test_a_run_trains_on_through_its_version_unless_told_to_switch(tmp_path):
    root = Location.parse(str(tmp_path / "d"))
    for version in (OLDER, NEWER):
        commit(root, written(root, version), "")
    cfg = train_config(tmp_path)
    assert pick_dataset_version(cfg, root, None, run="r") == NEWER  # a new run: the newest
    pinned = checkpoint_meta(dataset_version=OLDER)
    with pytest.raises(ConfigError, match=rf"trained on version {OLDER} .* which is still stored"):
        pick_dataset_version(cfg, root, pinned, run="r")
    again = train_config(tmp_path, f"dataset_version={OLDER}")
    assert pick_dataset_version(again, root, pinned, run="r") == OLDER
    switch = train_config(tmp_path, "switch_dataset=true")
    assert pick_dataset_version(switch, root, pinned, run="r") == NEWER


def test_a_run_stopped_inside_its_first_epoch_goes_on_with_that_checkpoints_version(tmp_path):
    # Stopped inside epoch 0: a checkpoint inside the epoch and none of an epoch, then a newer
    # version committed. The run is pinned to its checkpoint's version, as after an epoch.
    root = Location.parse(str(tmp_path / "d"))
    for version in (OLDER, NEWER):
        commit(root, written(root, version), "")
    run = Location.parse(str(tmp_path / "runs" / "r"))
    meta = checkpoint_meta(epoch=0, step=4, dataset_version=OLDER)
    inside = Path(run.child(STEPS, step_dir_name(0, 4)).path)
    inside.mkdir(parents=True)
    save_checkpoint(inside, {}, meta, {})
    pinned = newest_meta(run, None)
    assert (pinned.epoch, pinned.step, pinned.dataset_version) == (0, 4, OLDER)
    with pytest.raises(ConfigError, match=rf"trained on version {OLDER} .* which is still stored"):
        pick_dataset_version(train_config(tmp_path), root, pinned, run=run.uri)
    # Once epoch 0 has its checkpoint on storage, the one inside it is older than that, whether
    # or not Ray has recorded it yet.
    after = checkpoint_meta(epoch=0, dataset_version=NEWER)
    epoch_0 = Path(run.child(checkpoint_dir_name(0)).path)
    epoch_0.mkdir()
    save_checkpoint(epoch_0, {}, after, {})
    assert newest_meta(run, None) == after


def test_a_dataset_is_the_same_however_its_path_is_spelled(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    local = Location.parse(str(tmp_path / "d"))
    for same in ("d", "d/", f"{tmp_path}/x/../d", f"file://{tmp_path}/d", f"{tmp_path}//d"):
        assert local.same_place(same), same
    for other in (f"{tmp_path}/e", "s3://bucket/d", f"{tmp_path}/d/versions"):
        assert not local.same_place(other), other
    # A URI is compared as written: no storage is reached for it.
    s3 = Location(local.fs, "b/x/d", "s3://b/x/d")
    assert s3.same_place("s3://b/x/d/") and s3.same_place("s3://b//x/d")
    for other in ("s3://c/x/d", "gs://b/x/d", "s3://b/x/d?endpoint_override=h:9", "/b/x/d"):
        assert not s3.same_place(other), other


def test_the_runs_own_dataset_is_read_at_the_version_it_was_trained_on(root, tmp_path, caplog):
    for version in (OLDER, NEWER):  # NEWER: committed after the run trained on OLDER
        commit(root, written(root, version), "")
    meta = checkpoint_meta(
        dataset_version=OLDER,
        image_size=32,
        config={"dataset": root.uri, "checkpoint": {"metric": "val_accuracy"}},
    )
    caplog.set_level(logging.INFO, logger="pipeline.model.source")
    assert trained_version(meta, root, None, key="input") == OLDER
    assert f"input={root.uri} is the dataset the checkpoint was trained on: reading version " in (
        caplog.text
    )
    assert trained_version(meta, Location.parse(f"{root.uri}/"), None, key="input") == OLDER
    # An explicit version wins; another dataset, or a folder, is read at its newest.
    assert trained_version(meta, root, NEWER, key="input") == NEWER
    other = root.parent.child("other")
    assert trained_version(meta, other, None, key="input") is None
    # The export's parity check reads the same version, by default of the checkpoint's dataset.
    export = [f"model={tmp_path}/run"]
    assert parity_dataset(load_config(ExportConfig, None, export), meta)[1].version == OLDER
    asked = load_config(ExportConfig, None, [*export, f"dataset_version={NEWER}"])
    assert parity_dataset(asked, meta)[1].version == NEWER
    # Removed since by retention: said so, not silently another version.
    root.child(VERSIONS, f"{OLDER}.json").delete()
    with pytest.raises(InputError, match=rf"no longer holds version {OLDER}, the one it was "):
        trained_version(meta, root, None, key="input")


@pytest.mark.parametrize("recorded", [True, False], ids=["size recorded", "before sizes"])
def test_a_shard_cut_short_is_found_by_its_size_or_else_its_footer(
    tmp_path, tiny_dataset, recorded
):
    shutil.copytree(tiny_dataset, tmp_path / "d")
    root = Location.parse(str(tmp_path / "d"))
    manifest = read_manifest(root)
    assert all(f.size for split in manifest.splits.values() for f in split.files)
    if not recorded:  # a manifest written before shard sizes were
        manifest = manifest.model_copy(
            update={
                "splits": {
                    name: split.model_copy(
                        update={"files": [f.model_copy(update={"size": None}) for f in split.files]}
                    )
                    for name, split in manifest.splits.items()
                }
            }
        )
    check_files(root, manifest)  # whole: nothing to say
    shard = tmp_path / "d" / manifest.splits["val"].files[1].path
    os.truncate(shard, shard.stat().st_size - 1)
    with pytest.raises(InputError, match=r"is damaged: 1 files .*/val/part-\d+\.parquet \("):
        check_files(root, manifest)
    check_files(root, manifest, ["train"])  # only the splits asked for are looked at
