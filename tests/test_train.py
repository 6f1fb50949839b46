"""Training without a cluster: the config, the per-worker steps on the CPU, the optimizer and
schedule, resume rules, the driver's checks. The real job on a real cluster: test_train_jobs."""

from __future__ import annotations

import itertools
import json
import logging
import math
import shutil

import pytest
import torch
from helpers import checkpoint_meta
from torch.utils.data import DataLoader

from pipeline.core.config import TrainConfig, load_config
from pipeline.core.errors import ConfigError, InputError
from pipeline.core.storage import Location
from pipeline.data.dataset import VERSIONS, read_manifest
from pipeline.data.images import IMAGENET_MEAN, IMAGENET_STD
from pipeline.infer.batch import resolve_checkpoint
from pipeline.model.checkpoint import ModelInput, save_checkpoint
from pipeline.model.device import DevicePolicy, pick_precision
from pipeline.model.networks import build_model
from pipeline.model.runs import (
    RUN_SUMMARY,
    SNAPSHOT,
    check_resumable,
    resume_changes,
    training_since,
)
from pipeline.train import driver
from pipeline.train.driver import (
    STARTUP_ATTEMPTS_UNLIMITED,
    check_dataset,
    failure_config,
    pick_dataset_version,
    startup_attempts,
)
from pipeline.train.optim import build_optimizer, restore_optimizer
from pipeline.train.torch_input import RowGroupStream
from pipeline.train.worker import Progress, evaluate, train_one_epoch


def config(dataset, storage, *overrides) -> TrainConfig:
    return load_config(
        TrainConfig, None, [f"dataset={dataset}", f"storage_path={storage}", *overrides]
    )


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


def test_progress_lines_within_an_epoch(caplog):
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
    assert calls == [(1, 4), (2, 8), (3, 12), (4, 16), (5, 20)] and t["images"] == 20
    caplog.set_level(logging.INFO, logger="pipeline.train.worker")
    progress = Progress(epoch=2, epochs=10, batches=5, every_s=0)
    for batch in range(1, 6):
        progress(batch, 4 * batch)
    lines = [r.getMessage() for r in caplog.records]
    # One per batch here (every_s=0), none after the last: the epoch line says the rest.
    assert len(lines) == 4 and lines[0].startswith("epoch 2/9: batch 1/5, ")
    assert lines[-1].startswith("epoch 2/9: batch 4/5, ") and "images/s on this worker" in lines[-1]


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_train_and_evaluate_steps_run_in_every_precision(tiny_dataset, precision):
    # The GPU's mixed-precision path (autocast, grad scaler) runs here on the CPU.
    root = Location.parse(str(tiny_dataset))
    manifest = read_manifest(root)
    policy = DevicePolicy(torch.device("cpu"), precision, manifest.mean, manifest.std)
    assert policy.scaler.is_enabled() == (precision == "fp16")
    torch.manual_seed(0)
    model = build_model(len(manifest.classes))
    cfg = config(tiny_dataset, "/tmp/unused", "optimizer.name=adamw", "optimizer.lr=0.001")
    optimizer, _ = build_optimizer(model, cfg)
    # A few images: half precision on the CPU has slow kernels.
    loader = list(itertools.islice(RowGroupStream(root, manifest, "val", batch_size=4), 3))
    before = [p.detach().clone() for p in model.parameters()]
    t = train_one_epoch(model, loader, optimizer, torch.nn.CrossEntropyLoss(), policy=policy)
    assert t["images"] == 12 and torch.isfinite(torch.tensor(t["loss_sum"]))
    changed = any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    # fp16: the scaler skips steps whose gradients overflowed, and lowers its scale instead.
    assert changed or (precision == "fp16" and policy.scaler.get_scale() < 2.0**16)
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
    stream = RowGroupStream(root, manifest, "train", batch_size=64)
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
    monkeypatch.setattr(driver.time, "monotonic", lambda: next(clock))
    limit = driver.ElasticWaitLimit(10, min_workers=2)
    waiting, running = RestartingState(training_failed_error=None), RunningState()
    limit.after_controller_state_update(running, waiting)  # t=0: a wait starts
    limit.after_controller_state_update(waiting, waiting)  # t=5
    limit.after_controller_state_update(waiting, running)  # placed: that wait is over
    limit.after_controller_state_update(running, waiting)  # t=6: a new wait
    limit.after_controller_state_update(waiting, waiting)  # t=15: 9 s of it
    with pytest.raises(driver.WorkersNotPlacedError, match=r"waited 10 s for room for 2 workers"):
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
    ]:
        with pytest.raises(ConfigError, match=said):
            resume_changes(old, config(tiny_dataset, "/s", change))
    # A run recorded before the model section trained ResNet-18.
    before = {k: v for k, v in old.items() if k != "model"} | {"pretrained": None}
    assert resume_changes(before, config(tiny_dataset, "/s", "precision=bf16")) == []
    with pytest.raises(ConfigError, match=r"model.name: resnet18 -> mobilenet_v3_small"):
        resume_changes(before, config(tiny_dataset, "/s", "model.name=mobilenet_v3_small"))
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
        return driver.check_model(cfg, read_manifest(root), root)

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

    from pipeline.train.ray_data_input import decode_batch

    root = Location.parse(str(tiny_dataset))
    manifest = read_manifest(root)
    table = pq.read_table(root.child(manifest.splits["val"].files[0].path).path)
    batch = {"image": table["image"].to_numpy()[:5], "label": table["label"].to_numpy()[:5]}
    plain = decode_batch(batch, augment="none", image_size=32)
    # The val stream's first batch: the first rows of the first file, in order.
    images, labels = next(iter(RowGroupStream(root, manifest, "val", batch_size=5)))
    assert plain["image"].dtype == "uint8" and plain["image"].shape == (5, 3, 32, 32)
    assert (plain["image"] == images.numpy()).all()
    assert list(plain["label"]) == labels.tolist()
    torch.manual_seed(0)
    augmented = decode_batch(batch, augment="random_resized_crop", image_size=32)
    assert augmented["image"].shape == (5, 3, 32, 32)
    assert (augmented["image"] != plain["image"]).any()


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
