"""`python -m jobs.submit`: the plan it submits. The chain itself runs for real in
test_s3.py, and under Airflow, through the example DAG, in test_airflow.py."""

from __future__ import annotations

import pytest

from jobs.submit import (
    committed_version,
    main,
    parse_env,
    pin_dataset,
    plan,
    runtime_env,
    step_command,
    without_noise,
)
from pipeline.core.errors import ConfigError


def test_plan_derives_every_path_from_the_root():
    planned = plan("s3://b/x/", profile="demo", sets=["train.name=r1", "infer.top_k=3"])
    jobs = {j.step: j.entrypoint for j in planned}
    assert jobs["preprocess"][:5] == [
        "python",
        "-m",
        "jobs.preprocess",
        "--config",
        "configs/demo-preprocess.yaml",
    ]
    assert "output=s3://b/x/dataset" in jobs["preprocess"]
    assert {"dataset=s3://b/x/dataset", "storage_path=s3://b/x/runs", "name=r1"} <= set(
        jobs["train"]
    )
    assert {
        "model=s3://b/x/runs/r1",
        "input=s3://b/x/dataset",
        "output=s3://b/x/predictions/r1",
        "top_k=3",
    } <= set(jobs["infer"])
    # The export of the run's best checkpoint goes beside it: <run>/export/<checkpoint name>.
    assert jobs["export"][:5] == [
        "python",
        "-m",
        "jobs.export",
        "--config",
        "configs/demo-export.yaml",
    ]
    assert {"model=s3://b/x/runs/r1", "dataset=s3://b/x/dataset"} <= set(jobs["export"])
    assert not [arg for arg in jobs["export"] if arg.startswith("output=")]


def test_all_runs_the_chain_and_export_only_when_named(monkeypatch):
    submitted = []

    def submit(address, job, env_vars=None, log=None):
        submitted.append(job.step)
        return 0

    monkeypatch.setattr("jobs.submit.submit_and_wait", submit)
    args = ["--address", "http://127.0.0.1:9", "--root", "s3://b/x", "--profile", "demo"]
    assert main([*args, "all"]) == 0
    assert submitted == ["preprocess", "train", "infer"]
    submitted.clear()
    assert main([*args, "export"]) == 0
    assert submitted == ["export"]


def test_a_local_root_becomes_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (job, *_) = plan("out", profile="demo")
    assert f"output={tmp_path / 'out' / 'dataset'}" in job.entrypoint


@pytest.mark.parametrize(
    "sets, message",
    [
        (["train.epochs=0"], "epochs"),
        (["epochs=3"], "must start with one of preprocess, train, infer"),
        (["infer.no_such_key=1"], "no_such_key: unknown key"),
    ],
)
def test_bad_settings_fail_before_anything_is_submitted(sets, message, capsys):
    # No cluster at this address: a config error must come first, with exit code 2.
    args = ["--address", "http://127.0.0.1:9", "--root", "s3://b/x", "--profile", "demo"]
    assert main([*args, *[f"--set={s}" for s in sets], "all"]) == 2
    assert message in capsys.readouterr().err
    with pytest.raises(ConfigError):
        plan("s3://b/x", profile="demo", sets=sets)


def test_env_vars_reach_every_job_over_the_runtime_envs(capsys):
    env = runtime_env(parse_env(["AWS_PROFILE=prod", "EMPTY="]))
    assert env["env_vars"] == {"PYTHONUNBUFFERED": "1", "AWS_PROFILE": "prod", "EMPTY": ""}
    args = ["--address", "http://127.0.0.1:9", "--root", "s3://b/x", "--profile", "demo"]
    assert main([*args, "--env", "NO_VALUE", "all"]) == 2
    assert "--env 'NO_VALUE': expected NAME=VALUE" in capsys.readouterr().err


def test_the_chain_pins_the_dataset_version_its_preprocess_step_committed():
    log = (
        "2026-11-23 10:00:01 INFO jobs.preprocess: current dataset version: 20261123T1-aa\n"
        "2026-11-23 10:00:02 INFO jobs.preprocess: done\n"
    )
    assert committed_version(log) == "20261123T1-aa"
    assert committed_version("no such line\n") is None
    _, train, infer, _ = plan("s3://b/x", profile="demo")
    assert pin_dataset(train, "v1").entrypoint == [*train.entrypoint, "dataset_version=v1"]
    assert pin_dataset(infer, "v1").entrypoint[-1] == "dataset_version=v1"
    # A version the user set stays.
    _, asked, _, _ = plan("s3://b/x", profile="demo", sets=["train.dataset_version=v0"])
    assert pin_dataset(asked, "v1") == asked


def test_a_recipe_layers_its_file_over_the_train_config(capsys):
    _, train, infer, _ = plan("s3://b/x", profile="demo", recipe="finetune")
    assert train.entrypoint[3:7] == [
        "--config",
        "configs/demo-train.yaml",
        "--config",
        "configs/recipes/finetune.yaml",
    ]
    assert infer.entrypoint.count("--config") == 1
    assert "--recipe" in step_command("http://h:8265", "/r", "train", recipe="finetune")
    # Validated with the recipe before anything is submitted: this one's scaled-down batch.
    with pytest.raises(ConfigError, match=r"micro_batch_size=5 does not divide"):
        plan("s3://b/x", profile="demo", recipe="scratch", sets=["train.micro_batch_size=5"])
    with pytest.raises(ConfigError, match=r"--recipe 'fast': no such recipe; the bundle has "):
        plan("s3://b/x", recipe="fast")
    args = ["--address", "http://127.0.0.1:9", "--root", "s3://b/x", "--recipe", "../train"]
    assert main([*args, "all"]) == 2
    assert "finetune, scratch" in capsys.readouterr().err


def test_the_streamed_logs_leave_out_rays_noise():
    noise = (
        "[2026-11-24 17:00:00,000 E 1 1] core_worker.cc:2465: Actor with class name: "
        "'MapWorker(MapBatches(Predictor))' and ID: 'ab' has constructor arguments in the "
        "object store and max_restarts > 0. If the arguments ... for more details.\n"
    )
    ours = "2026-11-24 17:00:01,000 INFO jobs.infer: 119 images classified\n"
    assert without_noise(ours + noise + ours) == ours + ours
    assert without_noise(ours.rstrip("\n")) == ours.rstrip("\n")  # a chunk ends mid-line
