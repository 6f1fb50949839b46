"""The test harness's own cluster: what every cluster test stands on."""

import socket

from harness.cluster import LocalCluster, free_ports


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
