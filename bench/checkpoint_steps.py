"""What checkpoints cost the step loop: inside an epoch, and an epoch's own upload to S3.

    .venv/bin/python -m bench.checkpoint_steps --image-size 64 --every 10 --rounds 3 --blocks 8

In this process, without Ray: ResNet-18 and AdamW on random batches held in memory (the step
alone, as a GPU-fed worker runs it), side by side in each round, which goes first rotating. The
step runs on the CPU with `--threads` threads, where the writer's thread competes with it for
the cores; with `--device-step S` it stands for a step on an accelerator instead: 5 ms of Python
in the loop's thread (the kernels' launches), then a wait until S seconds after the step before,
so that what a checkpoint costs is what it holds the loop for (the copy, the GIL) and not the
cores that a device's step leaves free.

- inside an epoch: blocks of `--every` steps with no checkpoint, with one by the worker's
  StepWriter (the state copied in the loop, serialized and written by its thread) and with one
  by the previous writer (serialized to local disk in the loop, published by a thread), the
  checkpoint after the block's first step and its write waited for before the block ends.
  `--blocks` of each way a round, interleaved: the machine's drift of seconds falls on the
  three alike, and each block is compared with the block without a checkpoint beside it.
  Reported: seconds per step each way, the ratios to none (the median over the blocks), and the
  time a save holds the loop;
- an epoch's checkpoint to S3 (a moto server on loopback, in a process of its own): the
  `--next-steps` steps after an epoch's end with no checkpoint, with the worker's way (the copy
  in the loop; `publish_checkpoint` to S3 in a thread, as Ray's upload thread runs it with
  checkpoint_upload_mode=ASYNC) and with Ray's synchronous upload of before (the checkpoint
  written to local disk, then copied to S3, before the next step). Reported: the time from the
  epoch's end to its next step, the next steps' seconds per step, and the upload's time.

Steps redone per failure are the checkpoints' arithmetic: a failure at a uniformly random step
of an epoch of S steps redoes on average (S - 1) / 2 steps (at most S - 1) with checkpoints at
epoch ends, (N - 1) / 2 (at most N - 1) with one every N steps; the table uses `--epoch-steps`.
Results go to bench/results/checkpoint_steps.json (checkpoint_steps_device.json with
`--device-step`).
"""

import argparse
import multiprocessing
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import pyarrow.fs as pafs
import torch

from bench.common import write_results
from pipeline.core.storage import Location, publish_directory
from pipeline.model.checkpoint import METADATA, CheckpointMeta, save_checkpoint
from pipeline.model.device import DevicePolicy
from pipeline.model.networks import build_model
from pipeline.model.runs import step_dir_name
from pipeline.train.epoch import train_one_epoch
from pipeline.train.saving import Background, Snapshot, StepWriter, publish_checkpoint

CLASSES = 10
STEP_WAYS = ("none", "worker", "previous")
EPOCH_WAYS = ("none", "async", "sync")


def meta(size: int, step: int | None) -> CheckpointMeta:
    return CheckpointMeta(
        epoch=0,
        step=step,
        classes=[str(c) for c in range(CLASSES)],
        image_size=size,
        mean=(0.5,) * 3,
        std=(0.25,) * 3,
        dataset_fingerprint="bench",
        dataset_version="bench",
        metrics={"epoch": 0} if step is None else {"epoch": 0, "step": step},
        history=[],
        config={"checkpoint": {"metric": "val_loss"}},
    )


class Trainer:
    """The model, optimizer and one batch; `steps(n, after_step)` trains n steps. With
    `device_step`, a step stands for one on an accelerator, whose compute needs no CPU core:
    `LAUNCH_S` of Python in the loop's thread (what launching a step's kernels costs it, GIL
    held), then a wait until `device_step` seconds after the step before ended. The state (the
    model's and AdamW's, made by the warm-up's steps) is what a checkpoint copies either way."""

    LAUNCH_S = 0.005

    def __init__(self, size: int, batch: int, device_step: float | None = None):
        torch.manual_seed(0)
        self.size, self.device_step = size, device_step
        self.model = build_model(CLASSES)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.policy = DevicePolicy(torch.device("cpu"), "fp32", (0.5,) * 3, (0.25,) * 3)
        x = torch.randint(0, 256, (batch, 3, size, size), dtype=torch.uint8)
        self.batch = (x, torch.randint(0, CLASSES, (batch,)))
        self.criterion = torch.nn.CrossEntropyLoss()
        self._train(3)  # warm-up, and AdamW's state made

    def _train(self, n: int, after_step=None) -> None:
        train_one_epoch(
            *(self.model, [self.batch] * n, self.optimizer, self.criterion),
            policy=self.policy,
            after_step=after_step,
        )

    def steps(self, n: int, after_step=None) -> float:
        """Seconds for `n` steps."""
        began = time.perf_counter()
        if not self.device_step:
            self._train(n, after_step)
            return time.perf_counter() - began
        ended = began
        for step in range(1, n + 1):
            # What the loop holds itself for (after_step's save) delays the next step's
            # launch, and so its end, as on a device.
            launched = time.thread_time() + self.LAUNCH_S
            while time.thread_time() < launched:
                pass
            time.sleep(max(ended + self.device_step - time.perf_counter(), 0))
            if after_step is not None:
                after_step(step, None)
            ended = time.perf_counter()
        return time.perf_counter() - began

    def state(self):
        return self.model.state_dict(), {"optimizer": self.optimizer.state_dict()}


class Writers:
    """The two ways of writing a checkpoint inside an epoch, one run directory for both."""

    def __init__(self, t: Trainer, run_dir: Location):
        self.t, self.run_dir = t, run_dir
        self.worker = StepWriter(run_dir)
        self.previous = Background("previous-writer")

    def save(self, way: str, step: int) -> None:
        t, m = self.t, meta(self.t.size, step)
        if way == "worker":
            self.worker.save(0, step, t.state(), lambda d, c: save_checkpoint(d, c[0], m, c[1]))
            return
        # The previous writer: serialized to local disk while the loop waits, then published
        # by a thread.
        self.previous.wait()
        staged = Path(tempfile.mkdtemp(prefix="bench-previous-"))
        weights, state = t.state()
        save_checkpoint(staged, weights, m, state)
        target = self.run_dir.child("previous", step_dir_name(0, step))

        def publish() -> None:
            publish_directory(staged, target, last=METADATA)
            shutil.rmtree(staged)

        self.previous.submit(publish)

    def wait(self) -> None:
        self.worker.wait()
        self.previous.wait()


def block(t: Trainer, way: str, every: int, writers: Writers, first_step: int) -> dict:
    """`every` steps; unless `way` is none, a checkpoint the `way` given after the first of them,
    its write waited for before the block ends: what one checkpoint every `every` steps costs,
    all of it counted in its own block."""
    held = []

    def after_step(step: int, totals) -> None:
        if way != "none" and step == 1:
            began = time.perf_counter()
            writers.save(way, first_step + step)
            held.append(time.perf_counter() - began)

    began = time.perf_counter()
    t.steps(every, after_step)
    writers.wait()
    return {"s": time.perf_counter() - began, "held_s": held[0] if held else 0.0}


def inside_epoch(t: Trainer, blocks: int, every: int, run_dir: Location) -> dict:
    """`blocks` blocks of `every` steps each way, interleaved (none, worker, previous, the first
    rotating), so that the machine's drift falls on the ways alike: each block's time over that
    of the block without a checkpoint beside it."""
    writers, timed = Writers(t, run_dir), {w: [] for w in STEP_WAYS}
    for b in range(blocks):
        for w in STEP_WAYS[b % 3 :] + STEP_WAYS[: b % 3]:
            timed[w].append(block(t, w, every, writers, b * every))
    ratios = {
        w: [x["s"] / n["s"] for x, n in zip(timed[w], timed["none"], strict=True)]
        for w in STEP_WAYS[1:]
    }
    return {
        "blocks": timed,
        "block_ratios": ratios,
        "s_per_step": {w: statistics.median(x["s"] for x in timed[w]) / every for w in timed},
        "held_s": {w: statistics.median(x["held_s"] for x in timed[w]) for w in STEP_WAYS[1:]},
        "ratio": {w: statistics.median(ratios[w]) for w in STEP_WAYS[1:]},
    }


def over_blocks(rounds: list[dict], way: str) -> float:
    """The median of `way`'s block ratios over the blocks of all rounds."""
    return statistics.median(x for r in rounds for x in r["block_ratios"][way])


def epoch_upload(t: Trainer, way: str, next_steps: int, s3_root: Location, r: int) -> dict:
    """An epoch's end, its checkpoint sent to S3 the `way` given, and the next steps."""
    target = s3_root.child(f"run{r}-{way}", "epoch_0000")
    upload, m = Background("bench-upload"), meta(t.size, None)
    ended = time.perf_counter()
    if way == "async":
        copied = Snapshot().take(t.state())
        upload.submit(
            lambda: publish_checkpoint(
                target, lambda d: save_checkpoint(d, copied[0], m, copied[1])
            )
        )
    elif way == "sync":  # Ray's synchronous report: written locally, copied, then reported
        staged = Path(tempfile.mkdtemp(prefix="bench-sync-"))
        weights, state = t.state()
        save_checkpoint(staged, weights, m, state)
        target.fs.create_dir(target.path)
        pafs.copy_files(
            str(staged),
            target.path,
            source_filesystem=pafs.LocalFileSystem(),
            destination_filesystem=target.fs,
        )
        shutil.rmtree(staged)
    held = time.perf_counter() - ended
    seconds = t.steps(next_steps)
    upload.wait()
    whole = time.perf_counter() - ended
    if way != "none":
        assert target.child(METADATA).exists(), target.uri
    return {"held_s": held, "s_per_step": seconds / next_steps, "until_uploaded_s": whole}


def serve_s3(ready) -> None:
    """A moto S3 server in this process of its own; its environment goes to `ready`."""
    from harness.s3 import S3Server

    with S3Server() as s3:
        s3.create_bucket("bench")
        ready.put(s3.env)
        while True:
            time.sleep(3600)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--blocks", type=int, default=8, help="of --every steps, each way")
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--next-steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--threads",
        type=int,
        default=2,
        help="the step's threads; fewer than the cores leaves the writer cores of its own, as "
        "the CPU cores a GPU worker's step leaves free",
    )
    parser.add_argument(
        "--device-step",
        type=float,
        help="seconds: each step stands for one on an accelerator (5 ms of Python in the loop, "
        "then a wait for the rest of the step), whose compute leaves the CPU cores free",
    )
    parser.add_argument("--epoch-steps", type=int, default=296, help="Food-101 at batch 256")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    spawn = multiprocessing.get_context("spawn")
    ready = spawn.Queue()
    server = spawn.Process(target=serve_s3, args=(ready,), daemon=True)
    server.start()
    os.environ.update(ready.get(timeout=120))
    s3_root = Location.parse("s3://bench/checkpoints")
    t = Trainer(args.image_size, args.batch, args.device_step)
    rounds, uploads = [], []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for r in range(args.rounds):
                run_dir = Location.parse(str(Path(tmp) / f"run{r}"))
                timed = inside_epoch(t, args.blocks, args.every, run_dir)
                rounds.append(timed)
                per_step, ratios, held = timed["s_per_step"], timed["ratio"], timed["held_s"]
                print(
                    f"round {r}: {per_step['none']:.3f} s/step without; every {args.every} "
                    f"steps: {per_step['worker']:.3f} ({ratios['worker']:.3f}x, the loop held "
                    f"{held['worker']:.3f} s a save), previous writer {per_step['previous']:.3f} "
                    f"({ratios['previous']:.3f}x, held {held['previous']:.3f} s); medians of "
                    f"{args.blocks} blocks each"
                )
                # Rotating which goes first, so that a machine's drift favours none.
                order = EPOCH_WAYS[r % 3 :] + EPOCH_WAYS[: r % 3]
                up = {w: epoch_upload(t, w, args.next_steps, s3_root, r) for w in order}
                base = up["none"]["s_per_step"]
                up["ratio"] = {w: up[w]["s_per_step"] / base for w in EPOCH_WAYS[1:]}
                uploads.append(up)
                print(
                    f"round {r}: epoch checkpoint to S3, epoch end to next step: async "
                    f"{up['async']['held_s']:.3f} s, sync {up['sync']['held_s']:.3f} s; next "
                    f"{args.next_steps} steps {base:.3f} s/step without, async "
                    f"{up['async']['s_per_step']:.3f} ({up['ratio']['async']:.3f}x; uploaded "
                    f"{up['async']['until_uploaded_s']:.1f} s after the epoch's end), sync "
                    f"{up['sync']['s_per_step']:.3f} ({up['ratio']['sync']:.3f}x)"
                )
    finally:
        server.terminate()
    s, n = args.epoch_steps, args.every
    redone = {
        "epoch_ends": {"mean": (s - 1) / 2, "max": s - 1},
        f"every_{n}": {"mean": (n - 1) / 2, "max": n - 1},
    }

    def median(items, *keys):
        values = []
        for item in items:
            for k in keys:
                item = item[k]
            values.append(item)
        return statistics.median(values)

    result = {
        "config": vars(args),
        "rounds": rounds,
        "step_time_ratio": over_blocks(rounds, "worker"),
        "previous_step_time_ratio": over_blocks(rounds, "previous"),
        "epoch_uploads": uploads,
        "epoch_end_held_s": {w: median(uploads, w, "held_s") for w in EPOCH_WAYS[1:]},
        "next_steps_ratio": {w: median(uploads, "ratio", w) for w in EPOCH_WAYS[1:]},
        "steps_redone_per_failure": redone,
        "redone_ratio": redone[f"every_{n}"]["mean"] / redone["epoch_ends"]["mean"],
    }
    held, after = result["epoch_end_held_s"], result["next_steps_ratio"]
    print(
        f"step time with / without a checkpoint every {n} steps: {result['step_time_ratio']:.3f}x "
        f"(previous writer {result['previous_step_time_ratio']:.3f}x; median of "
        f"{args.rounds * args.blocks} blocks); "
        f"an epoch's checkpoint to S3 holds the loop {held['async']:.3f} s (sync "
        f"{held['sync']:.3f} s), the next steps {after['async']:.3f}x (sync {after['sync']:.3f}x); "
        f"steps redone per failure, epoch of {s} steps: {(s - 1) / 2:.1f} -> {(n - 1) / 2:.1f} on "
        f"average ({result['redone_ratio']:.3f}x)"
    )
    write_results("checkpoint_steps_device" if args.device_step else "checkpoint_steps", result)


if __name__ == "__main__":
    main()
