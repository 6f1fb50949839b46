"""Tracking in MLflow without a cluster, against a real MLflow server: on only with a URI and
free when off, a server that cannot be used failing the job at its start, the run record written
once, each epoch logged once whatever restarts, a registered version back to its checkpoint, and
that version loaded and served by MLflow's own tools as batch inference classifies.
(The jobs tracked on a cluster: test_train_jobs, test_s3, test_tracking_jobs.)"""

from __future__ import annotations

import base64
import json
import os
import pickle
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import (
    CLASSES,
    USER_MODEL,
    bundle_hidden_env,
    checkpoint_meta,
    errors_table,
    make_image_folder,
    metric_steps,
    png_bytes,
)

from harness.cluster import BUNDLE_ROOT, free_port
from pipeline.core.config import load_config
from pipeline.core.errors import ClusterError, ConfigError, InputError
from pipeline.core.storage import Location
from pipeline.model.checkpoint import METADATA, TRAIN_STATE, WEIGHTS, save_checkpoint
from pipeline.model.networks import build_model
from pipeline.tracking import (
    registered_checkpoint,
    registered_version,
    tracking_uri,
    training_tracker,
)
from pipeline.tracking.client import RUN_RECORD, connect, write_once
from pipeline.tracking.registry import log_best_model, model_spec
from pipeline.train.config import TrainConfig
from scripts.lock import requirements_file


def train_config(tmp_path, *overrides) -> TrainConfig:
    args = [f"dataset={tmp_path}/dataset", f"storage_path={tmp_path}/runs", *overrides]
    return load_config(TrainConfig, None, args)


def test_off_without_a_uri_and_then_mlflow_is_never_imported(tmp_path):
    # The clients (the chain, the job entrypoints' imports) never load mlflow; a job without a
    # URI neither, through opening its tracker.
    code = (
        "import sys, jobs.submit, jobs.train, jobs.preprocess, jobs.infer, pipeline.tracking\n"
        "from pipeline.core.config import load_config\n"
        "from pipeline.train.config import TrainConfig\n"
        f"cfg = load_config(TrainConfig, None, ['dataset=/d', 'storage_path={tmp_path}'])\n"
        "assert pipeline.tracking.training_tracker(cfg) is None\n"
        "print([m for m in sys.modules if m.split('.')[0] == 'mlflow'])"
    )
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}  # no MLFLOW_TRACKING_URI
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=BUNDLE_ROOT, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_the_uri_is_the_configs_else_the_environments(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert tracking_uri(train_config(tmp_path).tracking) is None
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://env:5000")
    assert tracking_uri(train_config(tmp_path).tracking) == "http://env:5000"
    cfg = train_config(tmp_path, "tracking.uri=http://config:5000")
    assert tracking_uri(cfg.tracking) == "http://config:5000"


def test_a_server_that_does_not_answer_fails_the_job_at_once_with_exit_3(tmp_path):
    uri = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    started = time.monotonic()
    with pytest.raises(ClusterError, match=rf"^the tracking server {uri} does not answer \("):
        training_tracker(train_config(tmp_path, f"tracking.uri={uri}"))
    assert time.monotonic() - started < 30  # a few short retries, not MLflow's minutes


def test_a_uri_mlflow_cannot_use_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match=r"^the tracking URI nonsense://x is not an MLflow"):
        training_tracker(train_config(tmp_path, "tracking.uri=nonsense://x"))


@pytest.mark.parametrize("where", ["local", "s3"])
def test_the_run_record_is_written_once(where, tmp_path, s3_server):
    if where == "s3":
        with s3_server.client_env():
            s3_server.create_bucket("tracking-record")
            file = Location.parse(f"s3://tracking-record/runs/r/{RUN_RECORD}")
            first, second = write_once(file, b"first"), write_once(file, b"second")
            stored = file.read_bytes()
    else:
        file = Location.parse(str(tmp_path / "runs" / "r" / RUN_RECORD))
        first, second = write_once(file, b"first"), write_once(file, b"second")
        stored = file.read_bytes()
        assert [p.name for p in file_dir(tmp_path)] == [RUN_RECORD]  # no temporary file left
    assert first == second == stored == b"first"


def file_dir(tmp_path):
    return sorted((tmp_path / "runs" / "r").iterdir())


def history_of(epochs: int) -> list[dict]:
    return [
        {
            "epoch": e,
            "train_loss": 1.0 / (e + 1),
            "val_accuracy": 0.1 * e,
            "workers": 2,
            "dataset_version": "v1",
        }
        for e in range(epochs)
    ]


def test_one_mlflow_run_per_training_run_and_each_epoch_once(tmp_path, mlflow_server):
    cfg = train_config(tmp_path, f"tracking.uri={mlflow_server.uri}", "name=once", "epochs=3")
    run_dir = Location.parse(f"{tmp_path}/runs/once")
    sink = training_tracker(cfg).start(run_dir, cfg, version="v1", changes=[])
    run_id = json.loads((tmp_path / "runs" / "once" / RUN_RECORD).read_text())["run_id"]
    history = history_of(3)
    sink.log_epochs(history[:1])
    sink.log_epochs(history[:2])
    # A restarted rank 0 (a new copy of the sink, as Ray sends it) with the checkpoint's history:
    # the server's epochs are not logged again.
    # Epoch 1 trained again (its checkpoint lost before Ray recorded it) is not logged again:
    # the values logged first stay.
    restarted = pickle.loads(pickle.dumps(sink))
    retrained = [history[0], history[1] | {"train_loss": 9.0}]
    restarted.log_epochs(retrained)
    restarted.log_epochs(history)
    # A submission of the same run continues the same MLflow run; a setting it changes is a tag
    # (the run's params stay those it started with).
    again = train_config(tmp_path, f"tracking.uri={mlflow_server.uri}", "name=once", "epochs=5")
    sink = training_tracker(again).start(run_dir, again, version="v1", changes=["epochs: 3 -> 5"])
    assert sink.run_id == run_id
    sink.log_epochs(history)
    steps = metric_steps(mlflow_server, run_id, history)
    assert steps == {k: [0, 1, 2] for k in ("train_loss", "val_accuracy", "workers")}
    run = mlflow_server.client().get_run(run_id)
    assert run.data.params["epochs"] == "3" and run.data.params["name"] == "once"
    assert run.data.tags["ray_cv.changed.epochs"] == "3 -> 5"
    assert run.data.tags["ray_cv.run_dir"] == run_dir.uri
    assert run.data.tags["ray_cv.code_version"].startswith(("git:", "sha256:"))
    experiment = mlflow_server.client().get_experiment(run.info.experiment_id)
    named = f"tags.`ray_cv.run_dir` = '{run_dir.uri}'"
    assert len(mlflow_server.client().search_runs([experiment.experiment_id], named)) == 1


def test_a_run_tracked_on_another_server_is_not_split_across_two(tmp_path, mlflow_server):
    cfg = train_config(tmp_path, f"tracking.uri={mlflow_server.uri}", "name=elsewhere")
    run_dir = Location.parse(f"{tmp_path}/runs/elsewhere")
    record = {"tracking_uri": "http://other:5000", "experiment_id": "1", "run_id": "abc"}
    run_dir.child(RUN_RECORD).write_bytes(json.dumps(record).encode())
    with pytest.raises(ConfigError, match="is tracked in MLflow run abc at http://other:5000"):
        training_tracker(cfg).start(run_dir, cfg, version="v1", changes=[])


def test_a_deleted_run_or_experiment_is_not_tracked_into(tmp_path, mlflow_server):
    cfg = train_config(
        tmp_path, f"tracking.uri={mlflow_server.uri}", "tracking.experiment=gone", "name=gone"
    )
    run_dir = Location.parse(f"{tmp_path}/runs/gone")
    sink = training_tracker(cfg).start(run_dir, cfg, version="v1", changes=[])
    client = mlflow_server.client()
    client.delete_run(sink.run_id)
    record = run_dir.child(RUN_RECORD).uri
    said = f"MLflow run {sink.run_id}, which {record} names, is gone from {mlflow_server.uri}"
    with pytest.raises(ConfigError, match=re.escape(said)):
        training_tracker(cfg).start(run_dir, cfg, version="v1", changes=[])
    client.delete_experiment(client.get_experiment_by_name("gone").experiment_id)
    said = f"MLflow experiment 'gone' at {mlflow_server.uri} is deleted"
    with pytest.raises(ConfigError, match=re.escape(said)):
        training_tracker(cfg)


def small_checkpoint(directory) -> Location:
    directory.mkdir(parents=True)
    weights = {"fc.weight": torch.arange(6.0).reshape(3, 2)}
    save_checkpoint(directory, weights, checkpoint_meta(), {"optimizer": {"step": 1}})
    return Location.parse(str(directory))


def test_a_registered_version_resolves_to_its_checkpoint(tmp_path, mlflow_server):
    conn = connect(mlflow_server.uri, "registry-test")
    run_id = conn.client.create_run(conn.experiment_id).info.run_id
    checkpoint = small_checkpoint(tmp_path / "runs" / "r" / "epoch_0004")
    log_best_model(conn, run_id, checkpoint, "resolve-test")
    log_best_model(conn, run_id, checkpoint, "resolve-test")  # a second finish adds nothing
    (version,) = conn.client.search_model_versions("name = 'resolve-test'")
    assert version.run_id == run_id
    assert version.tags["ray_cv.checkpoint"] == checkpoint.uri
    assert version.tags["ray_cv.dataset_version"] == checkpoint_meta().dataset_version
    assert version.tags["ray_cv.model"] == model_spec(checkpoint_meta())
    assert json.loads(version.tags["ray_cv.model"])["name"] == "resnet18"
    got = registered_checkpoint(
        f"models:/resolve-test/{version.version}", uri=mlflow_server.uri, dst=tmp_path / "copy"
    )
    assert Path(got.path).is_relative_to(tmp_path / "copy")
    files = sorted(p.name for p in Path(got.path).iterdir())
    assert files == sorted([METADATA, WEIGHTS]) and TRAIN_STATE not in files
    assert got.child(WEIGHTS).read_bytes() == checkpoint.child(WEIGHTS).read_bytes()
    assert got.child(METADATA).read_bytes() == checkpoint.child(METADATA).read_bytes()
    with pytest.raises(InputError, match=r"^models:/resolve-test/9 is no registered model version"):
        registered_checkpoint("models:/resolve-test/9", uri=mlflow_server.uri)
    with pytest.raises(ConfigError, match="is not a registered model: give models:/<name>/"):
        registered_checkpoint("runs:/abc/model", uri=mlflow_server.uri)

    # A version logged before the model was an MLflow model: the checkpoint's files alone.
    (tmp_path / "files").mkdir()
    for name in (METADATA, WEIGHTS):
        (tmp_path / "files" / name).write_bytes(checkpoint.child(name).read_bytes())
    logged = conn.client.create_logged_model(conn.experiment_id, source_run_id=run_id)
    conn.client.log_model_artifacts(logged.model_id, str(tmp_path / "files"))
    conn.client.finalize_logged_model(logged.model_id, "READY")
    source = f"models:/{logged.model_id}"
    old = conn.client.create_model_version("resolve-test", source, run_id, model_id=logged.model_id)
    got = registered_checkpoint(f"models:/resolve-test/{old.version}", uri=mlflow_server.uri)
    assert sorted(p.name for p in Path(got.path).iterdir()) == sorted([METADATA, WEIGHTS])
    assert (
        registered_version(f"models:/resolve-test/{old.version}", uri=mlflow_server.uri)[1].epoch
        == 4
    )


# --- the registered version as an MLflow model, through MLflow's own tools ---------------------

# mlflow.pyfunc.load_model(uri).predict on the images (base64 on stdin), as JSON.
PYFUNC_PREDICT = """
import base64, json, sys
import mlflow.pyfunc, pandas as pd
images = [base64.b64decode(s) for s in json.load(sys.stdin)]
out = mlflow.pyfunc.load_model(sys.argv[1]).predict(pd.DataFrame({"data": images}), {"top_k": 2})
import pipeline
rows = out.to_dict(orient="records")
print(json.dumps({"pipeline": pipeline.__file__, "rows": rows}, default=lambda a: a.tolist()))
"""
COLUMNS = ["pred", "pred_name", "top_k", "top_k_prob"]  # what the infer job writes of each image


@pytest.fixture(scope="module")
def registered_classifier(tmp_path_factory, mlflow_server):
    """A version of a registered model, logged as training logs its best checkpoint: an
    untrained network of the user's own (examples/, shipped as the model's code beside the
    bundle's), and the images with what batch inference's predictor answers for them (top 2).
    Returns (models:/ URI, images, the predictor's rows)."""
    from pipeline.infer.batch import Predictor

    root = tmp_path_factory.mktemp("pyfunc")
    torch.manual_seed(0)
    meta = checkpoint_meta(
        classes=list(CLASSES), model={"name": USER_MODEL, "kwargs": {"width": 8}}
    )
    (root / "checkpoint").mkdir()
    model = build_model(len(CLASSES), name=USER_MODEL, kwargs={"width": 8})
    save_checkpoint(root / "checkpoint", model.eval().state_dict(), meta, {"optimizer": {}})
    checkpoint = Location.parse(str(root / "checkpoint"))
    conn = connect(mlflow_server.uri, "pyfunc-test")
    run_id = conn.client.create_run(conn.experiment_id).info.run_id
    log_best_model(conn, run_id, checkpoint, "pyfunc-test")
    make_image_folder(root / "images", per_class=2, corrupt=False)  # PNG and JPEG, 40 and 48 px
    images = [p.read_bytes() for p in sorted((root / "images").rglob("*.*"))]
    predictor = Predictor(checkpoint, use_gpu=False, precision="auto", top_k=2, decode_size=32)
    batch = {"data": images, "source_id": np.arange(6).astype(str), "label_name": [""] * 6}
    return "models:/pyfunc-test/1", images, predictor(batch).select(COLUMNS).to_pylist()


def isolated_env(tmp_path, mlflow_server) -> dict[str, str]:
    """An environment where the bundle is not importable (helpers.bundle_hidden_env), with the
    tracking server's URI."""
    return bundle_hidden_env(tmp_path) | {"MLFLOW_TRACKING_URI": mlflow_server.uri}


def found_in_model_code(tmp_path) -> None:
    """Every process that imported `pipeline` found it in a model's code/, downloaded here."""
    found = (tmp_path / "found").read_text().split()
    assert found and all(f.endswith("/code/pipeline/__init__.py") for f in found), found
    assert all(Path(f).is_relative_to(tmp_path) for f in found), found


def same_predictions(got: list[dict], expected: list[dict]) -> None:
    assert [{k: r[k] for k in COLUMNS[:3]} for r in got] == [
        {k: r[k] for k in COLUMNS[:3]} for r in expected
    ]
    for g, e in zip(got, expected, strict=True):
        assert g["top_k_prob"] == pytest.approx(e["top_k_prob"], abs=1e-6)


def test_the_registered_model_loads_with_mlflow_pyfunc_as_batch_inference_classifies(
    registered_classifier, mlflow_server, tmp_path
):
    uri, images, expected = registered_classifier
    env = isolated_env(tmp_path, mlflow_server)
    proc = subprocess.run(
        [sys.executable, "-c", PYFUNC_PREDICT, uri],
        input=json.dumps([base64.b64encode(i).decode() for i in images]),
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.splitlines()[-1])
    same_predictions(out["rows"], expected)
    assert out["pipeline"] == (tmp_path / "found").read_text().split()[0]
    found_in_model_code(tmp_path)

    # What MLflow's tools read: the signature, the example, the lock's pins of what it loads.
    import mlflow.artifacts
    from mlflow.models import Model

    def download(name: str) -> Path:
        source = mlflow_server.client().get_model_version_download_uri("pyfunc-test", "1")
        path = mlflow.artifacts.download_artifacts(
            f"{source}/{name}", dst_path=str(tmp_path), tracking_uri=mlflow_server.uri
        )
        return Path(path)

    signature = Model.load(download("MLmodel")).signature
    assert signature.inputs.input_names() == ["data"]
    assert signature.outputs.input_names() == COLUMNS
    assert signature.params.to_dict() == [
        {"name": "top_k", "default": 5, "shape": None, "type": "long"}
    ]
    lock = BUNDLE_ROOT / "requirements" / "cluster.lock"
    pinned = requirements_file(download("requirements.txt"))
    assert {str(r) for r in pinned} <= {str(r) for r in requirements_file(lock)}
    names = {r.name for r in pinned}
    assert {"mlflow-skinny", "torch", "torchvision", "pillow", "pandas", "numpy"} <= names
    assert not names & {"ray", "timm", "onnx", "matplotlib"}  # not what this model loads
    example = json.loads(download("serving_input_example.json").read_text())
    assert example["dataframe_split"]["columns"] == ["data"]
    assert base64.b64decode(example["dataframe_split"]["data"][0][0]).startswith(b"\x89PNG")


def test_mlflow_models_serve_answers_as_batch_inference_classifies(
    registered_classifier, mlflow_server, tmp_path
):
    # The venv's own `mlflow` (mlflow-skinny, as on the nodes) serves: its scoring server needs
    # fastapi, uvicorn and pandas, which the lock holds, and the model needs torch; the tracking
    # server's venv (the full mlflow) has no torch. The server runs `uvicorn` from PATH.
    uri, images, expected = registered_classifier
    env = isolated_env(tmp_path, mlflow_server)
    port = free_port()
    serve = [str(Path(sys.executable).with_name("mlflow")), "models", "serve", "-m", uri]
    serve += ["--env-manager", "local", "--host", "127.0.0.1", "--port", str(port)]
    with open(tmp_path / "serve.log", "w") as log:
        server = subprocess.Popen(
            serve,
            cwd=tmp_path,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: mlflow and the uvicorn it execs
        )
    try:
        deadline = time.monotonic() + 180
        while not answers(f"http://127.0.0.1:{port}/ping"):
            assert server.poll() is None, (tmp_path / "serve.log").read_text()
            assert time.monotonic() < deadline, (tmp_path / "serve.log").read_text()
            time.sleep(0.5)
        # Binary columns travel base64 in JSON: the scoring server decodes them by the signature.
        rows = [[base64.b64encode(i).decode()] for i in images]
        request = {"dataframe_split": {"columns": ["data"], "data": rows}, "params": {"top_k": 2}}
        status, answer = invoke(port, request)
        assert status == 200, answer
        same_predictions(answer["predictions"], expected)
        found_in_model_code(tmp_path)

        # Each bad request of docs/errors.md, with its status and message; the server serves on.
        bad = {
            "an image that does not decode": ([rows[0], ["bm90IGFuIGltYWdl"]], {}),
            "`top_k` below 1": (rows[:1], {"top_k": 0}),
        }
        documented = errors_table("MLflow's scoring server: bad requests")
        assert [what for what, _, _ in documented] == list(bad)
        for what, status, message in documented:
            data, params = bad[what]
            split = {"columns": ["data"], "data": data}
            got, answer = invoke(port, {"dataframe_split": split, "params": params})
            assert got == status, answer
            assert f"Error: {message.replace('<i>', '1')}" in answer["message"], answer
        assert server.poll() is None
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)


# --- a network the train job accepts registers, whatever package it is in -----------------------

# A network of a package installed in the environment, as on nodes whose image holds it: the
# train job builds any importable module:function (docs/models.md).
INSTALLED_MODEL = "timm.models.resnet:resnet18"


def test_a_network_of_an_installed_package_registers_and_loads_where_it_is_installed(
    tmp_path, mlflow_server
):
    import mlflow.artifacts
    import timm

    meta = checkpoint_meta(model={"name": INSTALLED_MODEL, "kwargs": {}})
    (tmp_path / "checkpoint").mkdir()
    model = build_model(3, name=INSTALLED_MODEL).eval()
    save_checkpoint(tmp_path / "checkpoint", model.state_dict(), meta, {"optimizer": {}})
    conn = connect(mlflow_server.uri, "installed-test")
    run_id = conn.client.create_run(conn.experiment_id).info.run_id
    log_best_model(conn, run_id, Location.parse(str(tmp_path / "checkpoint")), "installed-test")
    (version,) = conn.client.search_model_versions("name = 'installed-test'")
    source = conn.client.get_model_version_download_uri("installed-test", version.version)
    got = mlflow.artifacts.download_artifacts(
        source, dst_path=str(tmp_path / "model"), tracking_uri=mlflow_server.uri
    )
    # The package is no code of the model's: its distribution is a requirement, at its version.
    assert sorted(p.name for p in (Path(got) / "code").iterdir()) == ["pipeline"]
    pinned = {r.name: r for r in requirements_file(Path(got) / "requirements.txt")}
    assert str(pinned["timm"].specifier) == f"=={timm.__version__}"
    # MLflow's own loader takes it where the package is installed, with no allow_modules.
    uri = f"models:/installed-test/{version.version}"
    image = base64.b64encode(png_bytes(CLASSES[0], 0, size=32)).decode()
    proc = subprocess.run(
        [sys.executable, "-c", PYFUNC_PREDICT, uri],
        input=json.dumps([image]),
        cwd=tmp_path,
        env=isolated_env(tmp_path, mlflow_server),
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = json.loads(proc.stdout.splitlines()[-1])["rows"]
    assert row["pred_name"] in meta.classes and len(row["top_k"]) == 2


def test_a_model_that_cannot_be_logged_ends_the_mlflow_run_failed_not_the_job(
    tmp_path, mlflow_server, caplog
):
    # A complete run submitted again without the package of its network: the job trains
    # nothing, and its MLflow run must not stay RUNNING with a model PENDING.
    args = ("name=unlogged", "tracking.registered_model=unlogged-test")
    cfg = train_config(tmp_path, f"tracking.uri={mlflow_server.uri}", *args)
    run_dir = Location.parse(f"{tmp_path}/runs/unlogged")
    tracker = training_tracker(cfg)
    tracker.start(run_dir, cfg, version="v1", changes=[])
    best = tmp_path / "runs" / "unlogged" / "checkpoint_000004"
    best.mkdir()
    meta = checkpoint_meta(model={"name": "not_installed_anywhere:build", "kwargs": {}})
    save_checkpoint(best, {"fc.weight": torch.zeros(3, 2)}, meta, {"optimizer": {}})
    for report in ("history.csv", "curves.png", "summary.json"):
        (best.parent / report).write_text("{}")
    summary = {"latest_checkpoint": str(best), "best_checkpoint": str(best)}
    with caplog.at_level("WARNING", logger="pipeline.tracking"):
        tracker.finish(run_dir, summary)  # returns: the job exits 0, its training whole
    run = mlflow_server.client().get_run(tracker.run_id)
    assert run.info.status == "FAILED"
    said = "module not_installed_anywhere does not import here"
    assert said in run.data.tags["ray_cv.error"]
    assert f"MLflow run {tracker.run_id} at {mlflow_server.uri} is marked FAILED" in caplog.text
    assert said in caplog.text
    models = mlflow_server.client().search_logged_models(
        [run.info.experiment_id], filter_string=f"source_run_id = '{tracker.run_id}'"
    )
    assert models and all(m.status.name == "FAILED" for m in models)
    assert run.data.metrics["val_accuracy"] == 0.5  # the rest is logged


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def invoke(port: int, request: dict) -> tuple[int, dict]:
    post = urllib.request.Request(
        f"http://127.0.0.1:{port}/invocations",
        data=json.dumps(request).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(post, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
