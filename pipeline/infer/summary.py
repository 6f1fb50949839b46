"""An inference run's summary: counts and scores of its predictions, the speeds of those it
inferred itself, and what the driver cost."""

from __future__ import annotations

import math
import resource

import numpy as np

from pipeline.core.storage import Location
from pipeline.infer.sink import Tally
from pipeline.model.checkpoint import served_weights, weights_by, weights_scores


def driver_usage() -> dict:
    """This process's peak memory and CPU time so far: what the driver costs, which must not
    grow with the number of images (bench/infer_scale.py)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return {
        "driver_peak_rss_mib": round(usage.ru_maxrss / 1024, 1),  # Linux reports KiB
        "driver_cpu_s": round(usage.ru_utime + usage.ru_stime, 1),
    }


def summarize(
    meta,
    checkpoint: Location,
    source: Location,
    dataset_version: str | None,
    tally: Tally,
    inferred: Tally,
    started: float,
    seconds: float,
) -> dict:
    """The run's summary: counts and scores of all its predictions (`tally`), speeds of those
    it inferred itself (`inferred`; the others were carried over from a partial run)."""
    summary = {
        "checkpoint": checkpoint.uri,
        # Which of its weights classified (raw, or its EMA's where those scored better on val),
        # and each one's val score that decided it.
        "weights": served_weights(meta),
        "weights_by": weights_by(meta),
        "weights_scores": weights_scores(meta),
        "input": source.uri,
        **({"dataset_version": dataset_version} if dataset_version else {}),
        "classes": meta.classes,
        "images": tally.images,
        "images_inferred": inferred.images,
        "seconds": seconds,
        "images_per_s": inferred.images / seconds if seconds else 0.0,
        "skipped": sorted(tally.skipped, key=lambda s: s["source_id"]),
    }
    if math.isfinite(inferred.first_at):
        # Start-up (actors importing torch, loading the model) apart from the steady rate.
        first_s = inferred.first_at - started
        summary["first_batch_s"] = first_s
        rest = seconds - first_s
        steady = inferred.images - inferred.first_images
        summary["steady_images_per_s"] = steady / rest if rest else 0.0
    cm = tally.confusion  # rows: true class, columns: predicted
    labelled = int(cm.sum())
    if labelled:
        tp = np.diag(cm)
        precision = tp / np.maximum(cm.sum(axis=0), 1)
        recall = tp / np.maximum(cm.sum(axis=1), 1)
        summary |= {
            "labelled_images": labelled,
            "accuracy": float(tp.sum() / labelled),
            "per_class": {
                c: {
                    "precision": float(precision[i]),
                    "recall": float(recall[i]),
                    "support": int(cm[i].sum()),
                }
                for i, c in enumerate(meta.classes)
            },
            "confusion_matrix": cm.tolist(),
        }
    return summary
