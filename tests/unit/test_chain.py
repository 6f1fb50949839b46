"""`python -m jobs.submit`: the plan it submits, and how it follows its jobs, against a stand-in of
Ray's Jobs API (tests/jobs_api.py). `all` on a local cluster: tests/jobs/test_chain_jobs.py; the
chain step by step on S3 in test_s3.py, and under Airflow, through the example DAG, in
test_airflow.py."""

from __future__ import annotations

import asyncio
import math
import re
import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest
from helpers import wait_for
from jobs_api import JobsAPI
from ray.job_submission import JobStatus

from harness.cluster import BUNDLE_ROOT
from jobs.submit import main
from pipeline.chain.follow import Patience, follow
from pipeline.chain.plan import check_py_modules, parse_env, plan, runtime_env, step_command
from pipeline.chain.run import committed_version, pin_dataset, without_noise
from pipeline.core.errors import ConfigError
from pipeline.core.storage import Location


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


def test_the_chains_predictions_of_each_input_go_to_an_output_of_their_own():
    def output(*sets: str) -> str:
        jobs = {j.step: j.entrypoint for j in plan("s3://b/x", sets=["train.name=r1", *sets])}
        return [a for a in jobs["infer"] if a.startswith("output=")][-1].removeprefix("output=")

    val = output()
    assert val == "s3://b/x/predictions/r1"  # the run's dataset's val split, where it was
    assert output("infer.input=s3://b/x/dataset/") == val  # the same input, however spelled
    photos = output("infer.input=s3://b/photos")
    assert photos.startswith("s3://b/x/predictions/r1-photos-")
    others = {
        output("infer.split=train"),
        output("infer.input=s3://c/photos"),
        output("infer.input=s3://b/photos", "infer.split=train"),
    }
    assert len({val, photos, *others}) == 5
    assert output("infer.input=s3://b/photos") == photos  # again: the same output
    assert output("infer.input=s3://b/photos", "infer.output=s3://b/mine") == "s3://b/mine"


def test_plan_keeps_the_roots_query_after_every_path():
    # The documented MinIO root: its endpoint option must stay an option of each path.
    root = "s3://my-bucket/ray-cv?endpoint_override=minio.internal:9000&scheme=http"
    paths = [a for job in plan(root) for a in job.entrypoint if "s3://" in a]
    assert sorted({a.partition("=")[0] for a in paths}) == [
        "dataset",
        "input",
        "model",
        "output",
        "storage",  # the check's: the root itself
        "storage_path",
    ]
    for arg in paths:
        uri = arg.partition("=")[2]
        path, _, query = uri.partition("?")
        assert query == "endpoint_override=minio.internal:9000&scheme=http", arg
        assert path.startswith("s3://my-bucket/ray-cv") and "?" not in path, arg
        assert Location.parse(uri).path.startswith("my-bucket/ray-cv"), arg


def test_all_runs_the_chain_and_export_and_tune_only_when_named(monkeypatch):
    submitted, shipped = {}, {}

    def submit(address, job, env_vars=None, log=None, patience=None, py_modules=()):
        submitted[job.step] = job.entrypoint
        shipped[job.step] = py_modules
        log.append("INFO jobs.preprocess: current dataset version: 20261123T1-aa\n")
        return 0

    monkeypatch.setattr("pipeline.chain.run.submit_and_wait", submit)
    args = ["--address", "http://127.0.0.1:9", "--root", "s3://b/x", "--profile", "demo"]
    assert main([*args, "all"]) == 0
    assert list(submitted) == ["preprocess", "train", "infer"]
    # Training reads the version the preprocess step committed; inference, whatever its input,
    # is told no version: of the run's own dataset it reads the one the run was trained on.
    pinned = [step for step, args in submitted.items() if "dataset_version=20261123T1-aa" in args]
    assert pinned == ["train"]
    assert not [arg for arg in submitted["infer"] if arg.startswith("dataset_version=")]
    submitted.clear()
    assert main([*args, "export"]) == 0
    assert list(submitted) == ["export"]
    submitted.clear()
    assert main([*args, "tune"]) == 0
    assert list(submitted) == ["tune"]
    assert {"dataset=s3://b/x/dataset", "storage_path=s3://b/x/runs"} <= set(submitted["tune"])


def test_check_runs_first_and_a_failed_check_submits_nothing_after_it(monkeypatch):
    submitted, codes = [], {"check": 0}

    def submit(address, job, env_vars=None, log=None, patience=None, py_modules=()):
        submitted.append(job.step)
        return codes.get(job.step, 0)

    monkeypatch.setattr("pipeline.chain.run.submit_and_wait", submit)
    args = ["--address", "http://127.0.0.1:9", "--root", "s3://b/x", "--profile", "demo"]
    assert main([*args, "--check", "all"]) == 0
    assert submitted == ["check", "preprocess", "train", "infer"]
    submitted.clear()
    assert main([*args, "check"]) == 0
    assert submitted == ["check"]
    submitted.clear()
    codes["check"] = 3  # a row failed: the cluster cannot run it
    assert main([*args, "--check", "train"]) == 3
    assert submitted == ["check"]


def test_the_users_package_ships_with_every_job_as_py_modules(tmp_path, monkeypatch, capsys):
    package, wheel = tmp_path / "mynet", tmp_path / "mynet-1.0-py3-none-any.whl"
    package.mkdir()
    (package / "__init__.py").write_text("")
    wheel.write_bytes(b"")
    monkeypatch.chdir(tmp_path)
    given = ["mynet", str(wheel), "s3://b/code/mynet.zip"]
    modules = check_py_modules(given)
    assert modules == [str(package), str(wheel), "s3://b/code/mynet.zip"]
    env = runtime_env({}, modules)
    assert env["py_modules"] == modules and env["working_dir"] == str(BUNDLE_ROOT)
    assert "py_modules" not in runtime_env({})
    # The chain hands them to every job it submits, and a scheduler's step command carries them.
    shipped = {}

    def submit(address, job, env_vars=None, log=None, patience=None, py_modules=()):
        shipped[job.step] = py_modules
        return 0

    monkeypatch.setattr("pipeline.chain.run.submit_and_wait", submit)
    command = step_command("http://127.0.0.1:9", "s3://b/x", "all", py_modules=given)
    assert main([*command[3:-1], "--profile", "demo", "all"]) == 0
    assert shipped == dict.fromkeys(["preprocess", "train", "infer"], modules)
    # A path that is no package is refused before anything is submitted.
    args = ["--address", "http://127.0.0.1:9", "--root", "s3://b/x", "--profile", "demo"]
    for bad, said in [("nowhere", "no such path"), ("mynet/__init__.py", "not a folder")]:
        assert main([*args, "--py-module", bad, "all"]) == 2
        assert f"--py-module {bad}: {said}" in capsys.readouterr().err


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
    _, train, *_ = plan("s3://b/x", profile="demo")
    assert pin_dataset(train, "v1").entrypoint == [*train.entrypoint, "dataset_version=v1"]
    # A version the user set stays.
    _, asked, *_ = plan("s3://b/x", profile="demo", sets=["train.dataset_version=v0"])
    assert pin_dataset(asked, "v1") == asked


def test_a_recipe_layers_its_file_over_the_train_config(capsys):
    _, train, infer, *_ = plan("s3://b/x", profile="demo", recipe="finetune")
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


# --- the chain against a stand-in for the Job REST API that breaks the connection -------------

LINES = [f"2026-11-24 17:00:{i:02d},000 INFO jobs.preprocess: line {i}\n" for i in range(12)]


@pytest.fixture
def chain(tmp_path, capsys, monkeypatch):
    """Run the chain's preprocess step against `api`, in this process: (exit code, out, err)."""
    monkeypatch.setattr("pipeline.chain.follow.POLL_S", 0.05)
    # Nothing to upload: the stand-in holds every package.
    monkeypatch.setattr("pipeline.chain.run.runtime_env", lambda env_vars=None, py_modules=(): {})

    def run(api: JobsAPI, *flags: str) -> tuple[int, str, str]:
        args = ["--address", api.address, "--root", str(tmp_path), "--profile", "demo", *flags]
        code = main([*args, "preprocess"])
        out, err = capsys.readouterr()
        assert "Traceback" not in out + err
        return code, out, err

    return run


def printed_lines(out: str) -> list[str]:
    return [line for line in out.splitlines(keepends=True) if "jobs.preprocess: line" in line]


@pytest.mark.parametrize("after_drop", ["reconnect", "poll"])
@pytest.mark.parametrize("ending", [("SUCCEEDED", 0), ("FAILED", 2)], ids=["succeeded", "failed"])
def test_a_dropped_log_stream_is_followed_to_the_jobs_own_end(chain, ending, after_drop):
    # The stream cut mid-job (close code 1006), the job running on: the chain streams it again
    # from where it stopped ("reconnect"), or polls its log where no stream passes ("poll").
    with JobsAPI(LINES, ending, drop_after=5, after_drop=after_drop) as api:
        code, out, err = chain(api)
    assert code == ending[1], out + err
    assert printed_lines(out) == LINES  # each once, in order
    assert "dropped (WebSocket connection closed unexpectedly with close code 1006)" in out
    assert api.streams == (2 if after_drop == "reconnect" else 1)


@pytest.mark.parametrize("api", [{"busy": 2}, {"late_s": 1.0}], ids=["no agent", "not up"])
def test_a_cluster_that_cannot_take_the_job_yet_is_tried_again(chain, api):
    # 500 "No available agent ..., please try again later" twice; a dashboard not yet listening.
    with JobsAPI(LINES, **api) as api:
        code, out, err = chain(api, "--submit-timeout-s=20")
    assert code == 0, out + err
    assert "cannot take the job yet" in out and "for up to 20 s (--submit-timeout-s)" in out
    assert printed_lines(out) == LINES and len(api.jobs) == 1


def test_a_cluster_that_never_takes_the_job_ends_the_chain_with_exit_3(chain):
    started = time.monotonic()
    with JobsAPI(LINES, busy=math.inf) as api:
        code, out, err = chain(api, "--submit-timeout-s=1")
    assert code == 3 and time.monotonic() - started < 10
    assert "for up to 1 s (--submit-timeout-s)" in out and api.posts >= 2 and not api.jobs
    (line,) = err.splitlines()
    address = api.address
    assert line.startswith(f"error: the cluster at --address {address} did not take the job for")
    assert "1 s (--submit-timeout-s): 500: No available agent to submit job" in line
    assert "default port 52365" in line and "--dashboard-agent-listen-port" in line


@pytest.mark.parametrize("after_drop", ["vanish", "hang", "forget"])
def test_a_cluster_lost_mid_job_ends_the_chain_with_exit_3_and_the_jobs_id(
    chain, after_drop, monkeypatch
):
    # "vanish": the cluster stops answering (connection refused), for longer than the bound;
    # "hang": the connection stays open and silent, and requests go unanswered; "forget": a
    # restarted head that no longer knows the job.
    monkeypatch.setattr("pipeline.chain.follow.QUIET_S", 0.5)
    monkeypatch.setattr("pipeline.chain.follow.REQUEST_S", 2.0)
    with JobsAPI(LINES, drop_after=5, after_drop=after_drop) as api:
        code, out, err = chain(api, "--reconnect-timeout-s=1")
        (submission_id,) = api.jobs
    assert code == 3, out + err
    assert f"submitted {submission_id}" in out and printed_lines(out) == LINES[:5]
    (line,) = err.splitlines()
    if after_drop in ("vanish", "hang"):
        assert f"job {submission_id} again for up to 1 s (--reconnect-timeout-s)" in out
        assert line.startswith(f"error: cannot reach the cluster at --address {api.address} for")
        assert f" s (--reconnect-timeout-s), following job {submission_id}, which may" in line
        # At least the bound: "hang" spends REQUEST_S on each request that goes unanswered.
        assert int(re.search(r" for (\d+) s \(--reconnect-timeout-s\)", line)[1]) >= 1
    else:
        assert line.startswith(
            f"error: the cluster at --address {api.address} no longer knows job {submission_id}"
        )


class SilentStream:
    """A job client whose log stream sends one chunk, then nothing ever again (an idle NAT or
    firewall, a proxy, that dropped the connection without a reset), while the job has ended as
    `status` says."""

    def __init__(self, status: str):
        self.status, self.asked = JobStatus(status), 0

    async def tail_job_logs(self, submission_id):
        yield LINES[0]
        await asyncio.Event().wait()

    def get_job_info(self, submission_id):
        self.asked += 1
        code = {"SUCCEEDED": 0, "FAILED": 2}.get(self.status)
        return SimpleNamespace(status=self.status, driver_exit_code=code, message="")

    def get_job_logs(self, submission_id):
        return "".join(LINES)


@pytest.mark.parametrize("status", ["SUCCEEDED", "FAILED", "STOPPED"])
def test_a_log_stream_silent_after_the_job_ended_is_left_at_the_jobs_end(status, monkeypatch):
    monkeypatch.setattr("pipeline.chain.follow.QUIET_S", 0.05)
    client, written, ended = SilentStream(status), [], []

    def chain():
        say = print
        ended.append(
            follow(client, "raysubmit_1", "http://h:8265", Patience(), written.append, say)
        )

    follower = threading.Thread(target=chain, daemon=True)  # on its own: it may never return
    follower.start()
    follower.join(timeout=10)
    assert ended, f"still following after 10 s, the job's status asked {client.asked} times"
    assert ended[0].status == status and client.asked <= 2
    assert "".join(written) == "".join(LINES)  # the log's rest read from the job, once


def interrupted_chain(api: JobsAPI, root, signum: int, ready) -> tuple[int, str, str]:
    """`python -m jobs.submit ... preprocess` against `api` in a process of its own, sent `signum`
    once `ready(its output so far)`: (exit code, out, err)."""
    cmd = [sys.executable, *step_command(api.address, str(root), "preprocess", profile="demo")[1:]]
    out, err = root / "out", root / "err"
    with out.open("w") as stdout, err.open("w") as stderr:
        # Ctrl-C reaches the chain as at a terminal: a runner started in the background by a
        # shell without job control ignores SIGINT, and its children inherit that.
        proc = subprocess.Popen(
            cmd,
            cwd=BUNDLE_ROOT,
            stdout=stdout,
            stderr=stderr,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        try:
            wait_for(lambda: ready(out.read_text()) or proc.poll() is not None, "the chain", 120)
            proc.send_signal(signum)
            code = proc.wait(timeout=60)
        finally:
            proc.kill()
    return code, out.read_text(), err.read_text()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "Ctrl-C"])
def test_a_chain_interrupted_while_it_submits_stops_its_job_and_exits_4(tmp_path, signum):
    # The request that submits the job has gone out and the job runs, the answer not in yet:
    # left running, a scheduler's retry of the step would run a second job beside it.
    with JobsAPI(LINES, hold=True) as api:
        code, out, err = interrupted_chain(api, tmp_path, signum, lambda _: api.jobs)
        (submission_id,) = api.jobs
        status = api.jobs[submission_id].status
    assert code == 4, out + err
    assert status == "STOPPED" and "Traceback" not in err
    assert err.splitlines()[-1] == f"[preprocess] interrupted: stopped {submission_id}"


def test_a_chain_interrupted_before_it_submits_has_nothing_to_stop_and_exits_4(tmp_path):
    with JobsAPI(LINES, late_s=60) as api:  # a dashboard not up yet
        code, out, err = interrupted_chain(
            api, tmp_path, signal.SIGTERM, lambda out: "cannot take the job yet" in out
        )
    assert code == 4, out + err
    assert re.fullmatch(
        r"\[preprocess\] interrupted before job ray-cv-preprocess-\S+ was submitted: nothing runs",
        err.splitlines()[-1],
    )


class LateJob:
    """A head that registers the job of an interrupted submission only after `late` requests to
    stop it; never, with None."""

    def __init__(self, late: int | None):
        self.late, self.asked = late, 0

    def stop_job(self, submission_id):
        self.asked += 1
        if self.late is None or self.asked <= self.late:
            raise RuntimeError(
                f"Request failed with status code 404: Job {submission_id} does not exist."
            )
        return True


def test_a_job_the_head_registers_after_the_interrupt_is_stopped(monkeypatch):
    from pipeline.chain.follow import Submission, stop

    monkeypatch.setattr("pipeline.chain.follow.POLL_S", 0.01)
    sent = Submission("http://head:8265", "raysubmit_1", sent=True)
    head = LateJob(late=2)
    monkeypatch.setattr("pipeline.chain.follow.job_client", lambda address: head)
    assert stop(sent) == "interrupted: stopped raysubmit_1" and head.asked == 3
    never = LateJob(late=None)
    monkeypatch.setattr("pipeline.chain.follow.job_client", lambda address: never)
    monkeypatch.setattr("pipeline.chain.follow.TAKEN_S", 0.1)
    assert stop(sent) == "interrupted; the cluster did not take job raysubmit_1: nothing runs"
