"""Resume equivalence at world size 2, in this machine's processes and without Ray: two ranks of
a gloo process group (torch.multiprocessing), each running the training loop in a local run
context. A run stopped inside an epoch and resumed from its last checkpoint there, in fresh
loops, ends with exactly the weights and optimisation state of the run never stopped, as at
world size 1 (tests/unit/test_resume.py). Here rather than in tests/unit: starting the two
processes alone takes seconds."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing
from helpers import (
    USER_MODEL,
    Stopped,
    assert_same_state,
    loop_here,
    small_run_config,
    stopping_after,
    waiting_for_step_checkpoints,
)

from pipeline.core.config import validate_config
from pipeline.core.storage import Location
from pipeline.model.runs import checkpoint_dir_name, step_checkpoints
from pipeline.train.config import TrainConfig
from pipeline.train.context import LocalContext

WORLD = 2
EVERY = 4
# Steps of 32 images, 16 per rank: 16 steps an epoch of the tiny dataset. The stopped run's last
# checkpoint is at step 8 of epoch 1, after epoch 0's own.
RECIPE = (
    f"model.name={USER_MODEL}",
    "model.kwargs.width=8",
    "global_batch_size=32",
    f"scaling.num_workers={WORLD}",
    "optimizer.momentum=0.9",
    "epochs=2",
    "augment=crop_flip",
    "auto_augment=trivial_augment_wide",
)
STOP = 16 + 9


def rank_runs(rank: int, init_file: str, configs: dict[str, dict], runs: Path) -> None:
    """On rank `rank`: the run never stopped, then the run stopped after STOP steps, then the
    stopped run resumed in fresh loops."""
    torch.set_num_threads(1)  # two ranks on this machine's cores, not each on all of them
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        cfg = {name: validate_config(TrainConfig, c) for name, c in configs.items()}
        loop_here(cfg["never-stopped"], runs / "never-stopped", LocalContext.in_process_group())
        stopped = runs / "stopped"
        try:
            loop_here(cfg["stopped"], stopped, stopping_after(STOP, rank=rank, world=WORLD))
        except Stopped:
            pass
        else:
            raise AssertionError(f"rank {rank} was not stopped")
        # Its last checkpoint inside an epoch is at step 8 of epoch 1.
        last = step_checkpoints(Location.parse(str(stopped)))[-1]
        assert last[:2] == (1, 8), last
        # Every rank alike: the record the stopped run left, epoch 0's checkpoint.
        recorded = str(stopped / checkpoint_dir_name(0))
        loop_here(cfg["stopped"], stopped, LocalContext.in_process_group(recorded=recorded))
    finally:
        dist.destroy_process_group()


def test_two_ranks_stopped_inside_an_epoch_resume_to_the_state_of_the_run_never_stopped(
    tiny_dataset, tmp_path, monkeypatch
):
    configs = {
        "never-stopped": small_run_config(tiny_dataset, tmp_path, *RECIPE),
        "stopped": small_run_config(
            tiny_dataset, tmp_path, *RECIPE, f"checkpoint.every_steps={EVERY}"
        ),
    }
    waiting_for_step_checkpoints(monkeypatch, tmp_path / "faults")  # the ranks inherit it
    runs = tmp_path / "runs"
    torch.multiprocessing.spawn(
        rank_runs,
        args=(
            str(tmp_path / "process-group"),
            {name: c.model_dump(mode="json") for name, c in configs.items()},
            runs,
        ),
        nprocs=WORLD,
        join=True,
    )
    last = checkpoint_dir_name(1)
    assert_same_state(runs / "stopped" / last, runs / "never-stopped" / last)
