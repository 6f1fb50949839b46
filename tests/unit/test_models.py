"""Models by name, without a cluster: each architecture checked as the driver checks it, trained
by the workers' own loop (`train_loop_per_worker`, one worker in this process), checkpointed,
resumed, and classified by the inference predictor exactly as by the model in memory. Weights by
file and by name (from caches made here: no network). The bad inputs: test_bad_inputs. On a
cluster: test_s3's chain trains a MobileNet and infers with it."""

from __future__ import annotations

import hashlib
import logging
import math
import shutil
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
import torchvision
from helpers import ARCHITECTURES, USER_MODEL, OneWorker, checkpoint_meta, small_run_config

from harness.cluster import BUNDLE_ROOT
from pipeline.core.config import load_config
from pipeline.core.errors import InputError
from pipeline.core.storage import Location
from pipeline.data.dataset import read_manifest
from pipeline.infer.batch import Predictor
from pipeline.model.checkpoint import ModelInput, ModelSpec, read_meta, save_checkpoint
from pipeline.model.device import DevicePolicy
from pipeline.model.loading import load_model
from pipeline.model.networks import architecture, batchnorm_layers, build_model
from pipeline.model.runs import checkpoint_dir_name
from pipeline.model.weights import head_keys
from pipeline.train import preflight
from pipeline.train.config import TrainConfig
from pipeline.train.input.decoding import Decoded
from pipeline.train.input.rows import RowGroupStream, StreamSpec
from pipeline.train.worker import warn_if_at_chance

timm = pytest.importorskip("timm")
safetensors_torch = pytest.importorskip("safetensors.torch")


def weights_file(name: str, directory: Path) -> Path:
    """A state_dict of `name` as it would be downloaded: its builder's own head (1000
    classes), a torch.save file for torchvision, .safetensors for timm."""
    torch.manual_seed(123)
    if name.startswith("timm/"):
        path = directory / f"{name[5:]}.safetensors"
        safetensors_torch.save_file(timm.create_model(name[5:]).state_dict(), str(path))
    else:
        path = directory / f"{name}.pth"
        torch.save(torchvision.models.get_model(name).state_dict(), path)
    return path


def assert_backbone_from(model: torch.nn.Module, state: dict, name: str, kwargs: dict, n: int):
    head = head_keys(architecture(name, kwargs), n)
    assert head and all(model.state_dict()[k].shape[0] == n for k in head if "weight" in k)
    for key, value in model.state_dict().items():
        if key not in head:
            assert torch.equal(value, state[key]), key


def val_rows(dataset: Path) -> dict:
    manifest = read_manifest(Location.parse(str(dataset)))
    tables = [pq.read_table(dataset / f.path) for f in manifest.splits["val"].files]
    return {
        "data": np.concatenate([t["image"].to_numpy() for t in tables]),
        "source_id": np.concatenate([t["source_id"].to_numpy() for t in tables]),
        "label_name": np.concatenate([t["label_name"].to_numpy() for t in tables]),
    }


# Each architecture's settings; whether the run starts from a weights file of it.
FROM_FILE = {"resnet18", "mobilenet_v3_small", "timm"}
MODELS = [pytest.param(s, name in FROM_FILE, id=name) for name, s in ARCHITECTURES.items()]


@pytest.mark.parametrize(("settings", "from_file"), MODELS)
def test_a_model_trains_resumes_and_infers_as_in_memory(
    small_dataset, tmp_path, settings, from_file
):
    storage = tmp_path / "runs"
    cfg = small_run_config(small_dataset, storage, "epochs=1", *settings)
    name, kwargs = cfg.model.name, cfg.model.kwargs
    if from_file:
        path = weights_file(name, tmp_path)
        cfg = small_run_config(
            small_dataset, storage, "epochs=1", *settings, f"model.weights={path}"
        )
        state = safetensors_torch.load_file(str(path)) if path.suffix == ".safetensors" else None
        state = state or torch.load(path, weights_only=True)
        assert_backbone_from(
            build_model(3, name=name, kwargs=kwargs, weights=str(path)), state, name, kwargs, 3
        )
    root = Location.parse(str(small_dataset))
    manifest = read_manifest(root)
    inputs = preflight.check_model(cfg, manifest, root)
    assert inputs.image_size == (16 if name == "timm/test_vit" else 32)

    run = OneWorker(storage / "run")
    run.run(cfg, inputs)
    first = run.run_dir / checkpoint_dir_name(0)
    meta = read_meta(Location.parse(str(first)))
    assert meta.model == ModelSpec(name=name, kwargs=kwargs)
    assert meta.model_input == inputs and meta.image_size == 32
    assert meta.config["model"]["name"] == name

    # Resumed for a second epoch from the checkpoint, the weights file gone: a resumed run
    # needs only its checkpoint.
    if from_file:
        path.unlink()
    run.run(
        small_run_config(small_dataset, storage, "epochs=2", *settings),
        inputs,
        resume_from=first.name,
    )
    last = Location.parse(str(run.run_dir / checkpoint_dir_name(1)))
    resumed = read_meta(last)
    assert [h["epoch"] for h in resumed.history] == [0, 1] and resumed.history[0] == meta.metrics

    # The inference predictor rebuilds the network from the checkpoint alone and gives what
    # the model in memory gives, image for image.
    rows = val_rows(small_dataset)
    predictor = Predictor(last, use_gpu=False, precision="fp32", top_k=3, decode_size=32)
    table = predictor(rows)
    assert table.num_rows == manifest.splits["val"].rows
    policy = DevicePolicy.for_input(torch.device("cpu"), "fp32", inputs)
    val = Decoded(RowGroupStream(root, manifest, "val", StreamSpec(batch_size=64)))
    model = run.model.eval()
    with torch.no_grad():
        expected = torch.cat([model(policy.inputs(x)).softmax(dim=1) for x, _ in val])
    probs, top = expected.topk(3, dim=1)
    assert table["top_k"].to_pylist() == top.tolist()
    assert np.allclose(table["top_k_prob"].to_pylist(), probs.numpy(), atol=1e-5)
    # ...and what training measured on the val split.
    accuracy = np.mean(np.array(table["pred"]) == np.array(table["label"]))
    assert accuracy == pytest.approx(resumed.metrics["val_accuracy"], abs=1e-6)


def test_the_examples_config_names_the_examples_module(small_dataset):
    example = BUNDLE_ROOT / "examples" / "custom_model" / "train.yaml"
    cfg = load_config(TrainConfig, example, [f"dataset={small_dataset}", "storage_path=/runs"])
    assert cfg.model.name == USER_MODEL
    root = Location.parse(str(small_dataset))
    assert preflight.check_model(cfg, read_manifest(root), root).image_size == 32


def test_a_vision_transformer_by_name_for_small_images(small_dataset):
    # torchvision's ViT-B/16 (86M parameters: checked, not trained here) for 32 px squares.
    root = Location.parse(str(small_dataset))
    vit = ["model.name=vit_b_16", "model.kwargs.image_size=32"]
    cfg = small_run_config(small_dataset, small_dataset.parent, *vit)
    assert preflight.check_model(cfg, read_manifest(root), root).image_size == 32
    assert head_keys(architecture("vit_b_16", {"image_size": 32}), 3) == {
        "heads.head.weight",
        "heads.head.bias",
    }


def test_torchvision_weights_by_name_come_from_the_torch_hub_cache(tmp_path, monkeypatch):
    # What `model.weights=IMAGENET1K_V1` downloads once per node, placed in the cache first.
    weights = torchvision.models.MobileNet_V3_Small_Weights.IMAGENET1K_V1
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    cached = tmp_path / "hub" / "checkpoints" / Path(weights.url).name
    cached.parent.mkdir(parents=True)
    shutil.copy(weights_file("mobilenet_v3_small", tmp_path), cached)
    model = build_model(3, name="mobilenet_v3_small", weights="IMAGENET1K_V1")
    state = torch.load(cached, weights_only=True)
    assert_backbone_from(model, state, "mobilenet_v3_small", {}, 3)
    # The same name through DEFAULT, its alias.
    model = build_model(3, name="mobilenet_v3_small", weights="DEFAULT")
    assert_backbone_from(model, state, "mobilenet_v3_small", {}, 3)


def test_timm_weights_by_name_come_from_the_hugging_face_hub(tmp_path, monkeypatch, small_dataset):
    # timm's own pretrained=True path: hf_hub_download finds the file in the hub's cache (offline
    # here), as it does on a node that downloaded it before.
    from huggingface_hub import constants

    repo = timm.models.get_pretrained_cfg("test_convnext").hf_hub_id  # timm/test_convnext.<tag>
    revision = hashlib.sha1(b"r").hexdigest()
    snapshot = tmp_path / f"models--{repo.replace('/', '--')}" / "snapshots" / revision
    snapshot.mkdir(parents=True)
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text(revision)
    shutil.copy(weights_file("timm/test_convnext", tmp_path), snapshot / "model.safetensors")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)

    model = build_model(3, name="timm/test_convnext", weights="DEFAULT")
    state = safetensors_torch.load_file(str(snapshot / "model.safetensors"))
    assert_backbone_from(model, state, "timm/test_convnext", {}, 3)

    # The weights' metadata (timm's pretrained_cfg) sets the input: 160 px, bicubic, mean 0.5.
    root = Location.parse(str(small_dataset))
    manifest = read_manifest(root)
    timm_default = ["model.name=timm/test_convnext", "model.weights=DEFAULT"]
    cfg = small_run_config(small_dataset, tmp_path, *timm_default)
    with pytest.raises(InputError, match=r"stores 32 px .* the 160 px model timm/test_convnext"):
        preflight.check_model(cfg, manifest, root)
    cfg = small_run_config(small_dataset, tmp_path, *timm_default, "model.input.image_size=32")
    expected = ModelInput(32, "bicubic", (0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
    assert preflight.check_model(cfg, manifest, root) == expected


# torchvision's MobileNetV3 (momentum 0.01, eps 0.001), timm's BatchNormAct2d, the user's own.
BATCHNORM_MODELS = ["mobilenet_v3_small", "timm/test_efficientnet", USER_MODEL]


@pytest.mark.parametrize("name", BATCHNORM_MODELS)
def test_model_bn_momentum_and_eps_reach_every_batchnorm_layer_and_the_checkpoint(name, tmp_path):
    own = batchnorm_layers(build_model(3, name=name))
    assert own
    model = build_model(3, name=name, bn_momentum=0.1, bn_eps=2e-3)
    layers = batchnorm_layers(model)
    assert len(layers) == len(own)
    assert {(layer.momentum, layer.eps) for layer in layers} == {(0.1, 2e-3)}
    unset = build_model(3, name=name, bn_eps=2e-3)  # momentum: the builder's own
    assert [layer.momentum for layer in batchnorm_layers(unset)] == [b.momentum for b in own]

    # A checkpoint rebuilds the network with them: eps changes what evaluation computes.
    spec = ModelSpec(name=name, bn_momentum=0.1, bn_eps=2e-3)
    save_checkpoint(tmp_path, model.state_dict(), checkpoint_meta(model=spec), {})
    loaded, meta = load_model(Location.parse(str(tmp_path)))
    assert meta.model == spec
    assert {(layer.momentum, layer.eps) for layer in batchnorm_layers(loaded)} == {(0.1, 2e-3)}


def test_a_val_loss_stuck_at_chance_while_train_loss_falls_names_batchnorm(caplog):
    mobilenet = build_model(6, name="mobilenet_v3_small")
    stuck = {"epoch": 2, "train_loss": 0.9, "val_loss": math.log(6) + 0.004}
    with caplog.at_level(logging.WARNING, logger="pipeline.train.worker"):
        warn_if_at_chance(stuck, 6, mobilenet)
    [record] = caplog.records
    assert "ln(6 classes)" in record.message and "momentum 0.01" in record.message
    assert "model.bn_momentum=0.1" in record.message
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="pipeline.train.worker"):
        warn_if_at_chance(stuck, 6, build_model(6, name="mobilenet_v3_small", bn_momentum=0.1))
    [record] = caplog.records  # early in a run: statistics that lag fast-changing weights
    assert "momentum 0.1)" in record.message and "next epochs" in record.message
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="pipeline.train.worker"):
        warn_if_at_chance({**stuck, "val_loss": 1.2}, 6, mobilenet)  # learning
        warn_if_at_chance({**stuck, "train_loss": 1.79}, 6, mobilenet)  # not learning at all
        warn_if_at_chance(stuck, 6, torch.nn.Linear(3, 6))  # no BatchNorm to blame
    assert not caplog.records
