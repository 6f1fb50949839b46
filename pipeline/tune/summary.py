"""A sweep's results, once its trials end: each trial's row (status, best score, cost, error),
the runs its trials could not finish, `trials.png`, and `summary.json`, written last."""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING

from pipeline.core.config import flatten_config, validate_config
from pipeline.core.errors import ClusterError, ConfigError, first_line
from pipeline.core.plots import plot_trials
from pipeline.core.storage import Location
from pipeline.model.checkpoint import Score, best_of, read_meta
from pipeline.model.run_status import training_since
from pipeline.model.runs import (
    COST_KEYS,
    RUN_SUMMARY,
    DivergedRun,
    latest_checkpoint,
    run_cost,
    write_reports,
)
from pipeline.train.config import TrainConfig
from pipeline.tune.config import SweepConfig
from pipeline.tune.trials import ranking, trial_run_name

if TYPE_CHECKING:  # mlflow is imported only where tracking is on
    from pipeline.tracking.sweep import TrialTracking

log = logging.getLogger(__name__)

SWEEP_SUMMARY = "summary.json"
TRIALS_PNG = "trials.png"
FINISHED, STOPPED, FAILED = "finished", "stopped early", "failed"


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
    trials, histories = [], {}
    for result in results:
        trial, history = trial_row(cfg, sweep_dir, result, version, tracking)
        if history is not None:
            histories[trial["trial"]] = history
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


def trial_row(
    cfg: SweepConfig, sweep_dir: Location, result, version: str, tracking: TrialTracking | None
) -> tuple[dict, list | None]:
    """A trial's row of the summary, from its Tune result and its run, and its run's history
    (None before its first checkpoint). Its run's reports are written where it could not."""
    metric, _ = ranking(cfg.score)
    trial_id = result.path.rstrip("/").rpartition("/")[2]
    run_dir = sweep_dir.child(trial_run_name(trial_id))
    given = flatten_config(result.config or {})
    trial = {
        "trial": trial_id,
        "run": run_dir.uri,
        "config": {p.key: given.get(p.key) for p in cfg.params},
        "status": FAILED,
        "epochs": 0,
        "best_score": None,
        "best_epoch": None,
    }
    latest, history = latest_checkpoint(run_dir), None
    if latest is not None:
        history = read_meta(latest).history
        trial["epochs"] = len(history)
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
    if history is not None:  # what its epochs cost, stopped and failed trials too
        trial |= run_cost(history, result.config or {})
    if "error" in trial and tracking is not None:
        tracking.close(run_dir, trial["error"])
    return trial, history


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
