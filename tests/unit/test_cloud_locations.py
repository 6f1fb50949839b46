"""gs:// and abfs:// for real, against emulators on loopback (fake-gcs-server, Azurite): the
bundle's reads and writes through Location, and the errors it retries and those it does not. The
jobs on each store: tests/jobs/test_cloud_storage.py."""

import io
import os

import pyarrow.fs as pafs
import pytest
import torch
from cloud_stores import BUCKET, environment

from pipeline.core import storage
from pipeline.core.errors import EXIT_CODES, ClusterError, failure, is_transient
from pipeline.core.storage import Location

# Each store as a job's nodes see it: (the URI of a folder on it, the environment it needs).
# gs:// as on Google Cloud, the emulator named by STORAGE_EMULATOR_HOST; gs:// with pyarrow's own
# endpoint options and no environment; abfs:// at Azurite's host:port, its key in the environment.
STORES = {
    "gs-env": lambda gcs, azurite: (f"gs://{BUCKET}", gcs.env),
    "gs-uri": lambda gcs, azurite: (gcs.uri(BUCKET), {}),
    "abfs": lambda gcs, azurite: (azurite.uri(BUCKET), azurite.env),
}


@pytest.fixture(params=list(STORES))
def store(request, gcs, azurite) -> tuple[str, dict[str, str]]:
    return STORES[request.param](gcs, azurite)


def test_location_writes_lists_reads_and_deletes(store, tmp_path):
    root_uri, env = store
    with environment(env):
        root = Location.parse(root_uri).child(f"round-trip-{os.getpid()}")
        big = os.urandom(6 * 1024 * 1024 + 17)  # past one upload part of each client
        root.child("a", "big.bin").write_bytes(big)
        root.child("a", "b", "small.json").write_bytes(b'{"x": 1}')
        assert root.is_dir() and root.child("a", "b").is_dir()
        assert [i.path.removeprefix(root.path) for i in root.list_files()] == [
            "/a/b/small.json",
            "/a/big.bin",
        ]
        assert [i.base_name for i in root.child("a").list_dirs()] == ["b"]
        assert root.child("a", "big.bin").info().size == len(big)
        assert root.child("a", "big.bin").read_bytes() == big
        assert root.child("nothing-here").list_dirs() == []

        with pytest.raises(FileNotFoundError) as missing:
            root.child("a", "missing.bin").read_bytes()
        assert not is_transient(missing.value)

        root.child("a", "big.bin").delete()
        assert not root.child("a", "big.bin").exists()
        root.delete()
        assert not root.exists() and root.list_dirs() == []


def test_azure_refused_key_fails_at_once(azurite):
    """A wrong key is the input's fault: no retries, exit code 1 (errors.failure)."""
    wrong = {"AZURE_STORAGE_ACCOUNT_KEY": "d3Jvbmcga2V5IGZvciBhenVyaXRl"}
    with environment(wrong):
        location = Location.parse(azurite.uri(BUCKET, "anything.txt"))
        with pytest.raises(OSError) as refused:
            location.fs.get_file_info(location.path)
    assert "[AuthorizationFailure] 403" in str(refused.value)
    assert not is_transient(refused.value), refused.value


def test_gcs_emulator_host_leaves_an_explicit_endpoint_alone(gcs):
    """STORAGE_EMULATOR_HOST points gs:// URIs at the emulator, unauthenticated, as Google's
    clients do; a URI that names its endpoint keeps it."""
    with environment({"STORAGE_EMULATOR_HOST": "http://127.0.0.1:1"}):
        # Bounded: a URI sent to the variable's dead port would fail in 2 s, not hang.
        assert Location.parse(gcs.uri(BUCKET) + "&retry_limit_seconds=2").is_dir()
    with environment(gcs.env):
        assert Location.parse(f"gs://{BUCKET}").is_dir()
    # Google's own service, through the bundle's wrapper (pipeline/core/gcs.py).
    assert isinstance(Location.parse(f"gs://{BUCKET}").fs.handler.fs, pafs.GcsFileSystem)


def test_gcs_that_does_not_answer_fails_the_call_instead_of_holding_it(monkeypatch):
    """Google's client retries a call for 15 minutes by default, which with the bundle's
    attempts could hold a job over an hour where its node cannot reach GCS. Each call gives up
    after the bundle's limit, and fails as storage that kept failing (exit 3)."""
    monkeypatch.setattr(storage, "ATTEMPTS", 1)  # the bundle's own retries: test_storage
    monkeypatch.setattr(storage, "GCS_RETRY_LIMIT_S", 2)  # a test's wait, not 20 s
    with environment({"STORAGE_EMULATOR_HOST": "http://127.0.0.1:1"}):  # nothing listens
        location = Location.parse(f"gs://{BUCKET}/run")
        assert location.fs.handler.fs.__reduce__()[1][0]["retry_time_limit"].seconds == 2
        with pytest.raises(OSError) as unreachable:
            location.list_dirs()
    assert "UNAVAILABLE: Retry policy exhausted" in str(unreachable.value)
    code, line = failure(unreachable.value)
    assert code == EXIT_CODES[ClusterError] and line.startswith("storage: "), line


def test_a_gcs_folder_without_a_marker_object_lists_and_deletes(gcs):
    """GCS has no folders: a writer that makes no marker object (Ray Train's uploads) leaves
    none. pyarrow's listing leaves such a folder out (a resumed run found no checkpoint and
    trained from scratch), and its delete_dir, having deleted the files below, fails on it."""
    run = Location.parse(gcs.uri(BUCKET, "markerless"))
    raw, _ = pafs.FileSystem.from_uri(run.uri)
    for name in ("epoch_0000/model.pt", "epoch_0000/metadata.json", "summary.json"):
        with raw.open_output_stream(f"{run.path}/{name}") as f:
            f.write(b"{}")  # no marker object for epoch_0000/
    run.child("steps").create_parent()  # markers for the run and...
    run.child("steps", "x").create_parent()  # ... for steps/, as pyarrow makes them
    listed = [(i.base_name, i.type) for i in run.fs.get_file_info(pafs.FileSelector(run.path))]
    assert listed == [
        ("epoch_0000", pafs.FileType.Directory),
        ("steps", pafs.FileType.Directory),
        ("summary.json", pafs.FileType.File),
    ]
    assert [i.base_name for i in run.list_dirs()] == ["epoch_0000", "steps"]
    run.fs.delete_dir(run.child("epoch_0000").path)
    assert not run.child("epoch_0000").exists()
    with pytest.raises(OSError, match="No such directory"):
        run.fs.delete_dir(run.child("epoch_0001").path)  # a folder that is not there still fails


def test_a_gcs_file_opened_for_random_access_seeks_to_its_end(gcs):
    """torch.load's zip reader seeks to a checkpoint's end first, which pyarrow's GCS file
    turns into a read past the end that GCS answers with 416."""
    weights = Location.parse(gcs.uri(BUCKET, "seek/model.pt"))
    saved = io.BytesIO()
    torch.save({"w": torch.arange(6)}, saved)
    weights.write_bytes(saved.getvalue())
    with weights.fs.open_input_file(weights.path) as f:
        assert f.size() == len(saved.getvalue())
        assert torch.equal(torch.load(f, weights_only=True)["w"], torch.arange(6))
        assert f.read_at(4, 0) == saved.getvalue()[:4]
