"""One log format for the bundle's processes, and Ray's routine lines kept out of job logs.

`ray job logs` shows what drivers and workers print. Ray Train logs every report of every rank
("Reporting training result ..."), its preemption watcher warns on clusters that have no
preemption to watch, and the job SDK narrates uploads: in a training job those lines outnumber
the bundle's own. Their loggers go to WARNING; their errors still show.
"""

from __future__ import annotations

import logging
import sys

ROUTINE = (
    "ray.train.v2._internal.execution.context",  # "Reporting training result N ... from rank R"
    "ray.train.v2._internal.execution.checkpoint",  # "Checkpoint successfully created ..."
    "ray.train.v2._internal.callbacks",  # preemption watcher, placement and the like
    "ray.train.v2._internal.execution.controller",  # state changes; failures raise anyway
    "ray._private.runtime_env",  # working_dir packaging: ".gitignore" and size notices
)


def setup_logging() -> None:
    """INFO and up to stdout, which `ray job logs` shows; for job drivers and Ray workers."""
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stdout,
    )
    for name in ROUTINE:
        logging.getLogger(name).setLevel(logging.WARNING)
