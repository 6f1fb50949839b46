"""cluster-onprem.yaml launched for real: `ray up` over SSH, the chain through the dashboard,
`ray down`; the commands of docs/cluster.md.

The machines are this one: each node is an sshd on its own loopback address (127.0.0.2 the
head, 127.0.0.3 a worker), in its own PID namespace, so that one node's `ray stop` cannot see
another's processes, and with its own mount namespace, where its home (/root) and Ray's temp dir
(/tmp/ray) are directories of its own, as on separate machines. Everything else is shared, as
on machines with a shared filesystem: the nodes run this checkout's venv, and the chain's root
is a local directory. Needs root; installs openssh-server and rsync with apt-get where missing.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from harness.cluster import BUNDLE_ROOT, free_port

HEAD, WORKER = "127.0.0.2", "127.0.0.3"
SSHD = "/usr/sbin/sshd"
# The config's default environment, replaced by this checkout's venv.
DEFAULT_VENV = "/opt/ray-cv/venv"
RECONNECT_TIMEOUT_ENV = "RAY_gcs_rpc_server_reconnect_timeout_s"
# Tiny data, as in test_s3.py: the chain is what is tested here, not the model.
CHAIN_SETTINGS = [
    "preprocess.source.synthetic.num_classes=3",
    "preprocess.source.synthetic.images_per_class=40",
    "preprocess.source.synthetic.raw_size=48",
    "preprocess.image_size=32",
    "preprocess.shard_size=40",
    "preprocess.row_group_size=20",
    "train.name=onprem",
    "train.epochs=1",
    "train.global_batch_size=16",
    "infer.cpus_per_actor=1",
]


def ensure_tools() -> None:
    """sshd for the nodes; ssh and rsync for `ray up` (apt-get, as on a fresh CI machine)."""
    if os.geteuid() != 0:
        pytest.skip("needs root: runs sshd on loopback addresses and logs in as root")
    missing = [
        package
        for package, tool in (
            ("openssh-server", SSHD),
            ("openssh-client", "ssh"),
            ("rsync", "rsync"),
        )
        if not shutil.which(tool)
    ]
    if missing:
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run(["apt-get", "update", "-q"], env=env, check=True, capture_output=True)
        subprocess.run(
            ["apt-get", "install", "-y", "-q", *missing], env=env, check=True, capture_output=True
        )


class SSHNode:
    """An sshd on `ip`:22 as PID 1 of its own PID and mount namespaces: killing it ends every
    process of the node, as a machine that goes away."""

    def __init__(self, ip: str, root: Path, authorized_key: Path):
        self.ip = ip
        self.dir = root / ip
        home, ray_tmp = self.dir / "home", self.dir / "tmp-ray"
        for d in (home, ray_tmp):
            d.mkdir(parents=True)
        (home / ".bashrc").touch()  # Ray's SSH commands source it
        subprocess.run(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.dir / "host_key")],
            check=True,
        )
        config = self.dir / "sshd_config"
        config.write_text(
            f"ListenAddress {ip}:22\n"
            f"HostKey {self.dir / 'host_key'}\n"
            f"AuthorizedKeysFile {authorized_key}\n"
            f"PidFile {self.dir / 'sshd.pid'}\n"
            "PermitRootLogin prohibit-password\n"
            "PasswordAuthentication no\n"
            "KbdInteractiveAuthentication no\n"
            "UsePAM no\n"
            "StrictModes no\n"
            # Ray's SSH runner multiplexes its commands over a few connections.
            "MaxSessions 50\n"
            "MaxStartups 50\n"
        )
        Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege separation directory
        # The node's own /root and /tmp/ray, bound in its private mount namespace only. This
        # machine's Python may live under /root (pyenv): the node's /root shows that part too.
        python = Path(os.path.realpath(sys.executable))
        keep = [Path("/root", python.parts[2])] if python.parts[1] == "root" else []
        script = "".join(
            f"mkdir -p {home / k.name} && mount --bind {k} {home / k.name} && " for k in keep
        )
        script += (
            f"mount --rbind {home} /root && mount --bind {ray_tmp} /tmp/ray && "
            f"exec {SSHD} -D -e -f {config}"
        )
        Path("/tmp/ray").mkdir(exist_ok=True)
        self.log = open(self.dir / "sshd.log", "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            ["unshare", "--pid", "--fork", "--mount-proc", "sh", "-c", script],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.init_pid = self._child()
        self.pid_ns = os.readlink(f"/proc/{self.init_pid}/ns/pid")
        self._wait_listening()

    def _child(self, timeout_s: float = 10) -> int:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text()
            if children.split():
                return int(children.split()[0])
            time.sleep(0.05)
        raise RuntimeError(f"unshare started nothing: {self.log_tail()}")

    def _wait_listening(self, timeout_s: float = 10) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sshd on {self.ip} exited: {self.log_tail()}")
            try:
                socket.create_connection((self.ip, 22), timeout=1).close()
                return
            except OSError:
                time.sleep(0.1)
        raise TimeoutError(f"sshd on {self.ip} not listening: {self.log_tail()}")

    def processes(self) -> dict[int, str]:
        """pid -> command line of every process in the node's PID namespace but its sshd."""
        found = {}
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit() or int(proc.name) == self.init_pid:
                continue
            try:
                if os.readlink(proc / "ns" / "pid") == self.pid_ns:
                    found[int(proc.name)] = (proc / "cmdline").read_bytes().decode(errors="replace")
            except OSError:  # exited meanwhile
                continue
        return found

    def ray_daemons(self) -> dict[int, str]:
        return {
            pid: cmd
            for pid, cmd in self.processes().items()
            if any(name in cmd for name in ("raylet", "gcs_server"))
        }

    def log_tail(self) -> str:
        return (self.dir / "sshd.log").read_text(errors="replace")[-3000:]

    def monitor_log(self) -> str:
        """The end of the autoscaler's log on this node (the head): how workers were set up."""
        # Not session_latest: a link to /tmp/ray/..., which is this node's only in its namespace.
        sessions = sorted((self.dir / "tmp-ray").glob("session_2*"))
        return "".join(
            f"--- {f.name}\n{f.read_text(errors='replace')[-4000:]}"
            for f in sorted(sessions[-1].glob("logs/monitor*"))
            if sessions
        )

    def stop(self) -> None:
        # PID 1 of a namespace gone: the kernel kills every other process in it.
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.init_pid, signal.SIGKILL)
        self.proc.wait(timeout=30)
        self.log.close()


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    ensure_tools()
    root = tmp_path_factory.mktemp("ssh")
    key = root / "id_ed25519"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    started: list[SSHNode] = []
    try:
        for ip in (HEAD, WORKER):
            started.append(SSHNode(ip, root, key.with_suffix(".pub")))
        yield key, started
    finally:
        for node in started:
            node.stop()


@pytest.fixture(scope="module")
def onprem(nodes, tmp_path_factory):
    """cluster-onprem.yaml with this machine's nodes, key and venv; the client's environment,
    with its own home (~/.ray/auth_token, which the config copies to the nodes)."""
    key, ssh_nodes = nodes
    d = tmp_path_factory.mktemp("onprem")
    config = yaml.safe_load((BUNDLE_ROOT / "cluster-onprem.yaml").read_text())
    name = f"ray-cv-test-{secrets.token_hex(3)}"
    config["cluster_name"] = name
    config["provider"].update(head_ip=HEAD, worker_ips=[WORKER])
    config["auth"] = {"ssh_user": "root", "ssh_private_key": str(key)}
    setup = config["setup_commands"]
    assert sum(DEFAULT_VENV in c for c in setup) == 1, setup
    config["setup_commands"] = [c.replace(DEFAULT_VENV, sys.prefix) for c in setup]
    # `ray down` stops the head; a worker's raylet exits by itself once it has not reached the
    # GCS for Ray's gcs_rpc_server_reconnect_timeout_s: 60 by default, 10 here.
    *stop, start = config["worker_start_ray_commands"]
    assert start.count(" ray start ") == 1, start
    start = start.replace(" ray start ", f" {RECONNECT_TIMEOUT_ENV}=10 ray start ")
    config["worker_start_ray_commands"] = [*stop, start]
    # The nodes share this machine's network: each job agent binds its node's address and
    # 127.0.0.1, on Ray's default port 52365 unless told otherwise, as does any other Ray
    # instance here (a test's in-process `ray.init`). Each node gets a free port instead.
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        assert config[key][-1].count(" ray start ") == 1, config[key]
        config[key][-1] += f" --dashboard-agent-listen-port={free_port()}"
    path = d / "cluster-onprem.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))

    home = d / "home"
    token = secrets.token_hex(32)
    (home / ".ray").mkdir(parents=True)
    (home / ".ray" / "auth_token").write_text(token)
    env = {
        **os.environ,
        "HOME": str(home),
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]),
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": token,
        "RAY_USAGE_STATS_ENABLED": "0",
    }
    state = [Path("/tmp/ray") / f"cluster-{name}.{ext}" for ext in ("state", "lock")]
    try:
        yield path, env, ssh_nodes
    finally:
        # If the test failed before its own `ray down`; the nodes' sshds end the rest.
        with contextlib.suppress(subprocess.TimeoutExpired):
            subprocess.run(
                ["ray", "down", "-y", str(path)],
                cwd=BUNDLE_ROOT,
                env=env,
                capture_output=True,
                timeout=120,
            )
        for f in state:  # the local provider's record of the cluster, on the client
            f.unlink(missing_ok=True)


def ray(env, *args: str, timeout_s: float = 600) -> str:
    proc = subprocess.run(
        ["ray", *args],
        cwd=BUNDLE_ROOT,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        timeout=timeout_s,
    )
    assert proc.returncode == 0, f"ray {' '.join(args)}:\n{proc.stdout[-5000:]}"
    return proc.stdout


def alive_nodes(env, address: str) -> list[dict]:
    out = ray(
        env,
        "list",
        "nodes",
        "--filter",
        "state=ALIVE",
        "--format",
        "json",
        "--address",
        address,
        timeout_s=60,
    )
    return json.loads(out) if out.lstrip().startswith("[") else []


def test_ray_up_chain_ray_down(onprem, tmp_path):
    config, env, (head, worker) = onprem
    timings = {}
    started = time.monotonic()
    ray(env, "up", "-y", "--no-config-cache", str(config))
    timings["ray up"] = time.monotonic() - started

    # `ray dashboard`: local port -> the head's 127.0.0.1:8265, over SSH. The dashboard and this
    # process share the loopback interface here, so the local end takes a free port.
    port = free_port()
    tunnel = subprocess.Popen(
        ["ray", "dashboard", "--port", str(port), str(config)],
        cwd=BUNDLE_ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    address = f"http://127.0.0.1:{port}"
    try:
        # The head's autoscaler brings up the worker after `ray up` returns.
        deadline = time.monotonic() + 240
        while True:
            try:
                nodes = alive_nodes(env, address)
            except AssertionError:
                nodes = []
            if {n["node_ip"] for n in nodes} == {HEAD, WORKER}:
                break
            assert time.monotonic() < deadline, f"nodes alive: {nodes}\n{head.monitor_log()}"
            time.sleep(2)
        timings["worker joined"] = time.monotonic() - started
        by_ip = {n["node_ip"]: n["node_id"] for n in nodes}

        chain_started = time.monotonic()
        cmd = [
            sys.executable,
            "-m",
            "jobs.submit",
            "--address",
            address,
            "--root",
            str(tmp_path / "chain"),
            "--profile",
            "demo",
            *[f"--set={s}" for s in CHAIN_SETTINGS],
            "all",
        ]
        proc = subprocess.run(
            cmd, cwd=BUNDLE_ROOT, env=env, text=True, capture_output=True, timeout=600
        )
        timings["chain"] = time.monotonic() - chain_started
        assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-5000:]
        assert (tmp_path / "chain" / "predictions" / "onprem" / "summary.json").exists()
        # Training reads the version the chain's preprocess step committed, and inference the
        # version the run was trained on.
        (version,) = [p.stem for p in (tmp_path / "chain" / "dataset" / "versions").iterdir()]
        submitted = re.search(r"\[train\] submitted \S+: (.*)", proc.stdout)[1]
        assert submitted.endswith(f"dataset_version={version}"), submitted
        assert f"the checkpoint was trained on: reading version {version}" in proc.stdout

        # `ray job submit`, as the README shows it: the same preprocessing, now up to date.
        preprocess = [s.split(".", 1)[1] for s in CHAIN_SETTINGS if s.startswith("preprocess.")]
        out = ray(
            env,
            "job",
            "submit",
            "--address",
            address,
            "--runtime-env",
            "runtime_env.yaml",
            "--",
            "python",
            "-m",
            "jobs.preprocess",
            "--config",
            "configs/demo-preprocess.yaml",
            f"output={tmp_path / 'chain' / 'dataset'}",
            *preprocess,
        )
        assert "up to date" in out, out[-3000:]

        # Every job's driver ran on the head; the training workers on the worker node. (The
        # CLI, not the SDK here: this process holds conftest's token, not the cluster's.)
        jobs = json.loads(
            ray(env, "list", "jobs", "--detail", "--format", "json", "--address", address)
        )
        assert [j["status"] for j in jobs] == ["SUCCEEDED"] * 4, jobs
        assert {j["driver_node_id"] for j in jobs} == {by_ip[HEAD]}
        actors = ray(
            env,
            "list",
            "actors",
            "--filter",
            "class_name=RayTrainWorker",
            "--detail",
            "--format",
            "json",
            "--address",
            address,
        )
        assert {a["node_id"] for a in json.loads(actors)} == {by_ip[WORKER]}
    finally:
        tunnel.terminate()
        tunnel.wait(timeout=30)

    down_started = time.monotonic()
    ray(env, "down", "-y", str(config))
    timings["ray down"] = time.monotonic() - down_started
    # `ray stop` on the head, whose daemons exit as they finish; the local provider has no
    # machines to turn off, so a worker's raylet exits by itself once the GCS is gone for good
    # (10 s without it, set in `onprem`).
    for node, limit_s in ((head, 60), (worker, 120)):
        deadline = down_started + limit_s
        while node.ray_daemons():
            assert time.monotonic() < deadline, node.ray_daemons()
            time.sleep(0.5)
        timings[f"{node.ip} stopped"] = time.monotonic() - down_started
    print("on-prem deploy:", ", ".join(f"{k} {v:.0f} s" for k, v in timings.items()))
