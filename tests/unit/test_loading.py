"""What loading a checkpoint runs and picks, in one process: the code a checkpoint names runs
only where the user chose it, in every loader (batch inference, serving, export, the MLflow
model); a NaN score is never the best (checkpoints, EMA or raw weights, a sweep's trials); the
MLflow model of a network in a package loads where only the model's code is importable."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import ray.train
import torch
from helpers import bundle_hidden_env, checkpoint_meta, png_bytes, recorded_run
from user_code import NETWORK

from pipeline.core.config import load_config
from pipeline.core.errors import ConfigError, InputError, failure
from pipeline.core.storage import Location
from pipeline.export.config import ExportConfig
from pipeline.export.exporter import export_checkpoint
from pipeline.infer.batch import Predictor
from pipeline.model import source
from pipeline.model.checkpoint import (
    EMA,
    METADATA,
    RAW,
    SCORES,
    WEIGHTS,
    ModelSpec,
    best_of,
    save_checkpoint,
    served_weights,
    weights_by,
)
from pipeline.model.loading import load_model
from pipeline.model.networks import build_model
from pipeline.model.runs import (
    RUN_SUMMARY,
    DivergedRun,
    checkpoint_dir_name,
    summary_score,
    write_reports,
)
from pipeline.model.trust import PY_MODULES_FILES, check_model_code, py_module_dirs
from pipeline.serve import app as serve_app
from pipeline.tracking import pyfunc
from pipeline.tune import summary as sweep_summary
from pipeline.tune.config import SweepConfig

CLASSES = ["a", "b", "c"]

# --- code a checkpoint names ---------------------------------------------------------------

HUBCONF = """
from pathlib import Path

import torch


def evil(num_classes, **kwargs):
    Path({marker!r}).write_text("ran")
    return torch.nn.Linear(1, num_classes)
"""
REFUSED = r"names module torch\.hub .*allow_modules=\[torch\.hub\]"


@pytest.fixture
def hub_checkpoint(tmp_path) -> tuple[Path, Path]:
    """A checkpoint whose metadata rebuilds its network with torch.hub.load from a folder whose
    hubconf.py writes a marker file; (checkpoint, marker)."""
    hub, marker = tmp_path / "hub", tmp_path / "marker"
    hub.mkdir()
    (hub / "hubconf.py").write_text(HUBCONF.format(marker=str(marker)))
    spec = {"name": "torch.hub:load"}
    spec["kwargs"] = {"repo_or_dir": str(hub), "model": "evil", "source": "local"}
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    weights = torch.nn.Linear(1, len(CLASSES)).state_dict()
    save_checkpoint(checkpoint, weights, checkpoint_meta(model=spec), {})
    return checkpoint, marker


def test_the_hub_checkpoint_runs_its_code_only_where_the_user_allows_it(hub_checkpoint):
    checkpoint, marker = hub_checkpoint
    with pytest.raises(ConfigError, match=REFUSED):
        load_model(Location.parse(str(checkpoint)))
    assert not marker.exists()
    # Allowed by name, it is what it says it is: code that runs.
    load_model(Location.parse(str(checkpoint)), allow_modules=["torch.hub"])
    assert marker.read_text() == "ran"


def test_an_installed_package_is_refused_where_its_environment_lies_below_the_working_dir(
    hub_checkpoint, monkeypatch
):
    # As in a checkout with its .venv inside, whose dir a job is submitted from.
    checkpoint, marker = hub_checkpoint
    monkeypatch.chdir(Path(sys.prefix).resolve().parent)
    with pytest.raises(ConfigError, match=REFUSED):
        load_model(Location.parse(str(checkpoint)))
    assert not marker.exists()


def test_batch_inference_refuses_the_hub_checkpoint(hub_checkpoint):
    checkpoint, marker = hub_checkpoint
    with pytest.raises(ConfigError, match=REFUSED):
        Predictor(Location.parse(str(checkpoint)), use_gpu=False, precision="fp32", top_k=2)
    assert not marker.exists()


def test_serving_refuses_the_hub_checkpoint_at_deploy_and_in_each_replica(
    hub_checkpoint, monkeypatch
):
    checkpoint, marker = hub_checkpoint
    with pytest.raises(ConfigError, match=REFUSED):
        serve_app.build_app({"model": str(checkpoint)})
    # A replica as Serve starts it, on one CPU.
    context = SimpleNamespace(get_assigned_resources=lambda: {"CPU": 1.0})
    monkeypatch.setattr(serve_app.ray, "get_runtime_context", lambda: context)
    monkeypatch.setattr(serve_app.ray, "get_gpu_ids", lambda: [])
    replica = serve_app.ImageClassifier.func_or_class
    with pytest.raises(ConfigError, match=REFUSED):
        replica(str(checkpoint), {"model": str(checkpoint)})
    assert not marker.exists()


def test_export_refuses_the_hub_checkpoint(hub_checkpoint, tmp_path):
    checkpoint, marker = hub_checkpoint
    cfg = load_config(ExportConfig, None, [f"model={checkpoint}"])
    output = Location.parse(str(tmp_path / "export"))
    with pytest.raises(ConfigError, match=REFUSED):
        export_checkpoint(cfg, checkpoint=Location.parse(str(checkpoint)), output=output)
    assert not marker.exists() and not output.exists()


def test_the_mlflow_model_refuses_the_hub_checkpoint(hub_checkpoint, tmp_path):
    import mlflow.pyfunc

    checkpoint, marker = hub_checkpoint
    (tmp_path / "saved").mkdir()
    model = save_pyfunc(tmp_path / "saved", build_model(len(CLASSES)), "resnet18")
    # The model's checkpoint replaced with the hub checkpoint.
    for name in (METADATA, WEIGHTS):
        (model / pyfunc.CHECKPOINT_PATH / name).write_bytes((checkpoint / name).read_bytes())
    with pytest.raises(ConfigError, match=REFUSED):
        mlflow.pyfunc.load_model(str(model))
    assert not marker.exists()
    # ...unless its caller allows it.
    mlflow.pyfunc.load_model(str(model), model_config={"allow_modules": ["torch.hub"]})
    assert marker.exists()


@pytest.mark.parametrize(
    ("name", "kwargs", "error"),
    [
        ("pipeline.core.storage:retry", {}, r"module pipeline\.core\.storage \(the bundle's own"),
        ("json:loads", {}, r"names module json \(/\S+/json/__init__\.py\), which is not a file"),
        ("no_such_module:build", {}, r"names module no_such_module, which is not a file below"),
        ("timm/resnet18", {"checkpoint_path": "/x.pth"}, r"\['checkpoint_path'\], which load"),
    ],
)
def test_a_checkpoint_names_no_other_code(tmp_path, name, kwargs, error):
    save_checkpoint(tmp_path, {}, checkpoint_meta(model={"name": name, "kwargs": kwargs}), {})
    with pytest.raises(ConfigError, match=error):
        load_model(Location.parse(str(tmp_path)))


def test_a_module_shipped_with_the_job_loads(tmp_path):
    # The documented example: a file below the working dir (the bundle's root in tests).
    name = "examples.custom_model.tiny_cnn:build"
    model = build_model(len(CLASSES), name=name, kwargs={"width": 8})
    save_checkpoint(
        tmp_path,
        model.state_dict(),
        checkpoint_meta(model={"name": name, "kwargs": {"width": 8}}),
        {},
    )
    loaded, _ = load_model(Location.parse(str(tmp_path)))
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(loaded(x), model.eval()(x))
    # Below another root it is not the job's own.
    with pytest.raises(ConfigError, match=r"which is not a file below"):
        load_model(Location.parse(str(tmp_path)), code_root=tmp_path)


def ray_unpacked(tmp_path: Path, package: str, text: str) -> Path:
    """`package` with `text` as its __init__.py, where Ray unpacks an uploaded py_module:
    .../runtime_resources/py_modules_files/_ray_pkg_<hash>/<package>/; that folder."""
    folder = tmp_path / "runtime_resources" / PY_MODULES_FILES / f"_ray_pkg_{package}0123"
    (folder / package).mkdir(parents=True)
    (folder / package / "__init__.py").write_text(text)
    return folder


def test_a_py_module_loads_only_where_the_runtime_env_ships_it(tmp_path, monkeypatch):
    shipped = ray_unpacked(tmp_path, "mynet", NETWORK)
    other = ray_unpacked(tmp_path, "theirnet", NETWORK)  # another job's, on the path all the same
    monkeypatch.syspath_prepend(str(shipped))
    monkeypatch.syspath_prepend(str(other))
    (tmp_path / "working_dir").mkdir()
    monkeypatch.chdir(tmp_path / "working_dir")  # the py_modules lie outside it
    uris = [f"gcs://{shipped.name}.zip"]
    assert py_module_dirs(uris, sys.path) == [shipped]
    assert py_module_dirs(["local:///opt/nets"], sys.path) == [Path("/opt/nets")]
    # A zip on storage: Ray names its folder by the URI's hash.
    on_s3 = Path("/n", PY_MODULES_FILES, "s3_66b4d4c8e2d678e580b921a9cbd34d8d23c720fb")
    assert py_module_dirs(["s3://bucket/code/mynet.zip"], ["/n/x", str(on_s3)]) == [on_s3]
    name = "mynet:build"
    model = build_model(len(CLASSES), name=name)
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    save_checkpoint(checkpoint, model.state_dict(), checkpoint_meta(model={"name": name}), {})
    with pytest.raises(ConfigError, match=r"Ship your package with --py-module"):
        check_model_code(ModelSpec(name=name), shipped=[])
    check_model_code(ModelSpec(name=name), shipped=py_module_dirs(uris, sys.path))
    # The runtime env names the folders: the checkpoint's data cannot add one.
    for refused in ("theirnet:build", "torch.hub:load", "json:loads"):
        with pytest.raises(ConfigError, match=r"which is not a file below"):
            check_model_code(ModelSpec(name=refused), shipped=py_module_dirs(uris, sys.path))
    # Loaders take the runtime env's folders by default (none here: no Ray).
    with pytest.raises(ConfigError, match=r"names module mynet"):
        load_model(Location.parse(str(checkpoint)))
    # The MLflow model of that run ships the package from Ray's folder in its code/, and loads
    # where neither the bundle nor the package is importable.
    saved = save_pyfunc(tmp_path / "saved", model, name)
    assert sorted(p.name for p in (saved / "code").iterdir()) == ["mynet", "pipeline"]
    (tmp_path / "image.png").write_bytes(png_bytes("red_circle", 0))
    run = tmp_path / "elsewhere"
    run.mkdir()
    proc = subprocess.run(
        [sys.executable, "-c", PREDICT, str(tmp_path / "image.png"), str(saved)],
        cwd=run,
        env=bundle_hidden_env(run),
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert set(json.loads(proc.stdout.splitlines()[-1])[0]) <= set(CLASSES)


def wheel(out: Path, name: str, files: dict[str, str], requires: tuple[str, ...] = ()) -> Path:
    """A wheel of distribution `name`, version 1.0, holding `files` and requiring `requires`."""
    info = f"{name.replace('-', '_')}-1.0.dist-info"
    metadata = f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n"
    files = {
        **files,
        f"{info}/METADATA": metadata + "".join(f"Requires-Dist: {r}\n" for r in requires),
        f"{info}/WHEEL": "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    files[f"{info}/RECORD"] = "".join(f"{path},,\n" for path in [*files, f"{info}/RECORD"])
    path = out / f"{name.replace('-', '_')}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for file, text in files.items():
            z.writestr(file, text)
    return path


def test_a_wheel_py_module_admits_its_own_modules_not_its_dependencies(tmp_path, monkeypatch):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    mine = wheel(wheels, "wheel-net", {"wheelnet/__init__.py": NETWORK}, requires=("netdep",))
    wheel(wheels, "netdep", {"netdep/__init__.py": NETWORK})
    # As Ray installs a .whl py_module: `pip install <wheel> --target=<its folder>`, on the path.
    folder = tmp_path / "runtime_resources" / PY_MODULES_FILES / mine.name.removesuffix(".whl")
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-index"]
    subprocess.run([*pip, f"--find-links={wheels}", str(mine), f"--target={folder}"], check=True)
    assert {"wheelnet", "netdep"} <= {p.name for p in folder.iterdir()}  # its dependency beside it
    monkeypatch.syspath_prepend(str(folder))
    shipped = py_module_dirs([f"gcs://{mine.name}"], sys.path)
    check_model_code(ModelSpec(name="wheelnet:build"), code_root=tmp_path / "job", shipped=shipped)
    with pytest.raises(ConfigError, match=r"names module netdep \(\S+/netdep/__init__\.py\)"):
        check_model_code(
            ModelSpec(name="netdep:build"), code_root=tmp_path / "job", shipped=shipped
        )


# --- a network in a package, as an MLflow model ------------------------------------------------

# mlflow.pyfunc.load_model(path).predict on one image, for each model: the classes they answer.
PREDICT = """
import json, sys
import mlflow.pyfunc, pandas as pd
image = pd.DataFrame({"data": [open(sys.argv[1], "rb").read()]})
answers = []
for path in sys.argv[2:]:
    out = mlflow.pyfunc.load_model(path).predict(image, {"top_k": 2})
    answers.append(out["pred_name"].tolist())
print(json.dumps(answers))
"""


def save_pyfunc(root: Path, model: torch.nn.Module, name: str) -> Path:
    """`model` (named `name`) in a checkpoint saved as an MLflow model at root/model."""
    checkpoint = root / pyfunc.CHECKPOINT
    checkpoint.mkdir(parents=True)
    meta = checkpoint_meta(model={"name": name})
    save_checkpoint(checkpoint, model.eval().state_dict(), meta, {})
    pyfunc.save(checkpoint, root / "model", meta)
    return root / "model"


# Networks in a package's __init__.py, at the top and one level down, and in a nested module.
PACKAGED = {
    "mynets:build": {"mynets/__init__.py": NETWORK},
    "pkga.sub:build": {"pkga/__init__.py": "", "pkga/sub/__init__.py": NETWORK},
    "pkgb.sub.mod:build": {"pkgb/__init__.py": "", "pkgb/sub/mod.py": NETWORK},
}


def test_the_mlflow_model_of_a_network_in_a_package_loads_from_its_code_alone(
    tmp_path, monkeypatch
):
    src = tmp_path / "src"
    for files in PACKAGED.values():
        for path, text in files.items():
            (src / path).parent.mkdir(parents=True, exist_ok=True)
            (src / path).write_text(text)
    monkeypatch.syspath_prepend(str(src))
    monkeypatch.chdir(src)  # the job's working dir, where its networks live
    models = []
    for i, name in enumerate(PACKAGED):
        models.append(save_pyfunc(tmp_path / str(i), build_model(len(CLASSES), name=name), name))
        top = name.split(".")[0].split(":")[0]
        assert sorted(p.name for p in (models[-1] / "code").iterdir()) == sorted(["pipeline", top])
    (tmp_path / "image.png").write_bytes(png_bytes("red_circle", 0))
    run = tmp_path / "elsewhere"  # where neither the bundle nor the networks are importable
    run.mkdir()
    proc = subprocess.run(
        [sys.executable, "-c", PREDICT, str(tmp_path / "image.png"), *map(str, models)],
        cwd=run,
        env=bundle_hidden_env(run),
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    answers = json.loads(proc.stdout.splitlines()[-1])
    assert len(answers) == 3 and all(set(a) <= set(CLASSES) for a in answers)
    # The bundle came from a model's code alone.
    code = {str(m / "code/pipeline/__init__.py") for m in models}
    found = (run / "found").read_text().split()
    assert found and set(found) <= code


# --- NaN is never the best ---------------------------------------------------------------------


def test_the_ranking_puts_nan_and_missing_scores_last():
    items = [("nan", math.nan), ("none", None), ("a", 0.62), ("inf", math.inf), ("b", 0.62)]
    assert best_of(items, lambda i: i[1], "min") == ("a", 0.62)  # the first of those tied
    assert best_of(items, lambda i: i[1], "max") == ("a", 0.62)
    assert best_of(items[:2], lambda i: i[1], "min") is None


def diverged_run(tmp_path, monkeypatch, losses: list[float]) -> Location:
    """A finished run ranked by val loss whose epochs scored `losses`, its checkpoints on disk."""
    run = Location.parse(str(tmp_path))
    record = []
    for e, loss in enumerate(losses):
        directory = tmp_path / checkpoint_dir_name(e)
        directory.mkdir()
        metrics = {"epoch": e, "val_loss": loss, "val_accuracy": 0.5, "train_loss": loss}
        history = [
            {**metrics, "epoch": i, "train_s": 1.0, "images_per_s": 1.0} for i in range(e + 1)
        ]
        history = [h | {"images_per_s_per_worker": 1.0} for h in history]
        meta = checkpoint_meta(epoch=e, metrics=metrics, history=history)
        save_checkpoint(directory, {}, meta, {})
        record.append((ray.train.Checkpoint(str(directory)), metrics))
    return recorded_run(run, record, monkeypatch)


def test_a_nan_checkpoint_is_never_the_best(tmp_path, monkeypatch):
    run = diverged_run(tmp_path, monkeypatch, [0.62, math.nan, math.nan])
    summary = write_reports(run, SCORES["val_loss"], wall_time_s=1.0)
    assert summary["best_checkpoint"] == str(tmp_path / "epoch_0000")
    assert source.resolve_checkpoint(run).path == str(tmp_path / "epoch_0000")


def test_a_run_whose_every_checkpoint_is_nan_is_refused(tmp_path, monkeypatch):
    run = diverged_run(tmp_path, monkeypatch, [math.nan, math.nan])
    with pytest.raises(DivergedRun, match=r"run \S+ diverged: .*lower optimizer\.lr"):
        write_reports(run, SCORES["val_loss"], wall_time_s=1.0)
    # Its reports are written, without a best; inference says the same.
    summary = json.loads(run.child(RUN_SUMMARY).read_bytes())
    assert summary["best_checkpoint"] is None and summary["status"] == "finished"
    with pytest.raises(
        InputError, match=r"run \S+ diverged: no checkpoint it keeps has a val_loss to rank it by"
    ):
        source.resolve_checkpoint(run)


@pytest.mark.parametrize(
    ("metrics", "served"),
    [
        ({"val_loss": math.nan, "ema_val_loss": 0.6}, EMA),
        ({"val_loss": 0.6, "ema_val_loss": math.nan}, RAW),
        ({"val_loss": math.nan, "ema_val_loss": math.nan}, RAW),
    ],
)
def test_nan_weights_are_not_served_where_the_others_scored(metrics, served):
    meta = checkpoint_meta(
        metrics=metrics, ema_weights="model_ema.pt", config={"checkpoint": {"metric": "val_loss"}}
    )
    assert served_weights(meta) == served


def test_a_score_of_your_own_recorded_without_its_mode_is_one_input_error():
    # Ranked by a Metric of the user's whose order (max or min) the record lacks: every loader
    # picks the served weights, and a run's best checkpoint, by that order.
    meta = checkpoint_meta(
        metrics={"val_f1": 0.6, "ema_val_f1": 0.7},
        ema_weights="model_ema.pt",
        config={"metrics": ["my_metrics:f1"], "checkpoint": {"metric": "val_f1"}},
    )
    run_summary = {"checkpoint_metric": "val_f1", "checkpoint_mode": None}
    said = r"^checkpoint.metric=val_f1 is recorded with checkpoint.mode=None, so which of its"
    for read in (served_weights, weights_by, lambda _: summary_score(run_summary)):
        with pytest.raises(InputError, match=said) as raised:
            read(meta)
        assert failure(raised.value) == (1, str(raised.value))
        assert "\n" not in str(raised.value)


def test_a_diverged_trial_is_not_the_sweeps_best(tmp_path, monkeypatch, caplog):
    # Ranked by the newest checkpoint (checkpoint.metric=last), trials go by its val loss:
    # trial t_00000's is NaN. Trial t_00002 diverged at every epoch.
    cfg = load_config(
        SweepConfig,
        None,
        [
            f"dataset={tmp_path}/data",
            f"storage_path={tmp_path}",
            "name=s",
            "train.checkpoint.metric=last",
            "space.optimizer.lr.choice=[0.1, 0.01]",
        ],
    )
    scores = {"t_00000": math.nan, "t_00001": 0.7}

    def run_summary(run_dir, *_):
        trial = run_dir.name
        if trial == "t_00002":
            raise DivergedRun(run_dir, SCORES["val_loss"], [{"epoch": 0, "val_loss": math.nan}])
        return {"epochs": 2, "best_metrics": {"epoch": 1, "val_loss": scores[trial]}}

    monkeypatch.setattr(sweep_summary, "_run_summary", run_summary)
    results = [
        SimpleNamespace(path=f"{tmp_path}/tune/{t}", config={}, error=None, metrics={})
        for t in ("t_00000", "t_00001", "t_00002")
    ]
    monkeypatch.setattr(sweep_summary, "latest_checkpoint", lambda run: run)
    monkeypatch.setattr(
        sweep_summary,
        "read_meta",
        lambda _: SimpleNamespace(history=[{"epoch": 0, "val_loss": 1.0}]),
    )
    monkeypatch.setattr(sweep_summary, "plot_trials", lambda *_, **__: b"png")
    summary = sweep_summary.write_summary(
        cfg, Location.parse(str(tmp_path)), results, "v", 1.0, tracking=None
    )
    assert (summary["best_trial"], summary["best_score"]) == ("t_00001", 0.7)
    failed = summary["trials"][2]
    assert failed["status"] == "failed" and "diverged" in failed["error"]
