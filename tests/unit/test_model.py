"""The default network (ResNet-18) and the checkpoint directory: round trip, metadata, formats,
weights files, bad inputs. Other architectures: test_models."""

import json
import logging

import numpy as np
import pytest
import torch
from helpers import checkpoint_meta, png_bytes

from pipeline.core.config import load_config
from pipeline.core.errors import ConfigError, InputError
from pipeline.core.storage import Location
from pipeline.infer.batch import Predictor, classes_unknown, log_weights
from pipeline.infer.sink import Tally
from pipeline.infer.summary import summarize
from pipeline.model.checkpoint import (
    CHECKPOINT_FORMAT,
    EMA,
    EMA_WEIGHTS,
    METADATA,
    load_train_state,
    load_weights,
    read_meta,
    save_checkpoint,
    served_weights,
)
from pipeline.model.device import DevicePolicy
from pipeline.model.loading import load_model
from pipeline.model.networks import build_model, unwrap
from pipeline.train.config import TrainConfig
from pipeline.train.optim import OptimState

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
    # Which weights serve is ranked by the run's score: metadata without it is refused on read,
    # not failed on in the infer job or a serve replica.
    unranked = json.loads(checkpoint_meta().model_dump_json()) | {"config": {"epochs": 5}}
    (tmp_path / METADATA).write_text(json.dumps(unranked))
    with pytest.raises(
        InputError,
        match=r"^\S+ is not valid checkpoint metadata \(config: Value error, config holds no "
        r"checkpoint.metric, .*\)$",
    ):
        read_meta(checkpoint)
    # An older format than this code reads, and a newer one, are refused as such.
    for older in ({"format": 1, "model": "vit_b_16"}, {"format": CHECKPOINT_FORMAT - 1}):
        meta = json.loads(checkpoint_meta().model_dump_json()) | older
        (tmp_path / METADATA).write_text(json.dumps(meta))
        name = "vit_b_16" if older["format"] == 1 else "resnet18"
        with pytest.raises(
            InputError,
            match=rf"^\S+ holds a {name} checkpoint of format {older['format']}; this code reads "
            rf"format {CHECKPOINT_FORMAT}$",
        ):
            read_meta(checkpoint)
    newer = CHECKPOINT_FORMAT + 1
    (tmp_path / METADATA).write_text(checkpoint_meta(format=newer).model_dump_json())
    with pytest.raises(InputError, match=rf"is a checkpoint of format {newer}, newer than this"):
        read_meta(checkpoint)


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


def optim_state(model: torch.nn.Module, precision: str, *overrides: str) -> OptimState:
    cfg = load_config(TrainConfig, None, ["dataset=/d", "storage_path=/s", *overrides])
    return OptimState(model, cfg, precision=precision, device=torch.device("cpu"))


def test_a_resume_in_fp16_of_a_run_trained_without_it_starts_a_new_scaler(tmp_path):
    # Trained where precision=auto picked fp32 (a CPU) or bf16 (an A100): its scaler was off.
    model = build_model(len(CLASSES))
    trained = optim_state(model, "bf16")
    save_checkpoint(tmp_path, model.state_dict(), checkpoint_meta(), trained.state_dict())
    # Resumed where auto picks fp16 (a GPU before Ampere); a CPU scaler stands in for its.
    here = optim_state(model, "fp16")
    [note] = here.load_state_dict(load_train_state(Location.parse(str(tmp_path))))
    assert note.endswith("fp16 here starts with a new grad scaler")
    assert here.scaler.get_scale() == torch.amp.GradScaler("cpu").get_scale()
    with policy("fp16").autocast():
        loss = model(torch.randn(2, 3, 32, 32)).float().sum()
    here.scaler.scale(loss).backward()
    here.scaler.step(here.optimizer)
    here.scaler.update()
    # An fp16 checkpoint's scaler comes back as it was; a bf16 resume of it ignores it.
    trained_fp16 = here.state_dict()
    again = optim_state(model, "fp16")
    assert again.load_state_dict(trained_fp16) == []
    assert again.scaler.get_scale() == here.scaler.get_scale()
    assert optim_state(model, "bf16").load_state_dict(trained_fp16) == []


def ema_checkpoint(directory, raw, ema, metrics: dict, metric: str):
    meta = checkpoint_meta(
        metrics={"epoch": 4, **metrics}, config={"checkpoint": {"metric": metric}}
    )
    save_checkpoint(directory, raw.state_dict(), meta, {}, ema=ema.state_dict())
    return Location.parse(str(directory))


# The run's checkpoint.metric decides, by its own val metric: accuracy and loss disagree here.
DISAGREE = {"val_accuracy": 0.75, "ema_val_accuracy": 0.5, "val_loss": 0.6, "ema_val_loss": 0.4}


@pytest.mark.parametrize(
    ("metric", "metrics", "served", "shown"),
    [
        (
            "val_accuracy",
            {"val_accuracy": 0.5, "ema_val_accuracy": 0.75},
            "ema",
            "val_accuracy (max)",
        ),
        ("val_accuracy", DISAGREE, "raw", "val_accuracy (max)"),
        (
            "val_accuracy",
            {"val_accuracy": 0.5, "ema_val_accuracy": 0.5},
            "raw",
            "val_accuracy (max)",
        ),
        ("val_loss", DISAGREE, "ema", "val_loss (min)"),
        ("val_loss", {"val_loss": 0.4, "ema_val_loss": 0.6}, "raw", "val_loss (min)"),
        ("last", DISAGREE, "ema", "val_loss (min)"),
    ],
)
def test_inference_serves_the_better_of_the_raw_and_ema_weights(
    tmp_path, caplog, metric, metrics, served, shown
):
    torch.manual_seed(0)
    models = {"raw": build_model(len(CLASSES)).eval(), "ema": build_model(len(CLASSES)).eval()}
    checkpoint = ema_checkpoint(tmp_path, *models.values(), metrics, metric)
    assert (tmp_path / EMA_WEIGHTS).exists() and read_meta(checkpoint).ema_weights == EMA_WEIGHTS
    loaded, meta = load_model(checkpoint)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(loaded(x), models[served](x))
        assert torch.equal(load_model(checkpoint, weights="raw")[0](x), models["raw"](x))
    # The job's log and the predictions' summary say which, by what, and what each scored.
    key = shown.split()[0]
    scores = {"raw": metrics[key], "ema": metrics[f"ema_{key}"]}
    caplog.set_level(logging.INFO, logger="pipeline.infer.batch")
    log_weights(checkpoint, meta)
    assert (
        f"classifying with the {served} weights ({shown}: raw {scores['raw']:.4f}, "
        f"ema {scores['ema']:.4f})" in caplog.text
    )
    none = Tally.empty(len(CLASSES))
    summary = summarize(meta, checkpoint, checkpoint, None, none, none, 0.0, 1.0)
    assert summary["weights"] == served
    assert (summary["weights_by"], summary["weights_scores"]) == (shown, scores)


def test_inference_keeps_the_inputs_labels_and_warns_of_classes_the_checkpoint_lacks(
    tmp_path, caplog
):
    save_checkpoint(tmp_path, build_model(len(CLASSES)).eval().state_dict(), checkpoint_meta(), {})
    predictor = Predictor(
        Location.parse(str(tmp_path)), use_gpu=False, precision="fp32", top_k=2, decode_size=32
    )
    batch = {
        "data": np.array([png_bytes("red_circle", i) for i in range(3)], dtype=object),
        "source_id": np.array(["dog/1", "a/1", "2"], dtype=object),
        "label_name": np.array(["dog", "a", ""], dtype=object),  # "": no label
    }
    rows = predictor(batch).to_pylist()
    # A label of no checkpoint class has no index, and keeps its name.
    assert [(r["label"], r["label_name"]) for r in rows] == [(None, "dog"), (0, "a"), (None, None)]

    caplog.set_level(logging.WARNING, logger="pipeline.infer.batch")
    assert classes_unknown(["a", "b"], CLASSES) == [] and not caplog.text
    assert classes_unknown(["cat", "dog"], CLASSES) == ["cat", "dog"]
    assert (
        "none of the input's classes [cat, dog] is a class of the checkpoint [a, b, c]: no "
        "accuracy" in caplog.text
    )
    assert classes_unknown(["a", "dog"], CLASSES) == ["dog"]
    assert "1 of the input's classes are not classes of the checkpoint [a, b, c]: [dog]" in (
        caplog.text
    )


def test_a_checkpoint_without_an_ema_serves_its_weights(tmp_path):
    model = build_model(len(CLASSES))
    metrics = {"epoch": 4, "val_accuracy": 0.5, "ema_val_accuracy": 0.9}  # no EMA file: ignored
    save_checkpoint(tmp_path, model.state_dict(), checkpoint_meta(metrics=metrics), {})
    meta = read_meta(Location.parse(str(tmp_path)))
    assert meta.ema_weights is None and served_weights(meta) == "raw"
    assert not (tmp_path / EMA_WEIGHTS).exists()


def test_a_resume_restores_the_ema(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    ema_on = ("ema.enabled=true", "ema.decay=0.9", "ema.every_steps=2")
    saved = optim_state(model, "fp32", *ema_on)
    ema = saved.ema
    for _ in range(5):
        model.weight.data.add_(0.1)
        ema.step(model)
    weights, state = model.state_dict(), saved.state_dict()
    save_checkpoint(tmp_path, weights, checkpoint_meta(), state, ema=saved.ema_weights())
    # What the checkpointer's restore reads from the checkpoint, into a fresh model and EMA.
    checkpoint = Location.parse(str(tmp_path))
    meta, train_state = read_meta(checkpoint), load_train_state(checkpoint)
    resumed_model = torch.nn.Linear(4, 2)
    resumed_model.load_state_dict(load_weights(checkpoint))
    restored = optim_state(resumed_model, "fp32", *ema_on)
    notes = restored.load_state_dict(train_state, ema_weights=load_weights(checkpoint, meta, EMA))
    assert notes == ["resumed the EMA of the weights (2 updates)"]
    resumed = restored.ema
    assert (resumed.steps, resumed.updates) == (ema.steps, ema.updates) == (5, 2)
    assert torch.equal(resumed.module.weight, ema.module.weight)
    # It goes on as the one it was saved from: the next update averages, not copies.
    for m, e in ((model, ema), (resumed_model, resumed)):
        m.weight.data.add_(0.1)
        e.step(m)
    assert torch.equal(resumed.module.weight, ema.module.weight)
    assert not torch.equal(resumed.module.weight, resumed_model.weight)
    # A checkpoint without one (EMA turned on at the resume): a new EMA, from these weights.
    fresh = optim_state(torch.nn.Linear(4, 2), "fp32", *ema_on)
    fresh.model.load_state_dict(resumed_model.state_dict())
    [note] = fresh.load_state_dict(optim_state(resumed_model, "fp32").state_dict())
    assert note.startswith("the checkpoint has no EMA of the weights")
    assert fresh.ema.updates == 0
    assert torch.equal(fresh.ema.module.weight, resumed_model.weight)
    assert optim_state(resumed_model, "fp32").ema is None


def test_a_checkpoint_of_a_compiled_model_loads_into_a_plain_one(tmp_path):
    from pipeline.train.epoch import StepRecipe, train_one_epoch

    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 4 * 4, 3))
    # The "eager" backend: the same wrapping as the worker's torch.compile (inductor), whose
    # code generation would take this test tens of seconds.
    compiled = torch.compile(plain, backend="eager")
    data = [(torch.zeros(4, 3, 4, 4, dtype=torch.uint8), torch.zeros(4, dtype=torch.long))]
    optimizer = torch.optim.SGD(compiled.parameters(), lr=0.1)
    loss = torch.nn.CrossEntropyLoss()
    train_one_epoch(compiled, data, optimizer, loss, policy=policy("fp32"), recipe=StepRecipe())
    assert all(k.startswith("_orig_mod.") for k in compiled.state_dict())
    # What the worker saves: the bare model's state_dict, whatever wraps it.
    save_checkpoint(tmp_path, unwrap(compiled).state_dict(), checkpoint_meta(), {})
    again = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 4 * 4, 3))
    again.load_state_dict(load_weights(Location.parse(str(tmp_path))))  # strict
    x = torch.randn(2, 3, 4, 4)
    with torch.no_grad():
        assert torch.equal(again(x), compiled(x))
