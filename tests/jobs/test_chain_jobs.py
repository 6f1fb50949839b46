"""`python -m jobs.submit ... all` on a local cluster: the user's package and hooks, tracking on,
and inference of a folder of new photos."""

from __future__ import annotations

import json
import re
import subprocess
import textwrap

from helpers import CLASSES, history, make_image_folder, metric_steps, mlflow_run
from user_code import HOOKS, NETWORK

from harness.cluster import BUNDLE_ROOT
from pipeline.chain.plan import step_command
from pipeline.chain.run import RAY_NOISE
from pipeline.core.storage import Location
from pipeline.infer.predictions import read_predictions, read_summary
from pipeline.model.runs import RUN_SUMMARY, checkpoint_dir_name

# --- the chain on a local cluster, classifying other images than its dataset's ----------------

# The demo configs, shrunk: 3 generated classes of 20 images at 32 px, one epoch on one worker.
TINY = [
    "preprocess.source.synthetic.num_classes=3",
    "preprocess.source.synthetic.images_per_class=20",
    "preprocess.source.synthetic.raw_size=40",
    "preprocess.image_size=32",
    "preprocess.shard_size=60",
    "preprocess.row_group_size=20",
    "train.name=photos",
    "train.epochs=1",
    "train.global_batch_size=16",
    "train.scaling.num_workers=1",
    "infer.cpus_per_actor=1",
]


def run_chain(cluster, root, step: str, *sets: str) -> str:
    cmd = step_command(cluster.address, str(root), step, profile="demo", sets=[*TINY, *sets])
    proc = subprocess.run(
        cmd, cwd=BUNDLE_ROOT, env=cluster.env, text=True, capture_output=True, timeout=900
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    return out


def test_all_with_your_package_trains_by_your_hooks_and_classifies_a_folder_of_new_photos(
    cluster_2cpu, mlflow_server, tmp_path
):
    # The user's own package, outside the checkout and importable from nowhere here: their
    # network, focal loss, macro-F1 and augmentation, shipped with every step (--py-module).
    # The chain, tracked, trains 2 epochs ranked by that metric, then classifies new photos,
    # <class>/<image>, of other classes than the dataset's: what `all` is for.
    package = tmp_path / "src" / "mynet"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(NETWORK + textwrap.dedent(HOOKS))
    photos = tmp_path / "photos"
    make_image_folder(photos, per_class=3, corrupt=False)
    files = sorted(str(p.relative_to(photos)) for p in photos.rglob("*") if p.is_file())
    root = tmp_path / "chain"
    sets = [
        *TINY,
        "train.epochs=2",
        "train.model.name=mynet:build",
        "train.loss=mynet:focal",
        "train.metrics=[mynet:macro_f1, top2_accuracy]",
        "train.checkpoint.metric=val_macro_f1",
        "train.augment=mynet:augment",
    ]

    def chain(step: str, *more: str) -> tuple[int, str]:
        *options, step = step_command(
            cluster_2cpu.address,
            str(root),
            step,
            profile="demo",
            sets=[*sets, *more],
            py_modules=[str(package)],
        )
        cmd = [*options, f"--env=MLFLOW_TRACKING_URI={mlflow_server.uri}", step]
        proc = subprocess.run(
            cmd, cwd=BUNDLE_ROOT, env=cluster_2cpu.env, text=True, capture_output=True, timeout=900
        )
        return proc.returncode, proc.stdout + proc.stderr

    code, out = chain("all", f"infer.input={photos}")
    assert code == 0, out[-5000:]
    assert "model mynet:build" in out
    assert "checkpoints ranked by val_macro_f1 (max), by mynet:macro_f1's Metric" in out
    assert re.search(r"epoch 1/1: .* val_macro_f1 \d\.\d{4} val_top2_accuracy \d\.\d{4}", out)
    run = root / "runs" / "photos"
    rows = history(run)
    assert [r["epoch"] for r in rows] == [0, 1]
    summary = json.loads((run / RUN_SUMMARY).read_text())
    assert (summary["checkpoint_metric"], summary["checkpoint_mode"]) == ("val_macro_f1", "max")
    best = max(rows, key=lambda r: (r["val_macro_f1"], r["epoch"]))  # of equals, the newest
    assert summary["best_metrics"]["epoch"] == best["epoch"], rows
    steps = metric_steps(mlflow_server, mlflow_run(mlflow_server, run).info.run_id, rows)
    assert steps["val_macro_f1"] == steps["val_top2_accuracy"] == [0, 1]

    # Training read the version its preprocess step committed; inference, the new photos, with
    # the best checkpoint by the user's metric.
    (version,) = set(re.findall(r"current dataset version: (\S+)", out))
    (train,) = re.findall(r"\[train\] submitted \S+: (.*)", out)
    (infer,) = re.findall(r"\[infer\] submitted \S+: (.*)", out)
    assert f"dataset_version={version}" in train and "dataset_version" not in infer
    assert f"best checkpoint epoch {int(best['epoch'])} by val_macro_f1 (max)" in out
    # The photos' output is theirs, beside the dataset's: <run>-<folder>-<hash of the input>.
    (output,) = re.findall(r"\boutput=(\S+)", infer)
    assert output.startswith(f"{root}/predictions/photos-photos-")
    predictions = root / "predictions" / output.rpartition("/")[2]
    assert sorted(read_predictions(str(predictions))["source_id"].to_pylist()) == files
    summary = read_summary(Location.parse(str(predictions)))
    assert summary["input"] == str(photos) and "dataset_version" not in summary
    assert summary["checkpoint"].endswith(checkpoint_dir_name(int(best["epoch"])))
    assert f"input: folder {photos}, {len(files)} files" in out
    # Ray's actor-restart warning for inference's actor pool is in the job's own log, not here.
    (infer_id,) = re.findall(r"\[infer\] submitted (\S+):", out)
    logs = cluster_2cpu.job_logs(infer_id)
    assert RAY_NOISE[0] in logs and RAY_NOISE[0] not in out

    # Export of the run, with the package; the files need no code.
    code, out = chain("export")
    assert code == 0, out[-5000:]
    (export,) = (run / "export").iterdir()
    assert {"model.onnx", "model.pt2", "preprocessing.json"} <= {p.name for p in export.iterdir()}

    # One image file, the chain's infer step alone: its top-k printed, nothing written.
    image = photos / CLASSES[1] / "001.jpg"
    code, out = chain("infer", f"infer.input={image}")
    assert code == 0, out[-5000:]
    printed = json.loads(re.search(r'^\{\n  "input".*?^\}$', out, re.S | re.M)[0])
    assert printed["input"] == str(image) and len(printed["top_k"]) == 3
    assert read_summary(Location.parse(str(predictions))) == summary
