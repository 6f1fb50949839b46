"""The cluster check's own logic, without Ray: its rows from what probes found (GPU rows
included, from facts shaped as a GPU node's probe returns them), the loader's /dev/shm estimate
against train/input/ring.py's buffers, the table and JSON, the exit codes, its config and its place
in the chain. tests/jobs/test_check.py runs it as a job on a cluster."""

from __future__ import annotations

import io
import json
import math

import pytest
import torch
from PIL import Image

from pipeline.chain.plan import CHECK, plan
from pipeline.check import gpus, needs, probes, rows
from pipeline.check.config import CheckConfig, train_config
from pipeline.check.report import FAIL, PASS, SKIPPED, exit_code, failed, passed, report, table
from pipeline.check.report import skipped as skipped_row
from pipeline.core.config import load_config
from pipeline.core.errors import ConfigError
from pipeline.core.storage import Location
from pipeline.train.config import TrainConfig
from pipeline.train.input.ring import BatchRing

A = rows.Node("a" * 56, "10.0.0.1", cpus=8, gpus=0, object_store=2 * 10**9)
B = rows.Node("b" * 56, "10.0.0.2", cpus=8, gpus=0, object_store=2 * 10**9)
VERSIONS = {"python": "3.11.7", "ray": "2.60.0", "torch": "2.14.1+cu130", "torchvision": "0.29.2"}
LOCK = """ray==2.60.0 \\
    --hash=sha256:00
torch==2.14.1 ; sys_platform == 'linux' \\
torchvision==0.29.2 \\
"""


def train(*overrides: str) -> TrainConfig:
    return load_config(TrainConfig, None, ["dataset=/d", "storage_path=/s", *overrides])


def facts(**changes):
    return {
        "host": "h",
        "versions": dict(VERSIONS),
        "imports": {},
        "shm_total": 8 * 10**9,
    } | changes


def test_exit_code_is_3_for_a_cluster_row_1_for_input_rows_only_else_0():
    ok = [passed("a", "x"), skipped_row("b", "y")]
    assert exit_code(ok) == 0
    assert exit_code([*ok, failed("dataset", "unreadable", owner="input")]) == 1
    both = [*ok, failed("dataset", "x", owner="input"), failed("nodes", "y")]
    assert exit_code(both) == 3


def test_the_table_wraps_details_beside_their_row_and_the_report_holds_every_row():
    long = "word " * 40
    text = table([passed("nodes", "2 of 2"), failed("storage", long.strip())], width=80)
    lines = text.splitlines()
    assert lines[0].split() == ["row", "status", "detail"]
    assert lines[2] == "nodes    pass     2 of 2"
    assert lines[3].startswith("storage  fail     word")
    assert all(line.startswith(" " * 18 + "word") for line in lines[4:])
    assert all(len(line) <= 80 for line in lines)
    data = report([passed("nodes", "ok", alive=2), skipped_row("gpus", "none")], id="x")
    assert data["id"] == "x" and data["exit_code"] == 0
    assert data["verdict"] == "cluster check passed: 1 rows pass, 1 skipped"
    assert data["rows"][0] == {
        "name": "nodes",
        "status": PASS,
        "detail": "ok",
        "owner": "cluster",
        "facts": {"alive": 2},
    }
    json.dumps(data)  # plain data


def test_a_silent_node_and_too_few_nodes_fail_the_nodes_row():
    row = rows.nodes_row([A, B], {A.node_id: facts()}, min_nodes=3, timeout_s=5, seconds=5.1)
    assert row.status == FAIL
    assert row.detail.startswith("10.0.0.2 (bbbbbbbb) did not answer a probe within timeout_s=5 s")
    assert "2 node(s) alive, fewer than min_nodes=3" in row.detail
    row = rows.nodes_row([A], {A.node_id: facts()}, min_nodes=1, timeout_s=5, seconds=0.4)
    assert (row.status, row.detail) == (PASS, "1 of 1 nodes answered in 0.4 s (min_nodes=1)")


def test_versions_are_compared_with_the_driver_and_the_lock_without_the_cuda_build():
    assert rows.lock_pins(LOCK) == {
        "ray": {"2.60.0"},
        "torch": {"2.14.1"},
        "torchvision": {"0.29.2"},
    }
    cpu_build = facts(versions=VERSIONS | {"torch": "2.14.1+cpu"})
    row = rows.versions_row(VERSIONS, LOCK, [A, B], {A.node_id: facts(), B.node_id: cpu_build})
    assert row.status == PASS, row.detail
    old = facts(versions=VERSIONS | {"torch": "2.13.0"})
    row = rows.versions_row(VERSIONS, LOCK, [A, B], {A.node_id: facts(), B.node_id: old})
    assert row.status == FAIL
    assert row.detail.startswith(
        "10.0.0.2 (bbbbbbbb): torch 2.13.0 (driver 2.14.1, requirements/cluster.lock 2.14.1)"
    )
    assert row.detail.endswith("pip install --require-hashes -r requirements/cluster.lock)")
    # Node and driver agree, the lock pins another: the lock wins.
    row = rows.versions_row(VERSIONS, LOCK.replace("2.60.0", "2.61.0"), [A], {A.node_id: facts()})
    assert row.status == FAIL and "ray 2.60.0 (driver 2.60.0" in row.detail
    row = rows.versions_row(VERSIONS, None, [A], {A.node_id: facts()})
    assert row.status == PASS and "no requirements/cluster.lock in the working dir" in row.detail


def test_a_package_that_does_not_import_on_a_node_fails_naming_both():
    assert rows.packages_row((), [A], {A.node_id: facts()}).status == SKIPPED
    answers = {
        A.node_id: facts(imports={"mynets": None}),
        B.node_id: facts(imports={"mynets": "ModuleNotFoundError: No module named 'mynets'"}),
    }
    row = rows.packages_row(("mynets",), [A, B], answers)
    assert row.status == FAIL
    assert row.detail.startswith(
        "does not import: mynets on 10.0.0.2 (bbbbbbbb) (ModuleNotFoundError: No module named"
    )


def test_without_gpus_the_gpu_rows_are_skipped_or_fail_when_the_run_uses_them():
    skipped = gpus.gpu_rows(train(), [A, B], {}, free_gb=2)
    assert [(r.name, r.status) for r in skipped] == [(n, SKIPPED) for n in gpus.GPU_ROWS]
    assert {r.detail for r in skipped} == {"no GPU on any node; the train config does not use GPUs"}
    asked = gpus.gpu_rows(train("scaling.use_gpu=true"), [A, B], {}, free_gb=2)
    assert [r.status for r in asked] == [FAIL, SKIPPED, SKIPPED, SKIPPED]
    assert asked[0].detail.startswith("the train config asks for GPUs (scaling.use_gpu=true)")


def gpu_node(**changes):
    device = {
        "index": 0,
        "name": "H100",
        "free": 70 * 2**30,
        "total": 80 * 2**30,
        "matmul": {"n": 4096, "correct": True, "tflops": 50.0},
    }
    found = {
        "cuda": True,
        "count": 1,
        "torch_cuda": "13.0",
        "devices": [device],
        "decode": {"shape": [224, 224, 3], "mean_diff": 0.4},
    }
    for key, value in changes.items():
        (device if key in device else found)[key] = value
    return found


def test_the_gpu_rows_from_what_a_gpu_nodes_probe_found():
    node = rows.Node("g" * 56, "10.0.0.3", cpus=8, gpus=1, object_store=10**10)
    gpu = {node.node_id: gpu_node()}
    found = gpus.gpu_rows(train("scaling.use_gpu=true"), [A, node], gpu, free_gb=2)
    assert [r.status for r in found] == [PASS] * 4, [r.detail for r in found]
    bad = {
        "devices": [],  # Ray counts 1, torch sees none
        "matmul": {"error": "CUDA error: no kernel image is available"},
        "decode": {"error": "nvjpeg failed"},
        "free": 2**29,
    }
    for key, value in bad.items():
        probe = gpu_node(**{key: value})
        if key == "devices":  # what gpu_facts returns where torch sees no GPU
            probe.update(count=0, cuda=False)
            del probe["decode"]
        found = gpus.gpu_rows(train(), [node], {node.node_id: probe}, free_gb=2)
        failing = [r.name for r in found if r.status == FAIL]
        if key == "devices":
            assert failing == list(gpus.GPU_ROWS), [r.detail for r in found]
        else:
            assert failing == [
                {"matmul": "cuda_matmul", "decode": "gpu_decode"}.get(key, "gpu_memory")
            ]
    silent = gpus.gpu_rows(train(), [node], {}, free_gb=2)
    assert {r.status for r in silent} == {FAIL}
    assert "its GPU probe did not answer" in silent[0].detail


def test_the_collective_row_reports_bus_bandwidth_as_nccl_tests_do():
    cfg = train("scaling.num_workers=4")
    result = {
        "placed": True,
        "bundle": {"CPU": 1},
        "backend": "gloo",
        "bytes": 64 * 10**6,
        "nodes": ["a", "a", "b", "b"],
        "members": [{"correct": True, "seconds": s, "device": "cpu"} for s in (0.1, 0.2, 0.1, 0.1)],
    }
    row = rows.collective_row(cfg, result, 60)
    assert row.status == PASS
    assert row.facts["algbw_gbps"] == pytest.approx(0.32)  # the slowest member's time
    assert row.facts["busbw_gbps"] == pytest.approx(0.32 * 2 * 3 / 4)
    assert row.facts["nodes"] == 2
    assert rows.collective_row(cfg, result | {"placed": False}, 60).detail.startswith(
        "the cluster could not place 4 workers of {'CPU': 1} within timeout_s=60 s"
    )
    wrong = result | {"members": [{"correct": False, "seconds": 1}] * 4}
    assert rows.collective_row(cfg, wrong, 60).status == FAIL


def test_storage_that_a_node_cannot_read_is_not_shared():
    write = {"bytes": 4_000_000, "seconds": 0.01}
    read = {"listed": 4_000_000, "read": 4_000_000, "seconds": 0.02}
    both = {A.node_id: facts(read=read), B.node_id: facts(read={"error": "No such file"})}
    row = rows.storage_row("/mnt/runs", write, [A, B], both)
    assert row.status == FAIL and row.owner == "cluster"
    assert row.detail.startswith("/mnt/runs is not shared by every node: 10.0.0.2 (bbbbbbbb)")
    refused = {"step": "writing", "where": "/x/f", "error": "Not a directory", "permanent": True}
    assert rows.storage_row("/x", refused, [A], {}).owner == "input"
    ok = rows.storage_row("/mnt/runs", write, [A], {A.node_id: facts(read=read)})
    assert ok.status == PASS and ok.facts["read_mbps"] == [200.0]
    # No node answered in time (the nodes row fails for it): nothing was read back.
    silent = rows.storage_row("/mnt/runs", write, [A], {})
    assert silent.status == SKIPPED and "no node answered" in silent.detail


def test_the_dataset_row_skips_a_dataset_not_there_yet_and_fails_an_unreadable_one():
    assert rows.dataset_row("/d", {}).status == SKIPPED
    row = rows.dataset_row("/d", {"error": "not a manifest", "permanent": True})
    assert (row.status, row.owner) == (FAIL, "input")


def ring_bytes(processes: int, batch: int, size: int) -> int:
    """What RingLoader maps for a train and a val epoch of one worker: BatchRing's own buffers,
    of the shapes RingLoader gives them."""
    parts = processes if processes > 1 else 1
    train_ring = BatchRing(
        processes, batch=math.ceil(batch / parts), size=size, slots=2 * parts + 1
    )
    val_ring = BatchRing(processes, batch=batch, size=size, slots=3)
    return train_ring.memory.numel() + val_ring.memory.numel()


@pytest.mark.parametrize("processes", [1, 3])
def test_the_shm_estimate_is_what_the_loaders_ring_maps(processes):
    cfg = train(
        "global_batch_size=24", "scaling.num_workers=2", f"scaling.loader_workers={processes}"
    )
    need = needs.loader_shm(cfg, 32, "png")
    assert need.bytes == ring_bytes(processes, 12, 32)
    assert need.why.startswith(f"{processes} loader processes x")
    gpu = train("scaling.use_gpu=true", "decode=auto", f"scaling.loader_workers={processes}")
    assert needs.loader_shm(gpu, 32, "jpeg").bytes == 0  # encoded images
    assert needs.loader_shm(gpu, 32, None).bytes > 0  # no dataset yet: the larger need


def test_a_node_needs_its_workers_loaders_and_the_object_store_where_ray_maps_it():
    loader = needs.Need(10**9, "x")
    need, in_shm = needs.shm_need(loader, 2, object_store=3 * 10**9, shm_total=8 * 10**9)
    assert (need.bytes, in_shm) == (5 * 10**9, True)
    need, in_shm = needs.shm_need(loader, 2, object_store=3 * 10**9, shm_total=64 * 10**6)
    assert (need.bytes, in_shm) == (2 * 10**9, False)  # the store went to /tmp
    cfg = train("scaling.cpus_per_worker=3", "scaling.use_gpu=true", "scaling.num_workers=4")
    assert needs.workers_on_node(cfg, cpus=8, gpus=4) == 2
    assert needs.workers_on_node(cfg, cpus=16, gpus=1) == 1
    assert needs.workers_on_node(cfg, cpus=0, gpus=0) == 0


def test_a_small_shm_fails_with_the_estimate_and_the_fix():
    cfg = train("global_batch_size=256", "scaling.num_workers=1", "scaling.loader_workers=3")
    small = rows.Node("c" * 56, "10.0.0.4", cpus=4, gpus=0, object_store=10**8)
    answers = {small.node_id: facts(shm_total=64 * 2**20)}  # docker's default
    shm, store = rows.memory_rows(cfg, [small], answers, image_size=224, image_format=None)
    assert shm.status == FAIL and store.status == PASS
    assert shm.detail.startswith("/dev/shm too small: 10.0.0.4 (cccccccc): 0.07 GB for 0.62 GB")
    assert "224 px images assumed: no dataset yet" in shm.detail
    assert "docker run --shm-size" in shm.detail
    data = train("ingest=ray_data", "global_batch_size=256", "scaling.num_workers=1")
    shm, store = rows.memory_rows(data, [small], answers, image_size=224, image_format="jpeg")
    assert store.status == FAIL and "4 decoded batches" in store.detail


def test_the_node_probe_imports_and_reads_back_here(tmp_path):
    scratch = Location.parse(str(tmp_path / ".check-x" / "scratch.bin"))
    scratch.write_bytes(b"x" * 1000)
    found = probes.node_facts(("json", "no_such_module_here"), scratch, 1000)
    assert found["imports"]["json"] is None
    assert found["imports"]["no_such_module_here"].startswith("ModuleNotFoundError")
    assert (found["read"]["listed"], found["read"]["read"]) == (1000, 1000)
    assert found["versions"]["torch"] == rows.public(torch.__version__)


def test_the_decode_and_matmul_probes_on_a_cpu_device():
    buffer = io.BytesIO()
    Image.new("RGB", (40, 40), (200, 30, 90)).save(buffer, format="JPEG")
    decoded = probes.gpu_decode(buffer.getvalue(), torch.device("cpu"))
    assert decoded == {"shape": [40, 40, 3], "mean_diff": 0.0}  # libjpeg-turbo both
    assert "error" in probes.gpu_decode(b"\xff\xd8 not a jpeg", torch.device("cpu"))
    product = probes.matmul(torch.device("cpu"), 64)
    assert product["correct"] and product["tflops"] > 0


def test_the_train_config_it_reads_takes_the_checks_storage_and_dataset_last():
    cfg = load_config(
        CheckConfig,
        None,
        ["train=[configs/demo-train.yaml]", "storage=/runs", "dataset=/data"],
    )
    cfg = cfg.model_copy(update={"train_overrides": ("scaling.num_workers=4", "dataset=/other")})
    found = train_config(cfg)
    assert (found.dataset, found.storage_path, found.scaling.num_workers) == ("/data", "/runs", 4)
    with pytest.raises(ConfigError, match=r"train_overrides.0: 'epochs' must look like key=value"):
        load_config(CheckConfig, None, ["train_overrides=[epochs]"])
    with pytest.raises(ConfigError, match=r"config file \S*nope\.yaml does not exist"):
        train_config(load_config(CheckConfig, None, ["train=[nope.yaml]"]))


def test_the_chain_checks_its_own_train_step():
    jobs = plan("/tmp/root", sets=["train.epochs=3", "check.min_nodes=2"], recipe="finetune")
    (check,) = [job for job in jobs if job.step == CHECK]
    assert check.entrypoint == [
        *("python", "-m", "jobs.check", "--config", "configs/check.yaml"),
        "storage=/tmp/root",
        "dataset=/tmp/root/dataset",
        'train=["configs/train.yaml", "configs/recipes/finetune.yaml"]',
        'train_overrides=["epochs=3"]',
        "min_nodes=2",
    ]
    # The check config's own train file is the train step's: not named again.
    (check,) = [job for job in plan("/tmp/root") if job.step == CHECK]
    assert check.entrypoint[5:] == ["storage=/tmp/root", "dataset=/tmp/root/dataset"]
    with pytest.raises(ConfigError, match=r"config file \S*/nope\.yaml does not exist"):
        plan("/tmp/root", sets=["check.train=[nope.yaml]"])
