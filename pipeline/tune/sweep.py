"""A sweep: Ray Tune over the train job, each trial a run of its own.

<storage_path>/<name>/
  sweep.yaml     the sweep's config and the dataset version every trial trains on (first start)
  tune/          Ray Tune's record: the trials, their reports, the scheduler's state (a resume
                 reads it)
  <trial id>/    each trial's run, as the train job writes it (pipeline.model.runs)
  trials.png     every trial's curve of the score on one figure
  summary.json   written last: every trial, and the best one's run (`best_run`)

Each trial is a Tune function trainable that runs the train job's own `train` (its checks, its
TorchTrainer, its retries, its resume) and passes rank 0's report of each epoch to Tune
through `TuneReportCallback`, which ASHA stops trials by.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import TYPE_CHECKING

import yaml

from pipeline.core.config import dump_config, flatten_config, parse_yaml
from pipeline.core.errors import ClusterError, ConfigError
from pipeline.core.storage import Location
from pipeline.model.runs import SNAPSHOT
from pipeline.train.config import TrainConfig
from pipeline.tune.config import SweepConfig
from pipeline.tune.summary import FAILED, SWEEP_SUMMARY, TRIALS_PNG, write_summary
from pipeline.tune.trials import tuner

if TYPE_CHECKING:  # mlflow is imported only where tracking is on
    from pipeline.tracking.sweep import MLflowSweep

log = logging.getLogger(__name__)

SWEEP_RECORD = "sweep.yaml"
# What a resumed sweep may change: Ray Tune's record keeps the rest (max_concurrent_trials too).
CHANGES_ON_RESUME = ("retry_failed",)


def runtime_env() -> dict:
    """What the sweep's driver adds to the job's runtime env, for every process it starts.

    RAY_ADDRESS: each Train run starts a detached PlacementGroupCleaner that removes the run's
    placement group once its controller dies, as it does when ASHA stops a trial (the
    controller dies with the trial's process); else the group would hold its CPUs until the
    sweep's driver exits. The cleaner finds the cluster through the state API, which fails
    (`Found multiple active Ray instances`) on a machine that runs several clusters unless
    told the address; a job's driver has it, its actors do not."""
    address = os.environ.get("RAY_ADDRESS")
    return {"env_vars": {"RAY_ADDRESS": address}} if address else {}


def sweep(
    cfg: SweepConfig, *, dataset: Location, runs: Location, tracking: MLflowSweep | None = None
) -> dict:
    """Run (or resume) the sweep `<runs>/<name>`; return its summary (Ray initialised). With
    `tracking`, the sweep is an MLflow run and each trial's run its child."""
    started = time.monotonic()
    sweep_dir = runs.child(cfg.name)
    if sweep_dir.child(SNAPSHOT).exists():
        raise ConfigError(
            f"name={cfg.name}: {sweep_dir.uri} is a training run, not a sweep: pick another name="
        )
    version = pinned_version(cfg, dataset, sweep_dir)
    configs = [c.model_copy(update={"dataset_version": version}) for c in cfg.trial_configs()]
    mode = _check_inputs(configs, dataset, version)
    cfg = cfg.with_checkpoint_mode(mode)
    configs = [c.with_checkpoint_mode(mode) for c in configs]
    log.info("trials ranked by %s", cfg.score)
    trials = None
    if tracking is not None:  # before any trial: a server that cannot take the sweep fails it
        trials = tracking.start(sweep_dir, cfg.model_dump(mode="json"), version=version)
    results = tuner(cfg, configs, version, sweep_dir, trials).fit()
    took = time.monotonic() - started
    summary = write_summary(cfg, sweep_dir, results, version, took, tracking=trials)
    if tracking is not None:
        reports = [sweep_dir.child(f) for f in (SWEEP_SUMMARY, TRIALS_PNG)]
        tracking.finish(sweep_dir, summary, [f for f in reports if f.exists()])
    if summary["best_run"] is None:
        failed = [t for t in summary["trials"] if t["status"] == FAILED]
        first = f" (the first: {failed[0]['error']})" if failed else ""
        raise ClusterError(
            f"every trial of sweep {sweep_dir.uri} failed{first}; its summary.json lists each "
            "trial's error. Fix the cause and submit the sweep again with retry_failed=true"
        )
    return summary


def pinned_version(cfg: SweepConfig, dataset: Location, sweep_dir: Location) -> str:
    """The dataset version of every trial: the record's, for a sweep that has started (whose
    config must be the same), else the one asked for or the newest, recorded now."""
    from pipeline.train.preflight import pick_dataset_version

    record = sweep_dir.child(SWEEP_RECORD)
    now = cfg.model_dump(mode="json")
    if record.exists():
        was = parse_yaml(record.read_bytes().decode())
        version = was.pop("pinned_dataset_version")
        old, new = flatten_config(was), flatten_config(now)
        changed = [
            f"{k}: {old.get(k)} -> {new.get(k)}"
            for k in sorted(old.keys() | new.keys())
            if old.get(k) != new.get(k) and k not in CHANGES_ON_RESUME
        ]
        if changed:
            raise ConfigError(
                f"sweep {sweep_dir.uri} was started with another config:\n  "
                + "\n  ".join(changed)
                + "\nSubmit it as it started to resume it, or pick a new name= for a new sweep"
            )
        log.info("resuming sweep %s, on dataset version %s", sweep_dir.uri, version)
        return version
    version = pick_dataset_version(cfg.base_train(), dataset, None, run=sweep_dir.uri)
    record.write_bytes(dump_config(cfg).encode() + _pin_line(version))
    log.info("new sweep %s on dataset version %s", sweep_dir.uri, version)
    return version


def _pin_line(version: str) -> bytes:
    return yaml.safe_dump({"pinned_dataset_version": version}).encode()


def _check_inputs(configs: list[TrainConfig], dataset: Location, version: str) -> str | None:
    """The dataset, every model the space names and the hooks of the train config, checked
    once here rather than failing in every trial (pipeline.train.driver's own checks); returns
    the order of the trials' score (checkpoint.mode, resolved)."""
    from pipeline.train.preflight import check_dataset, check_hooks, check_model

    seen_data, seen_models = set(), set()
    for c in configs:
        data = (c.scaling.max_workers, c.global_batch_size)
        if data not in seen_data:
            seen_data.add(data)
            manifest = check_dataset(c, dataset, version)
        model = json.dumps(c.model.model_dump(mode="json"), sort_keys=True)
        if model not in seen_models:
            seen_models.add(model)
            check_model(c, manifest, dataset)
    return check_hooks(configs[0], manifest).checkpoint.mode
