"""A throwaway single-node Ray cluster on 127.0.0.1, and job submission the way users do it.

Used by `make demo`, the tests and the benchmarks. The head runs `ray start --block` in its own
process group with its own temp dir and auth token, so stopping it touches nothing else: not a
cluster the user runs, nor their ~/.ray/auth_token.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import yaml

log = logging.getLogger(__name__)

BUNDLE_ROOT = Path(__file__).resolve().parent.parent
ENDED = ("STOPPED", "SUCCEEDED", "FAILED")  # a job's statuses once it has ended
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
# Ray's fake multi-node provider, each node with a runtime-env directory of its own.
PROVIDER_DIR = Path(__file__).resolve().parent / "autoscaler"
# Keys a cluster config must have; the fake multi-node provider runs no commands.
AUTOSCALER_EMPTY_LISTS = (
    "initialization_commands",
    "setup_commands",
    "head_setup_commands",
    "worker_setup_commands",
    "head_start_ray_commands",
    "worker_start_ray_commands",
    "cluster_synced_files",
    "rsync_exclude",
    "rsync_filter",
)


def free_port() -> int:
    [port] = free_ports(1)
    return port


def free_ports(count: int) -> list[int]:
    """`count` distinct ports free on 127.0.0.1 now. All are held until all are chosen: ports
    chosen one at a time can repeat, as the kernel may hand a just-released port out again."""
    with contextlib.ExitStack() as held:
        ports = []
        for _ in range(count):
            s = held.enter_context(socket.socket())
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
        return ports


# What `ray start` prints when a port it was given is taken: another process bound it
# between free_ports() and Ray's own bind.
PORT_TAKEN = ("that is used by other components", "already in use")
# What the job agent logs once it stops retrying its port (it retries for a few seconds).
AGENT_GAVE_UP = "failed to bind after"
# How long `add_node` gives a node to join, `ray start` restarts included; a run that waits for a
# replacement node waits as long.
NODE_JOIN_TIMEOUT_S = 180


class PortTaken(RuntimeError):
    """A port given to the head was taken before Ray bound it: start it on others."""


# What `ray start` says when its raylet took longer than Ray's fixed 30 s to register, which a
# loaded machine exceeds now and then: starting again gets one.
SLOW_START = "timed out during startup"


class SlowStart(RuntimeError):
    """The head's `ray start` gave up waiting for its own raylet: start it again."""


def _ray_cli() -> str:
    # The `ray` next to this interpreter: the venv's, not whatever is first on PATH.
    return str(Path(sys.executable).with_name("ray"))


class LocalCluster:
    """`with LocalCluster(num_cpus=2) as cluster: cluster.submit([...])`.

    With `autoscale`, Ray's own autoscaler runs on the head and adds and removes worker nodes
    of those types on this machine (its fake multi-node provider): `{"cpu": {"resources":
    {"CPU": 1}, "max_workers": 2}}` starts none, adds up to 2 one-CPU nodes for the demand it
    sees, and removes each after `idle_timeout_s` idle.

    With `metrics`, the head exports its metrics (Ray's and the jobs', docs/metrics.md) on
    `metrics_port`, for a Prometheus to scrape (harness/prometheus.py)."""

    def __init__(
        self,
        *,
        num_cpus: int | None = None,
        env: dict[str, str] | None = None,
        autoscale: dict[str, dict] | None = None,
        idle_timeout_s: float = 60,
        metrics: bool = False,
    ):
        self.num_cpus = num_cpus
        self.metrics = metrics
        self.extra_env = dict(env or {})
        if autoscale is not None:
            self.extra_env |= {
                "RAY_FAKE_CLUSTER": "1",
                "AUTOSCALER_UPDATE_INTERVAL_S": "1",
                # The v1 autoscaler, as cluster-onprem.yaml's head runs.
                "RAY_enable_autoscaler_v2": "0",
                # Where it finds its node provider (harness/autoscaler/local_nodes.py).
                "PYTHONPATH": str(PROVIDER_DIR),
            }
        self.autoscale = autoscale
        self.idle_timeout_s = idle_timeout_s
        self.token = secrets.token_hex(32)
        self._choose_ports()
        self.temp_dir = ""
        self._proc: subprocess.Popen | None = None
        self.nodes: list[Node] = []
        self._config_file = ""

    @property
    def address(self) -> str:
        """For `ray job submit --address` and JobSubmissionClient."""
        return f"http://127.0.0.1:{self.dashboard_port}"

    @property
    def running(self) -> bool:
        """Started, and not stopped since."""
        return self._proc is not None

    @property
    def gcs_address(self) -> str:
        """For `ray.init(address=...)`."""
        return f"127.0.0.1:{self.gcs_port}"

    @property
    def env(self) -> dict[str, str]:
        """Environment for clients of this cluster: token authentication on, our token."""
        # As if the venv were activated: the job's `python` is this interpreter.
        path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
        return {
            **os.environ,
            **self.extra_env,
            "PATH": path,
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN": self.token,
            "RAY_USAGE_STATS_ENABLED": "0",
        }

    def _choose_ports(self) -> None:
        ports = free_ports(5)
        self.gcs_port, self.dashboard_port, self._client_port, self._agent_port = ports[:4]
        self.metrics_port = ports[4]

    def start(self, timeout_s: float = 90, attempts: int = 3) -> LocalCluster:
        """Start the head; ready once its job API and its job agent answer. A port taken by
        another process before Ray bound it (tests start clusters side by side), or a raylet
        slower to register than `ray start` waits for, starts it again on other ports."""
        for attempt in range(1, attempts + 1):
            args = [
                "--head",
                f"--port={self.gcs_port}",
                f"--dashboard-port={self.dashboard_port}",
                f"--ray-client-server-port={self._client_port}",
                f"--dashboard-agent-listen-port={self._agent_port}",
            ]
            if self.metrics:
                args.append(f"--metrics-export-port={self.metrics_port}")
            if self.autoscale is not None:
                args.append(f"--autoscaling-config={self._autoscaling_config()}")
            self.temp_dir, self._proc, self._log = _ray_start(args, self.num_cpus, self.env)
            try:
                self._wait_ready(timeout_s)
                break
            except BaseException as e:
                self.stop()
                if not isinstance(e, (PortTaken, SlowStart)) or attempt == attempts:
                    raise
                log.warning("the head did not start (%s); starting it again on other ports", e)
                self._choose_ports()
        log.info("Ray cluster up: dashboard %s, %s CPUs", self.address, self.num_cpus or "all")
        return self

    def _autoscaling_config(self) -> str:
        """A cluster config for Ray's fake multi-node provider: the head as started here,
        worker node types from `autoscale`, none at the start."""
        head = {"resources": {"CPU": self.num_cpus or 0}, "node_config": {}, "max_workers": 0}
        workers = {
            name: {"node_config": {}, "min_workers": 0, **node_type}
            for name, node_type in self.autoscale.items()
        }
        config = {
            "cluster_name": "local",
            "max_workers": sum(t["max_workers"] for t in workers.values()),
            "provider": {
                "type": "external",
                "module": "local_nodes.Provider",
                "gcs_address": self.gcs_address,
                "use_node_id_as_ip": True,
                "disable_node_updaters": True,
                "disable_launch_config_check": True,
            },
            "available_node_types": {"ray.head.default": head, **workers},
            "head_node_type": "ray.head.default",
            "idle_timeout_minutes": self.idle_timeout_s / 60,
            "upscaling_speed": 1.0,
            "auth": {},
            "docker": {},
            "file_mounts": {},
            **{key: [] for key in AUTOSCALER_EMPTY_LISTS},
        }
        fd, path = tempfile.mkstemp(prefix="ray-autoscale-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(config, f)
        self._config_file = path
        return path

    def add_node(self, num_cpus: int, timeout_s: float = NODE_JOIN_TIMEOUT_S) -> Node:
        """Join one more node (`ray start --address`) with its own processes, temp dir and
        resources; returns once the cluster counts it. `stop` stops it with the head.

        On a loaded machine a raylet can miss the 30 s `ray start` gives it to register: the
        node is then started again, until `timeout_s`."""
        # A resource of its own, to tell this node from the others in the node list.
        tag = f"local_node_{len(self.nodes) + 1}"
        deadline = time.monotonic() + timeout_s
        while True:
            args = [
                f"--address={self.gcs_address}",
                f"--resources={json.dumps({tag: 1})}",
                f"--dashboard-agent-listen-port={free_port()}",
            ]
            node = Node(*_ray_start(args, num_cpus, self.env), tag=tag)
            code = node.wait_joined(self, deadline)
            if code is None:
                self.nodes.append(node)
                return node
            tail = node.log_tail()  # before remove() deletes its temp dir
            node.remove()
            if code == "late" or time.monotonic() > deadline:
                why = f"exited with {code}" if code != "late" else f"not in {timeout_s:.0f}s"
                raise RuntimeError(f"node did not join: `ray start` {why}:\n{tail}")
            log.warning("node did not join (`ray start` exited with %s); starting it again", code)

    def alive_resources(self) -> set[str]:
        """Names of the resources that the cluster's live nodes have."""
        nodes = self.state("nodes", "state=ALIVE")
        return {name for node in nodes for name in node["resources_total"]}

    def state(self, kind: str, *filters: str, detail: bool = False) -> list[dict]:
        """What `ray list <kind> --filter ...` lists, from the dashboard's state API (a request,
        not a CLI process per poll), e.g. state("actors", "class_name=RayTrainWorker",
        "state=ALIVE")."""
        params = [("limit", 10000), ("timeout", 30), ("detail", str(detail).lower())]
        for f in filters:
            key, predicate, value = f.partition("!=") if "!=" in f else f.partition("=")
            params += [("filter_keys", key), ("filter_predicates", predicate)]
            params += [("filter_values", value)]
        body = self.get(f"/api/v0/{kind}?{urllib.parse.urlencode(params)}")
        if body["result"] is False:
            raise RuntimeError(f"state API: {body['msg']}")
        return body["data"]["result"]["result"]

    def stop_job(self, submission_id: str, timeout_s: float = 120) -> str:
        """`ray job stop`, by request: no CLI process to start first, so the stop lands at once
        on a loaded machine. Returns the job's status once it has ended (STOPPED, or SUCCEEDED
        or FAILED where the job ended first)."""
        stop = self.request(f"/api/jobs/{submission_id}/stop", method="POST")
        urllib.request.urlopen(stop, timeout=60).close()
        deadline = time.monotonic() + timeout_s
        while (status := self.job(submission_id)["status"]) not in ENDED:
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {submission_id} still {status} {timeout_s:.0f} s after")
            time.sleep(0.5)
        return status

    def job(self, submission_id: str) -> dict:
        """What `ray job status` reads of a job, by request: its status, message, entrypoint."""
        return self.get(f"/api/jobs/{submission_id}")

    def job_logs(self, submission_id: str) -> str:
        """What `ray job logs` prints of a job, by request."""
        return self.get(f"/api/jobs/{submission_id}/logs")["logs"]

    def request(
        self, path: str, method: str = "GET", port: int | None = None
    ) -> urllib.request.Request:
        """A request to the dashboard's `path` (or that of whatever listens on `port`), with
        this cluster's token."""
        address = self.address if port is None else f"http://127.0.0.1:{port}"
        return urllib.request.Request(
            f"{address}{path}",
            method=method,
            headers={"Authorization": f"Bearer {self.token}"},
        )

    def get(self, path: str, timeout_s: float = 60):
        """The JSON answer to an authenticated GET of the dashboard's `path`."""
        with urllib.request.urlopen(self.request(path), timeout=timeout_s) as response:
            return json.load(response)

    def _wait_ready(self, timeout_s: float) -> None:
        # Ready when the job API answers an authenticated request and the head's job agent,
        # which runs submitted jobs and binds its port after the API is up, answers too.
        checks = [
            self.request("/api/jobs/"),
            self.request("/api/local_raylet_healthz", port=self._agent_port),
        ]
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                tail = self._log_tail()
                taken = any(marker in tail for marker in PORT_TAKEN)
                error = PortTaken if taken else SlowStart if SLOW_START in tail else RuntimeError
                raise error(f"`ray start` exited early:\n{tail}")
            if gave_up := [line for line in self._agent_log() if AGENT_GAVE_UP in line]:
                raise PortTaken(f"the job agent's port is taken: {gave_up[0]}")
            while checks and _answers(checks[0]):
                checks.pop(0)
            if not checks:
                return
            time.sleep(0.5)
        raise TimeoutError(f"Ray cluster not ready after {timeout_s:.0f}s:\n{self._log_tail()}")

    def _agent_log(self) -> list[str]:
        path = Path(self.temp_dir, "session_latest", "logs", "dashboard_agent.log")
        return path.read_text(errors="replace").splitlines() if path.exists() else []

    def _log_tail(self) -> str:
        return _log_tail(self.temp_dir)

    def stop(self) -> None:
        """Stop what `start` started: the nodes, the head's processes, then its temp dir."""
        for node in self.nodes:
            node.remove()
        self.nodes = []
        if self._proc is not None:
            # `ray start --block` tears down its processes on SIGTERM; after a job it can wait
            # long on their graceful exits, and a throwaway cluster needs none.
            end_process(self._proc, grace_s=3)
            self._kill_leftovers()
            self._proc = None
            self._log.close()
        if self.temp_dir:
            shutil.rmtree(self.temp_dir, ignore_errors=True)
        if self._config_file:
            Path(self._config_file).unlink(missing_ok=True)

    def _kill_leftovers(self) -> None:
        _kill_tree(self._proc, self.temp_dir)

    def submit(
        self,
        args: list[str],
        *,
        timeout_s: float | None = None,
        capture: bool = False,
        **options,
    ) -> subprocess.CompletedProcess:
        """`ray job submit ... -- <args>`: waits for the job (unless `wait=False`), tails its
        logs, exits non-zero if the job failed. Runs from the bundle root, which
        `runtime_env.yaml` uploads. `options`: those of `submit_command`."""
        return subprocess.run(
            self.submit_command(args, **options),
            cwd=BUNDLE_ROOT,
            env=self.env,
            timeout=timeout_s,
            text=True,
            stdout=subprocess.PIPE if capture else None,
            stderr=subprocess.STDOUT if capture else None,
        )

    def run_job(
        self,
        args: list[str],
        *,
        timeout_s: float | None = None,
        capture: bool = False,
        runtime_env: str | Path | None = None,
        submission_id: str | None = None,
        wait: bool = True,
    ) -> subprocess.CompletedProcess:
        """What `submit` does, through Ray's job client in this process: the same job and runtime
        env, uploaded the same way, and the same ending as `ray job submit` prints it (the job's
        log, then "Job '<id>' succeeded", "was stopped", or "failed" and its status message; a
        failed job returns 1). No `ray` CLI process: starting one costs about 2.5 CPU-s, most of
        it imports. For the tests of a job's behaviour; `submit` is the users' own command."""
        from ray.job_submission import JobStatus, JobSubmissionClient

        env = yaml.safe_load(Path(runtime_env or BUNDLE_ROOT / "runtime_env.yaml").read_text())
        # Its paths are relative to the submitter's directory: the CLI runs from the bundle root.
        if "working_dir" in env:
            env["working_dir"] = _from_bundle_root(env["working_dir"])
        if "py_modules" in env:
            env["py_modules"] = [_from_bundle_root(m) for m in env["py_modules"]]
        client = JobSubmissionClient(
            self.address, headers={"Authorization": f"Bearer {self.token}"}
        )
        job = client.submit_job(
            entrypoint=shlex.join(args), runtime_env=env, submission_id=submission_id
        )
        command = self.submit_command(args, runtime_env=runtime_env, wait=wait)
        out, code = f"Job '{job}' submitted successfully\n", 0
        if wait:
            deadline = None if timeout_s is None else time.monotonic() + timeout_s
            while not (status := client.get_job_status(job)).is_terminal():
                if deadline is not None and time.monotonic() > deadline:
                    out += client.get_job_logs(job)
                    raise subprocess.TimeoutExpired(command, timeout_s, output=out)
                time.sleep(1)
            out += client.get_job_logs(job) + _ending(client.get_job_info(job))
            code = 1 if status == JobStatus.FAILED else 0
        if not capture:
            print(out, end="", flush=True)
            out = None
        return subprocess.CompletedProcess(command, code, stdout=out)

    def submit_command(
        self,
        args: list[str],
        *,
        runtime_env: str | Path | None = None,
        submission_id: str | None = None,
        wait: bool = True,
    ) -> list[str]:
        """The `ray job submit` command line for `args`, to run from BUNDLE_ROOT with `env`."""
        return [
            _ray_cli(),
            "job",
            "submit",
            "--address",
            self.address,
            "--runtime-env",
            str(runtime_env or BUNDLE_ROOT / "runtime_env.yaml"),
            *(["--submission-id", submission_id] if submission_id else []),
            *([] if wait else ["--no-wait"]),
            "--",
            *args,
        ]

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _from_bundle_root(path: str) -> str:
    return path if "://" in path else str(BUNDLE_ROOT / path)


def _ending(info) -> str:
    """The lines `ray job submit` ends with, for a job that has ended."""
    if info.status == "SUCCEEDED":
        return f"Job '{info.submission_id}' succeeded\n"
    if info.status == "STOPPED":
        return f"Job '{info.submission_id}' was stopped\n"
    message = f"Status message: {info.message}\n" if info.message is not None else ""
    return f"Job '{info.submission_id}' failed\n{message}"


class Node:
    """A worker node of a LocalCluster: `ray start --address ... --block` and what it started."""

    def __init__(self, temp_dir: str, proc: subprocess.Popen, log_file, *, tag: str):
        self.temp_dir, self.proc, self._log = temp_dir, proc, log_file
        self.tag = tag  # the custom resource only this node has
        self.drained = False  # told it goes away (`drain`)

    def node_id(self, cluster: LocalCluster) -> str:
        """Ray's hex id of this node, while it is alive."""
        [node] = [
            n for n in cluster.state("nodes", "state=ALIVE") if self.tag in n["resources_total"]
        ]
        return node["node_id"]

    def drain(self, cluster: LocalCluster, *, reason: str, message: str, deadline_s: int) -> None:
        """`ray drain-node`: tell the cluster this node goes away in `deadline_s` seconds (the
        caller kills it then), with `reason` DRAIN_NODE_REASON_PREEMPTION or _IDLE_TERMINATION."""
        subprocess.run(
            [
                _ray_cli(),
                "drain-node",
                f"--address={cluster.gcs_address}",
                f"--node-id={self.node_id(cluster)}",
                f"--reason={reason}",
                f"--reason-message={message}",
                f"--deadline-remaining-seconds={deadline_s}",
            ],
            env=cluster.env,
            timeout=60,
            check=True,
            capture_output=True,
        )
        self.drained = True

    def wait_joined(self, cluster: LocalCluster, deadline: float) -> int | str | None:
        """None once the cluster counts this node; else `ray start`'s exit code, or "late"."""
        while True:
            with contextlib.suppress(OSError, ValueError):  # a dashboard too busy to answer
                if self.tag in cluster.alive_resources():
                    return None
            code = self.proc.poll()
            if code is not None:
                return code
            if time.monotonic() > deadline:
                return "late"
            time.sleep(0.5)

    def kill(self) -> None:
        """SIGKILL the node's raylet, its workers and the rest, as a machine that dies. Its
        temp dir stays until the cluster stops: the files of a dead machine are out of reach,
        not deleted under the feet of a process."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        _kill_tree(self.proc, self.temp_dir)

    def remove(self) -> None:
        self.kill()
        self._log.close()
        shutil.rmtree(self.temp_dir, ignore_errors=True)

    def log_tail(self) -> str:
        return _log_tail(self.temp_dir)


def _answers(request: urllib.request.Request) -> bool:
    """Whether `request` gets a 200 within 2 s."""
    try:
        with urllib.request.urlopen(request, timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


def _ray_start(args: list[str], num_cpus: int | None, env: dict[str, str]):
    """`ray start --block <args>` on 127.0.0.1 in its own session, temp dir and free ports."""
    # Short path: Ray's unix sockets live under it, and socket paths are capped at 107 bytes.
    temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    cmd = [
        _ray_cli(),
        "start",
        "--block",
        *args,
        "--node-ip-address=127.0.0.1",
        "--dashboard-host=127.0.0.1",
        f"--temp-dir={temp_dir}",
        "--disable-usage-stats",
        *([f"--num-cpus={num_cpus}"] if num_cpus is not None else []),
    ]
    log_file = open(os.path.join(temp_dir, "ray-start.log"), "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        cmd,
        env=env,
        stdout=log_file,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=ends_with_its_starter(),
    )
    return temp_dir, proc, log_file


def end_process(proc: subprocess.Popen, *, grace_s: float) -> None:
    """SIGTERM `proc` if it runs, and SIGKILL it if it has not ended `grace_s` later."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def ends_with_its_starter():
    """For Popen's preexec_fn: the child gets SIGTERM when the thread that started it ends
    (Linux's parent-death signal), so a run killed midway (a test worker that dies, Ctrl-C on
    `make test`) leaves no cluster running; `ray start --block` takes its processes down on it.
    Only from the main thread, whose end is the process's: another thread may end before the
    cluster should."""
    if sys.platform != "linux" or threading.current_thread() is not threading.main_thread():
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    return lambda: prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _log_tail(temp_dir: str, lines: int = 30) -> str:
    with open(os.path.join(temp_dir, "ray-start.log"), errors="replace") as f:
        return "".join(f.readlines()[-lines:])


def _kill_tree(proc: subprocess.Popen, temp_dir: str) -> None:
    # Anything still alive in the node's process group, or naming its temp dir, is ours.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    for pid in _pids_mentioning(temp_dir):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _pids_mentioning(text: str) -> list[int]:
    """Processes whose command line names `text`, or that run in a directory under it (Ray
    workers run in their runtime env's working dir, inside their node's temp dir)."""
    pids = []
    if not Path("/proc").is_dir():  # not Linux: the process group kill has to do
        return pids
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().decode(errors="replace")
            cwd = os.readlink(proc / "cwd") if text not in cmdline else text
        except OSError:
            continue
        if text in cmdline or cwd.startswith(text):
            pids.append(int(proc.name))
    return pids
