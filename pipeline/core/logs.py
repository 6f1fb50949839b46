"""One log format for the bundle's processes, and Ray's routine lines kept out of job logs.

`ray job logs` shows what drivers and workers print. Left alone, Ray Train logs each report of
each rank, every placement step and every checkpoint it persists: in a training job, those lines
outnumber the bundle's own. The driver sets Ray Train's level to WARNING (`RAY_TRAIN_LOG_LEVEL`,
given to `RunConfig`), and each worker quiets the one logger that level misses. Ray's warnings
and errors still show.
"""

from __future__ import annotations

import logging
import sys

RAY_TRAIN_LOG_LEVEL = "WARNING"
# The preprocess job's last line; the chain (jobs.submit) reads the dataset version it committed
# there. Here, not beside the dataset: the chain's client imports no pyarrow.
CURRENT_DATASET_LINE = "current dataset version: "


def setup_logging() -> None:
    """INFO and up to stdout, which `ray job logs` shows; for job drivers and Ray workers."""
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stdout,
    )


def quiet_ray_data() -> None:
    """Ray Data's progress bars redraw several times a second: in a job's log, that is
    hundreds of lines per dataset. The jobs log their own progress."""
    import ray.data

    ray.data.DataContext.get_current().enable_progress_bars = False


def quiet_train_reports() -> None:
    """On a Ray Train worker: "Reporting training result N: TrainingReport(...)", per rank and
    epoch, comes from a logger named by its file's path, outside `ray.train`'s level."""
    from pipeline.core.ray_internals import train_context

    logging.getLogger(train_context.__file__).setLevel(logging.WARNING)
