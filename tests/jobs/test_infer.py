"""Inference: the real job on a real local Ray cluster, from a run the train job made; and the
export job, from the same run (in-process export tests: test_export)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from helpers import (
    CLASSES,
    armed_runtime_env,
    checkpoint_meta,
    held_until_it_ends,
    held_worker,
    in_background,
    make_image_folder,
    wait_for,
)

from jobs.infer import main as infer_main
from pipeline.core import faults
from pipeline.core.config import load_config
from pipeline.core.errors import InputError
from pipeline.core.storage import VERSION_MARKER, Location
from pipeline.infer.batch import Classifier, resolve_checkpoint
from pipeline.infer.config import InferConfig
from pipeline.infer.predictions import (
    CONFUSION_PNG,
    PREDICTIONS,
    PROGRESS,
    SUMMARY,
    VERSIONS,
    read_predictions,
)
from pipeline.model.checkpoint import save_checkpoint
from pipeline.model.networks import build_model
from pipeline.model.runs import RUN_SUMMARY

pytestmark = pytest.mark.xdist_group("main_run")  # its costly fixture, made once


def infer_job(cluster, *overrides, **submit):
    args = ["python", "-m", "jobs.infer", "--config", "configs/demo-infer.yaml", *overrides]
    return cluster.run_job(args, capture=True, timeout_s=600, **submit)


def committed(out: Path) -> dict[str, bytes]:
    """What a reader of `out` finds: summary.json and the files it names, by path."""
    summary = json.loads((out / SUMMARY).read_text())
    named = [f["path"] for f in summary["files"]] + [summary["confusion_matrix_png"]]
    return {path: (out / path).read_bytes() for path in [SUMMARY, *named]}


@pytest.fixture(scope="module")
def trained(main_run):
    """The run directory of the shared training run (see conftest.main_run)."""
    return main_run[1]


@pytest.fixture(scope="module")
def val_predictions(cluster_2cpu, trained, tiny_dataset, tmp_path_factory):
    out = tmp_path_factory.mktemp("preds")
    # Files of 50 rows: the 119 images make three or more, as a million would by default.
    proc = infer_job(
        cluster_2cpu,
        f"model={trained}",
        f"input={tiny_dataset}",
        f"output={out}",
        "rows_per_file=50",
    )
    assert proc.returncode == 0, proc.stdout
    return out, proc


def test_val_split_predictions_match_the_summary_and_training(
    val_predictions, trained, tiny_dataset
):
    out, proc = val_predictions
    table = read_predictions(str(out)).to_pylist()
    summary = json.loads((out / SUMMARY).read_text())
    train_summary = json.loads((trained / RUN_SUMMARY).read_text())
    assert summary["checkpoint"] == train_summary["best_checkpoint"]
    assert len(table) == summary["images"] == 119  # one row per row of the val split
    assert len({r["source_id"] for r in table}) == 119
    recomputed = sum(r["label"] == r["pred"] for r in table) / len(table)
    assert summary["accuracy"] == pytest.approx(recomputed)
    # The run's best checkpoint by its metric (the default, val loss), and the job says why.
    best = train_summary["best_metrics"]
    assert train_summary["checkpoint_metric"] == "val_loss"
    why = f"best checkpoint epoch {best['epoch']} by val_loss (min): {best['val_loss']:.4f}"
    assert f"{why}; last epoch 3: {summary['checkpoint']}" in proc.stdout
    # The same checkpoint on the same split: what training measured, image for image, of the
    # weights of lower val loss (the run keeps an EMA: conftest.main_run).
    served = "ema" if best["ema_val_loss"] < best["val_loss"] else "raw"
    assert summary["weights"] == served and f"classifying with the {served} weights" in proc.stdout
    assert summary["weights_by"] == "val_loss (min)"
    assert summary["weights_scores"] == {"raw": best["val_loss"], "ema": best["ema_val_loss"]}
    accuracy = {"raw": "val_accuracy", "ema": "ema_val_accuracy"}[served]
    assert summary["accuracy"] == pytest.approx(best[accuracy])
    cm = summary["confusion_matrix"]
    assert sum(map(sum, cm)) == 119 and sum(cm[i][i] for i in range(4)) == round(recomputed * 119)
    assert all(r["top_k"][0] == r["pred"] and len(r["top_k"]) == 4 for r in table)
    assert all(abs(sum(r["top_k_prob"]) - 1) < 1e-3 for r in table)
    assert summary["input"] == str(tiny_dataset)
    assert (out / summary["confusion_matrix_png"]).read_bytes()[:4] == b"\x89PNG"
    version = out / VERSIONS / summary["version"]
    assert f"predictions: {version / PREDICTIONS} (committed by {out / SUMMARY})" in proc.stdout
    # Written by the pipeline's write tasks in parts, straight into the run's own version:
    # summary.json names every one, and nothing else is there.
    parts = sorted(p.name for p in (version / PREDICTIONS).iterdir())
    assert len(parts) >= 3
    assert [f["path"] for f in summary["files"]] == [
        f"{VERSIONS}/{version.name}/{PREDICTIONS}/{p}" for p in parts
    ]
    # Beside them, the job's last progress (jobs.submit's status reads it).
    assert sorted(p.name for p in out.iterdir()) == sorted([SUMMARY, VERSIONS, "progress.json"])
    assert json.loads((out / "progress.json").read_text())["images_done"] == 119
    assert sorted(p.name for p in version.iterdir()) == sorted(
        [VERSION_MARKER, CONFUSION_PNG, PREDICTIONS]
    )
    assert summary["driver_peak_rss_mib"] > 0 and summary["driver_cpu_s"] > 0
    # The demo config's one actor with both CPUs, decoding its own batches; start-up timed apart.
    assert "1 predictor actors with {'num_cpus': 2} each" in proc.stdout
    assert 0 < summary["first_batch_s"] < summary["seconds"] and summary["steady_images_per_s"] > 0


def test_the_export_job_exports_the_checkpoint_and_weights_inference_classifies_with(
    cluster_2cpu, trained, tiny_dataset, val_predictions
):
    args = ["python", "-m", "jobs.export", "--config", "configs/demo-export.yaml"]
    proc = cluster_2cpu.run_job(
        [*args, f"model={trained}", "images=16"], capture=True, timeout_s=600
    )
    assert proc.returncode == 0, proc.stdout
    inference = json.loads((val_predictions[0] / SUMMARY).read_text())
    out = trained / "export" / Path(inference["checkpoint"]).name  # beside the run's checkpoints
    spec = json.loads((out / "preprocessing.json").read_text())
    # The run keeps an EMA: the export holds the weights inference chose, of its checkpoint.
    assert (spec["checkpoint"], spec["weights"]) == (inference["checkpoint"], inference["weights"])
    assert spec["classes"] == inference["classes"]
    parity = json.loads((out / "parity.json").read_text())
    assert (parity["images"], parity["dataset"]) == (16, str(tiny_dataset))  # the run's own
    assert parity["onnxruntime"]["passed"] and parity["torch.export"]["passed"]
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["model.onnx", "model.pt2", "parity.json", "preprocessing.json"]
    )
    # The job's last lines: its summary, as JSON.
    summary, _ = json.JSONDecoder().raw_decode(proc.stdout, proc.stdout.rindex("\n{") + 1)
    assert summary["output"] == str(out) and summary["parity"] == parity


def test_a_run_that_fails_leaves_the_previous_output_as_it_was(
    cluster_2cpu, trained, tiny_dataset, val_predictions, tmp_path
):
    # A complete output from before, and a dataset whose last val shard has its first page
    # header overwritten, its size and footer intact: the driver's check of the files passes,
    # and the run fails partway, with predictions of other shards perhaps staged already.
    out = tmp_path / "out"
    shutil.copytree(val_predictions[0], out)
    broken = tmp_path / "broken"
    shutil.copytree(tiny_dataset, broken)
    # The output of an earlier run on this input (the dataset before its damage): an output
    # holds the predictions of one input.
    summary = json.loads((out / SUMMARY).read_text())
    (out / SUMMARY).write_text(json.dumps({**summary, "input": str(broken)}, indent=2))
    before = committed(out)
    shards = sorted(broken.glob("data/*/val/*.parquet"))
    damaged = bytearray(shards[-1].read_bytes())
    damaged[4:68] = b"\xff" * 64  # past the leading magic bytes: the first page's header
    shards[-1].write_bytes(bytes(damaged))
    proc = infer_job(
        cluster_2cpu, f"model={trained}", f"input={broken}", f"output={out}", "rows_per_file=10"
    )
    assert proc.returncode != 0
    assert f"error: dataset {broken} is damaged: row group 0 of {shards[-1]}" in proc.stdout, (
        proc.stdout
    )
    # Readers see the previous run whole; the failed run's own version is left to retention.
    assert committed(out) == before
    assert read_predictions(str(out)).num_rows == 119
    assert len(list((out / VERSIONS).iterdir())) == 2


def test_a_job_stopped_midway_infers_only_the_rest_when_submitted_again(
    cluster_2cpu, trained, tiny_dataset, val_predictions, tmp_path
):
    out = tmp_path / "out"
    args = (f"model={trained}", f"input={tiny_dataset}", f"output={out}", "rows_per_file=10")
    (tmp_path / "fault").mkdir()
    runtime_env, marker = armed_runtime_env(tmp_path / "fault", faults.PREDICTIONS_PART_WRITTEN)
    submit = {"runtime_env": runtime_env, "submission_id": f"infer-stopped-{tmp_path.name}"}
    job = in_background(infer_job, cluster_2cpu, *args, **submit)
    pid = held_worker(marker, job)  # a write task, its first part of 10 predictions written
    cluster_2cpu.stop_job(submit["submission_id"])
    assert "was stopped" in job.result().stdout  # `ray job submit` exits 0 for a stopped job
    wait_for(lambda: not Path(f"/proc/{pid}").exists(), "the stopped job's write task to end")
    (stopped,) = (out / VERSIONS).iterdir()
    assert not (out / SUMMARY).exists()
    written = set()
    for part in (stopped / PREDICTIONS).iterdir():
        with contextlib.suppress(OSError, pa.ArrowInvalid):  # a part cut short: no footer
            written |= set(pq.read_table(part, columns=["source_id"])["source_id"].to_pylist())
    assert 10 <= len(written) < 119, len(written)

    proc = infer_job(cluster_2cpu, *args)
    assert proc.returncode == 0, proc.stdout
    why = f"resuming: {len(written)} of 119 images already inferred (version {stopped.name})"
    assert why in proc.stdout, proc.stdout
    summary = json.loads((out / SUMMARY).read_text())
    assert summary["resumed"] == [stopped.name] and summary["images_resumed"] == len(written)
    # Fewer images through the model than a clean run's 119, and the clean run's predictions.
    assert summary["images_inferred"] == 119 - len(written)
    assert summary["images"] == 119
    clean = json.loads((val_predictions[0] / SUMMARY).read_text())
    assert summary["confusion_matrix"] == clean["confusion_matrix"]
    assert summary["accuracy"] == clean["accuracy"]

    def rows(output):
        return read_predictions(str(output)).sort_by("source_id").to_pylist()

    resumed, clean_rows = rows(out), rows(val_predictions[0])
    # Row for row; the probabilities to float rounding, which moves with how the images were
    # batched (two clean runs batch them differently too: blocks arrive in any order).
    probs = [r.pop("top_k_prob") for r in resumed]
    clean_probs = [r.pop("top_k_prob") for r in clean_rows]
    assert resumed == clean_rows
    assert np.allclose(probs, clean_probs, rtol=1e-4, atol=1e-6)
    # The stopped job's version went with the commit: just the committed one is left.
    assert [p.name for p in (out / VERSIONS).iterdir()] == [summary["version"]]


@pytest.fixture(scope="module")
def folder_predictions(cluster_2cpu, trained, tmp_path_factory):
    """An image folder with files that are not images, and the shared run's job over it:
    (the folder, its bad files, the output, the job)."""
    root = tmp_path_factory.mktemp("folder")
    bad = make_image_folder(root / "images", per_class=4)
    out = root / "out"
    proc = infer_job(cluster_2cpu, f"model={trained}", f"input={root / 'images'}", f"output={out}")
    return root / "images", bad, out, proc


def test_a_job_killed_at_its_commit_point_leaves_the_previous_output(
    cluster_2cpu, trained, folder_predictions, tmp_path
):
    images, _, done, proc = folder_predictions
    assert proc.returncode == 0, proc.stdout
    out = tmp_path / "out"
    shutil.copytree(done, out)
    before = committed(out)
    previous = json.loads(before[SUMMARY])["version"]
    args = (f"model={trained}", f"input={images}", f"output={out}")

    (tmp_path / "fault").mkdir()
    runtime_env, marker = armed_runtime_env(tmp_path / "fault", faults.PREDICTIONS_WRITTEN)
    job = in_background(infer_job, cluster_2cpu, *args, runtime_env=runtime_env)
    pid = held_worker(marker, job)  # the job's driver, its version whole, summary.json not yet
    (held,) = {p.name for p in (out / VERSIONS).iterdir()} - {previous}
    # Whole, and still marked as partial work (PROGRESS), which the commit removes first.
    assert sorted(p.name for p in (out / VERSIONS / held).iterdir()) == sorted(
        [VERSION_MARKER, CONFUSION_PNG, PREDICTIONS, PROGRESS]
    )
    assert committed(out) == before
    os.kill(pid, signal.SIGKILL)
    proc = job.result()
    assert proc.returncode != 0, proc.stdout
    # Readers see the previous run whole; the killed run's version is left to retention.
    assert committed(out) == before
    assert read_predictions(str(out)).num_rows == 12
    assert {p.name for p in (out / VERSIONS).iterdir()} == {previous, held}


def test_folder_with_a_corrupt_file_is_predicted_and_the_file_listed(
    cluster_2cpu, trained, folder_predictions
):
    images, bad, out, proc = folder_predictions
    assert proc.returncode == 0, proc.stdout
    summary = json.loads((out / SUMMARY).read_text())
    reasons = {s["source_id"]: s["reason"] for s in summary["skipped"]}
    assert reasons.keys() == bad.keys()
    assert all(reasons[f].startswith(why) for f, why in bad.items())
    rows = read_predictions(str(out)).to_pylist()
    assert len(rows) == summary["images"] == 3 * 4
    # Two of the folder's classes are none of the checkpoint's: named, and their labels kept
    # with no index; only red_circle's images count in the accuracy.
    assert summary["classes_unknown"] == ["blue_triangle", "green_square"]
    assert "2 of the input's classes are not classes of the checkpoint" in proc.stdout
    assert sorted({r["label_name"] for r in rows}) == sorted(CLASSES)
    assert all((r["label"] is None) == (r["label_name"] != "red_circle") for r in rows)
    assert summary["labelled_images"] == 4

    # One image on its own, through a single Ray task: the same top-1 as the batch path.
    one = rows[0]
    image = images / one["source_id"]
    proc = infer_job(cluster_2cpu, f"model={trained}", f"input={image}")
    assert proc.returncode == 0, proc.stdout
    printed = json.loads(proc.stdout[proc.stdout.index("{\n") : proc.stdout.index("\n}") + 2])
    assert printed["top_k"][0]["index"] == one["pred"]
    assert printed["top_k"][0]["probability"] == pytest.approx(one["top_k_prob"][0], rel=1e-4)


# A held batch is called stalled after this (stall.min_s; the median batch is far shorter),
# and the job must end well before a test would give up on it.
STALL_MIN_S = 5
ENDS_WITHIN_S = 120


def test_a_predictor_held_on_a_batch_ends_the_job_naming_it_with_every_actors_stacks(
    cluster_2cpu, tmp_path
):
    # One predictor actor, batches of 4 of a folder's 24 images: it stops at the start of its
    # fourth batch. The model: a fresh checkpoint of three classes (no training needed here).
    model, photos, out = tmp_path / "checkpoint", tmp_path / "photos", tmp_path / "out"
    model.mkdir()
    save_checkpoint(model, build_model(3).eval().state_dict(), checkpoint_meta(), {})
    make_image_folder(photos, per_class=8, corrupt=False)
    (tmp_path / "fault").mkdir()
    runtime_env, marker = armed_runtime_env(tmp_path / "fault", faults.BATCH_STALLED)
    submit = {"runtime_env": runtime_env, "submission_id": f"infer-stalled-{tmp_path.name}"}
    args = (f"model={model}", f"input={photos}", f"output={out}", "batch_size=4")
    more = ("num_actors=1", f"stall.min_s={STALL_MIN_S}")
    job = in_background(infer_job, cluster_2cpu, *args, *more, **submit)
    pid, proc, ended_s = held_until_it_ends(
        cluster_2cpu, job, marker, submit["submission_id"], ENDS_WITHIN_S
    )
    log = proc.stdout
    assert "failed with exit code 3" in log, log
    line = re.search(
        rf"error: inference stalled: predictor actor pid {pid} on node [\d.]+ has held a batch "
        rf"for (\d+) s \(over stall.min_s={STALL_MIN_S} s and stall.multiple=20 times the median "
        r"batch of [\d.e-]+ s\), in faults.py:point; every actor's stacks are in the log above. "
        r"Submit the job again: it infers only what is not written yet\n",
        log,
    )
    assert line, log
    assert int(line[1]) >= STALL_MIN_S and ended_s < ENDS_WITHIN_S
    stacks = log[log.index(f"predictor actor pid {pid} on node") :]
    assert "stacks:" in stacks and "faults.py" in stacks.split("error:")[0]
    # Nothing committed, nothing lost: the output has no summary, and the job's progress says so.
    assert not (out / SUMMARY).exists()
    assert json.loads((out / "progress.json").read_text())["state"] == "failed"


def test_resources_the_cluster_lacks_fail_fast(cluster_2cpu, trained, tiny_dataset, tmp_path):
    # A GPU here; actors larger than the cluster: test_autoscale's cluster of no CPUs.
    proc = infer_job(
        cluster_2cpu,
        f"model={trained}",
        f"input={tiny_dataset}",
        f"output={tmp_path}",
        "use_gpu=true",
        "capacity_timeout_s=2",
    )
    assert proc.returncode != 0
    assert "use_gpu=true, but the cluster has 0 GPUs (waited 2 s" in proc.stdout
    assert not (tmp_path / SUMMARY).exists()


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
        infer_main(cfg(model=trained, input=tmp_path / "missing"))
    with pytest.raises(InputError, match="output= is required"):
        infer_main(cfg(model=trained, input=tiny_dataset))
    assert resolve_checkpoint(Location.parse(str(trained))).path.startswith(str(trained))

    unfinished = tmp_path / "unfinished"
    shutil.copytree(trained, unfinished)
    (unfinished / RUN_SUMMARY).unlink()
    with pytest.raises(InputError, match=r"has not finished training \(no summary.json\)"):
        resolve_checkpoint(Location.parse(str(unfinished)))
    # One of its checkpoints is still usable, explicitly.
    ckpt = sorted(unfinished.glob("epoch_*"))[0]
    assert resolve_checkpoint(Location.parse(str(ckpt))).path == str(ckpt)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_classifier_agrees_with_cpu(tmp_path):
    torch.manual_seed(0)
    save_checkpoint(tmp_path, build_model(3).eval().state_dict(), checkpoint_meta(), {})
    pixels = np.random.default_rng(0).integers(0, 256, (8, 3, 32, 32), dtype=np.uint8)
    ckpt = Location.parse(str(tmp_path))
    cpu = Classifier(ckpt, use_gpu=False, precision="auto").probabilities(pixels)
    gpu = Classifier(ckpt, use_gpu=True, precision="auto")
    assert gpu.precision in ("bf16", "fp16")
    assert torch.allclose(gpu.probabilities(pixels), cpu, atol=0.05)
