"""The run context's Ray side against Ray Train's own API: what RayContext passes to
`ray.train.report` is what it takes, and a checkpoint is recorded where it was written. Ray's
functions are stood in for here alone; the loop itself never needs them (test_worker.py), and a
real cluster runs them (tests/ray/test_worker_kills.py)."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pyarrow.fs
import ray.train

from pipeline.core.storage import Location
from pipeline.train.context import RayContext


def test_the_ray_context_reports_as_ray_train_takes_it_and_records_where_it_was_written(
    tmp_path, monkeypatch
):
    calls, written = [], []
    takes = inspect.signature(ray.train.report)

    def report(*args, **kwargs):
        bound = takes.bind(*args, **kwargs).arguments
        upload = bound.get("checkpoint_upload_fn")
        recorded = upload(bound["checkpoint"], bound["checkpoint_dir_name"]) if upload else None
        calls.append((bound, recorded))

    storage = SimpleNamespace(
        build_checkpoint_path_from_name=lambda name: str(tmp_path / "run" / name),
        storage_filesystem=pyarrow.fs.LocalFileSystem(),
    )
    monkeypatch.setattr(ray.train, "report", report)
    monkeypatch.setattr(
        ray.train, "get_context", lambda: SimpleNamespace(get_storage=lambda: storage)
    )
    context = object.__new__(RayContext)  # its rank and device are Ray's: not needed here
    epoch = Location.parse(str(tmp_path / "run" / "epoch_0000"))

    context.report({"epoch": 0})
    context.report({"epoch": 0}, epoch, write=lambda: written.append("epoch_0000"))
    context.report({"epoch": 1}, epoch.parent.child("epoch_0001"))

    (metrics_only, _), (async_write, recorded), (in_place, recorded_as_is) = calls
    assert metrics_only == {"metrics": {"epoch": 0}}
    # Written off the loop, by Ray's upload thread, and recorded where it was written.
    assert async_write["checkpoint_upload_mode"] == ray.train.CheckpointUploadMode.ASYNC
    assert async_write["checkpoint_dir_name"] == "epoch_0000" and written == ["epoch_0000"]
    assert recorded.path == epoch.path
    # One on storage already: recorded as it is, synchronously.
    assert "checkpoint_upload_mode" not in in_place
    assert recorded_as_is.path == str(tmp_path / "run" / "epoch_0001")
