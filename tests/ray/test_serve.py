"""Online inference with Ray in the test process: configs/serve.yaml deployed as `serve run` of
the file deploys it (Serve's controller builds the application), and a real HTTP client on
loopback. Answers equal batch inference's, bad requests get their 4xx and the replica serves on,
body limits, autoscaling and a killed replica replaced, a rollout that drops no request.
Untrained checkpoints and tiny images: what is tested is the serving, not the model. (The
application's arguments and the docs' table of bad requests: tests/unit/test_serve_app.py.)"""

from __future__ import annotations

import http.client
import re
import socket
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import ray
import torch
from corpus import REASONS, share
from helpers import (
    BAD_REQUESTS,
    CLASSES,
    MAX_REQUEST_BYTES,
    make_image_folder,
    registered_version,
    serve_checkpoints,
    wait_for,
)
from ray import serve
from ray.serve._private.api import serve_start
from ray.serve.schema import ServeDeploySchema

from harness.load import Client, Load, post
from harness.serving import APP, ServeApp
from pipeline.core.errors import ConfigError, InputError
from pipeline.core.storage import Location
from pipeline.data.images import BadImageError
from pipeline.infer.batch import Predictor
from pipeline.model.classifier import Classifier, prepare_image
from pipeline.serve.app import BAD_IMAGE_STATUS, build_app

pytestmark = pytest.mark.usefixtures("ray_in_process")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    return serve_checkpoints(tmp_path_factory)


@pytest.fixture(scope="module")
def registered(checkpoints, mlflow_server) -> str:
    """Checkpoint "b", version 1 of `serve-test` with the alias `production`: its URI."""
    return registered_version(checkpoints["b"], mlflow_server, "serve-test")


def test_a_registered_models_alias_is_pinned_to_its_version_when_built(registered, mlflow_server):
    # For every replica: the version the alias named when the application was built.
    with pytest.raises(ConfigError, match=r"'models:/serve-test' names no version: give"):
        build_app({"model": "models:/serve-test"})
    with pytest.raises(ConfigError, match=r"no tracking server to read it from: set MLFLOW_"):
        build_app({"model": registered})
    uri = {"tracking_uri": mlflow_server.uri}
    with pytest.raises(InputError, match=r"^models:/serve-test/9 is no registered model version"):
        build_app({"model": "models:/serve-test/9", **uri})
    app = build_app({"model": registered, **uri})
    assert app._bound_deployment.init_args[0] == "models:/serve-test/1"


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


class InProcessApp(ServeApp):
    """configs/serve.yaml, with ServeApp's changes, deployed with this process's Ray as `serve run`
    of the file deploys it: Serve started with the file's HTTP options, then the controller
    given the applications, which it builds in a task of their runtime env. Small enough for
    the 2 CPUs of `ray_in_process`."""

    def __init__(self, directory: Path):
        super().__init__(cluster=None, directory=directory)

    def deploy(self, model, env: dict[str, str] | None = None) -> None:
        """Returns once Serve took the config (not once it runs)."""
        cfg = ServeDeploySchema.model_validate(
            self.config(
                model,
                env=env,
                args={"max_request_bytes": MAX_REQUEST_BYTES},
                deployment={
                    # Two replicas and a batch actor fit in the 2 CPUs.
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
                # A request a killed replica leaves unanswered ends within the test; one that
                # a loaded machine keeps waiting does not (10 s failed 5 as the load began).
                http={"request_timeout_s": 30},
            )
        )
        client = serve_start(
            http_options=cfg.http_options.model_dump(), proxy_location=cfg.proxy_location
        )
        client.deploy_apps(cfg)

    def status(self) -> dict:
        """The application's details, as the controller gives them to `serve status`."""
        details = serve.context._get_global_client().get_serve_details()
        return (details.get("applications") or {}).get(APP, {})

    def kill_replica(self) -> tuple[str, float]:
        """`ray.kill` of one running replica actor: its name, and when (time.monotonic())."""
        name = next(r["actor_name"] for r in self.replicas() if r["state"] == "RUNNING")
        ray.kill(ray.get_actor(name, namespace="serve"))
        return name, time.monotonic()

    def shutdown(self) -> None:
        serve.shutdown()


@pytest.fixture(scope="module")
def app(checkpoints, tmp_path_factory):
    """Checkpoint "a" behind HTTP; Serve shut down after the module."""
    served = InProcessApp(tmp_path_factory.mktemp("serve"))
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
        # Serve tries a failing build 4 times, each in a new replica: about 65 s alone, minutes on
        # a loaded machine.
        wait_for(lambda: app.status().get("status") == "DEPLOY_FAILED", "the failed deploy", 360)
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
