"""The user's loss, metrics and augmentation, by config: class weights from the train split's
counts, the built-in metrics and hooks (module:function) from a module outside the checkout,
trained by the workers' own loop in this process; what the run records and ranks by, and a
checkpoint trained with hooks used by inference, export and the MLflow model without them."""

from __future__ import annotations

import csv
import io
import math
import re
import shutil
import sys
import textwrap

import mlflow.pyfunc
import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from helpers import (
    OneWorker,
    small_run_config,
)
from PIL import Image
from user_code import HOOKS

from harness.cluster import BUNDLE_ROOT
from pipeline.core.config import load_config
from pipeline.core.errors import ConfigError
from pipeline.core.storage import Location
from pipeline.data.dataset import read_manifest
from pipeline.data.images import encode_image
from pipeline.export import exporter
from pipeline.export.config import ExportConfig
from pipeline.model.checkpoint import (
    Score,
    best_of,
    config_score,
    read_meta,
    served_weights,
)
from pipeline.model.classifier import Classifier
from pipeline.model.device import DevicePolicy
from pipeline.model.loading import load_model
from pipeline.model.runs import checkpoint_dir_name, history_csv
from pipeline.tracking import pyfunc
from pipeline.train import preflight
from pipeline.train.augment import train_transform
from pipeline.train.config import TrainConfig
from pipeline.train.hooks import build_loss, build_metrics, class_weights
from pipeline.train.input.decoding import augmented
from pipeline.train.input.device_decode import pick_decode
from pipeline.train.input.loaders import train_data
from pipeline.tune import sweep, trials
from pipeline.tune.config import SweepConfig


@pytest.fixture
def user_hooks(tmp_path, monkeypatch):
    """The module `my_hooks` in a folder of its own outside the checkout, importable as the
    train job's would be (on sys.path); forgotten again after the test."""
    folder = tmp_path / "user_code"
    folder.mkdir()
    (folder / "my_hooks.py").write_text(textwrap.dedent(HOOKS))
    monkeypatch.syspath_prepend(str(folder))
    yield folder
    sys.modules.pop("my_hooks", None)


def imbalanced(manifest, counts: dict[str, int]):
    """`manifest` whose train split counts `counts` rows of each class."""
    train = manifest.splits["train"].model_copy(update={"counts": counts})
    return manifest.model_copy(update={"splits": {**manifest.splits, "train": train}})


def test_balanced_class_weights_weigh_the_loss_by_the_train_counts(small_dataset, tmp_path):
    manifest = read_manifest(Location.parse(str(small_dataset)))
    a, b, c = manifest.classes
    manifest = imbalanced(manifest, {a: 50, b: 50, c: 10})  # c five times rarer
    cfg = small_run_config(small_dataset, tmp_path, "class_weights=balanced")
    weights = class_weights(cfg, manifest)
    assert weights.tolist() == pytest.approx([110 / 150, 110 / 150, 110 / 30])
    assert weights[2] / weights[0] == pytest.approx(5.0)

    # An image of the rare class counts five times as much in the loss as one of another.
    loss = build_loss(cfg, manifest, torch.device("cpu"))
    logits = torch.tensor([[2.0, 0.5, -1.0], [0.1, 0.2, 1.5], [1.0, 1.0, 1.0]])
    targets = torch.tensor([0, 2, 1])
    each = F.cross_entropy(logits, targets, reduction="none")
    w = weights[targets]
    assert loss(logits, targets).item() == pytest.approx((w * each).sum().item() / w.sum().item())
    plain = build_loss(small_run_config(small_dataset, tmp_path), manifest, torch.device("cpu"))
    assert plain(logits, targets).item() == pytest.approx(each.mean().item())

    # A list: one weight per class, in the manifest's order.
    listed = small_run_config(small_dataset, tmp_path, "class_weights=[1, 2, 3]")
    assert class_weights(listed, manifest).tolist() == [1.0, 2.0, 3.0]
    wrong = small_run_config(small_dataset, tmp_path, "class_weights=[1, 2]")
    with pytest.raises(ConfigError, match=r"^class_weights has 2 weights and the dataset 3 "):
        preflight.check_hooks(wrong, manifest)


def test_crop_scale_ratio_and_flip_reach_the_transform():
    steps = train_transform(
        "random_resized_crop", image_size=32, scale=(0.5, 0.9), ratio=(0.9, 1.1), flip=False
    ).transforms
    assert [type(s).__name__ for s in steps] == ["RandomResizedCrop"]
    assert (steps[0].scale, steps[0].ratio) == ((0.5, 0.9), (0.9, 1.1))
    flipped = train_transform("crop_flip", image_size=32).transforms
    assert [type(s).__name__ for s in flipped] == ["RandomCrop", "RandomHorizontalFlip"]
    cfg = load_config(
        TrainConfig, None, ["dataset=/d", "storage_path=/s", "crop_scale=[0.5, 0.9]", "flip=false"]
    )
    assert (cfg.crop_scale, cfg.crop_ratio, cfg.flip) == ((0.5, 0.9), (0.75, 4 / 3), False)


def test_own_augment_gives_the_same_batches_for_the_same_seed(small_dataset, tmp_path, user_hooks):
    root = Location.parse(str(small_dataset))
    manifest = read_manifest(root)

    def batches(seed: int, epoch: int) -> list[torch.Tensor]:
        cfg = small_run_config(small_dataset, tmp_path, "augment=my_hooks:augment", f"seed={seed}")
        loader = train_data(cfg, root, manifest, rank=0, world=1, device=torch.device("cpu"))
        loader.set_epoch(epoch)
        return [images for images, _ in loader]

    first = batches(0, 0)
    assert first and all(torch.equal(a, b) for a, b in zip(first, batches(0, 0), strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(first, batches(1, 0), strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(first, batches(0, 1), strict=True))


def test_own_augment_draws_repeat_for_the_same_seeds(user_hooks):
    transform = train_transform("my_hooks:augment", image_size=32, auto_augment="none")
    images = [torch.randint(0, 256, (3, 32, 32), dtype=torch.uint8) for _ in range(4)]
    first = augmented(transform, images, [0, 1, 2, 3])
    again = augmented(transform, images, [0, 1, 2, 3])
    other = augmented(transform, images, [4, 5, 6, 7])
    assert all(torch.equal(x, y) for x, y in zip(first, again, strict=True))
    assert not all(torch.equal(x, y) for x, y in zip(first, other, strict=True))
    assert all(x.dtype == torch.uint8 and x.shape == (3, 32, 32) for x in first)


def test_hooks_train_report_rank_and_the_checkpoint_loads_without_them(
    small_dataset, tmp_path, monkeypatch, user_hooks
):
    storage = tmp_path / "runs"
    hooks = (
        "loss=my_hooks:focal",
        "class_weights=balanced",
        "metrics=[my_hooks:macro_f1, top2_accuracy, per_class_recall]",
        "checkpoint.metric=val_macro_f1",
        "augment=my_hooks:augment",
    )
    cfg = small_run_config(small_dataset, storage, "epochs=2", *hooks)
    root = Location.parse(str(small_dataset))
    manifest = read_manifest(root)
    inputs = preflight.check_model(cfg, manifest, root)
    cfg = preflight.check_hooks(cfg, manifest)
    assert cfg.checkpoint.mode == "max"  # from MulticlassF1Score.higher_is_better
    import my_hooks

    my_hooks.CALLS.update(loss=0, augment=0)  # the driver's check called each once
    run = OneWorker(storage / "run")
    run.run(cfg, inputs)
    # The loss trained every step, and the augmentation every image a step trained.
    steps = math.ceil(manifest.splits["train"].rows / 8)
    assert my_hooks.CALLS["loss"] == 2 * steps
    assert my_hooks.CALLS["augment"] == 2 * steps * 8

    last = Location.parse(str(run.run_dir / checkpoint_dir_name(1)))
    meta = read_meta(last)
    history = meta.history
    for row in history:
        assert 0 <= row["val_macro_f1"] <= 1 and 0 <= row["val_top2_accuracy"] <= 1
        assert row["val_top2_accuracy"] >= row["val_accuracy"]
        assert {f"val_recall/{c}" for c in manifest.classes} <= row.keys()
    rows = list(csv.DictReader(io.StringIO(history_csv(history))))
    assert [float(r["val_macro_f1"]) for r in rows] == pytest.approx(
        [h["val_macro_f1"] for h in history]
    )
    # The checkpoint records what was used, and ranks by it, highest first.
    assert meta.config["loss"] == "my_hooks:focal"
    assert meta.config["augment"] == "my_hooks:augment"
    assert meta.config["metrics"][0] == "my_hooks:macro_f1"
    score = config_score(meta.config)
    assert score == Score("val_macro_f1", "val_macro_f1", "max", "val_macro_f1", "max")
    best = best_of(history, lambda h: h[score.key], score.mode)
    assert best["val_macro_f1"] == max(h["val_macro_f1"] for h in history)
    assert served_weights(meta) == "raw"

    # Without the hooks' module: what inference, serving, export and the MLflow model load.
    monkeypatch.syspath_prepend(str(tmp_path / "elsewhere"))
    sys.path.remove(str(user_hooks))
    sys.modules.pop("my_hooks")
    model, _ = load_model(last)
    pixels = np.zeros((1, 3, 32, 32), dtype=np.uint8)
    policy = DevicePolicy.for_input(torch.device("cpu"), "fp32", meta.model_input)
    with torch.no_grad():
        expected = model(policy.inputs(torch.from_numpy(pixels))).softmax(dim=1)
    # Inference's and serving's model, the MLflow model, and an export with its parity check.
    classifier = Classifier(last, use_gpu=False, precision="fp32")
    assert torch.allclose(classifier.probabilities(pixels), expected, atol=1e-5)
    checkpoint = tmp_path / "mlflow" / pyfunc.CHECKPOINT
    shutil.copytree(last.path, checkpoint)
    pyfunc.save(checkpoint, tmp_path / "mlflow" / "model", meta)
    image = Image.new("RGB", (32, 32), (0, 0, 0))
    frame = pd.DataFrame({pyfunc.IMAGES: [encode_image(image, image_format="png")]})
    answer = mlflow.pyfunc.load_model(str(tmp_path / "mlflow" / "model")).predict(frame)
    assert answer["pred"].tolist() == [int(expected.argmax())]
    export = load_config(ExportConfig, None, [f"model={last.path}", "cpus=1"])
    output = Location.parse(str(tmp_path / "export"))
    summary = exporter.export_checkpoint(export, checkpoint=last, output=output)
    assert (tmp_path / "export" / "model.onnx").exists(), summary


def test_a_metric_without_an_order_needs_checkpoint_mode(small_dataset, tmp_path, user_hooks):
    (user_hooks / "unordered.py").write_text(
        "from torchmetrics.classification import MulticlassAccuracy\n\n\n"
        "class Unordered(MulticlassAccuracy):\n    higher_is_better = None\n\n\n"
        "def score(num_classes):\n    return Unordered(num_classes)\n"
    )
    manifest = read_manifest(Location.parse(str(small_dataset)))
    keys = ("metrics=[unordered:score]", "checkpoint.metric=val_score")
    cfg = small_run_config(small_dataset, tmp_path, *keys)
    with pytest.raises(ConfigError, match=r"higher_is_better=None: set checkpoint.mode=max or min"):
        preflight.check_hooks(cfg, manifest)
    cfg = small_run_config(small_dataset, tmp_path, *keys, "checkpoint.mode=min")
    assert preflight.check_hooks(cfg, manifest).checkpoint.mode == "min"
    sys.modules.pop("unordered", None)


@pytest.mark.parametrize(
    ("setting", "said"),
    [
        ("loss=my_hooks:macro_f1", "loss: my_hooks:macro_f1(num_classes=, class_weights=) failed"),
        ("augment=my_hooks:focal", "augment: my_hooks:focal(image_size=) failed"),
        ("metrics=[my_hooks:nothing]", "metrics='my_hooks:nothing': my_hooks has no function"),
        ("metrics=[top5_accuracy]", "metrics: top5_accuracy needs at least 5 classes"),
    ],
)
def test_hooks_are_checked_on_the_driver(small_dataset, tmp_path, user_hooks, setting, said):
    manifest = read_manifest(Location.parse(str(small_dataset)))
    cfg = small_run_config(small_dataset, tmp_path, setting)
    with pytest.raises(ConfigError, match="^" + re.escape(said)):
        preflight.check_hooks(cfg, manifest)


def test_checkpoint_metric_must_be_one_the_run_computes(small_dataset, tmp_path):
    with pytest.raises(ConfigError, match=r"checkpoint.metric=val_macro_f1: use val_loss, "):
        small_run_config(small_dataset, tmp_path, "checkpoint.metric=val_macro_f1")
    keys = ("metrics=[macro_f1, per_class_recall]", "checkpoint.metric=val_macro_f1")
    cfg = small_run_config(small_dataset, tmp_path, *keys)
    manifest = read_manifest(Location.parse(str(small_dataset)))
    resolved = preflight.check_hooks(cfg, manifest)
    assert config_score(resolved.model_dump()).mode == "max"
    with pytest.raises(ConfigError, match=r"checkpoint.metric=val_recall: use val_loss, "):
        small_run_config(
            small_dataset, tmp_path, "metrics=[per_class_recall]", "checkpoint.metric=val_recall"
        )


MY_METRICS = """
import torch
from torchmetrics import Metric
from torchmetrics.classification import MulticlassRecall


def each_recall(num_classes):
    return MulticlassRecall(num_classes, average="none")  # one value per class


class Rows(Metric):
    higher_is_better = True

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.add_state("rows", torch.tensor(0), dist_reduce_fx="sum")

    def update(self, logits, targets):
        self.rows += len(targets)

    def compute(self):
        return self.rows


def rows(num_classes):
    # Built not to sync, in a "process group" whose other rank evaluated 5 rows.
    return Rows(
        sync_on_compute=False,
        distributed_available_fn=lambda: True,
        dist_sync_fn=lambda state, group=None: [state, torch.full_like(state, 5)],
    )
"""


@pytest.fixture
def my_metrics(user_hooks):
    """The module `my_metrics` beside `my_hooks`: a Metric per class, and one built not to sync
    whose ranks' states a fake gather of two ranks gives."""
    (user_hooks / "my_metrics.py").write_text(MY_METRICS)
    yield
    sys.modules.pop("my_metrics", None)


@pytest.mark.parametrize(
    ("metrics", "said"),
    [
        (
            "[per_class_recall, my_metrics:recall]",
            "metrics: per_class_recall, my_metrics:recall report the same val_recall",
        ),
        ("[macro_f1, my_metrics:macro_f1]", "metrics: macro_f1, my_metrics:macro_f1 report the"),
        ("[my_metrics:images]", "metrics: my_metrics:images would report as val_images, the job"),
        ("[my_metrics:loss]", "metrics: my_metrics:loss would report as val_loss, the job's own"),
    ],
)
def test_a_metric_that_would_overwrite_another_is_refused_by_the_config(tmp_path, metrics, said):
    with pytest.raises(ConfigError, match=re.escape(said)):
        small_run_config(tmp_path / "data", tmp_path, f"metrics={metrics}")


def test_a_per_class_metric_cannot_rank_checkpoints(small_dataset, tmp_path, my_metrics):
    manifest = read_manifest(Location.parse(str(small_dataset)))
    keys = ("metrics=[my_metrics:each_recall]", "checkpoint.metric=val_each_recall")
    with pytest.raises(
        ConfigError, match=r"my_metrics:each_recall's Metric computes one value per"
    ):
        preflight.check_hooks(small_run_config(small_dataset, tmp_path, *keys), manifest)
    # Reported, not ranked by, it passes.
    cfg = small_run_config(small_dataset, tmp_path, "metrics=[my_metrics:each_recall]")
    preflight.check_hooks(cfg, manifest)


def test_a_metric_built_not_to_sync_is_computed_over_all_ranks(
    small_dataset, tmp_path, my_metrics, caplog
):
    cfg = small_run_config(small_dataset, tmp_path, "metrics=[my_metrics:rows]")
    metric = build_metrics(cfg, num_classes=3)["rows"]
    metric.update(torch.randn(4, 3), torch.tensor([0, 1, 2, 0]))
    assert metric.compute().item() == 4 + 5  # this rank's rows and the other's
    manifest = read_manifest(Location.parse(str(small_dataset)))
    with caplog.at_level("INFO", logger="pipeline.train.hooks"):
        preflight.check_hooks(cfg, manifest)
    assert "my_metrics:rows's Metric has sync_on_compute=False: computing val_rows over all" in (
        caplog.text
    )


def test_the_examples_hooks_pass_the_drivers_check(small_dataset, tmp_path):
    example = BUNDLE_ROOT / "examples" / "custom_hooks" / "train.yaml"
    cfg = load_config(
        TrainConfig, example, [f"dataset={small_dataset}", f"storage_path={tmp_path}"]
    )
    manifest = read_manifest(Location.parse(str(small_dataset)))
    checked = preflight.check_hooks(cfg, manifest)
    assert config_score(checked.model_dump()).mode == "max"
    loss = build_loss(checked, manifest, torch.device("cpu"))
    logits, targets = torch.randn(4, 3), torch.tensor([0, 1, 2, 0])
    # Each image's cross-entropy scaled by (1 - p)^2 < 1: below the plain mean (equal counts,
    # so the balanced weights are all 1).
    assert 0 < loss(logits, targets).item() < F.cross_entropy(logits, targets).item()


def test_a_sweep_ranks_its_trials_by_your_metric_in_its_order(small_dataset, tmp_path, user_hooks):
    given = [
        f"dataset={small_dataset}",
        f"storage_path={tmp_path}",
        "name=s",
        "train.global_batch_size=8",
        "train.metrics=[my_hooks:errors]",
        "train.checkpoint.metric=val_errors",
    ]
    cfg = load_config(SweepConfig, BUNDLE_ROOT / "configs" / "demo-tune.yaml", given)
    root = Location.parse(str(small_dataset))
    mode = sweep._check_inputs(cfg.trial_configs(), root, read_manifest(root).version)
    assert mode == "min"  # MulticlassHammingDistance.higher_is_better is False
    resolved = cfg.with_checkpoint_mode(mode)
    assert trials.ranking(resolved.score) == ("val_errors", "min")
    assert {c.checkpoint.mode for c in resolved.trial_configs()} == {"min"}
    # A built-in metric needs no resolving: the highest is best.
    builtin = [*given[:4], "train.metrics=[macro_f1]", "train.checkpoint.metric=val_macro_f1"]
    plain = load_config(SweepConfig, BUNDLE_ROOT / "configs" / "demo-tune.yaml", builtin)
    assert trials.ranking(plain.score) == ("val_macro_f1", "max")


def test_decode_auto_keeps_your_own_augment_on_the_cpu(small_dataset, tmp_path):
    # On a CUDA worker with JPEGs auto decodes on the GPU, which only the presets augment on.
    cuda = torch.device("cuda")
    preset = small_run_config(small_dataset, tmp_path, "decode=auto")
    assert pick_decode(preset.decode_setting(), cuda, "jpeg") == "gpu"
    own = small_run_config(small_dataset, tmp_path, "decode=auto", "augment=my_hooks:augment")
    assert pick_decode(own.decode_setting(), cuda, "jpeg") == "cpu"
    with pytest.raises(ConfigError, match=r"augment=my_hooks:augment runs on decoded images"):
        small_run_config(small_dataset, tmp_path, "decode=gpu", "augment=my_hooks:augment")
