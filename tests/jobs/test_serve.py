"""Online inference: configs/serve.yaml deployed with `serve deploy` to the session's 2-CPU
cluster, and a real HTTP client on loopback. Untrained checkpoints and tiny images: what is
tested is the serving, not the model."""

from __future__ import annotations

import http.client
import io
import re
import socket
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from corpus import REASONS, share
from helpers import (
    CLASSES,
    checkpoint_meta,
    errors_table,
    jpeg_bytes,
    make_image_folder,
    wait_for,
)
from PIL import Image

from harness.load import Client, Load, post
from harness.serving import ServeApp
from pipeline.core.config import validate_config
from pipeline.core.errors import ConfigError, InputError
from pipeline.core.storage import Location
from pipeline.data.images import BadImageError
from pipeline.infer.batch import Predictor
from pipeline.model.checkpoint import save_checkpoint
from pipeline.model.classifier import Classifier, prepare_image
from pipeline.model.networks import build_model
from pipeline.serve.app import BAD_IMAGE_STATUS, build_app
from pipeline.serve.config import ServeConfig
from pipeline.tracking.client import connect
from pipeline.tracking.registry import log_best_model

# Small enough for a test to exceed at once, large enough for the test images (a few KiB).
MAX_REQUEST_BYTES = 100_000


def truncated_jpeg() -> bytes:
    data = jpeg_bytes(CLASSES[0], 999, size=64)
    return data[: len(data) // 2]


def decompression_bomb() -> bytes:
    # 144 M pixels, past PIL's safety limit, in a 1-bit PNG of a few KiB.
    buf = io.BytesIO()
    Image.new("1", (12_000, 12_000)).save(buf, format="PNG")
    assert len(buf.getvalue()) < MAX_REQUEST_BYTES
    return buf.getvalue()


# What docs/errors.md's serving table lists: the request, its status, how the message starts.
BAD_REQUESTS = [
    ("an empty body", 400, "empty request body", lambda: b""),
    ("a body that is no image", 415, "not an image (unrecognised format)", lambda: b"hello\n"),
    ("a truncated image", 400, "truncated or corrupt image", truncated_jpeg),
    (
        "a body over `max_request_bytes`",
        413,
        "request body larger than max_request_bytes=<n>",
        lambda: b"\xff" * (MAX_REQUEST_BYTES + 1),
    ),
    ("an image too large to decode safely", 413, "too large to decode safely", decompression_bomb),
    ("a method other than POST or GET", 405, "PUT is not served here", None),
]


# --- the application's arguments, without a cluster -------------------------------------------


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """Two untrained checkpoints of the helpers' three classes, different weights: "a" is
    deployed first, "b" rolled out."""
    paths = {}
    for seed, name in enumerate("ab"):
        path = tmp_path_factory.mktemp(f"checkpoint_{name}")
        torch.manual_seed(seed)
        meta = checkpoint_meta(classes=list(CLASSES))
        save_checkpoint(path, build_model(len(CLASSES)).eval().state_dict(), meta, {})
        paths[name] = path
    return paths


@pytest.fixture(scope="module")
def registered(checkpoints, mlflow_server) -> str:
    """Checkpoint "b" logged and registered as the train job registers its best checkpoint,
    version 1 of `serve-test` in `mlflow_server`, with the alias `production`: its URI."""
    conn = connect(mlflow_server.uri, "serve-test")
    run_id = conn.client.create_run(conn.experiment_id).info.run_id
    log_best_model(conn, run_id, Location.parse(str(checkpoints["b"])), "serve-test")
    conn.client.set_registered_model_alias("serve-test", "production", "1")
    return "models:/serve-test@production"


def test_the_application_args_are_checked_when_it_is_built(
    checkpoints, registered, mlflow_server, tmp_path
):
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
    with pytest.raises(ConfigError, match=r"'models:/serve-test' names no version: give"):
        build_app({"model": "models:/serve-test"})
    with pytest.raises(ConfigError, match=r"no tracking server to read it from: set MLFLOW_"):
        build_app({"model": registered})
    uri = {"tracking_uri": mlflow_server.uri}
    with pytest.raises(InputError, match=r"^models:/serve-test/9 is no registered model version"):
        build_app({"model": "models:/serve-test/9", **uri})
    app = build_app({"model": registered, **uri})
    assert app._bound_deployment.init_args[0] == "models:/serve-test/1"


# --- on the cluster ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("serve_images")
    make_image_folder(root, per_class=2, corrupt=False)  # PNGs and JPEGs, not square
    return root


@pytest.fixture(scope="module")
def batch_predictions(checkpoints, images) -> dict[str, dict]:
    """Batch inference's answer for each image with checkpoint "a", in process: one batch of
    the image files' bytes through the predictor the job's CPU actors run (it decodes its own
    batches). {source_id: {class: probability}}."""
    files = sorted(images.rglob("*.*"))
    ids = [str(f.relative_to(images)) for f in files]
    predictor = Predictor(
        Location.parse(str(checkpoints["a"])),
        use_gpu=False,
        precision="auto",
        top_k=len(CLASSES),
        decode_size=32,
    )
    batch = {
        "data": np.array([f.read_bytes() for f in files], dtype=object),
        "source_id": np.array(ids, dtype=object),
        "label_name": np.array([i.split("/")[0] for i in ids], dtype=object),
    }
    return {
        row["source_id"]: dict(
            zip([predictor.classes[i] for i in row["top_k"]], row["top_k_prob"], strict=True)
        )
        for row in predictor(batch).to_pylist()
    }


class TestApp(ServeApp):
    """The application as the tests deploy it: small enough for the session's 2 CPUs."""

    __test__ = False

    def deploy(self, model, env: dict[str, str] | None = None) -> None:
        super().deploy(
            model,
            env=env,
            args={"max_request_bytes": MAX_REQUEST_BYTES},
            deployment={
                # Two replicas and a batch job's actor fit in the 2 CPUs.
                "ray_actor_options": {"num_cpus": 0.5},
                # Up as soon as more than 2 requests per replica wait; never down in a test.
                "autoscaling_config": {
                    "max_replicas": 2,
                    "target_ongoing_requests": 2,
                    "upscale_delay_s": 1,
                    "downscale_delay_s": 600,
                    "look_back_period_s": 2,
                },
            },
            # A request a killed replica leaves unanswered ends within the test.
            http={"request_timeout_s": 10},
        )


@pytest.fixture(scope="module")
def app(cluster_2cpu, checkpoints, tmp_path_factory):
    """Checkpoint "a" behind HTTP; Serve shut down after the module, leaving the shared cluster
    as it was."""
    served = TestApp(cluster_2cpu, tmp_path_factory.mktemp("serve"))
    try:
        served.deploy(checkpoints["a"])
        wait_for(lambda: served.running(1), "classifier running", 240)
        yield served
    finally:
        served.shutdown()


def probabilities(answer) -> dict[str, float]:
    return {c["class"]: c["probability"] for c in answer.json()["top_k"]}


def test_answers_are_the_batch_jobs_for_the_same_images(
    batch_predictions, app, checkpoints, images
):
    files = sorted(images.rglob("*.*"))
    bodies = {str(f.relative_to(images)): f.read_bytes() for f in files}
    assert {p.suffix for p in files} == {".png", ".jpg"} and len(files) == 6
    for source_id, body in bodies.items():
        answer = post(app.url, body)
        assert answer.status == 200, answer.body
        assert answer.headers["content-type"] == "application/json"
        got = answer.json()
        assert got["checkpoint"] == str(checkpoints["a"])
        assert [c["class"] for c in got["top_k"]] == sorted(
            batch_predictions[source_id], key=batch_predictions[source_id].get, reverse=True
        )
        assert probabilities(answer) == pytest.approx(batch_predictions[source_id], abs=1e-5)
        assert set(answer.timing_ms()) == {"decode", "queue", "forward"}

    # Many at once: batched together in the replica, each answer still its own image's.
    names = list(bodies)
    with Load(app.url, [bodies[n] for n in names], concurrency=6, requests=36) as load:
        answers = load.wait()
    assert len(answers) == 36 and all(a.status == 200 for a in answers)
    assert max(int(a.headers["x-batch-size"]) for a in answers) > 1
    for a in answers:
        # Each thread posts the bodies in turn; the answer names the image by its probabilities.
        assert any(
            probabilities(a) == pytest.approx(p, abs=1e-5) for p in batch_predictions.values()
        )
    # Bound to 127.0.0.1 alone (configs/serve.yaml): another loopback address is refused.
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.2", app.port), timeout=5)
    # GET: what is served.
    info = Client(app.url).request("GET").json()
    assert info["classes"] == list(CLASSES) and info["image_size"] == 32
    assert info["precision"] == "fp32"
    assert info["decodes_at_once"] == 1  # a replica of 0.5 CPU decodes one body at a time


def test_a_bad_request_gets_its_status_and_message_and_the_replica_serves_on(app, images):
    before = {r["replica_id"] for r in app.replicas()}
    good = next(images.rglob("*.png")).read_bytes()
    for what, status, message, body in BAD_REQUESTS:
        answer = post(app.url, body()) if body else Client(app.url).request("PUT", b"x")
        assert answer.status == status, (what, answer.body)
        error = answer.json()["error"]
        assert re.match(pattern(message), error), (what, error)
        assert "curl --data-binary @photo.jpg" in error or status == 413, error
        assert post(app.url, good).status == 200, what
    # None was replaced (the autoscaler may have added one after the previous test's burst).
    assert before <= {r["replica_id"] for r in app.replicas()}


@pytest.mark.filterwarnings("ignore::UserWarning")  # PIL's own, on the damaged EXIF
def test_damaged_images_of_every_format_get_a_4xx_and_the_replica_serves_on(app):
    # A share of the decoding fuzz tests' corpus: whole, cut short, bytes changed, headers that
    # say more pixels. Each gets 200 or a 4xx, JSON, as decoding it in process says: a damaged
    # image 400 with docs/errors.md's "truncated or corrupt image"; never a 5xx.
    before = {r["replica_id"] for r in app.replicas()}
    statuses = Counter()
    for case in share(30, MAX_REQUEST_BYTES):
        try:
            prepare_image(case.data, image_size=32)
            reason = None
        except BadImageError as e:
            reason = next(r for r in REASONS if str(e).startswith(r))
        answer = post(app.url, case.data)
        assert answer.headers["content-type"] == "application/json", case.name
        if reason is None:
            assert answer.status == 200 and answer.json()["top_k"], (case.name, answer.body)
        else:
            status = next((s for p, s in BAD_IMAGE_STATUS.items() if reason.startswith(p)), 400)
            assert answer.status == status, (case.name, answer.body)
            assert answer.json()["error"].startswith(reason), (case.name, answer.body)
        statuses[answer.status, reason] += 1
    assert statuses[400, "truncated or corrupt image"] >= 10 and statuses[200, None] >= 5, statuses
    assert before <= {r["replica_id"] for r in app.replicas()}  # none was replaced


def pattern(message: str) -> str:
    """A docs message as a regex: <...> stands for a value."""
    return ".+?".join(re.escape(p) for p in re.split(r"<[^>]+>", message))


def test_a_body_over_the_limit_without_a_length_is_refused_as_it_streams(app):
    # Chunked: no Content-Length to refuse it by, so the replica counts as it reads.
    conn = http.client.HTTPConnection("127.0.0.1", app.port, timeout=60)
    chunks = (b"\xff" * 10_000 for _ in range(MAX_REQUEST_BYTES // 10_000 + 2))
    conn.request("POST", "/", body=chunks, encode_chunked=True)
    response = conn.getresponse()
    assert response.status == 413
    assert b"larger than max_request_bytes" in response.read()
    conn.close()


def test_load_scales_to_the_max_replicas_and_a_killed_replica_is_replaced(app, images):
    bodies = [f.read_bytes() for f in sorted(images.rglob("*.*"))]
    started = time.monotonic()
    with Load(app.url, bodies, concurrency=8, duration_s=300) as load:
        wait_for(lambda: app.running(2), "a second replica under load", 120)
        scaled_at = time.monotonic()
        time.sleep(1)
        killed, killed_at = app.kill_replica()

        def replaced() -> bool:
            # Serve lists the killed replica as running until its controller notices.
            names = {r.get("actor_name") for r in app.replicas()}
            return killed not in names and app.running(2)

        wait_for(replaced, "a replacement replica", 180)
        replaced_at = time.monotonic()
        time.sleep(1)
    answers = load.answers
    failed = [a for a in answers if a.status != 200]
    print(
        f"scaled to 2 replicas in {scaled_at - started:.1f} s; {len(answers)} requests, "
        f"{len(failed)} failed; the replica replaced in {replaced_at - killed_at:.1f} s:",
        [(a.status, a.body, a.error, round(a.sent_at - killed_at, 2)) for a in failed],
    )
    assert len(answers) > 50
    # Only the requests the killed replica held, or was sent before the proxy knew it dead,
    # fail: a 500 from Serve's proxy at its death or, now and then, a 408 at the proxy's
    # request_timeout_s for one it never answered. Each can be retried.
    assert len(failed) <= 8
    assert all(a.status in (500, 408) and a.retryable for a in failed)
    assert all(a.sent_at < killed_at + 2 < a.sent_at + a.latency_s + 2.5 for a in failed)
    for a in failed:
        assert post(app.url, a.request).status == 200


def test_a_registered_version_rolls_out_under_load_without_dropping_a_request(
    app, checkpoints, registered, mlflow_server, images
):
    bodies = [f.read_bytes() for f in sorted(images.rglob("*.*"))]
    # Checkpoint "b", registered: what the new replicas must answer, as it does in process.
    b = Classifier(Location.parse(str(checkpoints["b"])), use_gpu=False, precision="fp32")
    expected_b = b.probabilities(
        torch.stack([torch.from_numpy(prepare_image(x, image_size=32)) for x in bodies]).numpy()
    )
    started = time.monotonic()
    # Requests all through the rollout, at about 7 a second: enough that each replica of either
    # checkpoint gets some, not so many that the load takes the cores the rollout needs.
    with Load(app.url, bodies, concurrency=4, duration_s=600, pause_s=0.5) as load:
        time.sleep(1)
        # A deploy that cannot build leaves the running replicas serving.
        tracked = {"MLFLOW_TRACKING_URI": mlflow_server.uri}
        app.deploy("models:/serve-test/9", env=tracked)
        wait_for(lambda: app.status().get("status") == "DEPLOY_FAILED", "the failed deploy", 180)
        assert "models:/serve-test/9 is no registered model version" in app.status()["message"]
        failed_at = time.monotonic()
        app.deploy(registered, env=tracked)
        wait_for(lambda: app.status().get("status") == "DEPLOYING", "the rollout's start", 60)
        wait_for(lambda: app.running(2), "the rollout's end", 240)
        rolled_at = time.monotonic()
        wait_for(lambda: load.answers[-1].sent_at > rolled_at + 2, "answers after the rollout", 60)
    print(
        f"failed deploy noticed in {failed_at - started:.1f} s, "
        f"rolled out in {rolled_at - failed_at:.1f} s"
    )
    answers = sorted(load.answers, key=lambda a: a.sent_at)
    assert answers and all(a.status == 200 for a in answers), {
        (a.status, a.error) for a in answers if a.status != 200
    }
    served = [a.json()["checkpoint"] for a in answers]
    a, b = str(checkpoints["a"]), "models:/serve-test/1"
    print(f"{len(answers)} requests during the rollout: {served.count(a)} by 'a', then 'b'")
    assert served[0] == a and set(served) == {a, b}
    # Every request sent once the rollout was done went to a new replica, and got what
    # checkpoint "b" answers in process.
    late = [answer for answer in answers if answer.sent_at > rolled_at]
    assert late and all(answer.json()["checkpoint"] == b for answer in late)
    for answer in late:
        got = probabilities(answer)
        assert any(
            all(abs(got[c] - float(p[i])) < 1e-5 for i, c in enumerate(CLASSES)) for p in expected_b
        ), got


def test_the_docs_table_lists_every_bad_request():
    documented = errors_table("Serving: bad requests")
    assert documented == [(what, status, message) for what, status, message, _ in BAD_REQUESTS]
