"""Online inference over HTTP against its limit: the Serve application (configs/serve.yaml) on
loopback, and the same model called in process with the same batch sizes on the same CPUs.

    .venv/bin/python -m bench.serve                  # 64 px, concurrency 1 4 16 64, 2 CPUs

Generated JPEG images and a ResNet-18 checkpoint with random weights (speed does not depend on
them) at `--image-size`. One replica of `--replica-cpus` CPUs (torch threads), batches of up to
`--max-batch-size`, on a fresh local cluster of `--cpus` CPUs; the load generator
(harness/load.py) runs in this process: `concurrency` threads, each with one request in flight.
For each concurrency, after a warm-up:
- serve: requests/s, p50 and p99 latency as the client sees them, and where the time went, from
  the replica's Server-Timing header: decode (read, decode, resize + crop), queue (waiting in
  `@serve.batch` for a batch to form and the previous one to finish), forward (the batch's model
  call); proxy+http = client latency - those three: HTTP both ways, the proxy's routing and the
  hop to the replica, and the wait in the proxy for a free slot once the replica holds
  max_ongoing_requests (4 x max batch size) requests;
- limit: this process with the replica's torch threads, batches of min(concurrency, max batch
  size): decode each image and run the model, as the replica does, without HTTP or Serve;
  measured just before each concurrency's level, as the machine's load moves.
  Its requests/s is the most the replica could answer; its latency at that concurrency is
  concurrency / requests/s (a closed loop at that rate).
Ratios: serve / limit requests/s, and serve p50 / limit latency. Results: bench/results/serve.json.
"""

import argparse
import io
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from bench.common import write_results
from harness.cluster import LocalCluster
from harness.load import Load, post
from harness.serving import ServeApp
from pipeline.core.storage import Location
from pipeline.data.sources import render_synthetic
from pipeline.model.checkpoint import CheckpointMeta, save_checkpoint
from pipeline.model.classifier import Classifier, prepare_image
from pipeline.model.networks import build_model

CLASSES = ["red_circle", "green_square", "blue_triangle"]


def make_inputs(tmp: Path, size: int, count: int) -> tuple[list[bytes], Path]:
    """`count` JPEGs a little larger than `size` (so each is resized and cropped, as photos
    are), and a random-weight checkpoint that classifies `size` px images."""
    images = []
    for i in range(count):
        buf = io.BytesIO()
        img = render_synthetic(CLASSES[i % 3], size=size + size // 7, seed=0, index=i)
        img.save(buf, format="JPEG", quality=90)
        images.append(buf.getvalue())
    checkpoint = tmp / "checkpoint"
    checkpoint.mkdir()
    meta = CheckpointMeta(
        epoch=0,
        classes=CLASSES,
        image_size=size,
        mean=(0.485, 0.456, 0.406),
        std=(0.229, 0.224, 0.225),
        dataset_fingerprint="bench",
        dataset_version="bench",
        metrics={},
        history=[],
        config={"checkpoint": {"metric": "val_loss"}},
    )
    torch.manual_seed(0)
    save_checkpoint(checkpoint, build_model(len(CLASSES)).eval().state_dict(), meta, {})
    return images, checkpoint


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q))


def serve_level(url: str, images: list[bytes], concurrency: int, seconds: float) -> dict:
    with Load(url, images, concurrency=concurrency, duration_s=min(2, seconds / 4)):
        pass  # warm-up: connections open, batches at their size
    started = time.monotonic()
    with Load(url, images, concurrency=concurrency, duration_s=seconds) as load:
        answers = load.wait()
    elapsed = time.monotonic() - started
    ok = [a for a in answers if a.status == 200]
    assert len(ok) == len(answers), {a.status or a.error for a in answers if a.status != 200}
    latency = [a.latency_s * 1000 for a in ok]
    timing = {
        k: statistics.mean(a.timing_ms()[k] for a in ok) for k in ("decode", "queue", "forward")
    }
    return {
        "requests": len(ok),
        "requests_per_s": len(ok) / elapsed,
        "p50_ms": percentile(latency, 50),
        "p99_ms": percentile(latency, 99),
        "mean_ms": statistics.mean(latency),
        "mean_batch": statistics.mean(int(a.headers["x-batch-size"]) for a in ok),
        **{f"{k}_ms": v for k, v in timing.items()},
        "http_proxy_ms": statistics.mean(latency) - sum(timing.values()),
    }


def limit_level(classifier: Classifier, images: list[bytes], batch: int, seconds: float) -> dict:
    """Requests/s of decode + model in one process, batches of `batch`, for about `seconds`."""
    size = classifier.meta.image_size

    def one_batch(offset: int) -> tuple[float, float]:
        start = time.perf_counter()
        group = [images[(offset + j) % len(images)] for j in range(batch)]
        pixels = np.stack([prepare_image(x, image_size=size) for x in group])
        decoded = time.perf_counter()
        classifier.probabilities(pixels)
        return decoded - start, time.perf_counter() - decoded

    one_batch(0)  # warm-up
    decode, forward, n = 0.0, 0.0, 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline or n < 3:
        d, f = one_batch(n * batch)
        decode, forward, n = decode + d, forward + f, n + 1
    per_batch = (decode + forward) / n
    return {
        "batch": batch,
        "requests_per_s": batch / per_batch,
        "decode_ms_per_image": decode / n / batch * 1000,
        "forward_ms_per_batch": forward / n * 1000,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--seconds", type=float, default=10, help="measured per concurrency")
    parser.add_argument("--cpus", type=int, default=2, help="the local cluster's CPUs")
    parser.add_argument("--replica-cpus", type=int, default=1)
    parser.add_argument("--max-batch-size", type=int, default=16)
    parser.add_argument("--batch-wait-timeout-s", type=float, default=0.005)
    parser.add_argument("--images", type=int, default=64)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        images, checkpoint = make_inputs(Path(tmp), args.image_size, args.images)

        torch.set_num_threads(args.replica_cpus)
        classifier = Classifier(Location.parse(str(checkpoint)), use_gpu=False, precision="fp32")
        serve, limits, load_average = {}, {}, {}
        with LocalCluster(num_cpus=args.cpus) as cluster:
            app = ServeApp(cluster, Path(tmp))
            app.deploy(
                checkpoint,
                args={
                    "max_batch_size": args.max_batch_size,
                    "batch_wait_timeout_s": args.batch_wait_timeout_s,
                },
                deployment={
                    "ray_actor_options": {"num_cpus": args.replica_cpus},
                    "autoscaling_config": {"min_replicas": 1, "max_replicas": 1},
                },
            )
            deadline = time.monotonic() + 300
            while not app.running(1):
                if time.monotonic() > deadline:
                    raise SystemExit(f"the application did not start: {app.status()}")
                time.sleep(1)
            assert post(app.url, images[0]).status == 200
            for c in args.concurrency:
                # The limit just before its level: a shared machine's load moves between them.
                limits[c] = limit_level(
                    classifier, images, min(c, args.max_batch_size), args.seconds / 2
                )
                serve[c] = serve_level(app.url, images, c, args.seconds)
                load_average[c] = os.getloadavg()[0]
                print(
                    f"concurrency {c}: {serve[c]['requests_per_s']:.1f} requests/s, limit "
                    f"{limits[c]['requests_per_s']:.1f} (load average {load_average[c]:.1f})",
                    flush=True,
                )
            app.shutdown()

    rows = []
    print(
        f"\n{args.image_size} px, 1 replica of {args.replica_cpus} CPU, batches <= "
        f"{args.max_batch_size}, batch_wait_timeout_s={args.batch_wait_timeout_s}; times in ms, "
        "per request (mean) unless p50/p99"
    )
    header = (
        "conc | req/s | limit | ratio | p50 | p99 | limit lat | p50 ratio | batch | "
        "decode | queue | forward | proxy+http | load avg"
    )
    print(header)
    for c in args.concurrency:
        s, lim = serve[c], limits[c]
        limit_latency = c / lim["requests_per_s"] * 1000
        row = {
            "concurrency": c,
            "serve": s,
            "limit": lim,
            "requests_per_s_ratio": s["requests_per_s"] / lim["requests_per_s"],
            "limit_latency_ms": limit_latency,
            "p50_ratio": s["p50_ms"] / limit_latency,
            "load_average_1min": load_average[c],
        }
        rows.append(row)
        print(
            f"{c} | {s['requests_per_s']:.1f} | {lim['requests_per_s']:.1f} | "
            f"{row['requests_per_s_ratio']:.2f}x | {s['p50_ms']:.1f} | {s['p99_ms']:.1f} | "
            f"{limit_latency:.1f} | {row['p50_ratio']:.2f}x | {s['mean_batch']:.1f} | "
            f"{s['decode_ms']:.1f} | {s['queue_ms']:.1f} | {s['forward_ms']:.1f} | "
            f"{s['http_proxy_ms']:.1f} | {load_average[c]:.1f}"
        )
    name = f"serve-{args.image_size}px-wait{args.batch_wait_timeout_s * 1000:g}ms"
    write_results(name, {"args": vars(args), "levels": rows})


if __name__ == "__main__":
    main()
