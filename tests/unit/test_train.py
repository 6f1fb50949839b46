"""Training without a cluster: the config, the per-worker steps on the CPU, the optimizer and
schedule, resume rules, the driver's checks. The real job on a real cluster: test_train_jobs."""

from __future__ import annotations

import contextlib
import copy
import itertools
import json
import logging
import math
import os
import shutil
import signal
import time

import pytest
import ray.train
import torch
from helpers import checkpoint_meta
from torch.utils.data import DataLoader
from torchvision.transforms import v2

from pipeline.core.config import load_config
from pipeline.core.errors import ClusterError, ConfigError, InputError
from pipeline.core.storage import Location
from pipeline.data.dataset import VERSIONS, read_manifest
from pipeline.data.images import IMAGENET_MEAN, IMAGENET_STD
from pipeline.infer.batch import resolve_checkpoint
from pipeline.model import source
from pipeline.model.checkpoint import ModelInput, save_checkpoint
from pipeline.model.device import DevicePolicy, pick_precision
from pipeline.model.networks import build_model
from pipeline.model.resume import check_resumable, resume_changes
from pipeline.model.run_status import (
    FINISHED,
    HEARTBEAT_S,
    STALE_BEATS,
    TRAINING,
    TrainingMark,
    training_since,
)
from pipeline.model.runs import RUN_SUMMARY, SNAPSHOT, checkpoint_dir_name
from pipeline.train import driver, failures, preflight
from pipeline.train.augment import Augment, batch_mix
from pipeline.train.config import TrainConfig
from pipeline.train.driver import input_verdict
from pipeline.train.ema import ModelEMA
from pipeline.train.epoch import StepRecipe, evaluate, train_one_epoch
from pipeline.train.failures import STARTUP_ATTEMPTS_UNLIMITED, failure_config, startup_attempts
from pipeline.train.input.decoding import Decoded
from pipeline.train.input.loaders import train_data
from pipeline.train.input.rows import RowGroupStream, StreamSpec
from pipeline.train.optim import build_optimizer, grad_scaler, restore_optimizer
from pipeline.train.preflight import check_dataset, pick_dataset_version


def config(dataset, storage, *overrides) -> TrainConfig:
    return load_config(
        TrainConfig, None, [f"dataset={dataset}", f"storage_path={storage}", *overrides]
    )


def decoded_split(root: Location, manifest, split: str, batch_size: int) -> Decoded:
    """`split`'s batches in manifest order, decoded as the CPU path decodes them."""
    return Decoded(RowGroupStream(root, manifest, split, StreamSpec(batch_size=batch_size)))


def checked(cfg: TrainConfig):
    root = Location.parse(cfg.dataset)
    return check_dataset(cfg, root, pick_dataset_version(cfg, root, None, run="r"))


def test_precision_is_fp32_on_cpu_unless_asked():
    cpu = torch.device("cpu")
    assert pick_precision("auto", cpu) == "fp32"
    assert pick_precision("bf16", cpu) == "bf16"


@pytest.mark.parametrize(
    ("capability", "expected"),
    [((7, 0), "fp16"), ((7, 5), "fp16"), ((8, 0), "bf16"), ((9, 0), "bf16")],
)
def test_auto_precision_follows_the_gpu_generation(monkeypatch, capability, expected):
    # V100 (7.0) and T4 (7.5) emulate bf16 slowly, and torch.cuda.is_bf16_supported() says yes
    # on them anyway; A100 (8.0) and H100 (9.0) compute in it.
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert pick_precision("auto", torch.device("cuda", 0)) == expected
    assert pick_precision("fp32", torch.device("cuda", 0)) == "fp32"


def test_progress_is_called_after_each_batch_with_the_input_waits():
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 4 * 4, 2))
    data = [(torch.zeros(4, 3, 4, 4, dtype=torch.uint8), torch.zeros(4, dtype=torch.long))] * 5
    policy = DevicePolicy(torch.device("cpu"), "fp32", (0.5, 0.5, 0.5), (0.2, 0.2, 0.2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    calls = []
    t = train_one_epoch(
        model,
        data,
        optimizer,
        torch.nn.CrossEntropyLoss(),
        policy=policy,
        progress=lambda *a: calls.append(a),
    )
    assert [c[:2] for c in calls] == [(1, 4), (2, 8), (3, 12), (4, 16), (5, 20)]
    assert t["images"] == 20
    waits = [c[2] for c in calls]
    assert waits == sorted(waits) and waits[-1] <= t["input_wait_s"]


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_train_and_evaluate_steps_run_in_every_precision(tiny_dataset, precision):
    # The GPU's mixed-precision path (autocast, grad scaler) runs here on the CPU.
    root = Location.parse(str(tiny_dataset))
    manifest = read_manifest(root)
    policy = DevicePolicy(torch.device("cpu"), precision, manifest.mean, manifest.std)
    scaler = grad_scaler(policy.device, precision)
    assert scaler.is_enabled() == (precision == "fp16")
    torch.manual_seed(0)
    model = build_model(len(manifest.classes))
    cfg = config(tiny_dataset, "/tmp/unused", "optimizer.name=adamw", "optimizer.lr=0.001")
    optimizer, _ = build_optimizer(model, cfg)
    # A few images: half precision on the CPU has slow kernels.
    loader = list(itertools.islice(decoded_split(root, manifest, "val", 4), 3))
    before = [p.detach().clone() for p in model.parameters()]
    criterion = torch.nn.CrossEntropyLoss()
    t = train_one_epoch(model, loader, optimizer, criterion, policy=policy, scaler=scaler)
    assert t["images"] == 12 and torch.isfinite(torch.tensor(t["loss_sum"]))
    changed = any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    # fp16: the scaler skips steps whose gradients overflowed, and lowers its scale instead.
    assert changed or (precision == "fp16" and scaler.get_scale() < 2.0**16)
    v = evaluate(model, loader, policy=policy, num_classes=len(manifest.classes))
    assert v["val_images"] == 12 and 0 <= v["val_accuracy"] <= 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_step_uses_mixed_precision_and_channels_last(tiny_dataset):
    root = Location.parse(str(tiny_dataset))
    manifest = read_manifest(root)
    policy = DevicePolicy(
        torch.device("cuda"),
        pick_precision("auto", torch.device("cuda")),
        manifest.mean,
        manifest.std,
    )
    assert policy.precision in ("bf16", "fp16") and policy.channels_last
    model = build_model(len(manifest.classes)).cuda().to(memory_format=torch.channels_last)
    cfg = config(tiny_dataset, "/tmp/unused")
    optimizer, _ = build_optimizer(model, cfg)
    stream = decoded_split(root, manifest, "train", 64)
    loader = DataLoader(stream, batch_size=None, pin_memory=True)
    t = train_one_epoch(model, loader, optimizer, torch.nn.CrossEntropyLoss(), policy=policy)
    assert t["images"] == manifest.splits["train"].rows
    v = evaluate(model, loader, policy=policy, num_classes=len(manifest.classes))
    assert 0 <= v["val_accuracy"] <= 1


def test_lr_schedule_warms_up_then_decays(tiny_dataset):
    cfg = config(
        tiny_dataset, "/tmp/x", "epochs=5", "optimizer.lr=1.0", "optimizer.warmup_epochs=1"
    )
    optimizer, scheduler = build_optimizer(torch.nn.Linear(2, 2), cfg)
    lrs = []
    for _ in range(5):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert lrs[0] == 0.5 and lrs[1] == 1.0 and lrs[1] > lrs[2] > lrs[3] > lrs[4] > 0


def test_global_batch_must_split_evenly():
    with pytest.raises(ConfigError, match=r"does not split evenly over scaling.num_workers=3"):
        config("/d", "/s", "global_batch_size=32", "scaling.num_workers=3")
    with pytest.raises(ConfigError, match=r"name: String should match pattern"):
        config("/d", "/s", "name=../escape")


def test_num_workers_is_a_count_or_an_elastic_range(tmp_path):
    cfg = config("/d", "/s", "global_batch_size=12", "scaling.num_workers=[1, 4]").scaling
    assert (cfg.min_workers, cfg.max_workers, cfg.elastic) == (1, 4, True)
    path = tmp_path / "train.yaml"
    path.write_text("dataset: /d\nstorage_path: /s\nscaling:\n  num_workers: [2, 2]\n")
    cfg = load_config(TrainConfig, path).scaling
    assert (cfg.min_workers, cfg.max_workers, cfg.elastic) == (2, 2, False)
    for value, said in [
        ("1-2", r"give a number of workers, or \[min, max\] for elastic training"),
        ("[2, 1]", r"\[min, max\] needs 1 <= min <= max"),
        ("[0, 2]", r"\[min, max\] needs 1 <= min <= max"),
        ("[1, 2, 3]", r"give \[min, max\] for elastic training: two numbers"),
        ("0", r"0 workers: at least 1"),
    ]:
        with pytest.raises(ConfigError, match=rf"scaling.num_workers: (Value error, )?{said}"):
            config("/d", "/s", f"scaling.num_workers={value}")


def test_an_elastic_global_batch_splits_evenly_over_every_count():
    # The global batch, and so the learning rate, stays the same whatever the worker count.
    cfg = config("/d", "/s", "global_batch_size=12", "scaling.num_workers=[1,4]")
    assert [cfg.batch_size_per_worker(n) for n in (1, 2, 3, 4)] == [12, 6, 4, 3]
    said = r"over scaling.num_workers=\[2, 4\] \(every count in the range\): use a multiple of 12"
    with pytest.raises(ConfigError, match=said):
        config("/d", "/s", "global_batch_size=16", "scaling.num_workers=[2,4]")


def test_placing_the_workers_is_tried_a_bounded_number_of_times():
    # Ray Train's controller_failure_limit=-1 would retry a group it cannot place forever.
    for max_failures, attempts in [(0, 1), (2, 3), (-1, STARTUP_ATTEMPTS_UNLIMITED)]:
        cfg = config("/d", "/s", f"max_failures={max_failures}")
        assert startup_attempts(cfg) == attempts
        failures = failure_config(cfg)
        assert failures.max_failures == max_failures
        assert failures.controller_failure_limit == attempts - 1 >= 0
    # Elastic: one more, for a group sized by a node that was lost a moment before.
    assert startup_attempts(config("/d", "/s", "max_failures=0", "scaling.num_workers=[1,2]")) == 2


def test_an_elastic_run_waits_for_room_a_bounded_time(monkeypatch):
    # Ray Train waits with no limit for room for an elastic run's minimum: the driver's
    # callback on its controller ends that wait, timed from when the wait starts.
    from pipeline.core.ray_internals import RestartingState, RunningState

    clock = iter([0.0, 5.0, 6.0, 15.0, 17.0])
    monkeypatch.setattr(failures.time, "monotonic", lambda: next(clock))
    limit = failures.ElasticWaitLimit(10, min_workers=2)
    waiting, running = RestartingState(training_failed_error=None), RunningState()
    limit.after_controller_state_update(running, waiting)  # t=0: a wait starts
    limit.after_controller_state_update(waiting, waiting)  # t=5
    limit.after_controller_state_update(waiting, running)  # placed: that wait is over
    limit.after_controller_state_update(running, waiting)  # t=6: a new wait
    limit.after_controller_state_update(waiting, waiting)  # t=15: 9 s of it
    with pytest.raises(failures.WorkersNotPlacedError, match=r"waited 10 s for room for 2 workers"):
        limit.after_controller_state_update(waiting, waiting)  # t=17: 11 s


def test_driver_rejects_unusable_datasets(tiny_dataset, tmp_path):
    with pytest.raises(InputError, match=r"no dataset at dataset=.*Run the preprocess job"):
        checked(config(tmp_path / "nothing", tmp_path))
    broken = tmp_path / "broken"
    shutil.copytree(tiny_dataset, broken)
    (entry,) = (broken / VERSIONS).iterdir()
    manifest = json.loads(entry.read_text())
    manifest["schema_version"] = 99
    entry.write_text(json.dumps(manifest))
    with pytest.raises(InputError, match=r"schema version 99"):
        checked(config(broken, tmp_path))
    del manifest["classes"]
    manifest["schema_version"] = 1
    entry.write_text(json.dumps(manifest))
    with pytest.raises(InputError, match=r"not a manifest this code can read"):
        checked(config(broken, tmp_path))
    with pytest.raises(InputError, match=r"too few for 300 workers"):
        checked(config(tiny_dataset, tmp_path, "scaling.num_workers=300", "global_batch_size=600"))
    # 481 train images: fewer than one step, and every rank would keep no whole batch.
    with pytest.raises(InputError, match=r"481 train images, fewer than one step of global_b"):
        checked(config(tiny_dataset, tmp_path, "global_batch_size=512"))


def test_resume_refuses_a_checkpoint_of_other_classes(tiny_dataset):
    from helpers import checkpoint_meta

    manifest = read_manifest(Location.parse(str(tiny_dataset)))
    with pytest.raises(InputError, match=r"was trained on 3 classes .* has 4 .*pick a new name="):
        check_resumable(checkpoint_meta(), manifest, checkpoint="/runs/x/epoch_0001", dataset="/d")


def test_a_resume_trains_with_the_new_optimizer_settings(tiny_dataset):
    model = torch.nn.Linear(2, 2)
    old = config(tiny_dataset, "/s", "epochs=4", "optimizer.lr=0.1")
    optimizer, scheduler = build_optimizer(model, old)
    for _ in range(2):  # two epochs done
        model(torch.ones(1, 2)).sum().backward()
        optimizer.step()
        scheduler.step()
    state = {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}
    new = config(
        tiny_dataset,
        "/s",
        "epochs=8",
        "optimizer.lr=1e-2",
        "optimizer.weight_decay=0",
        "optimizer.momentum=0.5",
    )
    optimizer, scheduler = build_optimizer(model, new)
    restore_optimizer(optimizer, scheduler, state, new)
    [group] = optimizer.param_groups
    # Epoch 2 of 8 on the cosine: 0.01 * 0.5 * (1 + cos(pi * 2 / 8)).
    assert group["lr"] == pytest.approx(0.01 * 0.5 * (1 + math.cos(math.pi / 4)))
    assert (group["weight_decay"], group["momentum"]) == (0, 0.5)
    assert optimizer.state[model.weight]["momentum_buffer"] is not None  # the state came along
    lrs = []
    for _ in range(6):
        optimizer.step()
        scheduler.step()
        lrs.append(optimizer.param_groups[0]["lr"])
    assert lrs[-1] == pytest.approx(0.0, abs=1e-12) and lrs == sorted(lrs, reverse=True)


def test_a_resume_refuses_what_it_cannot_change(tiny_dataset, tmp_path):
    from helpers import checkpoint_meta

    old = config(tiny_dataset, "/s", "precision=bf16").model_dump(mode="json")
    new = config(tiny_dataset, "/s", "precision=fp32", "epochs=20", "optimizer.lr=0.01")
    assert resume_changes(old, new) == [
        "epochs: 10 -> 20",
        "precision: bf16 -> fp32",
        "optimizer.lr: 0.1 -> 0.01",
    ]
    with pytest.raises(ConfigError, match=r"optimizer.name: sgd -> adamw \(the optimizer's st"):
        resume_changes(old, config(tiny_dataset, "/s", "optimizer.name=adamw"))
    with pytest.raises(ConfigError, match=r"precision: bf16 -> fp16 \(fp16 trains with a grad"):
        resume_changes(old, config(tiny_dataset, "/s", "precision=fp16"))
    # The network and its input stay: the checkpoint's weights are theirs.
    for change, said in [
        ("model.name=resnet50", r"model.name: resnet18 -> resnet50 \(the run's weights belong"),
        ("model.kwargs.zero_init_residual=true", r"model.kwargs: {} -> {'zero_init_residual'"),
        ("model.input.image_size=24", r"model.input: {'image_size': None, .*'image_size': 24"),
        ("model.bn_eps=0.001", r"model.bn_eps: None -> 0.001 \(the run's weights belong"),
    ]:
        with pytest.raises(ConfigError, match=said):
            resume_changes(old, config(tiny_dataset, "/s", change))
    # ...but for how fast BatchNorm's statistics follow: a run stuck at chance goes on.
    faster = config(tiny_dataset, "/s", "precision=bf16", "model.bn_momentum=0.1")
    assert resume_changes(old, faster) == ["model.bn_momentum: None -> 0.1"]
    # The checkpoints kept so far were ranked by the run's metric; how many to keep may change.
    ranked = config(tiny_dataset, "/s", "checkpoint.metric=val_accuracy")
    ranked = ranked.model_dump(mode="json")
    with pytest.raises(ConfigError, match=r"checkpoint.metric: val_accuracy -> last \(the chec"):
        resume_changes(ranked, config(tiny_dataset, "/s", "checkpoint.metric=last"))
    again = config(tiny_dataset, "/s", "checkpoint.metric=val_accuracy", "checkpoint.num_to_keep=5")
    assert resume_changes(ranked, again) == ["checkpoint.num_to_keep: 2 -> 5"]
    with pytest.raises(ConfigError, match=r"model.name: resnet18 -> mobilenet_v3_small"):
        resume_changes(old, config(tiny_dataset, "/s", "model.name=mobilenet_v3_small"))
    manifest = read_manifest(Location.parse(str(tiny_dataset)))
    with pytest.raises(InputError, match=r"trained on 64 px images, but dataset \S+ has 32 px"):
        check_resumable(
            checkpoint_meta(image_size=64, classes=manifest.classes),
            manifest,
            checkpoint="/runs/x/epoch_0001",
            dataset=str(tiny_dataset),
        )


def test_driver_finds_missing_shards_and_bad_initial_weights(tiny_dataset, tmp_path):
    damaged = tmp_path / "damaged"
    shutil.copytree(tiny_dataset, damaged)
    gone = sorted(damaged.glob("data/*/val/*.parquet"))[0]
    gone.unlink()
    with pytest.raises(InputError, match=rf"damaged: 1 files .*{gone.name}.*overwrite=true"):
        checked(config(damaged, tmp_path))

    def check(*overrides):
        cfg = config(tiny_dataset, tmp_path, *overrides)
        root = Location.parse(cfg.dataset)
        return preflight.check_model(cfg, read_manifest(root), root)

    with pytest.raises(InputError, match=r"model.weights \S+missing.pt do not exist"):
        check(f"model.weights={tmp_path / 'missing.pt'}")
    with pytest.raises(ConfigError, match=r"'IMAGENET' is not a weights name of resnet18 \(IMAGEN"):
        check("model.weights=IMAGENET")
    # A known name passes without downloading, and its metadata sets the input: 224 px.
    with pytest.raises(InputError, match=r"stores 32 px images, smaller than the 224 px model"):
        check("model.weights=IMAGENET1K_V1")
    inputs = check("model.weights=IMAGENET1K_V1", "model.input.image_size=32")
    assert inputs == ModelInput(32, "bilinear", IMAGENET_MEAN, IMAGENET_STD)


def test_ray_data_decodes_and_augments_as_the_torch_loader_does(tiny_dataset):
    import pyarrow.parquet as pq

    from pipeline.train.input.ray_data import decode_batch

    root = Location.parse(str(tiny_dataset))
    manifest = read_manifest(root)
    table = pq.read_table(root.child(manifest.splits["val"].files[0].path).path)
    batch = {"image": table["image"].to_numpy()[:5], "label": table["label"].to_numpy()[:5]}
    plain = decode_batch(batch, augment="none", image_size=32)
    # The val stream's first batch: the first rows of the first file, in order.
    images, labels = next(iter(decoded_split(root, manifest, "val", 5)))
    assert plain["image"].dtype == "uint8" and plain["image"].shape == (5, 3, 32, 32)
    assert (plain["image"] == images.numpy()).all()
    assert list(plain["label"]) == labels.tolist()
    torch.manual_seed(0)
    augmented = decode_batch(batch, augment="random_resized_crop", image_size=32)
    assert augmented["image"].shape == (5, 3, 32, 32)
    assert (augmented["image"] != plain["image"]).any()
    # The auto-augment policy, in both input paths.
    policy = decode_batch(batch, augment="none", image_size=32, auto_augment="rand_augment")
    assert (policy["image"] != plain["image"]).any()
    cfg = config(tiny_dataset, "/s", "auto_augment=rand_augment")
    train = train_data(cfg, root, manifest, rank=0, world=1, device=torch.device("cpu"))
    assert isinstance(train.loader.batches.transform.transforms[-1], v2.RandAugment)


def test_a_run_trained_again_says_so_in_its_summary_while_it_trains(
    tiny_dataset, tmp_path, monkeypatch
):
    cfg = config(tiny_dataset, tmp_path, "name=again")
    run = Location.parse(str(tmp_path / "again"))
    # What its training before left: a summary that inference reads as finished.
    run.child(RUN_SUMMARY).write_bytes(json.dumps({"status": "finished"}).encode())
    during = []
    monkeypatch.setattr(driver, "fit", lambda *_, **__: during.append(training_since(run)))
    monkeypatch.setattr(driver, "write_reports", lambda *_, **__: {})
    driver.train(cfg, dataset=Location.parse(str(tiny_dataset)), runs=Location.parse(str(tmp_path)))
    assert during and during[0] is not None
    run.child(SNAPSHOT).write_bytes(b"{}")  # Ray's record of its checkpoints, as a run has
    with pytest.raises(ConfigError, match=r"model=\S+again is a run that a train job has been"):
        resolve_checkpoint(run)
    # A checkpoint given directly is not refused.
    (tmp_path / "again" / "epoch_0000").mkdir()
    save_checkpoint(tmp_path / "again" / "epoch_0000", {}, checkpoint_meta(), {})
    assert resolve_checkpoint(run.child("epoch_0000")).path == str(tmp_path / "again/epoch_0000")


def finished_run(tmp_path, monkeypatch) -> tuple[Location, dict]:
    """A finished run that ranks by val loss (its best: epoch 4 of HISTORY; by val accuracy it
    would be epoch 3), and its summary."""
    run = Location.parse(str(tmp_path))
    checkpoints = [
        (
            ray.train.Checkpoint(str(tmp_path / checkpoint_dir_name(e))),
            {"epoch": e, "val_loss": loss, "val_accuracy": accuracy},
        )
        for e, (loss, accuracy) in enumerate(HISTORY)
    ]
    result = ray.train.Result(*checkpoints[-1][::-1], None, run.path, best_checkpoints=checkpoints)
    monkeypatch.setattr(source, "load_result", lambda _: result)
    run.child(SNAPSHOT).write_bytes(b"{}")
    summary = {"status": "finished", "checkpoint_metric": "val_loss", "epochs": 6}
    run.child(RUN_SUMMARY).write_bytes(json.dumps(summary).encode())
    return run, summary


def test_a_run_whose_train_job_stopped_heartbeating_goes_as_it_last_finished(
    tmp_path, monkeypatch, caplog
):
    run, finished = finished_run(tmp_path, monkeypatch)
    stale_s = STALE_BEATS * HEARTBEAT_S
    # A job marks the run and is killed before it can put the summary back: its marker stays,
    # its heartbeat no longer refreshed. Its clock is injected: the last beat was at `beat`.
    beat = time.time()
    TrainingMark.hold(run, clock=lambda: beat).release(restore=False)
    marker = json.loads(run.child(RUN_SUMMARY).read_bytes())
    assert marker["status"] == TRAINING and marker[FINISHED] == finished
    assert (marker["holder"]["pid"], marker["holder"]["submission_id"]) == (os.getpid(), None)
    # Fresh, and up to STALE_BEATS heartbeats missed: a job trains the run, which is refused.
    assert training_since(run, now=beat + stale_s) == marker["since"]
    with pytest.raises(ConfigError, match=r"since .* by train job outside a Ray job on .+ \(pid"):
        resolve_checkpoint(run)
    # Past that the job has ended: the run is as it last finished, best by its val loss.
    assert training_since(run, now=beat + stale_s + 1) is None
    beat -= stale_s + 1
    TrainingMark.hold(run, clock=lambda: beat).release(restore=False)
    caplog.set_level(logging.WARNING, logger="pipeline.model.run_status")
    assert resolve_checkpoint(run).path == str(tmp_path / checkpoint_dir_name(4))
    assert f"(pid {os.getpid()}), training it again since" in caplog.text
    assert "it has ended without finishing, so the run goes as it last finished" in caplog.text


def test_the_heartbeat_is_refreshed_until_released_and_a_release_can_restore(tmp_path, monkeypatch):
    run, finished = finished_run(tmp_path, monkeypatch)
    mark = TrainingMark.hold(run, interval_s=0.05)
    first = json.loads(run.child(RUN_SUMMARY).read_bytes())["heartbeat"]
    deadline = time.monotonic() + 10
    while json.loads(run.child(RUN_SUMMARY).read_bytes())["heartbeat"] == first:
        assert time.monotonic() < deadline, "no heartbeat"
        time.sleep(0.01)
    mark.release(restore=True)
    time.sleep(0.2)  # four intervals: a heartbeat still beating would have written the marker
    assert json.loads(run.child(RUN_SUMMARY).read_bytes()) == finished


def test_a_damaged_summary_does_not_stop_a_resume(tmp_path, caplog):
    run = Location.parse(str(tmp_path))
    run.child(RUN_SUMMARY).write_bytes(b'{"status": "fini')
    mark = TrainingMark.hold(run)
    mark.release(restore=True)  # nothing finished to put back: the marker stays
    assert json.loads(run.child(RUN_SUMMARY).read_bytes())[FINISHED] is None
    assert f"{run.child(RUN_SUMMARY).uri} is not JSON" in caplog.text


def test_a_resume_that_fails_or_is_stopped_puts_the_finished_summary_back(
    tiny_dataset, tmp_path, monkeypatch
):
    cfg = config(tiny_dataset, tmp_path, "name=again")
    run = Location.parse(str(tmp_path / "again"))
    finished = {"status": "finished", "checkpoint_metric": "val_loss"}
    run.child(RUN_SUMMARY).write_bytes(json.dumps(finished).encode())
    args = {"dataset": Location.parse(str(tiny_dataset)), "runs": Location.parse(str(tmp_path))}

    def fails(*_, **__):
        assert training_since(run) is not None
        raise ClusterError("training failed")

    monkeypatch.setattr(driver, "fit", fails)
    with pytest.raises(ClusterError):
        driver.train(cfg, **args)
    assert json.loads(run.child(RUN_SUMMARY).read_bytes()) == finished

    # `ray job stop`: SIGTERM to the driver while it waits on Ray Train.
    def stopped(*_, **__):
        assert training_since(run) is not None
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)  # the handler raises before this ends
        raise AssertionError("SIGTERM did not stop the driver")

    monkeypatch.setattr(driver, "fit", stopped)
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit):
        driver.train(cfg, **args)
    assert json.loads(run.child(RUN_SUMMARY).read_bytes()) == finished
    assert signal.getsignal(signal.SIGTERM) == before


# (val_loss, val_accuracy) per epoch, as in a user's run: val accuracy best at epochs 1 and 3,
# val loss lowest at epoch 4, epoch 5 the last.
HISTORY = [(0.9, 0.7), (0.6, 0.8316), (0.5, 0.8), (0.47, 0.8316), (0.436, 0.8283), (0.464, 0.81)]


@pytest.mark.parametrize(
    ("metric", "epoch", "why"),
    [
        ("val_accuracy", 3, "val_accuracy (max): 0.8316"),  # of two tied, the newer, as Ray keeps
        ("val_loss", 4, "val_loss (min): 0.4360"),
        ("last", 5, "last: the newest epoch"),
    ],
)
def test_inference_takes_the_best_checkpoint_by_the_runs_metric(
    tmp_path, monkeypatch, caplog, metric, epoch, why
):
    run = Location.parse(str(tmp_path))
    checkpoints = [
        (
            ray.train.Checkpoint(str(tmp_path / checkpoint_dir_name(e))),
            {"epoch": e, "val_loss": loss, "val_accuracy": accuracy},
        )
        for e, (loss, accuracy) in enumerate(HISTORY)
    ]
    # Ray's record of the run, in an order of its own: the pick must not depend on it.
    record = checkpoints[3:] + checkpoints[:3]
    result = ray.train.Result(*checkpoints[-1][::-1], None, run.path, best_checkpoints=record)
    monkeypatch.setattr(source, "load_result", lambda _: result)
    run.child(SNAPSHOT).write_bytes(b"{}")
    recorded = {"status": "finished", "checkpoint_metric": metric}  # says how it ranks
    run.child(RUN_SUMMARY).write_bytes(json.dumps(recorded).encode())
    caplog.set_level(logging.INFO, logger="pipeline.model.runs")
    assert resolve_checkpoint(run).path == str(tmp_path / checkpoint_dir_name(epoch))
    assert f": best checkpoint epoch {epoch} by {why}; last epoch 5: " in caplog.text


# --- the recipe's ingredients in the training step ----------------------------------------------

POLICY = DevicePolicy(torch.device("cpu"), "fp32", (0.5, 0.5, 0.5), (0.2, 0.2, 0.2))


def tiny_batches(n: int = 1, size: int = 8, classes: int = 3, seed: int = 0) -> list:
    g = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (n, size, 3, 4, 4), dtype=torch.uint8, generator=g)
    labels = torch.randint(0, classes, (n, size), generator=g)
    return list(zip(images, labels, strict=True))


class NoBatchNorm(torch.nn.Sequential):
    """Flatten + Linear, with DDP's `no_sync` counted. No BatchNorm: its batch statistics, taken
    per micro-batch, would make accumulation differ from the whole batch on purpose."""

    def __init__(self, classes: int = 3):
        super().__init__(torch.nn.Flatten(), torch.nn.Linear(3 * 4 * 4, classes))
        self.unsynced, self.seen = 0, []
        self.register_forward_pre_hook(lambda _, args: self.seen.append(len(args[0])))

    @contextlib.contextmanager
    def no_sync(self):
        self.unsynced += 1
        yield


def one_step(
    model, batches, *, policy=POLICY, scaler=None, criterion=None, lr=0.1, **recipe
) -> dict:
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    criterion = criterion or torch.nn.CrossEntropyLoss()
    return train_one_epoch(
        model,
        batches,
        optimizer,
        criterion,
        policy=policy,
        scaler=scaler,
        recipe=StepRecipe(**recipe),
    )


def test_micro_batches_accumulate_the_gradient_of_the_whole_batch():
    torch.manual_seed(0)
    whole, micro = NoBatchNorm(), NoBatchNorm()
    micro.load_state_dict(whole.state_dict())
    batches = tiny_batches(size=8)
    a = one_step(whole, batches)
    # 3 + 3 + 2 images: each micro-batch's loss weighs its share, not a third.
    b = one_step(micro, batches, micro_batch=3)
    assert whole.seen == [8] and micro.seen == [3, 3, 2]
    for p, q in zip(whole.parameters(), micro.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert b["loss_sum"] == pytest.approx(a["loss_sum"], rel=1e-5) and b["images"] == 8
    # DDP all-reduces once a step: on the last micro-batch's backward, the others in no_sync.
    assert (whole.unsynced, micro.unsynced) == (0, 2)


def test_micro_batch_size_must_split_every_workers_share():
    cfg = config("/d", "/s", "global_batch_size=64", "micro_batch_size=16")
    assert cfg.batch_size_per_worker(2) // cfg.micro_batch_size == 2
    said = (
        r"micro_batch_size=16 does not divide each worker's share of global_batch_size=48 "
        r"\(48, 24, 16, 12 images\): use a divisor of 4"
    )
    with pytest.raises(ConfigError, match=said):
        config(
            "/d", "/s", "global_batch_size=48", "scaling.num_workers=[1,4]", "micro_batch_size=16"
        )
    with pytest.raises(ConfigError, match=r"micro_batch_size: Input should be greater than or eq"):
        config("/d", "/s", "micro_batch_size=1")


def test_mixup_and_cutmix_train_on_mixed_images_and_soft_labels():
    assert batch_mix(mixup_alpha=0, cutmix_alpha=0, num_classes=3) is None
    mix = batch_mix(mixup_alpha=0.2, cutmix_alpha=1.0, num_classes=3)
    targets = []

    def criterion(logits, target):
        targets.append(target)
        return torch.nn.functional.cross_entropy(logits, target)

    batches = tiny_batches(n=6)
    draw = Augment(mix, "mix/0/0/0").draw
    one_step(NoBatchNorm(), batches, criterion=criterion, mix=lambda x, y, step: draw(x, y))
    assert all(t.shape == (8, 3) and t.dtype == torch.float32 for t in targets)
    stacked = torch.cat(targets)
    torch.testing.assert_close(stacked.sum(dim=1), torch.ones(48))
    assert ((stacked > 0) & (stacked < 1)).any()  # mixed: not one-hot labels
    # Each rank (and epoch) draws its own mixes, and draws them again for the same seed.
    x = POLICY.inputs(batches[0][0])
    draw = {key: Augment(mix, key).draw(x, batches[0][1]) for key in ("0/0/0", "0/0/1")}
    assert not torch.equal(draw["0/0/0"][0], draw["0/0/1"][0])
    again = Augment(mix, "0/0/0").draw(x, batches[0][1])
    assert torch.equal(again[0], draw["0/0/0"][0]) and torch.equal(again[1], draw["0/0/0"][1])


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_gradients_are_clipped_to_the_max_norm_before_the_step(precision):
    # fp16: the grad scaler's gradients are 65536 times too large until unscaled; clipped
    # scaled, the step would move the weights 65536 times less than the norm says.
    policy = DevicePolicy(torch.device("cpu"), precision, (0.5,) * 3, (0.2,) * 3)
    # A first scale of 2**8 (2**16 by default): this model's fp16 gradients would overflow
    # the default, and the scaler skip the step.
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, enabled=precision == "fp16")
    torch.manual_seed(0)
    model = NoBatchNorm()
    before = [p.detach().clone() for p in model.parameters()]
    one_step(model, tiny_batches(), policy=policy, scaler=scaler, lr=1.0, clip_grad_norm=1e-3)
    moved = torch.cat([(p - b).flatten() for p, b in zip(model.parameters(), before, strict=True)])
    assert moved.norm().item() == pytest.approx(1e-3, rel=1e-2)
    unclipped = NoBatchNorm()
    unclipped.load_state_dict(dict(zip(unclipped.state_dict(), before, strict=True)))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, enabled=precision == "fp16")
    one_step(unclipped, tiny_batches(), policy=policy, scaler=scaler, lr=1.0)
    moved = [(p - b).flatten() for p, b in zip(unclipped.parameters(), before, strict=True)]
    assert torch.cat(moved).norm().item() > 1e-2  # the clip did the work above


def test_the_ema_averages_the_weights_every_few_steps():
    model = torch.nn.Linear(1, 1, bias=False)
    model.weight.data.fill_(0.0)
    ema = ModelEMA(model, decay=0.75, every_steps=2)
    seen = []
    for value in (1.0, 2.0, 3.0, 4.0, 5.0, 6.0):
        model.weight.data.fill_(value)
        ema.step(model)
        seen.append(ema.module.weight.item())
    # Updated every second step: the first update copies the weights, the next ones average.
    assert seen == [0.0, 2.0, 2.0, 2.5, 2.5, 0.75 * 2.5 + 0.25 * 6.0]
    assert (ema.steps, ema.updates) == (6, 3)
    ema.following = True  # the LR warm-up: the EMA follows the weights
    for value in (7.0, 8.0):
        model.weight.data.fill_(value)
        ema.step(model)
    assert ema.module.weight.item() == 8.0


def test_an_epoch_updates_the_ema_and_evaluates_it_beside_the_weights(tiny_dataset):
    root = Location.parse(str(tiny_dataset))
    manifest = read_manifest(root)
    policy = DevicePolicy(torch.device("cpu"), "fp32", manifest.mean, manifest.std)
    torch.manual_seed(0)
    model = build_model(len(manifest.classes))
    ema = ModelEMA(model, decay=0.5, every_steps=1)
    initial = copy.deepcopy(model)
    loader = list(itertools.islice(decoded_split(root, manifest, "val", 8), 3))
    one_step(model, loader, policy=policy, lr=0.01, ema=ema)
    assert ema.steps == 3
    # The average of the last weights, not the weights, nor where they started.
    for p, e, p0 in zip(
        model.parameters(), ema.module.parameters(), initial.parameters(), strict=True
    ):
        assert not torch.equal(e, p) and not torch.equal(e, p0)
    v = evaluate(model, loader, policy=policy, num_classes=4, ema=ema.module)
    alone = evaluate(model, loader, policy=policy, num_classes=4)
    assert v["val_accuracy"] == alone["val_accuracy"] and v["val_loss"] == alone["val_loss"]
    assert set(v) == {"val_images", "val_loss", "val_accuracy", "ema_val_loss", "ema_val_accuracy"}
    same = evaluate(model, loader, policy=policy, num_classes=4, ema=copy.deepcopy(model))
    assert same["ema_val_accuracy"] == same["val_accuracy"]
    assert same["ema_val_loss"] == pytest.approx(same["val_loss"])
    assert v["ema_val_loss"] != pytest.approx(v["val_loss"])


def test_the_step_loop_counts_the_time_it_waits_for_each_batch():
    def slow(batches, wait_s):
        for batch in batches:
            time.sleep(wait_s)  # a loader that decodes slower than the step
            yield batch

    batches = tiny_batches(n=4)
    t = one_step(NoBatchNorm(), slow(batches, 0.05))
    assert 4 * 0.05 <= t["input_wait_s"] <= t["seconds"]
    held = one_step(NoBatchNorm(), batches)  # in memory: next to no wait
    assert held["input_wait_s"] < 4 * 0.05 <= t["input_wait_s"]


def test_the_run_says_whether_it_was_input_bound():
    cpu = config("/d", "/s")
    assert input_verdict({"input_wait_share": 0.04}, cpu).startswith("not input-bound: the step")
    bound = input_verdict({"input_wait_share": 0.35}, cpu)
    assert bound.startswith("input-bound: the step loop waited for input 35% of its time")
    assert "scaling.cpus_per_worker" in bound and "decode=gpu" not in bound
    assert "not measured" in input_verdict({"input_wait_share": None}, cpu)
    # GPU workers decoding on CPUs: decoding on the GPUs comes first.
    gpu = config("/d", "/s", "scaling.use_gpu=true")
    assert "Decode on the GPUs (decode=gpu" in input_verdict({"input_wait_share": 0.35}, gpu)
    on_gpu = config("/d", "/s", "scaling.use_gpu=true", "decode=gpu")
    assert "decode=gpu" not in input_verdict({"input_wait_share": 0.35}, on_gpu)
