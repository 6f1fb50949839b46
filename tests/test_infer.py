"""Inference: the real job on a real local Ray cluster, from a run the train job made."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
from conftest import make_image_folder

from pipeline.config import InferConfig, load_config
from pipeline.errors import InputError
from pipeline.infer import is_single_image, resolve_checkpoint, run
from pipeline.storage import Location

pytestmark = pytest.mark.slow


def infer_job(cluster, *overrides):
    args = ["python", "-m", "jobs.infer", "--config", "configs/demo-infer.yaml", *overrides]
    return cluster.submit(args, capture=True, timeout_s=600)


@pytest.fixture(scope="module")
def trained(cluster, tiny_dataset, tmp_path_factory):
    """A 2-epoch run of the train job on the tiny dataset; returns its directory."""
    storage = tmp_path_factory.mktemp("runs")
    proc = cluster.submit(
        ["python", "-m", "jobs.train", "--config", "configs/demo-train.yaml",
         f"dataset={tiny_dataset}", f"storage_path={storage}", "name=r", "epochs=2",
         "scaling.num_workers=1"],
        capture=True, timeout_s=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout
    return storage / "r"


@pytest.fixture(scope="module")
def val_predictions(cluster, trained, tiny_dataset, tmp_path_factory):
    out = tmp_path_factory.mktemp("preds")
    proc = infer_job(cluster, f"model={trained}", f"input={tiny_dataset}", f"output={out}")
    assert proc.returncode == 0, proc.stdout
    return out, proc


def test_val_split_predictions_match_the_summary_and_training(val_predictions, trained):
    out, proc = val_predictions
    table = pq.read_table(out / "predictions.parquet").to_pylist()
    summary = json.loads((out / "summary.json").read_text())
    train_summary = json.loads((trained / "summary.json").read_text())
    assert summary["checkpoint"] == train_summary["best_checkpoint"]
    assert len(table) == summary["images"] == 119  # one row per row of the val split
    assert len({r["source_id"] for r in table}) == 119
    recomputed = sum(r["label"] == r["pred"] for r in table) / len(table)
    assert summary["accuracy"] == pytest.approx(recomputed)
    # The same checkpoint on the same split: what training measured, image for image.
    assert summary["accuracy"] == pytest.approx(train_summary["best_metrics"]["val_accuracy"])
    cm = summary["confusion_matrix"]
    assert sum(map(sum, cm)) == 119 and sum(cm[i][i] for i in range(4)) == round(recomputed * 119)
    assert all(r["top_k"][0] == r["pred"] and len(r["top_k"]) == 4 for r in table)
    assert all(abs(sum(r["top_k_prob"]) - 1) < 1e-3 for r in table)
    assert (out / "confusion_matrix.png").read_bytes()[:4] == b"\x89PNG"
    assert f"predictions: {out}/predictions.parquet" in proc.stdout


def test_folder_with_a_corrupt_file_is_predicted_and_the_file_listed(cluster, trained, tmp_path):
    bad = make_image_folder(tmp_path / "images", per_class=4)
    out = tmp_path / "out"
    proc = infer_job(cluster, f"model={trained}", f"input={tmp_path / 'images'}",
                     f"output={out}")  # fmt: skip
    assert proc.returncode == 0, proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    reasons = {s["source_id"]: s["reason"] for s in summary["skipped"]}
    assert reasons.keys() == bad.keys()
    assert all(reasons[f].startswith(why) for f, why in bad.items())
    rows = pq.read_table(out / "predictions.parquet").to_pylist()
    assert len(rows) == summary["images"] == 3 * 4

    # One image on its own, through a single Ray task: the same top-1 as the batch path.
    one = rows[0]
    image = tmp_path / "images" / one["source_id"]
    proc = infer_job(cluster, f"model={trained}", f"input={image}")
    assert proc.returncode == 0, proc.stdout
    printed = json.loads(proc.stdout[proc.stdout.index("{\n") : proc.stdout.index("\n}") + 2])
    assert printed["top_k"][0]["index"] == one["pred"]
    assert printed["top_k"][0]["probability"] == pytest.approx(one["top_k_prob"][0], rel=1e-4)


def test_use_gpu_on_a_cluster_without_gpus_fails_fast(cluster, trained, tiny_dataset, tmp_path):
    proc = infer_job(cluster, f"model={trained}", f"input={tiny_dataset}",
                     f"output={tmp_path}", "use_gpu=true", "gpu_timeout_s=2")  # fmt: skip
    assert proc.returncode != 0
    assert "use_gpu=true, but the cluster has no GPU (waited 2 s" in proc.stdout
    assert not (tmp_path / "summary.json").exists()


def test_bad_model_and_input_paths_are_clear_errors(trained, tiny_dataset, tmp_path):
    def cfg(**kw):
        return load_config(InferConfig, None, [f"{k}={v}" for k, v in kw.items()])

    with pytest.raises(InputError, match=r"model=\S+ does not exist"):
        resolve_checkpoint(Location.parse(str(tmp_path / "nope")))
    (tmp_path / "empty_ckpt").mkdir()
    (tmp_path / "empty_ckpt" / "model.pt").write_bytes(b"x")
    with pytest.raises(InputError, match=r"neither a training run .* nor a checkpoint"):
        resolve_checkpoint(Location.parse(str(tmp_path / "empty_ckpt")))
    with pytest.raises(InputError, match=r"input=\S+ does not exist"):
        is_single_image(cfg(model=trained, input=tmp_path / "missing"))
    with pytest.raises(InputError, match="output= is required"):
        run(cfg(model=trained, input=tiny_dataset))
    assert resolve_checkpoint(Location.parse(str(trained))).path.startswith(str(trained))
