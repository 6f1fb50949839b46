"""`python -m pipeline.submit`: the plan it submits, and the Airflow example that runs it.
The chain itself runs for real in test_s3.py, through the DAG's own commands."""

from __future__ import annotations

import shlex

import pytest
from conftest import airflow_dag_tasks

from pipeline.errors import ConfigError
from pipeline.submit import BUNDLE_ROOT, STEPS, main, plan, step_command


def test_dag_runs_each_step_of_the_chain_in_order():
    env = {
        "RAY_CV_BUNDLE": str(BUNDLE_ROOT),
        "RAY_CV_ADDRESS": "http://10.0.0.1:8265",
        "RAY_CV_ROOT": "s3://b/ray-cv",
        "RAY_CV_PROFILE": "demo",
    }
    tasks = airflow_dag_tasks(env)
    assert [t["task_id"] for t in tasks] == list(STEPS)
    for task in tasks:
        expected = step_command(
            "http://10.0.0.1:8265", "s3://b/ray-cv", task["task_id"], profile="demo"
        )
        assert shlex.split(task["bash_command"]) == expected
        assert task["cwd"] == str(BUNDLE_ROOT)
        # Token auth, and the token comes from Airflow's own store, never from the file.
        assert task["env"] == {
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN": "{{ var.value.ray_auth_token }}",
        }


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
