"""Storage errors that pass are retried with backoff; the others fail at once, and neither turns
an image that could not be read into a skipped one."""

from __future__ import annotations

import logging
import uuid

import pyarrow.fs as pafs
import pytest
from helpers import make_image_folder

from harness.counting import CountingHandler, FlakyHandler
from harness.s3 import S3Server
from pipeline.core import storage
from pipeline.core.config import load_config
from pipeline.core.errors import ClusterError, InputError
from pipeline.core.storage import Location, is_transient, publish_directory
from pipeline.data.config import FolderSourceConfig, PreprocessConfig
from pipeline.data.preprocess import process_items
from pipeline.data.sources import FolderSource

# What pyarrow raised when the S3 endpoint went away (taken from a real run against moto).
DROPPED = OSError(
    "When reading information for key 'x' in bucket 'b': AWS Error NETWORK_CONNECTION during "
    "HeadObject operation: curlCode: 7, Couldn't connect to server"
)
DENIED = OSError("When reading 'b/x': AWS Error ACCESS_DENIED during GetObject operation")


@pytest.fixture(autouse=True)
def quick_retries(monkeypatch):
    monkeypatch.setattr(storage, "FIRST_WAIT_S", 0.01)


def flaky(tmp_path, **kwargs) -> tuple[pafs.FileSystem, FlakyHandler]:
    handler = FlakyHandler(pafs.LocalFileSystem(), str(tmp_path / "reads"), **kwargs)
    return pafs.PyFileSystem(handler), handler


def test_an_error_that_passes_is_retried_with_backoff_and_logged(tmp_path, caplog):
    (tmp_path / "f").write_bytes(b"data")
    fs, handler = flaky(tmp_path, error=DROPPED, failures=2)
    with caplog.at_level(logging.WARNING, logger="pipeline.core.storage"):
        assert Location(fs, str(tmp_path / "f"), "f").read_bytes() == b"data"
    assert handler.opened == 3
    retries = [r.getMessage() for r in caplog.records]
    assert len(retries) == 2 and "NETWORK_CONNECTION" in retries[0]
    assert "attempt 2 of 5" in retries[0] and "attempt 3 of 5" in retries[1]


def test_an_error_that_persists_gives_up_after_the_attempts(tmp_path):
    (tmp_path / "f").write_bytes(b"data")
    fs, handler = flaky(tmp_path, error=DROPPED, failures=99)
    with pytest.raises(OSError, match="NETWORK_CONNECTION"):
        Location(fs, str(tmp_path / "f"), "f").write_bytes(b"new")
    assert handler.opened == storage.ATTEMPTS
    assert (tmp_path / "f").read_bytes() == b"data"


@pytest.mark.parametrize("error", [DENIED, FileNotFoundError("gone"), PermissionError("no")])
def test_an_error_that_cannot_pass_is_not_retried(tmp_path, error):
    (tmp_path / "f").write_bytes(b"data")
    fs, handler = flaky(tmp_path, error=error, failures=99)
    with pytest.raises(type(error)):
        Location(fs, str(tmp_path / "f"), "f").read_bytes()
    assert handler.opened == 1


def test_real_s3_errors_are_told_apart():
    with S3Server() as s3, s3.client_env():
        s3.create_bucket("there")
        fs, _ = pafs.FileSystem.from_uri("s3://there")
        with pytest.raises(OSError) as missing_key:
            fs.open_input_stream("there/nothing").read()
        with pytest.raises(OSError) as missing_bucket:
            fs.open_input_stream("nowhere/nothing").read()
        # Other calls name the same errors by pyarrow's enum: NO_SUCH_KEY, NO_SUCH_BUCKET.
        with pytest.raises(OSError) as move_missing_key:
            fs.move("there/nothing", "there/else")
        with pytest.raises(OSError) as list_missing_bucket:
            fs.get_file_info(pafs.FileSelector("nowhere/x"))
        with pytest.raises(OSError) as write_missing_bucket:
            fs.open_output_stream("nowhere/x").write(b"x")
        # A folder made in a missing bucket: pyarrow's own words, no S3 error's.
        with pytest.raises(OSError) as folder_missing_bucket:
            fs.create_dir("nowhere/x", recursive=True)
        endpoint = s3.env["AWS_ENDPOINT_URL"]
    permanent = [missing_key, missing_bucket, move_missing_key, list_missing_bucket]
    permanent += [write_missing_bucket, folder_missing_bucket]
    assert not [e.value for e in permanent if is_transient(e.value)]
    # The same endpoint once its server has stopped: nothing listens on the port.
    down = pafs.S3FileSystem(
        endpoint_override=endpoint,
        access_key="testing",
        secret_key="testing",
        region="us-east-1",
        retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=1),
        connect_timeout=1,
    )
    with pytest.raises(OSError) as unreachable:
        down.open_input_stream("there/nothing").read()
    assert is_transient(unreachable.value), unreachable.value


def folder(tmp_path, **kwargs) -> tuple[PreprocessConfig, FolderSource, FlakyHandler]:
    make_image_folder(tmp_path / "src", per_class=3, corrupt=False)
    cfg = load_config(PreprocessConfig, overrides=["image_size=32", f"output={tmp_path}/out"])
    source = FolderSource(FolderSourceConfig(path=str(tmp_path / "src")))
    fs, handler = flaky(tmp_path, **kwargs)
    source.root = Location(fs, source.root.path, source.root.uri)
    return cfg, source, handler


def test_preprocessing_reads_through_errors_that_pass(tmp_path):
    cfg, source, handler = folder(tmp_path, error=DROPPED, failures=0, every=2)
    items = source.list_items()
    rows, skipped = process_items(cfg, source.classes, items, source)
    assert skipped == [] and sum(map(len, rows.values())) == len(items) == 9
    assert handler.opened == 2 * len(items) - 1  # every second open failed and was retried


def test_preprocessing_fails_rather_than_skip_an_image_it_could_not_read(tmp_path):
    cfg, source, _ = folder(tmp_path, error=DROPPED, failures=99)
    items = source.list_items()
    with pytest.raises(ClusterError, match=r"reading source image .* kept failing"):
        process_items(cfg, source.classes, items, source)
    # Gone between the listing and the read: not the image's fault either.
    cfg, source, _ = folder(tmp_path / "again", error=DROPPED, failures=0)
    items = source.list_items()
    (tmp_path / "again" / "src" / items[0].source_id).unlink()
    with pytest.raises(InputError, match=rf"cannot read source image {items[0].source_id}"):
        process_items(cfg, source.classes, items, source)


class WriteOrder(CountingHandler):
    """Every call to `inner`; the paths opened for writing, in order, into `written`."""

    def __init__(self, inner: pafs.FileSystem, counts: str, written: list[str]):
        super().__init__(inner, counts)
        self.written = written

    def open_output_stream(self, path, metadata):
        self.written.append(path)
        return super().open_output_stream(path, metadata)


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_published_directory_is_whole_with_its_commit_file_last(tmp_path, s3_server, where):
    staged = tmp_path / "staged"
    (staged / "sub").mkdir(parents=True)
    files = {"a.bin": b"a" * 100_000, "sub/b.bin": b"b", "commit.json": b"{}"}
    for name, data in files.items():
        (staged / name).write_bytes(data)
    with s3_server.client_env():
        if where == "local":
            output = Location.parse(str(tmp_path / "out"))
        else:
            bucket = f"publish-{uuid.uuid4().hex[:8]}"
            s3_server.create_bucket(bucket)
            output = Location.parse(f"s3://{bucket}/runs/out")
            written: list[str] = []
            handler = WriteOrder(output.fs, str(tmp_path / "counts"), written)
            output = Location(pafs.PyFileSystem(handler), output.path, output.uri)
        publish_directory(staged, output, last="commit.json")
        assert {name: output.child(name).read_bytes() for name in files} == files
        if where == "local":
            # Copied into a temporary sibling, renamed into place: nothing else is left, and a
            # second publish finds the output there and leaves it.
            assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "staged"]
            (staged / "a.bin").write_bytes(b"new")
            with pytest.raises(OSError):
                publish_directory(staged, output, last="commit.json")
            assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "staged"]
            assert output.child("a.bin").read_bytes() == files["a.bin"]
        else:
            # Put in place one by one, the commit file last: whoever finds it finds the rest.
            assert written[-1] == output.child("commit.json").path and len(written) == 3
