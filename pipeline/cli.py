"""What every job entrypoint shares: arguments, logging, and turning bad input into exit codes."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel

from pipeline.config import load_config
from pipeline.errors import ClusterError, ConfigError, InputError

C = TypeVar("C", bound=BaseModel)

EXIT_CODES = {InputError: 1, ConfigError: 2, ClusterError: 3}


def job_main(doc: str, config_cls: type[C], default_config: str, body: Callable[[C], None]) -> None:
    """Parse `--config FILE key=value ...`, set up logging, run `body(config)`.

    Exit codes: 0 done, 1 the input data is unusable, 2 the config is invalid, 3 the work
    failed on the cluster (no room for the workers, or retries used up)."""
    parser = argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", default=default_config, help="YAML file (default: %(default)s)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="e.g. image_size=128")
    args = parser.parse_args()
    setup_logging()
    try:
        cfg = load_config(config_cls, Path(args.config), args.overrides)
        body(cfg)
    except (InputError, ConfigError, ClusterError) as e:
        print(f"error: {e}", file=sys.stderr)
        exit_now(EXIT_CODES[type(e)])
    exit_now(0)


def exit_now(code: int) -> None:
    """Flush, leave Ray, and exit without the interpreter's teardown. The job is done and its
    outputs are in place; the teardown of torch, Ray and Arrow's AWS SDK costs seconds per job
    and can crash (apache/arrow#38352), which would turn a job that succeeded into a failure."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def setup_logging() -> None:
    """INFO and up to stdout, which `ray job logs` shows; for job drivers and Ray workers."""
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stdout,
    )
