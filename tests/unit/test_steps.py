"""Checkpoints inside an epoch (checkpoint.every_steps): how they are written and kept on storage,
and which one a resume takes, in this process. On a real cluster, a worker killed mid-epoch:
tests/jobs/test_steps_jobs.py."""

from __future__ import annotations

import logging
import shutil
import threading
import uuid
from dataclasses import dataclass
from io import BytesIO
from pathlib import Path

import pytest
import torch

from pipeline.core.config import load_config
from pipeline.core.errors import InputError
from pipeline.core.storage import Location
from pipeline.data.dataset import read_manifest
from pipeline.model.checkpoint import (
    METADATA,
    WEIGHTS,
    ModelInput,
    checkpoint_meta,
    load_train_state,
    load_weights,
    read_meta,
    save_checkpoint,
)
from pipeline.model.networks import build_model
from pipeline.model.runs import (
    STEPS,
    checkpoint_dir_name,
    latest_step_checkpoint,
    step_checkpoints,
    step_dir_name,
)
from pipeline.train.checkpointer import Checkpointer, recorded
from pipeline.train.config import TrainConfig
from pipeline.train.context import LocalContext
from pipeline.train.input.loaders import EpochLoader, epoch_layout
from pipeline.train.optim import OptimState
from pipeline.train.progress import LoopState
from pipeline.train.run import TrainRun
from pipeline.train.saving import Snapshot, StepWriter, publish_checkpoint
from pipeline.train.state import State


def fill(directory: Path, copied: dict) -> None:
    """A checkpoint's files from the state copied at the save, metadata.json last as
    save_checkpoint writes it."""
    torch.save(copied, directory / WEIGHTS)
    (directory / METADATA).write_text("{}")


def test_the_writer_publishes_whole_checkpoints_and_keeps_the_newest_two_per_epoch(tmp_path):
    run = Location.parse(str(tmp_path / "run"))
    writer = StepWriter(run)
    for step in (4, 8, 12):
        writer.save(0, step, {"w": torch.full((3,), step)}, fill)
    writer.wait()
    names = [d.name for *_, d in step_checkpoints(run)]
    assert names == [step_dir_name(0, 8), step_dir_name(0, 12)]
    assert latest_step_checkpoint(run).name == step_dir_name(0, 12)
    # One cut short (no metadata): the newest whole one is taken.
    partial = tmp_path / "run" / STEPS / step_dir_name(0, 16)
    partial.mkdir()
    (partial / "model.pt").write_text("half")
    assert latest_step_checkpoint(run).name == step_dir_name(0, 12)
    # While epoch 0's own checkpoint uploads, epoch 1's come beside its newest two...
    for step in (4, 8, 12):
        writer.save(1, step, {"w": torch.full((3,), step)}, fill)
    writer.wait()
    kept = [(e, s) for e, s, _ in step_checkpoints(run)]
    assert kept == [(0, 12), (0, 16), (1, 8), (1, 12)]
    assert latest_step_checkpoint(run, epoch=0).name == step_dir_name(0, 12)
    # ...and once it is on storage, epoch 0's go, and any of epoch 0 written after that too.
    writer.epoch_done(0)
    assert [(e, s) for e, s, _ in step_checkpoints(run)] == [(1, 8), (1, 12)]
    writer.save(0, 20, {"w": torch.zeros(3)}, fill)
    writer.wait()
    assert [(e, s) for e, s, _ in step_checkpoints(run)] == [(1, 8), (1, 12)]


def test_the_step_loop_waits_for_the_copy_only_and_the_copy_is_what_is_written(tmp_path):
    run = Location.parse(str(tmp_path / "run"))
    writer = StepWriter(run)
    weights = {"w": torch.arange(4.0)}
    writing, go_on = threading.Event(), threading.Event()

    def slow(directory: Path, copied: dict) -> None:
        writing.set()
        assert go_on.wait(30)
        fill(directory, copied)

    writer.save(0, 4, weights, slow)  # returns with the write still to come
    assert writing.wait(30) and not latest_step_checkpoint(run)
    weights["w"].add_(100)  # the next steps change the weights in place meanwhile
    go_on.set()
    writer.wait()
    saved = torch.load(tmp_path / "run" / STEPS / step_dir_name(0, 4) / WEIGHTS)
    assert torch.equal(saved["w"], torch.arange(4.0))
    # The next copy goes into the same host memory: no new allocation per checkpoint.
    first = writer.snapshot.buffers[("w",)].data_ptr()
    writer.save(0, 8, weights, fill)
    writer.wait()
    assert writer.snapshot.buffers[("w",)].data_ptr() == first


def test_a_snapshot_is_a_copy_with_the_state_dicts_versions():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 2)).sum().backward()
    optimizer.step()
    state = (model.state_dict(), {"optimizer": optimizer.state_dict(), "n": [1, (2, "x")]})
    copied = Snapshot().take(state)
    assert copied[1]["n"] == [1, (2, "x")]
    assert copied[0]._metadata == state[0]._metadata  # BatchNorm's version, for loading
    before = {k: v.clone() for k, v in copied[0].items()}
    optimizer.step()
    for name, tensor in copied[0].items():
        assert torch.equal(tensor, before[name]), name
        assert tensor.data_ptr() != state[0][name].data_ptr()
    assert copied[1]["optimizer"]["state"][0]["exp_avg"].data_ptr() != (
        state[1]["optimizer"]["state"][0]["exp_avg"].data_ptr()
    )


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_checkpoint_published_over_an_orphan_of_its_name_replaces_it(tmp_path, s3_server, where):
    # A killed attempt's checkpoint that nothing recorded, and the next attempt's of the same
    # name: the new one, whole, with none of the old one's files.
    with s3_server.client_env():
        if where == "local":
            target = Location.parse(str(tmp_path / "run" / "epoch_0000"))
        else:
            bucket = f"steps-{uuid.uuid4().hex[:8]}"
            s3_server.create_bucket(bucket)
            target = Location.parse(f"s3://{bucket}/run/epoch_0000")
        publish_checkpoint(target, lambda d: fill(d, {"w": torch.zeros(2)}))

        def again(directory: Path) -> None:
            # On local disk the old one stays whole under its name until the new one is renamed
            # in; on S3, where files are put one by one, its metadata goes first: it cannot
            # vouch for the new files.
            assert target.child(METADATA).exists() == (where == "local")
            fill(directory, {"w": torch.ones(2)})

        publish_checkpoint(target, again)
        names = sorted(Path(f.path).name for f in target.list_files())
        assert names == sorted([METADATA, WEIGHTS])
        assert torch.equal(
            torch.load(BytesIO(target.child(WEIGHTS).read_bytes()))["w"], torch.ones(2)
        )
    if where == "local":
        assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["epoch_0000"]


def test_a_writer_that_fails_says_so_at_the_next_save(tmp_path):
    (tmp_path / "run").write_text("a file where the run directory should be")
    writer = StepWriter(Location.parse(str(tmp_path / "run")))
    writer.save(0, 4, {}, fill)
    with pytest.raises(OSError):
        writer.wait()


@dataclass
class Worker(TrainRun):
    """A run, trained by `world` workers."""

    world: int = 1


def worker(tiny_dataset, run_dir: Location, world: int, overrides=("scaling.loader_workers=0",)):
    required = [f"dataset={tiny_dataset}", f"storage_path={run_dir.parent.uri}"]
    cfg = load_config(TrainConfig, None, [*required, "model.name=resnet18", *overrides])
    root = Location.parse(str(tiny_dataset))
    manifest = read_manifest(root)
    inputs = ModelInput(manifest.image_size, "bilinear", manifest.mean, manifest.std)
    return Worker(cfg, root, run_dir, manifest, inputs, world=world)


class Stream:
    """Stands in for the loader's stream: what `set_epoch` asked of it."""

    def set_epoch(self, epoch: int, start_step: int) -> None:
        self.asked = (epoch, start_step)


def resumed(w: Worker, found: Location) -> State:
    """A fresh state of `w`'s, restored from the checkpoint `found`, at its epoch's start."""
    model = build_model(len(w.manifest.classes))
    optim = OptimState(model, w.cfg, precision="fp32", device=torch.device("cpu"))
    loader = EpochLoader([], Stream(), layout=epoch_layout(w.cfg, w.world))
    state = State(model, optim, LoopState(), loader)
    notes = state.load_state_dict(
        load_train_state(found), weights=load_weights(found), ema_weights=None
    )
    assert notes == []
    state.start_epoch(state.loop.epoch)
    return state


def test_a_resume_takes_the_step_checkpoint_of_its_epoch_and_goes_on_at_its_step_in_any_layout(
    tiny_dataset, tmp_path
):
    run_dir = Location.parse(str(tmp_path / "r"))
    taken = worker(tiny_dataset, run_dir, world=2)
    model = build_model(len(taken.manifest.classes))
    optim = OptimState(model, taken.cfg, precision="fp32", device=torch.device("cpu"))
    so_far = {"loss_sum": 12.5, "images": 128, "seconds": 3.0}
    layout = epoch_layout(taken.cfg, 2)
    state = {
        "optim": optim.state_dict(),
        "loop": {"epoch": 1, "step": 8, "history": [{"epoch": 0}], "totals": so_far},
        "loader": {"epoch": 1, "step": 8, "layout": layout},
    }

    def step_checkpoint(epoch: int, step: int) -> None:
        metrics = {"epoch": epoch, "step": step, "workers": 2}
        meta = checkpoint_meta(recorded(taken), metrics, history=[{"epoch": 0}], step=step)
        directory = tmp_path / "r" / STEPS / step_dir_name(epoch, step)
        directory.mkdir(parents=True)
        save_checkpoint(directory, model.state_dict(), meta, state)

    step_checkpoint(1, 8)
    # Epoch 1 goes on after its step 8, whole.
    w = worker(tiny_dataset, run_dir, world=2)
    found = newest(w)
    meta = read_meta(found)
    assert (meta.epoch, meta.step) == (1, 8)
    state_now = resumed(w, found)
    assert (state_now.loop.epoch, state_now.loop.step, state_now.loop.carried) == (1, 8, so_far)
    assert state_now.loop.history == [{"epoch": 0}]
    assert state_now.loader.stream.asked == (1, 8)
    for name, tensor in state_now.model.state_dict().items():
        assert torch.equal(tensor, model.state_dict()[name]), name
    # Another layout (workers, loader processes) goes on at the same next step: the epoch's
    # order is the data's (test_loader counts its rows).
    for world, change in ((1, ()), (2, ("scaling.loader_workers=3",))):
        other = worker(tiny_dataset, run_dir, world=world, overrides=change)
        state_now = resumed(other, newest(other))
        assert state_now.loop.step == 8 and state_now.loop.carried == so_far, change
        assert state_now.loader.stream.asked == (1, 8), change
    # Another global batch orders the epoch's steps otherwise: it starts over.
    rebatched = worker(tiny_dataset, run_dir, world=2, overrides=("global_batch_size=64",))
    assert newest(rebatched) is None
    # Another seed orders the epoch's rows otherwise: it starts over.
    reseeded = worker(tiny_dataset, run_dir, world=2, overrides=("seed=1",))
    assert newest(reseeded) is None
    # A step checkpoint of the next epoch, taken while epoch 1's own checkpoint was uploading (a
    # kill kept that out of Ray's record, or its upload is slow): the newest, whichever Ray has.
    step_checkpoint(2, 4)
    assert newest(w).name == step_dir_name(2, 4)
    # Epoch 2's own checkpoint, whole: newer than any inside it, and it ends epoch 2.
    step_checkpoint(2, 10)
    epoch_checkpoint = tmp_path / "r" / "epoch_0002"
    shutil.copytree(tmp_path / "r" / STEPS / step_dir_name(2, 10), epoch_checkpoint)
    assert newest(w) == run_dir.child("epoch_0002")
    # Without its metadata it is not whole: the one before it is the newest.
    (epoch_checkpoint / METADATA).unlink()
    assert newest(w).name == step_dir_name(2, 10)
    assert newest(rebatched) is None


def newest(w: Worker) -> Location | None:
    """The checkpoint a restore of `w` tries first."""
    return next(Checkpointer(w, LocalContext(world=w.world)).candidates(), None)


def test_an_epoch_checkpoint_resumes_at_the_next_epochs_start(tiny_dataset, tmp_path):
    w = worker(tiny_dataset, Location.parse(str(tmp_path / "r")), world=2)
    model = build_model(len(w.manifest.classes))
    optim = OptimState(model, w.cfg, precision="fp32", device=torch.device("cpu"))
    loader = EpochLoader([], Stream(), layout=epoch_layout(w.cfg, 2))
    state = State(model, optim, LoopState(), loader)
    state.start_epoch(0)
    loader.step = 12  # the epoch's steps, yielded
    state.end_epoch({"epoch": 0, "val_loss": 1.0})
    assert optim.scheduler.last_epoch == 1
    meta = checkpoint_meta(recorded(w), {"epoch": 0}, history=state.loop.history)
    weights, train_state, _ = state.files()
    save_checkpoint(tmp_path, weights, meta, train_state)
    state_now = resumed(w, Location.parse(str(tmp_path)))
    assert (state_now.loop.epoch, state_now.loop.step) == (1, 0)
    assert state_now.loop.history == [{"epoch": 0, "val_loss": 1.0}]
    assert state_now.loader.stream.asked == (1, 0)
    assert state_now.optim.scheduler.last_epoch == 1


NO_TOTALS = {"loss_sum": 0.0, "images": 0, "seconds": 0.0}


def run_of_checkpoints(w: Worker, *taken: tuple[int, int | None]) -> dict[tuple, Path]:
    """Checkpoints of `w`'s run on local storage, each (epoch, step) with its own weights (all
    parameters filled with a number of its own): step None for an epoch's own."""
    model = build_model(len(w.manifest.classes))
    optim = OptimState(model, w.cfg, precision="fp32", device=torch.device("cpu"))
    written = {}
    for i, (epoch, step) in enumerate(taken):
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(i)
        history = [{"epoch": e, "val_loss": 1.0 / (e + 1)} for e in range(epoch + (step is None))]
        metrics = history[-1] if step is None else {"epoch": epoch, "step": step, "workers": 1}
        done, at = (epoch + 1, 0) if step is None else (epoch, step)
        state = {
            "optim": optim.state_dict(),
            "loop": {"epoch": done, "step": at, "history": history, "totals": NO_TOTALS},
            "loader": {"epoch": done, "step": at, "layout": epoch_layout(w.cfg, w.world)},
        }
        name = (
            checkpoint_dir_name(epoch) if step is None else f"{STEPS}/{step_dir_name(epoch, step)}"
        )
        directory = Path(w.run_dir.path) / name
        directory.mkdir(parents=True)
        meta = checkpoint_meta(recorded(w), metrics, history=history, step=step)
        save_checkpoint(directory, model.state_dict(), meta, state)
        written[(epoch, step)] = directory
    return written


def restored(w: Worker, record: LocalContext) -> State:
    """A fresh state of `w`'s, restored by the checkpointer; `record`: the runner's record."""
    model = build_model(len(w.manifest.classes))
    optim = OptimState(model, w.cfg, precision="fp32", device=torch.device("cpu"))
    loader = EpochLoader([], Stream(), layout=epoch_layout(w.cfg, w.world))
    state = State(model, optim, LoopState(), loader)
    Checkpointer(w, record).restore(state)
    return state


def reported(record: LocalContext) -> list[tuple[int, str | None]]:
    """The epochs reported to `record`, each with the checkpoint's path (None: without one)."""
    return [(m["epoch"], c.path if c is not None else None) for m, c in record.reports]


def test_a_resume_goes_on_from_the_newest_checkpoint_on_storage_and_brings_rays_record_in_line(
    tiny_dataset, tmp_path, caplog
):
    """Epoch 0's checkpoint is on storage but not in Ray's record (its upload had not returned
    when rank 0 was lost); the loop trained on into epoch 1 and wrote its step-10 and step-20
    checkpoints, the step-20 one then damaged, and a killed write left its temporary copy."""
    run_dir = Location.parse(str(tmp_path / "r"))
    w = worker(tiny_dataset, run_dir, world=1, overrides=("checkpoint.every_steps=10",))
    written = run_of_checkpoints(w, (0, 20), (0, 40), (0, None), (1, 10), (1, 20))
    cut = written[(1, 20)] / WEIGHTS
    cut.write_bytes(cut.read_bytes()[:1000])
    partial = tmp_path / "r" / STEPS / f".{step_dir_name(1, 30)}.tmp-20261129T120000-1a2b3c4d"
    partial.mkdir()
    (partial / WEIGHTS).write_bytes(b"half a file")
    record = LocalContext()

    with caplog.at_level(logging.INFO, logger="pipeline.train.checkpointer"):
        state = restored(w, record)
    # Epoch 1 goes on after its step 10: the damaged step-20 checkpoint gives way, said so.
    assert (state.loop.epoch, state.loop.step) == (1, 10)
    assert all(torch.all(p == 3) for p in state.model.parameters())
    assert f"{cut.as_posix()} is damaged" in caplog.text
    assert "resuming from the run's checkpoint before it" in caplog.text
    # Ray records epoch 0's checkpoint where it is, with its metrics; the kill's copy is gone.
    assert reported(record) == [(0, str(written[(0, None)]))]
    assert not partial.exists()
    assert written[(1, 10)].exists() and written[(0, 40)].exists()  # pruned by the next save

    # Ray's record has caught up: nothing more to record on the next restore.
    record = LocalContext(recorded=run_dir.child("epoch_0000").path)
    state = restored(w, record)
    assert (state.loop.epoch, state.loop.step) == (1, 10) and record.reports == []

    # Every checkpoint damaged: the run is not trained again from scratch without a word.
    for directory in written.values():
        (directory / WEIGHTS).write_bytes(b"not a torch file")
    with pytest.raises(InputError, match=r"has checkpoints, and none of them reads"):
        restored(w, LocalContext())
