"""A real train job whose rank 1 is held between steps ends with exit 3 naming it, with every
rank's stacks and its last checkpoint intact (the stall watch's rules: tests/unit/test_stall.py)."""

from __future__ import annotations

import re
import uuid
from pathlib import Path

from helpers import (
    armed_runtime_env,
    held_until_it_ends,
    in_background,
    latest_recorded,
    train_job,
)

from pipeline.core import faults
from pipeline.model.checkpoint import METADATA

# The Ray test's floor: above the gaps between steps of a loaded 2-core machine (an epoch's
# end, its evaluation and checkpoint, the next epoch's loader), far under gloo's 30 minutes.
MIN_S = 12
# From the held rank's stop to the job's end: the floor, a read every few seconds, the stacks.
ENDS_WITHIN_S = 120


def test_a_rank_stopped_between_steps_ends_the_job_naming_it_with_every_ranks_stacks(
    cluster_2cpu, tiny_dataset, tmp_path
):
    # 15 steps an epoch: rank 1 stops after its second step of epoch 1, epoch 0's checkpoint
    # on storage; rank 0 waits for it in step 3's first collective (DDP's buffer broadcast).
    run, submission_id = tmp_path / "stalled", f"train-stall-{uuid.uuid4().hex[:8]}"
    env, marker = armed_runtime_env(tmp_path, faults.STEP_STALLED)
    args = ("name=stalled", "epochs=2", f"stall.min_s={MIN_S}")
    submit = {"runtime_env": env, "submission_id": submission_id}
    job = in_background(train_job, cluster_2cpu, tiny_dataset, tmp_path, *args, **submit)
    pid, proc, ended_s = held_until_it_ends(cluster_2cpu, job, marker, submission_id, ENDS_WITHIN_S)
    out = proc.stdout
    assert "failed with exit code 3" in out, out
    line = re.search(
        rf"error: training stalled: rank 1 \(pid {pid}, node [\d.]+\) made no progress for "
        rf"(\d+) s \(over stall.min_s={MIN_S} s; its median step is [\d.e-]+ s\) at epoch 1 "
        r"step 3, in faults.py:point; the other ranks waited for it in a collective. Stacks: "
        r"(\S+)/\. Resubmit to resume from the last checkpoint\n",
        out,
    )
    assert line, out
    assert MIN_S <= int(line[1]) < ENDS_WITHIN_S and ended_s < ENDS_WITHIN_S
    stacks = Path(line[2])
    assert stacks.parent == run / "stalls"
    assert sorted(p.name for p in stacks.iterdir()) == ["rank-0.txt", "rank-1.txt"]
    assert "faults.py" in (stacks / "rank-1.txt").read_text()
    # Rank 0 waits in DDP's collective: its buffers' broadcast, or the gradients' all-reduce.
    assert re.search(
        r"torch/(nn/parallel|distributed|autograd)/", (stacks / "rank-0.txt").read_text()
    )
    # Every rank's stacks in the job's log too.
    assert re.search(rf"rank 1 \(pid {pid}, node [\d.]+\), stacks:", out), out
    assert re.search(r"rank 0 \(pid \d+, node [\d.]+\), stacks:", out), out
    # Nothing lost: epoch 0's checkpoint is whole and Ray's latest, for a resubmission.
    assert (run / "epoch_0000" / METADATA).exists()
    assert latest_recorded(run) == "epoch_0000"
