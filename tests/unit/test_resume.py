"""Resume equivalence in this process, at world size 1: a run stopped inside an epoch and resumed
from its last checkpoint there, in a fresh loop, ends with exactly the weights and optimisation
state of the run never stopped, in every precision and augmentation. At world size 2:
tests/ray/test_resume_ranks.py; a worker really killed on a cluster:
tests/jobs/test_steps_jobs.py."""

from __future__ import annotations

import pytest
import torch
from helpers import (
    USER_MODEL,
    Stopped,
    assert_same_state,
    loop_here,
    small_run_config,
    stopping_after,
    waiting_for_step_checkpoints,
)

from pipeline.core.storage import Location
from pipeline.model.runs import checkpoint_dir_name, step_checkpoints
from pipeline.train.context import LocalContext

EPOCHS = 2
# The example's small network (with dropout: the generators must resume too), SGD with momentum
# (an optimizer state to resume), steps of 32 images: 16 steps an epoch of the tiny dataset.
RECIPE = (
    f"model.name={USER_MODEL}",
    "model.kwargs.width=8",
    "global_batch_size=32",
    "optimizer.momentum=0.9",
    f"epochs={EPOCHS}",
)
AUGMENTS = {
    "random_resized_crop": ("augment=random_resized_crop",),
    "crop_flip": ("augment=crop_flip",),
    "crop_flip+auto_augment": ("augment=crop_flip", "auto_augment=trivial_augment_wide"),
}
STEPS_PER_EPOCH = 16
# (checkpoint.every_steps, the steps the stopped run trains): its last checkpoint at step 6 of
# epoch 0, and at step 10 of epoch 1 (after epoch 0's own checkpoint).
STOPS = [(3, 7), (5, STEPS_PER_EPOCH + 11)]


def bf16_runs_here() -> bool:
    """Whether this CPU runs bf16 autocast (a convolution's forward and backward)."""
    try:
        conv = torch.nn.Conv2d(3, 4, 3)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            conv(torch.randn(1, 3, 8, 8)).sum().backward()
    except RuntimeError:
        return False
    return True


PRECISIONS = [
    "fp32",
    pytest.param(
        "bf16", marks=pytest.mark.skipif(not bf16_runs_here(), reason="no bf16 autocast here")
    ),
]


@pytest.fixture(scope="module")
def never_stopped(tiny_dataset, tmp_path_factory):
    """A function: the last checkpoint of the run never stopped, of a precision and an
    augmentation, trained on first use."""
    runs = {}

    def run(precision: str, augment: str):
        if (precision, augment) not in runs:
            storage = tmp_path_factory.mktemp("never-stopped")
            overrides = (*RECIPE, f"precision={precision}", *AUGMENTS[augment])
            cfg = small_run_config(tiny_dataset, storage, *overrides)
            loop_here(cfg, storage / "run", LocalContext())
            runs[precision, augment] = storage / "run" / checkpoint_dir_name(EPOCHS - 1)
        return runs[precision, augment]

    return run


def case(stop: tuple[int, int], precision: str, augment: str):
    marks = PRECISIONS[1].marks if precision == "bf16" else ()
    return pytest.param(
        *stop, precision, augment, marks=marks, id=f"{stop[0]}-{precision}-{augment}"
    )


# Every pair of any two of the stop, the precision and the augmentation, in six runs rather than
# all twelve combinations.
CASES = [
    case(STOPS[0], "fp32", "random_resized_crop"),
    case(STOPS[0], "bf16", "crop_flip"),
    case(STOPS[0], "bf16", "crop_flip+auto_augment"),
    case(STOPS[1], "fp32", "crop_flip"),
    case(STOPS[1], "bf16", "random_resized_crop"),
    case(STOPS[1], "fp32", "crop_flip+auto_augment"),
]


@pytest.mark.parametrize(("every", "stop", "precision", "augment"), CASES)
def test_a_run_stopped_inside_an_epoch_resumes_to_the_state_of_the_run_never_stopped(
    tiny_dataset, tmp_path, monkeypatch, never_stopped, every, stop, precision, augment
):
    overrides = (*RECIPE, f"precision={precision}", *AUGMENTS[augment])
    cfg = small_run_config(tiny_dataset, tmp_path, *overrides, f"checkpoint.every_steps={every}")
    run_dir = tmp_path / "run"
    waiting_for_step_checkpoints(monkeypatch, tmp_path / "faults")
    stopped = stopping_after(stop)
    with pytest.raises(Stopped):
        loop_here(cfg, run_dir, stopped)
    # What the stopped run left: its checkpoint at the last multiple of every_steps.
    epoch, step = divmod(stop - 1, STEPS_PER_EPOCH)
    step -= step % every
    assert step_checkpoints(Location.parse(str(run_dir)))[-1][:2] == (epoch, step)

    # A fresh loop, with the record the stopped run left (its epochs' checkpoints).
    resumed = LocalContext(recorded=stopped.recorded)
    loop_here(cfg, run_dir, resumed)
    assert [m["epoch"] for m, _ in resumed.reports] == list(range(epoch, EPOCHS))
    last = run_dir / checkpoint_dir_name(EPOCHS - 1)
    assert_same_state(last, never_stopped(precision, augment))
