"""What every job entrypoint shares: arguments, logging, and turning bad input into exit codes."""

from __future__ import annotations

import argparse
import logging
import os
import resource
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel

from pipeline.core.config import keys_help, load_config
from pipeline.core.errors import failure
from pipeline.core.logs import setup_logging

C = TypeVar("C", bound=BaseModel)

log = logging.getLogger("jobs")


def job_main(
    doc: str,
    config_cls: type[C],
    default_config: str,
    body: Callable[[C], str | None],
    *,
    docs_page: str,
) -> None:
    """Parse `--config FILE [--config FILE ...] key=value ...`, set up logging, run
    `body(config)` and print what it returns as the job's last line (the output a script picks
    up: a path, or JSON).

    Exit codes: 0 done, 1 the input data is unusable, 2 the config is invalid, 3 the work
    failed on the cluster (no room for the workers, or retries used up)."""
    args = job_parser(doc, config_cls, default_config, docs_page=docs_page).parse_args()
    setup_logging()
    started = time.monotonic()
    try:
        cfg = job_config(config_cls, default_config, args)
        result = body(cfg)
    except Exception as e:
        ended = failure(e)
        if ended is None:
            raise  # a bug: its traceback, and exit 1
        code, line = ended
        if isinstance(e, OSError):  # where in the bundle a storage call failed, for the log
            log.warning("storage failed", exc_info=True)
        print(f"error: {line}", file=sys.stderr)
        exit_now(code)
    # What the driver itself cost: it must not grow with the data (the work runs on the cluster).
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
    log.info("done in %.0f s; driver peak memory %.0f MiB", time.monotonic() - started, peak_mib)
    if result is not None:
        print(result, flush=True)
    exit_now(0)


def job_parser(
    doc: str, config_cls: type[C], default_config: str, *, docs_page: str
) -> argparse.ArgumentParser:
    """The arguments every job takes: `--config FILE [--config FILE ...] key=value ...`."""
    parser = argparse.ArgumentParser(
        description=doc,
        epilog=(
            f"settings (key=value; sections with dots):\n{keys_help(config_cls)}\n\n"
            f"Each setting explained: {docs_page}"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--config",
        action="append",
        metavar="FILE",
        help=f"YAML file (default: {default_config}); give it again to layer a recipe over it "
        "(configs/recipes/): later files override earlier ones key by key",
    )
    parser.add_argument(
        "overrides", nargs="*", metavar="key=value", help="settings over the file's (below)"
    )
    return parser


def job_config(config_cls: type[C], default_config: str, args: argparse.Namespace) -> C:
    """The config that `args` (from job_parser) ask for: its files, then its overrides."""
    files = [Path(f) for f in args.config or [default_config]]
    return load_config(config_cls, files, args.overrides)


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
