"""ResNet-18 construction and the checkpoint directory: round trip, metadata, bad inputs."""

import json

import pytest
import torch
from helpers import checkpoint_meta

from pipeline.core.errors import InputError
from pipeline.core.storage import Location
from pipeline.model.checkpoint import (
    METADATA,
    load_train_state,
    read_meta,
    save_checkpoint,
)
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
    (tmp_path / METADATA).write_text(checkpoint_meta(model="vit_b_16").model_dump_json())
    with pytest.raises(InputError, match=r"holds a vit_b_16 checkpoint"):
        read_meta(checkpoint)


def test_pretrained_state_dict_file_sets_the_backbone_not_the_head(tmp_path):
    torch.manual_seed(1)
    source = build_model(1000)
    torch.save(source.state_dict(), tmp_path / "resnet18.pt")
    model = build_model(3, pretrained=str(tmp_path / "resnet18.pt"))
    assert torch.equal(model.conv1.weight, source.conv1.weight)
    assert model.fc.out_features == 3

    torch.save({"weight": torch.zeros(2)}, tmp_path / "other.pt")
    with pytest.raises(InputError, match=r"is not a resnet18 state_dict"):
        build_model(3, pretrained=str(tmp_path / "other.pt"))
    with pytest.raises(InputError, match=r"do not exist"):
        build_model(3, pretrained=str(tmp_path / "missing.pt"))
    with pytest.raises(InputError, match=r"IMAGENET1K_V1"):
        build_model(3, pretrained="IMAGENET")
