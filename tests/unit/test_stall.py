"""A stalled training run ends with a diagnosis: the limit and the rule that names the rank,
without Ray. A real job whose rank 1 stops between two steps, the other rank waiting for it in
the gradient all-reduce: tests/jobs/test_stall_jobs.py."""

from __future__ import annotations

from pipeline.train import stall

# The Ray test's floor: above the gaps between steps of a loaded 2-core machine (an epoch's
# end, its evaluation and checkpoint, the next epoch's loader), far under gloo's 30 minutes.
MIN_S = 12
# From the held rank's stop to the job's end: the floor, a read every few seconds, the stacks.
ENDS_WITHIN_S = 120


def record(**fields) -> dict:
    """A worker's record as stall.report returns it, armed and working."""
    return {
        "pid": 1,
        "units": 10,
        "steps": 10,
        "since_s": 0.1,
        "median_step_s": 0.5,
        "phase": "epoch 1 step 3",
        "at": "epoch.py:train_one_epoch",
        "waiting": False,
    } | fields


def test_the_limit_is_a_multiple_of_the_median_step_never_below_the_floor():
    assert stall.limit_s(0.5, multiple=20, min_s=300) == 300
    assert stall.limit_s(30.0, multiple=20, min_s=300) == 600
    assert stall.limit_s(None, multiple=20, min_s=300) == 300
    ranks = {0: record(since_s=599, median_step_s=29.0), 1: record(since_s=601, median_step_s=31)}
    assert stall.median_step_s(ranks) == 30.0
    assert stall.stalled_for(ranks, multiple=20, min_s=300) is None  # rank 0 moved 599 s ago
    ranks[0]["since_s"] = 610
    assert stall.stalled_for(ranks, multiple=20, min_s=300) == 601
    assert stall.stalled_for(ranks, multiple=40, min_s=300) is None  # 1200 s allowed
    # Not armed before each rank's first steps of the attempt: they are slow.
    ranks[1]["steps"] = stall.ARM_AFTER_STEPS - 1
    assert stall.stalled_for(ranks, multiple=20, min_s=300) is None
    # A rank that did not answer: the others decide.
    assert stall.stalled_for({0: record(since_s=400), 1: None}, multiple=20, min_s=300) == 400
    assert stall.stalled_for({0: None}, multiple=20, min_s=300) is None


def test_the_rank_named_is_the_silent_one_else_the_one_not_waiting_else_the_one_behind():
    waiting = {"waiting": True, "at": "graph.py:_engine_run_backward"}
    ranks = {0: record(**waiting), 1: record(at="faults.py:point"), 2: record(**waiting)}
    assert stall.stalled_rank(ranks) == (1, "the other ranks waited for it in a collective")
    assert stall.stalled_rank(ranks | {2: None}) == (
        2,
        "it did not answer (its process is stopped or hung)",
    )
    # Every rank waits in a collective, or none does: the one that did the fewest units.
    behind = {0: record(**waiting), 1: record(units=9, **waiting), 2: record(**waiting)}
    assert stall.stalled_rank(behind) == (1, "it did the fewest units of work (9)")
    loading = {0: record(units=12), 1: record(units=11)}
    assert stall.stalled_rank(loading) == (1, "it did the fewest units of work (11)")


def test_the_record_counts_steps_and_times_only_step_after_step(monkeypatch):
    clock = iter([100.0, 100.5, 101.5, 103.0, 104.0, 150.0, 151.0])
    monkeypatch.setattr(stall.time, "monotonic", lambda: next(clock))
    monkeypatch.setattr(stall, "RECORD", stall.Record())  # t=100
    stall.at_epoch(1, 0)
    stall.progressed("step")  # 100.5: after the epoch's start, not a step's time
    stall.progressed("step")  # 101.5: 1 s
    stall.progressed("step")  # 103.0: 1.5 s
    stall.progressed("val_batch")  # 104.0
    stall.progressed("epoch")  # 150.0: an evaluation and a checkpoint are no step
    r = stall.report()  # 151.0
    assert (r["steps"], r["units"], r["median_step_s"], r["since_s"]) == (3, 5, 1.25, 1.0)
    assert r["phase"] == "epoch 2 step 1"
    assert r["at"] == "stall.py:where_waiting"  # this thread reported: it is the one reading
