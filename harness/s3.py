"""An S3-compatible server (moto) on loopback, for the tests and benchmarks that claim S3."""

from __future__ import annotations

import logging
import os
from contextlib import contextmanager
from unittest import mock

import pyarrow.fs as pafs

from harness.cluster import free_port


class S3Server:
    """`with S3Server() as s3:` a moto server on 127.0.0.1; `s3.env` points AWS clients (pyarrow,
    on the driver and, given to a LocalCluster, on its nodes) at it."""

    def __init__(self):
        from moto.server import ThreadedMotoServer

        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=free_port(), verbose=False)
        self.env: dict[str, str] = {}

    def start(self) -> S3Server:
        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # a line per request otherwise
        self._server.start()
        host, port = self._server.get_host_and_port()
        self.env = {
            "AWS_ENDPOINT_URL": f"http://{host}:{port}",
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_REGION": "us-east-1",
        }
        return self

    def stop(self) -> None:
        self._server.stop()

    @contextmanager
    def client_env(self):
        """This process's environment pointed at the server, for the duration."""
        with mock.patch.dict(os.environ, self.env):
            yield

    def create_bucket(self, bucket: str) -> pafs.FileSystem:
        """The bucket, made on the server; returns a filesystem for it (in `client_env`)."""
        with self.client_env():
            fs, _ = pafs.FileSystem.from_uri(f"s3://{bucket}?allow_bucket_creation=true")
            fs.create_dir(bucket)
        return fs

    def __enter__(self) -> S3Server:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
