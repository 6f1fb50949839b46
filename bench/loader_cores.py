"""The training loader against what its cores can do: images/s per core, and the loader's share.

    .venv/bin/python -m bench.loader_cores --image-size 224 --images 8000 --loader-workers 2

Target: the loader (--loader-workers DataLoader processes) delivers at least 0.8 of
--loader-workers times the per-core limit, at 224 px.

- Per-core limit: one process, one torch thread, no loader: the train split's stored rows (read
  into memory first), decoded and augmented as the training job does (random resized crop of
  scale 0.25-1 + flip, drawn per row as the loader draws), batch by batch. Decoders side by
  side: Pillow (`decode_image` + `pil_to_tensor`, the previous path), torchvision's
  `decode_jpeg`, the stream's `decode` (decode_jpeg behind its header check), and TorchCodec's
  `decode_jpeg` where it imports; each also without the augmentation. `--pillow DIR` adds
  `decode_image` with another Pillow build installed there (`pip install --target DIR
  pillow-simd`), in a subprocess.
- The same work in --loader-workers processes at once, still no loader: what the cores give
  when all of them work (they share caches, memory and, on a VM, the host).
- Loader: `RowGroupStream`'s rows decoded (`Decoded`) through a DataLoader of --loader-workers
  processes, as the training job builds it, --epochs epochs, images/s from each epoch's first
  batch on (the processes' start-up excluded); the consumer copies each batch into one buffer,
  as the pin-memory copy before a host-to-device transfer does. Beside it the previous
  per-batch path (`PillowDecoded`: decode_image, pil_to_tensor, torchvision's crop and flip,
  torch.stack), on the same rows; and that path's per-core figure.
- CPU seconds per image: the loader processes' (their rusage once they have exited, start-up
  included) and the consumer's, against the per-core limit's.
Every round measures each of them in turn, so the machine's load weighs on all alike; medians
of --rounds rounds, with the load average before and after each. Results go to
bench/results/loader_cores.json.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq
import torch
from torch.utils.data import DataLoader
from torchvision.io import ImageReadMode, decode_jpeg
from torchvision.transforms import v2

from bench.common import write_results
from bench.loader import generate
from harness.baseline import PillowDecoded, torchvisions_crop
from harness.cluster import BUNDLE_ROOT
from pipeline.core.storage import Location
from pipeline.data.dataset import read_manifest
from pipeline.data.images import decode_image
from pipeline.train.augment import train_transform
from pipeline.train.input.decoding import Decoded, augmented, decode
from pipeline.train.input.ring import RingLoader
from pipeline.train.input.rows import RowGroupStream, StreamSpec

DECODERS = {
    "pillow": lambda data, size: v2.functional.pil_to_tensor(decode_image(data)),
    "torchvision": lambda data, size: decode_jpeg(
        torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB
    ),
    "stream": decode,
}
try:  # not a dependency of the bundle: measured where it is installed
    from torchcodec.decoders import decode_jpeg as torchcodec_jpeg

    DECODERS["torchcodec"] = lambda data, size: torchcodec_jpeg(data, mode="RGB")
except ImportError:
    pass


def per_core(rows: list[bytes], *, decoder: str, transform, size: int, batch: int) -> dict:
    """Images/s and CPU s per image of decode (+ `transform`) on one thread, batch by batch."""
    fn = DECODERS[decoder]
    started, cpu = time.perf_counter(), time.process_time()
    for b in range(0, len(rows), batch):
        images = [fn(data, size) for data in rows[b : b + batch]]
        augmented(transform, images, list(range(b, b + len(images))))  # a seed a row, as trained
    seconds = time.perf_counter() - started
    return {"images_per_s": len(rows) / seconds, "cpu_s_per_image": cpu_per(cpu, len(rows))}


def all_cores(rows: list[bytes], *, processes: int, transform, size: int, batch: int) -> dict:
    """`per_core` of the stream's decoder + `transform` in `processes` forked processes that
    start together: their images/s summed, their mean CPU s per image."""
    ctx = multiprocessing.get_context("fork")
    start, results = ctx.Barrier(processes), ctx.Queue()

    def work() -> None:
        torch.set_num_threads(1)
        start.wait()
        results.put(per_core(rows, decoder="stream", transform=transform, size=size, batch=batch))

    children = [ctx.Process(target=work) for _ in range(processes)]
    for child in children:
        child.start()
    runs = [results.get() for _ in children]
    for child in children:
        child.join()
    return {
        "images_per_s": sum(r["images_per_s"] for r in runs),
        "cpu_s_per_image": statistics.mean(r["cpu_s_per_image"] for r in runs),
    }


def other_pillow(directory: str, dataset: str, args) -> dict:
    """Pillow's per-core figures with the Pillow build installed in `directory`, which a
    subprocess imports first."""
    code = (
        "import json, sys; from bench.loader_cores import pillow_figures; "
        f"print(json.dumps(pillow_figures({dataset!r}, {args.batch})))"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([directory, str(BUNDLE_ROOT)])}
    out = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", code],
        env=env,
        cwd=BUNDLE_ROOT,
        text=True,
        capture_output=True,
    )
    if out.returncode != 0:
        sys.exit(f"the Pillow build in {directory} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.splitlines()[-1])


def pillow_figures(dataset: str, batch: int) -> dict:
    """In the subprocess of `other_pillow`: decode_image's per-core figures, and the build."""
    import PIL

    torch.set_num_threads(1)
    root = Location.parse(dataset)
    rows, size = train_rows(root), read_manifest(root).image_size
    transform = train_transform("random_resized_crop", image_size=size)
    per_core(rows[:16], decoder="pillow", transform=transform, size=size, batch=8)  # warm
    return {
        "version": PIL.__version__,
        "pillow": per_core(rows, decoder="pillow", transform=None, size=size, batch=batch),
        "pillow+augment": per_core(
            rows, decoder="pillow", transform=transform, size=size, batch=batch
        ),
    }


def cpu_per(since: float, images: int) -> float:
    return (time.process_time() - since) / images


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def loader_run(root: Location, *, decoded, args, transform, ring: bool) -> dict:
    """--epochs epochs of the stream through the training job's `RingLoader` (`ring`) or a
    plain DataLoader (the previous path): images/s after each epoch's first batch, and CPU s
    per image of the loader processes and of this one (the consumer). `decoded`: Decoded, or
    the previous path's class of it."""
    spec = StreamSpec(batch_size=args.batch, shuffle=True)
    stream = RowGroupStream(root, read_manifest(root), "train", spec)
    batches = decoded(stream, transform)
    # The training job's loader, one for the run as the job makes it: its batches are already
    # copied out of the ring. Or a plain DataLoader's, which the consumer copies.
    if ring:
        loader = RingLoader(batches, processes=args.loader_workers)
    else:
        loader = DataLoader(
            batches,
            batch_size=None,
            num_workers=args.loader_workers,
            persistent_workers=False,
            generator=torch.Generator(),
        )
    buffer = None
    images = seconds = 0.0
    all_images, workers_cpu, own_cpu = 0, children_cpu(), time.process_time()
    for epoch in range(args.epochs):
        stream.set_epoch(epoch)
        first = None
        for x, _ in loader:
            if not ring:
                if buffer is None:
                    buffer = torch.empty_like(x)  # in x's memory format: a plain copy
                buffer[: len(x)].copy_(x)
            all_images += len(x)
            if first is None:  # the processes have started, and read and decoded ahead
                first = time.perf_counter()
                continue
            images += len(x)
        seconds += time.perf_counter() - first
    return {
        "images_per_s": images / seconds,
        "workers_cpu_s_per_image": (children_cpu() - workers_cpu) / all_images,
        "consumer_cpu_s_per_image": cpu_per(own_cpu, all_images),
    }


def loadavg() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def train_rows(root: Location) -> list[bytes]:
    rows = []
    for f in read_manifest(root).splits["train"].files:
        rows += pq.read_table(root.child(f.path).path, columns=["image"])["image"].to_pylist()
    return rows


def one_round(root: Location, rows: list[bytes], args, *, baseline_first: bool) -> dict:
    size = read_manifest(root).image_size
    transform = train_transform("random_resized_crop", image_size=size)
    out = {"load_before": loadavg()}
    for decoder in DECODERS:
        for augments in (False, True):
            out[f"{decoder}{'+augment' if augments else ''}"] = per_core(
                rows,
                decoder=decoder,
                transform=transform if augments else None,
                size=size,
                batch=args.batch,
            )
    out["previous: pillow+torchvision's crop"] = per_core(
        rows, decoder="pillow", transform=torchvisions_crop(size), size=size, batch=args.batch
    )
    if args.pillow:
        built = other_pillow(args.pillow, root.path, args)
        out["pillow_build"] = built.pop("version")
        out.update({f"{name} (other build)": run for name, run in built.items()})
    out["all cores"] = all_cores(
        rows, processes=args.loader_workers, transform=transform, size=size, batch=args.batch
    )
    streams = [
        ("baseline", PillowDecoded, torchvisions_crop(size), False),
        ("loader", Decoded, transform, True),
    ]
    for name, cls, augment, ring in streams if baseline_first else streams[::-1]:
        out[name] = loader_run(root, decoded=cls, args=args, transform=augment, ring=ring)
    limit = out["stream+augment"]
    for name in ("baseline", "loader"):
        run = out[name]
        run["over_limit"] = run["images_per_s"] / (args.loader_workers * limit["images_per_s"])
        run["over_all_cores"] = run["images_per_s"] / out["all cores"]["images_per_s"]
        run["cpu_over_limit"] = limit["cpu_s_per_image"] / (
            run["workers_cpu_s_per_image"] + run["consumer_cpu_s_per_image"]
        )
    out["load_after"] = loadavg()
    return out


def report(rounds: list[dict], args) -> dict:
    names = [k for k in rounds[0] if isinstance(rounds[0][k], dict)]
    summary = {
        name: {k: statistics.median(r[name][k] for r in rounds) for k in rounds[0][name]}
        for name in names
    }
    loads = ", ".join(f"{r['load_before']:.1f} / {r['load_after']:.1f}" for r in rounds)
    print(f"load average (1 min) before / after each round: {loads}")
    if "pillow_build" in rounds[0]:
        print(f"other build: Pillow {rounds[0]['pillow_build']} from {args.pillow}")
    for name in names:
        s = summary[name]
        line = f"{name:28s} {s['images_per_s']:6.0f} images/s"
        if "cpu_s_per_image" in s:
            line += f"  {1e6 * s['cpu_s_per_image']:5.0f} us CPU/image"
        else:
            per_round = ", ".join(f"{r[name]['over_limit']:.2f}" for r in rounds)
            line += (
                f"  {1e6 * s['workers_cpu_s_per_image']:5.0f} us CPU/image in the loader "
                f"processes + {1e6 * s['consumer_cpu_s_per_image']:3.0f} consumer. Over "
                f"{args.loader_workers} x the per-core limit: {s['over_limit']:.2f} (rounds "
                f"{per_round}); over all cores at once {s['over_all_cores']:.2f}; "
                f"CPU/image {s['cpu_over_limit']:.2f}"
            )
        print(line)
    return summary


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--image-size", type=int, default=224)
    # 6,400 train rows: 100 batches an epoch. Images/s count from an epoch's first batch, by
    # which a loader whose processes each make whole batches has the next ones made too: on
    # 25 batches an epoch that head start weighed about 4%, here 1%.
    p.add_argument("--images", type=int, default=8000, help="the generated dataset's size")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--loader-workers", type=int, default=2)
    p.add_argument("--epochs", type=int, default=3, help="per loader measurement")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dataset", help="a preprocessed dataset to read instead of generating one")
    p.add_argument("--pillow", help="a directory holding another Pillow build (pillow-simd)")
    args = p.parse_args()
    torch.set_num_threads(1)  # the per-core limit's one thread; the consumer's copy too
    with tempfile.TemporaryDirectory(prefix="bench-loader-cores-") as tmp:
        path = args.dataset or generate(Path(tmp) / "data", args.images, args.image_size)
        root = Location.parse(str(path))
        rows = train_rows(root)
        transform = train_transform("random_resized_crop", image_size=args.image_size)
        for decoder in DECODERS:  # warm: first calls, lazy imports
            per_core(rows[:16], decoder=decoder, transform=transform, size=0, batch=8)
        rounds = [
            one_round(root, rows, args, baseline_first=r % 2 == 0) for r in range(args.rounds)
        ]
    results = {
        "args": vars(args),
        "cpus": os.cpu_count(),
        "train_rows": len(rows),
        "median": report(rounds, args),
        "rounds": rounds,
        "target_over_limit": 0.8,
    }
    write_results("loader_cores", results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
