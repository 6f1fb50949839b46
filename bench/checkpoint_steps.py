"""What checkpoints inside an epoch cost a step, and what they save at a failure.

    .venv/bin/python -m bench.checkpoint_steps --image-size 64 --every 10 --rounds 3

In this process, without Ray: ResNet-18 and AdamW on random batches held in memory (the step
alone, as a GPU-fed worker runs it), `--steps` steps with a checkpoint inside the epoch every
`--every` steps (the worker's StepWriter: written to local disk while the step loop waits, then
published to a run directory by its thread) against the same steps with none, in `--rounds`
rounds, which of the two goes first alternating. Reported: seconds per step both ways and their
ratio (median of the rounds), and the time a save holds the step loop.

Steps redone per failure are the checkpoints' arithmetic: a failure at a uniformly random step
of an epoch of S steps redoes on average (S - 1) / 2 steps (at most S - 1) with checkpoints at
epoch ends, (N - 1) / 2 (at most N - 1) with one every N steps; the table uses `--epoch-steps`.
Results go to bench/results/checkpoint_steps.json.
"""

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.common import write_results
from pipeline.core.storage import Location
from pipeline.model.checkpoint import CheckpointMeta, save_checkpoint
from pipeline.model.device import DevicePolicy
from pipeline.model.networks import build_model
from pipeline.train.step import train_one_epoch
from pipeline.train.steps import StepWriter

CLASSES = 10


def run(steps: int, every: int | None, size: int, batch: int, run_dir: Location) -> dict:
    """`steps` steps of the worker's train step; with `every`, a checkpoint every `every`."""
    torch.manual_seed(0)
    model = build_model(CLASSES)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    policy = DevicePolicy(torch.device("cpu"), "fp32", (0.5,) * 3, (0.25,) * 3)
    x = torch.randint(0, 256, (batch, 3, size, size), dtype=torch.uint8)
    y = torch.randint(0, CLASSES, (batch,))
    writer = StepWriter(run_dir)
    held = []

    def after_step(step: int, totals) -> None:
        if every is None or step % every:
            return
        began = time.perf_counter()
        meta = CheckpointMeta(
            epoch=0,
            step=step,
            classes=[str(c) for c in range(CLASSES)],
            image_size=size,
            mean=(0.5,) * 3,
            std=(0.25,) * 3,
            dataset_fingerprint="bench",
            dataset_version="bench",
            metrics={"epoch": 0, "step": step},
            history=[],
            config={},
        )
        weights, state = model.state_dict(), {"optimizer": optimizer.state_dict()}
        writer.save(0, step, lambda d: save_checkpoint(d, weights, meta, state))
        held.append(time.perf_counter() - began)

    criterion = torch.nn.CrossEntropyLoss()
    train_one_epoch(model, [(x, y)] * 3, optimizer, criterion, policy=policy)  # warm-up
    began = time.perf_counter()
    train_one_epoch(
        model, [(x, y)] * steps, optimizer, criterion, policy=policy, after_step=after_step
    )
    seconds = time.perf_counter() - began
    waited = time.perf_counter()
    writer.wait()
    return {
        "s_per_step": seconds / steps,
        "saves": len(held),
        "held_s": statistics.median(held) if held else 0.0,
        "last_publish_s": time.perf_counter() - waited,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--epoch-steps", type=int, default=296, help="Food-101 at batch 256")
    args = parser.parse_args()
    torch.set_num_threads(2)
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            run_dir = Location.parse(str(Path(tmp) / f"run{r}"))
            # Alternating which goes first, so that a machine's drift favours neither.
            first, second = (None, args.every) if r % 2 == 0 else (args.every, None)
            timed = {
                every: run(args.steps, every, args.image_size, args.batch, run_dir)
                for every in (first, second)
            }
            off, on = timed[None], timed[args.every]
            rounds.append({"off": off, "on": on, "ratio": on["s_per_step"] / off["s_per_step"]})
            print(
                f"round {r}: {off['s_per_step']:.3f} s/step without, {on['s_per_step']:.3f} with "
                f"a checkpoint every {args.every} ({on['saves']} saves, each holding the loop "
                f"{on['held_s']:.3f} s): {rounds[-1]['ratio']:.3f}x"
            )
    s, n = args.epoch_steps, args.every
    redone = {
        "epoch_ends": {"mean": (s - 1) / 2, "max": s - 1},
        f"every_{n}": {"mean": (n - 1) / 2, "max": n - 1},
    }
    result = {
        "config": vars(args),
        "rounds": rounds,
        "step_time_ratio": statistics.median(r["ratio"] for r in rounds),
        "steps_redone_per_failure": redone,
        "redone_ratio": redone[f"every_{n}"]["mean"] / redone["epoch_ends"]["mean"],
    }
    print(
        f"step time with / without: {result['step_time_ratio']:.3f}x (median of "
        f"{args.rounds}); steps redone per failure, epoch of {s} steps: {(s - 1) / 2:.1f} -> "
        f"{(n - 1) / 2:.1f} on average ({result['redone_ratio']:.3f}x)"
    )
    write_results("checkpoint_steps", result)


if __name__ == "__main__":
    main()
