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
from typing import TYPE_CHECKING, Any

import ray
import yaml
from ray.tune.integration.ray_train import TuneReportCallback

from pipeline.core.config import dump_config, flatten_config, parse_yaml, validate_config
from pipeline.core.errors import ClusterError, ConfigError, first_line
from pipeline.core.plots import plot_trials
from pipeline.core.storage import Location
from pipeline.model.checkpoint import Score, best_of, read_meta
from pipeline.model.run_status import training_since
from pipeline.model.runs import (
    COST_KEYS,
    RUN_SUMMARY,
    SNAPSHOT,
    DivergedRun,
    latest_checkpoint,
    run_cost,
    write_reports,
)
from pipeline.train.config import TrainConfig
from pipeline.tune.config import SweepConfig

if TYPE_CHECKING:  # mlflow is imported only where tracking is on
    from pipeline.tracking.sweep import MLflowSweep, TrialTracking

log = logging.getLogger(__name__)

SWEEP_RECORD = "sweep.yaml"
TUNE_DIR = "tune"
SWEEP_SUMMARY = "summary.json"
TRIALS_PNG = "trials.png"
# What ASHA's rungs count: epochs done, reported with each epoch. Not Tune's training_iteration,
# which starts again at 1 when a resumed sweep trains a trial on from its checkpoint.
EPOCHS_DONE = "epochs_done"
FINISHED, STOPPED, FAILED = "finished", "stopped early", "failed"
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


def ranking(score: Score) -> tuple[str, str]:
    """The reported metric and mode that rank trials: the score's own, but for checkpoint.metric
    `last`, which ranks a run's checkpoints by epoch: trials then go by its weights' metric."""
    if score.key == "epoch":
        return score.weights_key, score.weights_mode
    return score.key, score.mode


def trial_run_name(trial_id: str) -> str:
    """A trial's run name (and its Tune directory's): its Tune id, new with each new sweep."""
    return trial_id


def _trial_dirname(trial) -> str:
    return trial_run_name(trial.trial_id)


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
    tune_dir = sweep_dir.child(TUNE_DIR)
    results = _tuner(cfg, configs, version, sweep_dir, tune_dir, trials).fit()
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


def trials_at_once(cfg: SweepConfig, configs: list[TrainConfig]) -> int:
    """Trials that run at once: max_concurrent_trials, else as many as the cluster holds now,
    each asking what its train config's workers ask (its largest in the space)."""
    if cfg.max_concurrent_trials is not None:
        return cfg.max_concurrent_trials
    cpus = max(c.scaling.max_workers * c.scaling.cpus_per_worker for c in configs)
    gpus = max(c.scaling.max_workers * c.scaling.use_gpu for c in configs)
    have = ray.cluster_resources()
    fits = int(have.get("CPU", 0) // cpus)
    if gpus:
        fits = min(fits, int(have.get("GPU", 0) // gpus))
    asks = f"{cpus} CPUs" + (f" and {gpus} GPUs" if gpus else "")
    held = f"{have.get('CPU', 0):g} CPUs" + (f" and {have.get('GPU', 0):g} GPUs" if gpus else "")
    log.info("%d trial(s) at once: each asks %s, the cluster has %s", max(fits, 1), asks, held)
    if fits == 0:
        log.warning(
            "a trial asks %s, more than the cluster has: trials run one at a time, each waiting "
            "for room as a train job does (scaling.startup_timeout_s, max_failures)",
            asks,
        )
    return max(fits, 1)


def _param_space(cfg: SweepConfig, version: str, sweep_dir: Location) -> dict[str, Any]:
    """The trials' train config as plain data, with Tune's search domains at the space's keys."""
    from ray import tune

    space = cfg.train_dict() | {"storage_path": sweep_dir.uri, "dataset_version": version}
    for p in cfg.params:
        domain = {
            "choice": tune.choice,
            "grid": tune.grid_search,
            "uniform": lambda v: tune.uniform(*v),
            "loguniform": lambda v: tune.loguniform(*v),
        }[p.kind](list(p.values))
        *parents, leaf = p.key.split(".")
        node = space
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = domain
    return space


def _tuner(
    cfg: SweepConfig,
    configs: list[TrainConfig],
    version: str,
    sweep_dir: Location,
    tune_dir: Location,
    tracking: TrialTracking | None,
):
    """A new Tuner for the sweep, or the one its record restores: finished trials stay
    finished, unfinished ones train on (each from its run's latest checkpoint)."""
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler

    # The trial's own process only waits on its Train run: its workers ask for the resources,
    # and trials_at_once bounds how many runs ask at once. No CPU, so that a trial's process
    # never holds one its workers wait for; Tune refuses a trial of no resources at all, so it
    # asks for one byte of memory.
    trainable = tune.with_resources(
        tune.with_parameters(run_trial, tracking=tracking), {"CPU": 0, "memory": 1}
    )
    if tune.Tuner.can_restore(tune_dir.path, storage_filesystem=tune_dir.fs):
        log.info("resuming from Ray Tune's record %s", tune_dir.uri)
        return tune.Tuner.restore(
            tune_dir.path,
            trainable,
            resume_unfinished=True,
            resume_errored=cfg.retry_failed,  # the same trial, its run from its checkpoint
            storage_filesystem=tune_dir.fs,
        )
    metric, mode = ranking(cfg.score)
    scheduler = None
    if cfg.asha.enabled:
        scheduler = ASHAScheduler(
            time_attr=EPOCHS_DONE,
            max_t=max(c.epochs for c in configs),
            grace_period=cfg.asha.grace_period,
            reduction_factor=cfg.asha.reduction_factor,
            # A trial that trains all its epochs ends by itself, its reports written: a stop
            # at its last report would end it before.
            stop_last_trials=False,
        )
    return tune.Tuner(
        trainable,
        param_space=_param_space(cfg, version, sweep_dir),
        tune_config=tune.TuneConfig(
            metric=metric,
            mode=mode,
            num_samples=cfg.num_samples,
            scheduler=scheduler,
            max_concurrent_trials=trials_at_once(cfg, configs),
            trial_name_creator=_trial_dirname,
            trial_dirname_creator=_trial_dirname,
        ),
        run_config=tune.RunConfig(
            name=TUNE_DIR,
            storage_path=sweep_dir.path,
            storage_filesystem=sweep_dir.fs,
            # A worker failure is the trial's own Train run's to retry (its max_failures); a
            # trial that fails past that is reported, and the sweep goes on.
            failure_config=tune.FailureConfig(max_failures=0),
        ),
    )


def run_trial(config: dict, tracking: TrialTracking | None = None) -> None:
    """One trial, in its Tune actor: the train job's `train` on the trial's config; with
    `tracking`, its run tracked as the sweep's child."""
    from ray import tune

    from pipeline.core.logs import setup_logging
    from pipeline.train.driver import train

    setup_logging()
    name = trial_run_name(tune.get_context().get_trial_id())
    cfg = validate_config(TrainConfig, {**config, "name": name}, f"trial {name}")
    train(
        cfg,
        dataset=Location.parse(cfg.dataset),
        runs=Location.parse(cfg.storage_path),
        tracking=tracking.tracker() if tracking is not None else None,
        callbacks=[EpochReport()],
    )


class EpochReport(TuneReportCallback):
    """Rank 0's report of each epoch to Tune, with the epochs done (what ASHA counts)."""

    def after_report(self, run_context, metrics, checkpoint):
        first = {**metrics[0], EPOCHS_DONE: metrics[0]["epoch"] + 1}
        super().after_report(run_context, [first, *metrics[1:]], checkpoint)


def write_summary(
    cfg: SweepConfig,
    sweep_dir: Location,
    results,
    version: str,
    wall_time_s: float,
    *,
    tracking: TrialTracking | None = None,
) -> dict:
    """Every trial's reports (a trial stopped early has none of its own yet), trials.png, then
    summary.json; returns the summary. With `tracking`, closes the trials' MLflow runs that
    their trials could not."""
    metric, mode = ranking(cfg.score)
    keys = [p.key for p in cfg.params]
    trials, histories = [], {}
    for result in results:
        trial_id = result.path.rstrip("/").rpartition("/")[2]
        run_dir = sweep_dir.child(trial_run_name(trial_id))
        given = flatten_config(result.config or {})
        trial = {
            "trial": trial_id,
            "run": run_dir.uri,
            "config": {k: given.get(k) for k in keys},
            "status": FAILED,
            "epochs": 0,
            "best_score": None,
            "best_epoch": None,
        }
        latest = latest_checkpoint(run_dir)
        if latest is not None:
            histories[trial_id] = read_meta(latest).history
            trial["epochs"] = len(histories[trial_id])
        if result.error is not None:
            trial["error"] = _error_line(result.error)
        elif latest is None:
            trial["error"] = "ended before its first checkpoint"
        else:
            try:
                summary = _run_summary(run_dir, cfg.score, result, version, tracking)
                best = summary["best_metrics"]
            except DivergedRun as e:
                trial["error"] = str(e)
            else:
                planned = given.get("epochs", cfg.base_train().epochs)
                trial |= {
                    "status": FINISHED if summary["epochs"] >= planned else STOPPED,
                    "best_score": best[metric],
                    "best_epoch": best["epoch"],
                }
        if trial_id in histories:  # what its epochs cost, stopped and failed trials too
            trial |= run_cost(histories[trial_id], result.config or {})
        if "error" in trial and tracking is not None:
            tracking.close(run_dir, trial["error"])
        trials.append(trial)
    trials.sort(key=lambda t: t["trial"])
    best = best_of(trials, lambda t: t["best_score"], mode)  # NaN and None rank worst
    if histories:
        labels = {t["trial"]: _label(t) for t in trials}
        png = plot_trials(
            histories, key=metric, best=best["trial"] if best else None, labels=labels
        )
        sweep_dir.child(TRIALS_PNG).write_bytes(png)
    summary = {
        "sweep": sweep_dir.uri,
        "dataset_version": version,
        "metric": metric,
        "mode": mode,
        "space": {str(p.key): {p.kind: list(p.values)} for p in cfg.params},
        "best_trial": best["trial"] if best else None,
        "best_run": best["run"] if best else None,
        "best_score": best["best_score"] if best else None,
        "counts": {s: sum(t["status"] == s for t in trials) for s in (FINISHED, STOPPED, FAILED)},
        "wall_time_s": wall_time_s,
        **sweep_cost(trials),
        "trials": trials,
    }
    sweep_dir.child(SWEEP_SUMMARY).write_bytes(json.dumps(summary, indent=2).encode())
    for t in trials:
        log.info(
            "trial %s: %s after %d epoch(s), best %s %s; %s",
            *(t["trial"], t["status"], t["epochs"], metric, t["best_score"], t["config"]),
        )
    if best:
        shown = (best["trial"], metric, best["best_score"], best["run"])
        log.info("best trial %s (%s %s): %s", *shown)
    return summary


def sweep_cost(trials: list[dict]) -> dict:
    """The trials' worker-hours, GPU-hours and cost (where priced), totalled."""
    totals = {}
    for key in COST_KEYS:
        values = [t[key] for t in trials if t.get(key) is not None]
        totals[key] = sum(values) if values else None
    currencies = {t["currency"] for t in trials if "currency" in t}
    if len(currencies) == 1:
        totals["currency"] = currencies.pop()
    return totals


def _label(trial: dict) -> str:
    """A trial as the figure's legend names it: its id, status and values of the space."""
    values = ", ".join(
        f"{k.rpartition('.')[2]}={v:.3g}" if isinstance(v, float) else f"{k.rpartition('.')[2]}={v}"
        for k, v in trial["config"].items()
    )
    return f"{trial['trial']} ({trial['status']}): {values}" if values else trial["trial"]


def _error_line(error: BaseException) -> str:
    """What failed the trial: the train job's own error (Tune wraps it in the actor's)."""
    cause = getattr(error, "cause", None) or error
    return f"{type(cause).__name__}: {first_line(cause)}"


def _run_summary(
    run_dir: Location, score: Score, result, version: str, tracking: TrialTracking | None
) -> dict:
    """The run's summary, written here where its trial ended before it could: stopped by ASHA
    (or at its last report), Tune ends the trial's process; with `tracking`, its MLflow run
    is finished as the train job finishes it. Raises DivergedRun for a run with no best."""
    if run_dir.child(RUN_SUMMARY).exists() and training_since(run_dir) is None:
        summary = json.loads(run_dir.child(RUN_SUMMARY).read_bytes())
        if summary.get("best_metrics") is not None:  # else a diverged run: raised below
            return summary
    took = (result.metrics or {}).get("time_total_s", 0.0)
    summary = write_reports(run_dir, score, wall_time_s=took)
    if tracking is not None:
        cfg = validate_config(TrainConfig, {**result.config, "name": run_dir.name}, "trial")
        try:
            tracker = tracking.tracker()
            tracker.start(run_dir, cfg, version=version, changes=[])
        except (ClusterError, ConfigError) as e:  # the runs are whole: the sweep goes on
            log.warning("MLflow: the run of %s is not finished there: %s", run_dir.uri, e)
        else:
            tracker.finish(run_dir, summary)
    return summary
