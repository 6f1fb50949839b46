"""ray job submit --address http://127.0.0.1:8265 --runtime-env runtime_env.yaml \
    -- python -m jobs.tune --config configs/tune.yaml \
       dataset=s3://bucket/food101 storage_path=s3://bucket/runs name=lr-sweep

Search the train job's settings with Ray Tune (docs/tune.md): each trial trains a run of its
own with the train job's TorchTrainer, `<storage_path>/<name>/<trial id>`, on one dataset
version for the whole sweep; ASHA stops the trials that trail by epoch; submitting the same
name again resumes the sweep (finished trials stay finished, the others train on from their
checkpoints). Writes summary.json (every trial, and `best_run`: a run as any other, for
inference, export and serving) and trials.png into <storage_path>/<name>, and prints the best
run last; with a tracking URI (train.tracking.uri), tracks the sweep as an MLflow run with a
child run per trial. Exit codes: 0 done (failed trials are listed in the summary), 1 unusable
input (dataset, weights file), 2 invalid config (an unknown key, bad range or refused value in
the space; a resumed sweep with another config), 3 every trial failed, or the tracking server
does not answer.
"""

import logging

import ray

from jobs.cli import job_main
from pipeline.core.storage import Location
from pipeline.tune.config import SweepConfig

log = logging.getLogger("jobs.tune")


def main(cfg: SweepConfig) -> str:
    # Here, not at the top: a bad config fails before Ray Tune and torch are imported.
    from pipeline.tracking import sweep_tracker
    from pipeline.tune.sweep import runtime_env, sweep

    dataset, runs = Location.parse(cfg.dataset), Location.parse(cfg.storage_path)
    tracking = sweep_tracker(cfg)  # None when off; a server that does not answer: exit 3
    ray.init(runtime_env=runtime_env())
    summary = sweep(cfg, dataset=dataset, runs=runs, tracking=tracking)
    counts = ", ".join(f"{n} {status}" for status, n in summary["counts"].items())
    log.info(
        "%d trials (%s); best trial %s by %s (%s): %.4f",
        *(len(summary["trials"]), counts, summary["best_trial"], summary["metric"]),
        *(summary["mode"], summary["best_score"]),
    )
    return f"best run: {summary['best_run']}"


if __name__ == "__main__":
    job_main(__doc__, SweepConfig, "configs/tune.yaml", main, docs_page="docs/tune.md")
