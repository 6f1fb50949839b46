"""A sweep's trials in Ray Tune: the Tuner (new, or restored from its record), the space as
Tune's search domains, ASHA by epochs done, how many trials run at once, and each trial's
process, which runs the train job's `train`."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import ray
from ray.tune.integration.ray_train import TuneReportCallback

from pipeline.core.config import validate_config
from pipeline.core.storage import Location
from pipeline.model.checkpoint import Score
from pipeline.train.config import TrainConfig
from pipeline.tune.config import SweepConfig

if TYPE_CHECKING:  # mlflow is imported only where tracking is on
    from pipeline.tracking.sweep import TrialTracking

log = logging.getLogger(__name__)

TUNE_DIR = "tune"
# What ASHA's rungs count: epochs done, reported with each epoch. Not Tune's training_iteration,
# which starts again at 1 when a resumed sweep trains a trial on from its checkpoint.
EPOCHS_DONE = "epochs_done"


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


def tuner(
    cfg: SweepConfig,
    configs: list[TrainConfig],
    version: str,
    sweep_dir: Location,
    tracking: TrialTracking | None,
):
    """A new Tuner for the sweep, or the one its record restores: finished trials stay
    finished, unfinished ones train on (each from its run's latest checkpoint)."""
    from ray import tune

    tune_dir = sweep_dir.child(TUNE_DIR)
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
    return tune.Tuner(
        trainable,
        param_space=_param_space(cfg, version, sweep_dir),
        tune_config=tune.TuneConfig(
            metric=metric,
            mode=mode,
            num_samples=cfg.num_samples,
            scheduler=_scheduler(cfg, configs),
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


def _scheduler(cfg: SweepConfig, configs: list[TrainConfig]):
    """ASHA by epochs done, where the sweep asks for it; else None (every trial to its end)."""
    from ray.tune.schedulers import ASHAScheduler

    if not cfg.asha.enabled:
        return None
    return ASHAScheduler(
        time_attr=EPOCHS_DONE,
        max_t=max(c.epochs for c in configs),
        grace_period=cfg.asha.grace_period,
        reduction_factor=cfg.asha.reduction_factor,
        # A trial that trains all its epochs ends by itself, its reports written: a stop
        # at its last report would end it before.
        stop_last_trials=False,
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
