"""The default network (ResNet-18) and the checkpoint directory: round trip, metadata, formats,
weights files, bad inputs. Other architectures: test_models."""

import json

import pytest
import torch
from helpers import checkpoint_meta

from pipeline.core.errors import ConfigError, InputError
from pipeline.core.storage import Location
from pipeline.model.checkpoint import (
    METADATA,
    ModelInput,
    ModelSpec,
    load_train_state,
    read_meta,
    save_checkpoint,
)
from pipeline.model.device import DevicePolicy
from pipeline.model.networks import build_model, load_model, unwrap

CLASSES = ["a", "b", "c"]


def test_checkpoint_round_trip_gives_the_same_predictions(tmp_path):
    torch.manual_seed(0)
    model = build_model(len(CLASSES)).eval()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 3, 32, 32)).sum().backward()
    optimizer.step()
    save_checkpoint(
        tmp_path, model.state_dict(), checkpoint_meta(), {"optimizer": optimizer.state_dict()}
    )

    checkpoint = Location.parse(str(tmp_path))
    loaded, loaded_meta = load_model(checkpoint)  # torch.load(weights_only=True) inside
    x = torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))
    assert loaded_meta == checkpoint_meta()
    assert json.loads((tmp_path / METADATA).read_text())["history"][0]["epoch"] == 4
    state = load_train_state(checkpoint)
    assert state["optimizer"]["state"][0]["momentum_buffer"].shape == model.conv1.weight.shape


def test_unwrap_finds_the_bare_model():
    model = torch.nn.Linear(2, 2)
    outer = torch.nn.Module()
    outer.module = model
    assert unwrap(outer) is model and unwrap(model) is model


def test_metadata_problems_are_clear_errors(tmp_path):
    checkpoint = Location.parse(str(tmp_path))
    with pytest.raises(InputError, match=r"no metadata.json: not a checkpoint"):
        read_meta(checkpoint)
    (tmp_path / METADATA).write_text('{"epoch": 1}')
    with pytest.raises(InputError, match=r"not valid checkpoint metadata"):
        read_meta(checkpoint)
    # Format 1 held ResNet-18 alone; a format this code does not know is refused.
    for fmt, model in [(1, "vit_b_16"), (3, "resnet18")]:
        (tmp_path / METADATA).write_text(checkpoint_meta(format=fmt, model=model).model_dump_json())
        with pytest.raises(InputError, match=rf"holds a {model} checkpoint of format {fmt}; this"):
            read_meta(checkpoint)


def test_a_checkpoint_from_before_models_by_name_still_loads(tmp_path):
    # Format 1: `"model": "resnet18"`, no input size or interpolation (the stored images were
    # fed as they were).
    old = json.loads(checkpoint_meta().model_dump_json())
    old |= {"format": 1, "model": "resnet18"}
    del old["input_size"], old["interpolation"]
    torch.manual_seed(0)
    model = build_model(len(CLASSES)).eval()
    save_checkpoint(tmp_path, model.state_dict(), checkpoint_meta(), {})
    (tmp_path / METADATA).write_text(json.dumps(old))
    loaded, meta = load_model(Location.parse(str(tmp_path)))
    assert meta.model == ModelSpec(name="resnet18", kwargs={})
    assert meta.model_input == ModelInput(32, "bilinear", (0.5,) * 3, (0.2,) * 3)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))


def test_pretrained_state_dict_file_sets_the_backbone_not_the_head(tmp_path):
    torch.manual_seed(1)
    source = build_model(1000)
    torch.save(source.state_dict(), tmp_path / "resnet18.pt")
    model = build_model(3, weights=str(tmp_path / "resnet18.pt"))
    assert torch.equal(model.conv1.weight, source.conv1.weight)
    assert model.fc.out_features == 3
    # A training checkpoint that holds it, saved from DDP: found and unwrapped.
    ddp = {"model": {f"module.{k}": v for k, v in source.state_dict().items()}, "epoch": 3}
    torch.save(ddp, tmp_path / "wrapped.pt")
    model = build_model(3, weights=str(tmp_path / "wrapped.pt"))
    assert torch.equal(model.layer4[1].bn2.running_var, source.layer4[1].bn2.running_var)

    torch.save({"weight": torch.zeros(2)}, tmp_path / "other.pt")
    with pytest.raises(InputError, match=r"\S+other.pt do not fit model resnet18 .*: 120 tens"):
        build_model(3, weights=str(tmp_path / "other.pt"))
    with pytest.raises(InputError, match=r"model.weights \S+missing.pt do not exist"):
        build_model(3, weights=str(tmp_path / "missing.pt"))
    (tmp_path / "junk.pt").write_bytes(b"not a zip")
    with pytest.raises(InputError, match=r"junk.pt is not a state_dict file: "):
        build_model(3, weights=str(tmp_path / "junk.pt"))
    with pytest.raises(ConfigError, match=r"'IMAGENET' is not a weights name of resnet18 \(IM"):
        build_model(3, weights="IMAGENET")


def policy(precision: str) -> DevicePolicy:
    return DevicePolicy(torch.device("cpu"), precision, (0.5,) * 3, (0.2,) * 3)


def test_a_resume_in_fp16_of_a_run_trained_without_it_starts_a_new_scaler(tmp_path):
    # Trained where precision=auto picked fp32 (a CPU) or bf16 (an A100): its scaler was off.
    model = build_model(len(CLASSES))
    state = {"scaler": policy("bf16").scaler.state_dict()}
    save_checkpoint(tmp_path, model.state_dict(), checkpoint_meta(), state)
    # Resumed where auto picks fp16 (a GPU before Ampere); a CPU scaler stands in for its.
    here = policy("fp16")
    assert not here.load_scaler(load_train_state(Location.parse(str(tmp_path)))["scaler"])
    assert here.scaler.get_scale() == torch.amp.GradScaler("cpu").get_scale()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with here.autocast():
        loss = model(torch.randn(2, 3, 32, 32)).float().sum()
    here.scaler.scale(loss).backward()
    here.scaler.step(optimizer)
    here.scaler.update()
    # An fp16 checkpoint's scaler comes back as it was; a bf16 resume of it ignores it.
    trained_fp16 = here.scaler.state_dict()
    again = policy("fp16")
    assert again.load_scaler(trained_fp16)
    assert again.scaler.get_scale() == here.scaler.get_scale()
    assert policy("bf16").load_scaler(trained_fp16)
