"""The online classifier's application without Ray: its arguments are checked when it is built
(`serve run`/`serve deploy` build it), and docs/errors.md lists every bad request
tests/ray/test_serve.py sends. (A registered model's alias, pinned when built, needs a tracking
server: tests/ray/test_serve.py, beside the rollout that shares it.)"""

from __future__ import annotations

import pytest
from helpers import BAD_REQUESTS, errors_table, serve_checkpoints

from pipeline.core.config import validate_config
from pipeline.core.errors import ConfigError, InputError
from pipeline.serve.app import build_app
from pipeline.serve.config import ServeConfig


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return serve_checkpoints(tmp_path_factory)


def test_the_application_args_are_checked_when_it_is_built(checkpoints, tmp_path):
    with pytest.raises(ConfigError, match=r"model: 'runs/x' is relative; use an absolute path"):
        build_app({"model": "runs/x"})
    with pytest.raises(InputError, match=r"model=\S+ does not exist"):
        build_app({"model": str(tmp_path / "nope")})
    with pytest.raises(ConfigError, match=r"max_batch_size: Input should be greater than"):
        build_app({"model": str(checkpoints["a"]), "max_batch_size": 0})
    with pytest.raises(ConfigError, match=r"unknown key \(allowed here: model, tracking_uri,"):
        build_app({"model": str(checkpoints["a"]), "batch_size": 8})
    # `serve run pipeline.serve.app:build_app key=value` passes strings: read as YAML values.
    app = build_app({"model": str(checkpoints["a"]), "max_batch_size": "8", "top_k": "2"})
    deployment = app._bound_deployment
    checkpoint, config = deployment.init_args
    assert checkpoint == str(checkpoints["a"])
    assert validate_config(ServeConfig, config).max_batch_size == 8 and config["top_k"] == 2
    assert deployment.max_ongoing_requests == 32  # 4 batches: the replica queues, not the proxy


def test_the_docs_table_lists_every_bad_request():
    documented = errors_table("Serving: bad requests")
    assert documented == [(what, status, message) for what, status, message, _ in BAD_REQUESTS]
