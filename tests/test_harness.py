"""The test harness: its own cluster, what every cluster test stands on, and the way `make test`
hands the tests to its processes."""

import os
import socket
import subprocess
import sys
from types import SimpleNamespace

import conftest
import pytest

from harness import cpu_cost
from harness.cluster import BUNDLE_ROOT, LocalCluster, free_ports


def test_ports_chosen_together_are_distinct():
    # One at a time, the kernel can hand a just-released port out again: a head given the
    # same port for two of its servers does not start.
    assert len(set(free_ports(64))) == 64


def test_a_head_whose_job_agent_port_is_taken_starts_on_other_ports_and_runs_a_job():
    """Another process (a test beside this one) binds the port chosen for the head's job
    agent before Ray does. The API still answers, but no job could run: the head is started
    again on other ports, where a job runs."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        cluster = LocalCluster(num_cpus=1)
        cluster._agent_port = taken.getsockname()[1]
        with cluster:
            assert cluster._agent_port != taken.getsockname()[1]
            proc = cluster.submit(["python", "-c", "print(42)"], capture=True, timeout_s=120)
            assert proc.returncode == 0 and "42" in proc.stdout, proc.stdout


class Worker:
    """An xdist worker as the scheduler sees it: what it is sent, and whether it was let go."""

    def __init__(self, name: str, scheduler, collection: list[str], sent: list):
        self.gateway = SimpleNamespace(id=name)
        self.shutting_down = False
        self.scheduler, self.collection, self.sent = scheduler, collection, sent

    def send_runtest_some(self, indices: list[int]) -> None:
        heavy_left = any(not conftest.light(u) for u in self.scheduler.workqueue)
        for i in indices:
            self.sent.append((self.gateway.id, self.collection[i], heavy_left))

    def shutdown(self) -> None:
        self.shutting_down = True


def test_the_light_worker_gets_only_light_units_and_the_others_get_them_last():
    collection = [
        "tests/test_config.py::test_a",
        "tests/test_infer.py::test_b",  # with test_train_jobs: main_run, the longest unit
        "tests/test_transforms.py::test_c",
        "tests/test_train_jobs.py::test_d",
        "tests/test_storage.py::test_e",
        "tests/test_cli.py::TestHelp::test_f",
        "tests/test_tune.py::test_g",
        "tests/test_model.py::test_h",
    ]
    options = {"numprocesses": 3, "light_worker": True}
    config = SimpleNamespace(
        getoption=lambda name, default=None: options.get(name, default),
        getvalue=lambda name: ["3*popen"],
        option=SimpleNamespace(loadscopereorder=False),
    )
    scheduler = conftest.pytest_xdist_make_scheduler(config, None)
    sent: list[tuple[str, str, bool]] = []
    workers = [Worker(f"gw{i}", scheduler, collection, sent) for i in range(3)]
    for w in workers:
        scheduler.add_node(w)
        scheduler.add_node_collection(w, collection)
    scheduler.schedule()
    finished: set[str] = set()
    while pending := [(w, t) for w, t, _ in sent if t not in finished]:
        name, test = pending[0]  # the tests end in the order they were sent
        finished.add(test)
        worker = next(w for w in workers if w.gateway.id == name)
        scheduler.mark_test_complete(worker, collection.index(test))

    assert scheduler.tests_finished and all(w.shutting_down for w in workers)
    assert sorted(t for _, t, _ in sent) == sorted(collection)  # each test once
    # The longest unit first; the light worker, light units only, and the others light units
    # only once no other is left to hand out.
    assert [t for w, t, _ in sent[:2]] == [
        "tests/test_infer.py::test_b",
        "tests/test_train_jobs.py::test_d",
    ]
    assert {w for w, _, _ in sent[:2]} == {"gw0"}
    light = [t for w, t, _ in sent if w == "gw2"]
    assert light and all(conftest.light(t) for t in light), sent
    assert not [s for s in sent if s[0] != "gw2" and conftest.light(s[1]) and s[2]], sent


def test_a_usage_error_is_printed_not_only_its_exit_code(tmp_path):
    # conftest.py leaves a finished run with os._exit; pytest prints a usage error after that.
    command = [sys.executable, "-m", "pytest", "-p", "no:xdist", "-k", "(", "tests/test_config.py"]
    # The run's CPU report, as `make test` names it: a pytest run by a test leaves it alone.
    report = tmp_path / "cpu-report.jsonl"
    report.write_text('{"test": "tests/test_harness.py::a_test_before"}\n')
    env = {**os.environ, "CPU_REPORT": str(report)}
    proc = subprocess.run(
        command, cwd=BUNDLE_ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 4, proc.stdout + proc.stderr
    assert "Wrong expression passed to '-k'" in proc.stderr, proc.stdout + proc.stderr
    assert report.read_text() == '{"test": "tests/test_harness.py::a_test_before"}\n'


# In a process of its own: the light worker's group, joined and left meanwhile, as conftest.py
# does around a fixture of NORMAL_PRIORITY; what each process's `cpu` cgroup is, printed.
PRIORITIES = """
import os, subprocess, sys
from harness import cpu_cost

def group(pid):
    lines = open(f"/proc/{pid}/cgroup").read().splitlines()
    return next(line.split(":", 2)[2] for line in lines if line.split(":")[1] == "cpu")

low = cpu_cost.low_priority(f"pytest-check-{os.getpid()}")
if low is None:
    sys.exit(3)
with cpu_cost.normal_priority(low):
    started = subprocess.Popen(["sleep", "60"])
later = subprocess.Popen(["sleep", "60"])
shares = (low / "cpu.shares").read_text().strip()
print(group(os.getpid()), group(started.pid), group(later.pid), shares)
for child in (started, later):
    child.kill()
    child.wait()
cpu_cost.leave(low)
print(low.exists())
"""


def test_the_light_worker_starts_its_services_at_the_normal_weight():
    proc = subprocess.run(
        [sys.executable, "-c", PRIORITIES],
        cwd=BUNDLE_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    if proc.returncode == 3:
        pytest.skip("no cgroup v1 `cpu` to write here (no root, or cgroup v2 only)")
    assert proc.returncode == 0, proc.stderr
    (itself, started, later, shares), removed = (line.split() for line in proc.stdout.splitlines())
    assert itself == later != "/" and started == "/", proc.stdout
    assert int(shares) == cpu_cost.LOW_SHARES and removed == ["False"], proc.stdout
