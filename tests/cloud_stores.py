"""The bucket the cloud-storage tests write to on the emulators (tests/conftest.py's `gcs` and
`azurite`), and an environment set for a block."""

from __future__ import annotations

import os
from contextlib import contextmanager
from unittest import mock

BUCKET = "bundle-test"


@contextmanager
def environment(env: dict[str, str]):
    with mock.patch.dict(os.environ, env):
        yield
