"""Source folder and output on a real S3-compatible server (moto), through `ray job submit`."""

import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest
from conftest import CLASSES, make_image_folder

from pipeline.cluster import LocalCluster, free_port
from pipeline.dataset import read_manifest
from pipeline.storage import Location

pytestmark = pytest.mark.slow
BUCKET = "bundle-test"


@pytest.fixture(scope="module")
def s3_env():
    """A moto S3 server on loopback and the environment that points AWS clients at it."""
    moto_server = pytest.importorskip("moto.server")
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=free_port(), verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {
        "AWS_ENDPOINT_URL": f"http://{host}:{port}",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_REGION": "us-east-1",
    }
    yield env
    server.stop()


@pytest.fixture(scope="module")
def s3(s3_env, monkeypatch_module):
    for k, v in s3_env.items():
        monkeypatch_module.setenv(k, v)
    fs, _ = pafs.FileSystem.from_uri(f"s3://{BUCKET}?allow_bucket_creation=true")
    fs.create_dir(BUCKET)
    return fs


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


@pytest.fixture(scope="module")
def s3_cluster(s3_env):
    # Credentials reach the workers as they would on a real cluster: in the nodes' environment.
    with LocalCluster(num_cpus=2, env=s3_env) as c:
        yield c


def upload(fs, local_root, prefix):
    for path in sorted(local_root.rglob("*")):
        if path.is_file():
            key = f"{prefix}/{path.relative_to(local_root)}"
            fs.create_dir(key.rsplit("/", 1)[0], recursive=True)
            with fs.open_output_stream(key) as f:
                f.write(path.read_bytes())


def test_preprocess_from_and_to_s3(s3, s3_cluster, tmp_path):
    bad = make_image_folder(tmp_path / "src", per_class=12)
    upload(s3, tmp_path / "src", f"{BUCKET}/raw")
    job = ["python", "-m", "jobs.preprocess", "--config", "configs/demo-preprocess.yaml",
           "source.kind=folder", f"source.folder.path=s3://{BUCKET}/raw",
           f"output=s3://{BUCKET}/datasets/shapes", "image_size=32", "shard_size=10"]  # fmt: skip
    proc = s3_cluster.submit(job, capture=True, timeout_s=300)
    assert proc.returncode == 0, proc.stdout

    root = Location.parse(f"s3://{BUCKET}/datasets/shapes")
    manifest = read_manifest(root)
    assert manifest.classes == sorted(CLASSES)
    assert {s.source_id for s in manifest.skipped} == set(bad)
    rows = sum(pq.read_table(root.child(f.path).path, filesystem=s3).num_rows
               for info in manifest.splits.values() for f in info.files)  # fmt: skip
    assert rows == 36
    keys = [i.path for i in root.list_files()]
    assert not [k for k in keys if "/_staging/" in k]
    assert f"{root.path}/config.yaml" in keys

    # Re-submitting the same job is a no-op that says so.
    again = s3_cluster.submit(job, capture=True, timeout_s=300)
    assert again.returncode == 0 and "is up to date" in again.stdout
    assert read_manifest(root) == manifest
