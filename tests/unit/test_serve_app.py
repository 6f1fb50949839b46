"""The online classifier's application without Ray: its arguments are checked when it is built
(`serve run`/`serve deploy` build it), a registered model's alias is pinned to its version then,
and docs/errors.md lists every bad request tests/ray/test_serve.py sends."""

from __future__ import annotations

import pytest
from helpers import BAD_REQUESTS, errors_table, registered_version, serve_checkpoints

from pipeline.core.config import validate_config
from pipeline.core.errors import ConfigError, InputError
from pipeline.serve.app import build_app
from pipeline.serve.config import ServeConfig


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return serve_checkpoints(tmp_path_factory)


def test_the_application_args_are_checked_when_it_is_built(checkpoints, mlflow_server, tmp_path):
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
    # A registered model: the alias pinned to its version when built, for every replica.
    registered = registered_version(checkpoints["b"], mlflow_server, "serve-args")
    with pytest.raises(ConfigError, match=r"'models:/serve-args' names no version: give"):
        build_app({"model": "models:/serve-args"})
    with pytest.raises(ConfigError, match=r"no tracking server to read it from: set MLFLOW_"):
        build_app({"model": registered})
    uri = {"tracking_uri": mlflow_server.uri}
    with pytest.raises(InputError, match=r"^models:/serve-args/9 is no registered model version"):
        build_app({"model": "models:/serve-args/9", **uri})
    app = build_app({"model": registered, **uri})
    assert app._bound_deployment.init_args[0] == "models:/serve-args/1"


def test_the_docs_table_lists_every_bad_request():
    documented = errors_table("Serving: bad requests")
    assert documented == [(what, status, message) for what, status, message, _ in BAD_REQUESTS]
