"""Export: each kind of model, trained one epoch by the workers' own loop in this process,
exported by the job's function to ONNX and torch.export, then checked here, apart from the job's
own check: ONNX Runtime and the loaded program give PyTorch's classes and probabilities on the
val split, at any batch size, and preprocessing.json is the checkpoint's input. Then what an
export refuses, and a parity check that fails, which commits nothing. The job itself, through
`ray job submit` on the run the cluster tests share: test_infer."""

from __future__ import annotations

import copy
import io
import json
import posixpath
import re
import shutil
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import ARCHITECTURES, OneWorker, jpeg_bytes, small_run_config
from PIL import Image

from harness.cluster import BUNDLE_ROOT
from pipeline.core.config import load_config
from pipeline.core.errors import InputError
from pipeline.core.storage import Location
from pipeline.data.dataset import read_manifest
from pipeline.export import exporter, formats
from pipeline.export.config import ExportConfig
from pipeline.infer.batch import Classifier, prepare_image
from pipeline.model.checkpoint import read_meta, served_weights
from pipeline.model.device import DevicePolicy
from pipeline.model.loading import load_model
from pipeline.model.runs import checkpoint_dir_name
from pipeline.train import preflight
from pipeline.train.input.decoding import Decoded
from pipeline.train.input.rows import RowGroupStream, StreamSpec

ort = pytest.importorskip("onnxruntime")
pytest.importorskip("timm")

# The architectures of test_models, one timm model among them: the ViT, whose 16 px input is
# resized from the stored 32 px images (a resize step in preprocessing.json).
EXPORTED = ["resnet18", "mobilenet_v3_small", "efficientnet_b0", "convnext_tiny", "vit", "user"]


@pytest.fixture(scope="module")
def trained(small_dataset, tmp_path_factory):
    """A function: an architecture's checkpoint after one epoch, trained on first use."""
    checkpoints: dict[str, Location] = {}

    def checkpoint(name: str) -> Location:
        if name not in checkpoints:
            storage = tmp_path_factory.mktemp(name)
            cfg = small_run_config(small_dataset, storage, "epochs=1", *ARCHITECTURES[name])
            root = Location.parse(str(small_dataset))
            inputs = preflight.check_model(cfg, read_manifest(root), root)
            OneWorker(storage / "run").run(cfg, inputs)
            checkpoints[name] = Location.parse(str(storage / "run" / checkpoint_dir_name(0)))
        return checkpoints[name]

    return checkpoint


def export_config(checkpoint: Location, *overrides: str) -> ExportConfig:
    return load_config(ExportConfig, None, [f"model={checkpoint.path}", "cpus=1", *overrides])


def exported(checkpoint: Location, *overrides: str) -> tuple[Path, dict]:
    """Export `checkpoint` to its default output by the job's function: the output, the
    summary."""
    output = exporter.default_output(checkpoint)
    cfg = export_config(checkpoint, *overrides)
    return Path(output.path), exporter.export_checkpoint(cfg, checkpoint=checkpoint, output=output)


def export_once(checkpoint: Location) -> Path:
    """The default output of `checkpoint`, exported unless it is already."""
    out = Path(exporter.default_output(checkpoint).path)
    if not (out / exporter.PREPROCESSING).exists():
        exported(checkpoint)
    return out


def val_inputs(dataset: Path, model_input) -> tuple[torch.Tensor, np.ndarray]:
    """The val split as the training loop reads it, fed as training feeds it: float32 NCHW."""
    root = Location.parse(str(dataset))
    policy = DevicePolicy.for_input(torch.device("cpu"), "fp32", model_input)
    stream = Decoded(RowGroupStream(root, read_manifest(root), "val", StreamSpec(batch_size=64)))
    pairs = list(stream)
    return torch.cat([policy.inputs(x) for x, _ in pairs]), torch.cat([y for _, y in pairs]).numpy()


def softmax(logits) -> np.ndarray:
    return torch.as_tensor(logits).softmax(dim=1).numpy()


@pytest.mark.parametrize("name", EXPORTED)
def test_an_export_gives_what_the_checkpoint_gives(name, trained, small_dataset):
    checkpoint = trained(name)
    out, summary = exported(checkpoint)
    meta = read_meta(checkpoint)
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [formats.ONNX, formats.PT2, exporter.PARITY, exporter.PREPROCESSING]
    )
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")]  # no staging left

    # Independently of the job's own check: the checkpoint's network as inference loads it.
    model, _ = load_model(checkpoint)
    x, labels = val_inputs(small_dataset, meta.model_input)
    with torch.no_grad():
        expected = model.eval()(x).numpy()
    session = ort.InferenceSession(str(out / formats.ONNX), providers=["CPUExecutionProvider"])
    program = torch.export.load(str(out / formats.PT2)).module()
    tolerance = json.loads((out / exporter.PARITY).read_text())["tolerance"]
    for batch in (x[:1], x):  # the batch dimension is free
        want = softmax(expected[: len(batch)])
        onnx_probs = softmax(session.run(None, {formats.INPUT: batch.numpy()})[0])
        with torch.no_grad():
            pt2_probs = softmax(program(batch))
        for got in (onnx_probs, pt2_probs):
            assert np.mean(got.argmax(1) == want.argmax(1)) >= 0.995
            assert np.abs(got - want).max() <= tolerance

    # What the job measured is what was measured here.
    report = summary["parity"]
    val_rows = read_manifest(Location.parse(str(small_dataset))).splits["val"].rows
    assert report["images"] == len(labels) == val_rows and report["split"] == "val"
    assert report["pytorch"]["accuracy"] == pytest.approx(np.mean(expected.argmax(1) == labels))
    for runtime in ("onnxruntime", "torch.export"):
        assert report[runtime]["passed"] and report[runtime]["top1_agreement"] == 1.0
        assert 0 <= report[runtime]["max_abs_prob_diff"] <= tolerance

    # preprocessing.json: the checkpoint's own record of its input, classes and model.
    spec = json.loads((out / exporter.PREPROCESSING).read_text())
    net = meta.model_input
    assert spec["input"]["shape"] == ["batch", 3, net.image_size, net.image_size]
    assert (spec["input"]["image_size"], spec["interpolation"]) == (
        net.image_size,
        net.interpolation,
    )
    assert (spec["input"]["mean"], spec["input"]["std"]) == (list(net.mean), list(net.std))
    assert (spec["input"]["dtype"], spec["input"]["layout"]) == ("float32", "NCHW")
    assert spec["stored_image_size"] == meta.image_size == 32
    assert spec["classes"] == meta.classes
    assert spec["model"] == meta.model.model_dump(mode="json")
    assert (spec["checkpoint"], spec["weights"]) == (checkpoint.uri, served_weights(meta))
    assert spec["onnx_opset"] == 18 and spec["versions"]["torch"] == torch.__version__.split("+")[0]
    resized = [s for s in spec["steps"] if s["op"] == "resize"]
    assert resized == (
        []
        if net.image_size == 32
        else [{"op": "resize", "size": 16, "interpolation": net.interpolation, "antialias": True}]
    )


def test_the_docs_onnx_example_classifies_a_photo_as_the_bundle_does(trained, tmp_path):
    # docs/export.md's ONNX Runtime lines, run as they are on a photo of another size and shape
    # than the stored images: they must preprocess it as the bundle does.
    checkpoint = trained("resnet18")
    out = export_once(checkpoint)
    photo = tmp_path / "photo.jpg"
    Image.open(io.BytesIO(jpeg_bytes("green_square", 7, size=57))).crop((0, 0, 57, 41)).save(photo)
    page = (BUNDLE_ROOT / "docs" / "export.md").read_text()
    code = re.search(r"```python\n(import json.*?onnxruntime.*?)```", page, re.S).group(1)
    scope: dict = {}
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.chdir(out)
        exec(
            compile(code.replace('"photo.jpg"', repr(str(photo))), "docs/export.md", "exec"), scope
        )
    classifier = Classifier(checkpoint, use_gpu=False, precision="fp32")
    want = classifier.probabilities(prepare_image(photo.read_bytes(), image_size=32)[None].copy())
    assert np.abs(softmax(scope["logits"]) - want.numpy()).max() < 1e-4


def test_an_export_is_never_replaced_and_a_retried_one_does_nothing(trained, tmp_path):
    checkpoint = trained("user")
    out = export_once(checkpoint)
    files = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    _, summary = exported(checkpoint)  # the same checkpoint and weights: a job retried
    assert summary["already_exported"] and summary["parity"]["images"] > 0
    # The job's driver finds it before it asks for a task (no Ray in this process).
    assert exporter.export(export_config(checkpoint))["already_exported"]
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == files

    # Another checkpoint into that output: refused, and the export there stays as it was.
    other = Location.parse(str(Path(checkpoint.path).parent / "epoch_0001"))
    shutil.copytree(checkpoint.path, other.path)
    with pytest.raises(InputError, match=rf"^output {out} holds an export of {checkpoint.path}"):
        exporter.export_checkpoint(
            export_config(other), checkpoint=other, output=Location.parse(str(out))
        )
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == files


def test_a_failed_parity_check_commits_nothing(trained, monkeypatch):
    # model.onnx made from other weights than the checkpoint's, as a faulty exporter would.
    checkpoint = trained("user")
    output = Location.parse(str(Path(checkpoint.path).parent / "export" / "mismatched"))
    Path(output.path).parent.mkdir(parents=True, exist_ok=True)
    real = formats.export_onnx

    def mismatched(program, example, path, *, opset):  # the program export_pt2 made
        other = copy.deepcopy(program)
        torch.manual_seed(0)
        with torch.no_grad():
            for p in other.parameters():
                p.add_(torch.randn_like(p) * 0.5)
        real(other, example, path, opset=opset)

    monkeypatch.setattr(formats, "export_onnx", mismatched)
    with pytest.raises(InputError) as raised:
        exporter.export_checkpoint(export_config(checkpoint), checkpoint=checkpoint, output=output)
    said = str(raised.value)
    # Which runtime, and by how much; the program that matches is not named.
    by = r"a probability differs from PyTorch's by [0-9.e-]+, over tolerance=0.0001"
    assert re.match(rf"parity check failed: onnxruntime: (.*; )?{by}", said), said
    assert "torch.export" not in said
    assert not output.exists()
    assert not [p for p in Path(output.path).parent.iterdir() if p.name.startswith(".")]


def test_an_export_to_s3_is_committed_by_its_preprocessing_json(trained, s3_server):
    checkpoint = trained("user")
    cfg = export_config(checkpoint)
    bucket = f"export-{uuid.uuid4().hex[:8]}"
    with s3_server.client_env():
        s3_server.create_bucket(bucket)
        output = Location.parse(f"s3://{bucket}/exports/user")
        summary = exporter.export_checkpoint(cfg, checkpoint=checkpoint, output=output)
        names = sorted(posixpath.basename(i.path) for i in output.list_files())
        assert names == sorted([formats.ONNX, formats.PT2, exporter.PARITY, exporter.PREPROCESSING])
        assert exporter.committed(output)["checkpoint"] == checkpoint.uri
        assert summary["parity"]["onnxruntime"]["passed"]
        # Whole: a retry writes nothing. Stopped before its commit file: exported again.
        assert exporter.export_checkpoint(cfg, checkpoint=checkpoint, output=output)[
            "already_exported"
        ]
        output.child(exporter.PREPROCESSING).delete()
        again = exporter.export_checkpoint(cfg, checkpoint=checkpoint, output=output)
        assert "already_exported" not in again and exporter.committed(output) is not None
