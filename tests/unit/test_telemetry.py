"""What a run tells while it runs, without Ray: the pace, the ETA, the cost, the progress record
and the gauges' values (pipeline.train.telemetry, pipeline.core.metrics, pipeline.core.progress);
inference's stall rule and its predictors' stacks (pipeline.infer.telemetry)."""

import json
import logging
import threading
import time

import pytest

from pipeline.core.config import StallConfig
from pipeline.core.metrics import INFER, TRAIN, Gauges, exported
from pipeline.core.progress import PROGRESS, ProgressWriter, duration_text, read_progress
from pipeline.core.storage import Location
from pipeline.infer.telemetry import held_batch, stall_limit_s, thread_stacks
from pipeline.train.config import TrainConfig
from pipeline.train.progress import LoopState
from pipeline.train.telemetry import EpochCost, Pace, Telemetry, eta_s


def config(**kw) -> TrainConfig:
    return TrainConfig(dataset="/tmp/d", storage_path="/tmp/r", name="run-a", **kw)


def test_pace_is_the_recent_steps_images_and_waits():
    pace = Pace(window=4)
    for _ in range(10):
        pace.add(2.0, 0.5, 8)  # older than the window: forgotten
    for seconds in (1.0, 1.0, 1.0, 3.0):
        pace.add(seconds, 0.25, 12)
    assert pace.step_s == 1.5 and pace.median_step_s == 1.0
    assert pace.images_per_s == pytest.approx(48 / 6)
    assert pace.wait_share == pytest.approx(1 / 6)


def test_eta_counts_the_steps_evaluations_and_epochs_left():
    cost = EpochCost(eval_s=4.0, other_s=1.0)
    # Epoch 1 of 3 at step 6 of 10, 0.5 s a step: 2 s of steps + 5 s, then one epoch of 10 s.
    left = eta_s(epoch=1, epochs=3, step=6, steps=10, step_s=0.5, cost=cost, eval_estimate_s=99)
    assert left == pytest.approx(2 + 5 + (5 + 5))
    # Once epochs have run whole, their mean wall time stands for each later one.
    cost.epochs_s += [10.0, 14.0]
    left = eta_s(epoch=1, epochs=3, step=6, steps=10, step_s=0.5, cost=cost, eval_estimate_s=99)
    assert left == pytest.approx(2 + 5 + 12)
    # Before a measured evaluation, the estimate stands in for it.
    fresh = EpochCost()
    left = eta_s(epoch=2, epochs=3, step=0, steps=10, step_s=0.5, cost=fresh, eval_estimate_s=3)
    assert left == pytest.approx(5 + 3)


def test_duration_text():
    assert [duration_text(s) for s in (None, 4.4, 200, 7500)] == ["?", "4s", "3m20s", "2h05m"]


def feed(
    t: Telemetry, loop: LoopState, epoch: int, steps: int, *, step_s: float, images: int = 8
) -> None:
    """Epoch `epoch` of `steps` steps of `step_s` each, as the loop moves `loop` through it."""
    loop.start_epoch(epoch, steps)
    t.start_epoch(loop)
    waited = 0.0
    for step in range(1, steps + 1):
        t.last -= step_s  # as if the step took step_s
        t.logged -= step_s
        waited += step_s / 4
        loop.advance(step)
        t.stepped(step * images, waited)


def test_a_run_reports_its_progress_eta_cost_and_best(tmp_path, caplog):
    cfg = config(epochs=3, log_every_s=0.001, cost={"price_per_worker_hour": 2.0})
    run_dir = Location.parse(str(tmp_path / "run-a"))
    t = Telemetry(
        cfg,
        rank=0,
        world=2,
        run_dir=run_dir,
        job_id="raysubmit_1",
        gpus_per_worker=1,
        rows={"train": 160, "val": 40},
    )
    caplog.set_level(logging.INFO, logger="pipeline.train.telemetry")
    loop = LoopState()
    feed(t, loop, 0, 10, step_s=0.5)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].startswith("epoch 0/2: batch 1/10, 16.0 images/s on this worker, 25% waiting")
    assert "ETA" in lines[0] and len(lines) == 9  # none after the last step: the epoch line says
    record = t.record()
    assert record["images_per_s"] == pytest.approx(32.0, rel=0.01)  # both workers
    assert record["input_wait_share"] == pytest.approx(0.25, rel=0.01)
    # 2 epochs of 10 steps, each with an estimated evaluation (40/160 * 10 * 0.5 s / 3).
    assert record["eta_s"] == pytest.approx(0.4167 + 2 * (5 + 0.4167), abs=0.1)
    t.evaluating()
    t.evaluated()
    metrics = {"epoch": 0, "train_s": 5.0, "val_loss": 0.9, "val_accuracy": 0.5}
    metrics |= t.end_epoch(metrics, carried_s=3600.0)  # an earlier attempt's hour of it
    assert metrics["worker_hours"] == pytest.approx(2.0, abs=0.01)  # 2 workers, 1 h each
    assert metrics["gpu_hours"] == metrics["worker_hours"]
    assert metrics["cost"] == pytest.approx(2 * metrics["worker_hours"])
    loop.end_epoch(metrics)
    t.ended_epoch(metrics)
    values = t.gauges.values()
    assert values["cv_train_val{metric=val_accuracy}"] == 0.5
    assert values["cv_train_epoch"] == 1 and values["cv_train_progress"] == pytest.approx(1 / 3)
    assert values["cv_train_worker_hours"] == pytest.approx(2.0, abs=0.01)
    assert values["cv_train_images_per_second{rank=0}"] == pytest.approx(16.0, rel=0.01)
    feed(t, loop, 1, 10, step_s=0.5)
    t.checkpointed("epoch", "file:///x/checkpoint_000000", epoch=0, step=None, upload_s=0.2)
    t.evaluating()
    t.evaluated()
    last = {"epoch": 1, "val_loss": 0.7, "val_accuracy": 0.75} | t.end_epoch({"epoch": 1}, 0)
    loop.end_epoch(last)
    t.ended_epoch(last)
    t.close("finished")
    written = read_progress(run_dir)
    assert written["state"] == "finished" and written["job_id"] == "raysubmit_1"
    assert written["best"] == {"metric": "val_loss", "value": 0.7, "epoch": 1}
    assert written["last_checkpoint"]["uri"] == "file:///x/checkpoint_000000"
    assert (written["epoch"], written["step"]) == (2, 0)  # the next, not started
    assert written["progress"] == pytest.approx(2 / 3, abs=1e-3)
    assert written["cost"] == pytest.approx(2 * written["worker_hours"])


def test_only_rank_0_writes_progress(tmp_path):
    run_dir = Location.parse(str(tmp_path / "run-a"))
    t = Telemetry(
        config(), rank=1, world=2, run_dir=run_dir, job_id="j", gpus_per_worker=0, rows={}
    )
    feed(t, LoopState(), 0, 3, step_s=0.1)
    t.close("finished")
    assert read_progress(run_dir) is None
    assert set(t.gauges.values()) == {
        f"cv_train_{name}{{rank=1}}"
        for name in ("images_per_second", "input_wait_share", "step_seconds")
    }


def test_the_progress_writer_keeps_the_newest_and_survives_a_failing_store(tmp_path, caplog):
    where = Location.parse(str(tmp_path / "out"))
    writer = ProgressWriter(where)
    for n in range(50):
        writer.put({"n": n})
    writer.flush()
    assert read_progress(where)["n"] == 49
    blocked = tmp_path / "file"
    blocked.write_text("")  # a file where the folder should be: every write fails
    failing = ProgressWriter(Location.parse(str(blocked)))
    failing.put({"n": 1})
    failing.put({"n": 2})
    failing.flush()
    assert sum("cannot write" in r.getMessage() for r in caplog.records) == 1
    assert json.loads((tmp_path / "out" / PROGRESS).read_text())["format"] == 1


def test_gauges_check_their_labels_and_keep_unknowns_out():
    g = Gauges(TRAIN, {"run": "r", "job_id": "j"})
    with pytest.raises(ValueError, match="takes the labels"):
        g.set("cv_train_val", 1.0)
    g.set("cv_train_eta_seconds", None)
    g.set("cv_train_epoch", 2)
    assert g.values() == {"cv_train_epoch": 2.0}
    g.close()
    names = [exported(m) for m in TRAIN + INFER]
    assert len(set(names)) == len(names) and all(n.startswith("ray_cv_") for n in names)


def test_step_time_is_wall_time_between_steps(tmp_path):
    t = Telemetry(
        config(),
        rank=1,
        world=1,
        run_dir=Location.parse(str(tmp_path)),
        job_id="j",
        gpus_per_worker=0,
        rows={},
    )
    loop = LoopState()
    loop.start_epoch(0, 3)
    t.start_epoch(loop)
    time.sleep(0.05)
    loop.advance(1)
    t.stepped(4, 0.0)
    assert t.pace.step_s >= 0.05
    t.close("finished")


def test_an_inference_batch_is_stalled_past_the_multiple_of_the_median_and_the_floor():
    stall = StallConfig(multiple=10, min_s=5)
    assert stall_limit_s(None, stall) == 5 and stall_limit_s(2.0, stall) == 20
    busy = {"pid": 7, "node": "10.0.0.1", "batches": 2}

    def snapshot(batches: int, *ages: float) -> dict:
        actors = {f"a{i}": busy | {"busy_since": 100.0 - age} for i, age in enumerate(ages)}
        actors["idle"] = busy | {"busy_since": None}
        return {"now": 100.0, "actors": actors, "batches": batches, "median_batch_s": 0.2}

    assert held_batch(snapshot(2, 60.0), stall) is None  # not armed: too few batches yet
    assert held_batch(snapshot(5, 4.0, 1.0), stall) is None  # under the floor
    assert held_batch(snapshot(5, 4.0, 6.0), stall) == ("a1", 6.0)  # the longest held


def test_a_predictors_stacks_put_its_batchs_thread_first_and_say_where_it_is():
    held, release = threading.Event(), threading.Event()

    def batch():
        held.set()
        release.wait(10)

    worker = threading.Thread(target=batch, name="udf")
    worker.start()
    held.wait(10)
    try:
        stacks = thread_stacks(worker.ident)
    finally:
        release.set()
        worker.join()
    assert stacks["text"].startswith("Thread udf:\n")
    assert stacks["where"] == "threading.py:wait"  # the innermost Python frame of its batch
