"""The chain's command line: its arguments and `--help`, logging, and what ends it as an exit
code; `python -m jobs.submit` is this."""

from __future__ import annotations

import argparse
import logging
import sys

from pipeline.chain.follow import Patience
from pipeline.chain.plan import CHECK, CONFIGS, STEPS, plan
from pipeline.chain.run import run_chain
from pipeline.chain.status import main_status
from pipeline.core.config import keys_help
from pipeline.core.errors import EXIT_CODES, ClusterError, failure, first_line
from pipeline.core.logs import setup_logging


def chain_parser(description: str) -> argparse.ArgumentParser:
    """The chain's arguments, `description` heading its --help and each step's keys ending it."""
    parser = argparse.ArgumentParser(
        prog="python -m jobs.submit",
        description=description,
        epilog=steps_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_where(parser)
    _add_shipped(parser)
    _add_patience(parser)
    _add_step(parser)
    return parser


def steps_help() -> str:
    """The steps in order, and each one's settings for `--set STEP.KEY=VALUE`."""
    sections = [
        f"steps, in this order: {', '.join(STEPS)} (or all); export and tune only when named;"
        f" {CHECK} (the cluster check, docs/check.md) when named, or first with --check"
    ]
    for step, cls in CONFIGS.items():
        sections.append(
            f"{step}: python -m jobs.{step}; --set {step}.KEY=VALUE with KEY one of\n"
            f"{keys_help(cls)}"
        )
    return "\n\n".join(sections)


def _add_where(parser: argparse.ArgumentParser) -> None:
    """The cluster, the outputs' root, and the configs the jobs read."""
    add = parser.add_argument
    add("--address", required=True, help="the cluster's dashboard: http://HOST:8265")
    add("--root", required=True, help="where outputs go: s3://bucket/prefix or a shared path")
    add("--profile", default="", help="'demo' for configs/demo-<step>.yaml; default <step>.yaml")
    add(
        "--recipe",
        default="",
        metavar="NAME",
        help="a training recipe: configs/recipes/NAME.yaml over the train config (finetune, "
        "scratch)",
    )
    add(
        "--set",
        action="append",
        default=[],
        metavar="STEP.KEY=VALUE",
        help="override a job's config, e.g. --set train.epochs=20 (repeatable)",
    )


def _add_shipped(parser: argparse.ArgumentParser) -> None:
    """What goes with every job in its runtime env."""
    add = parser.add_argument
    add(
        "--env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="an environment variable for the jobs, over runtime_env.yaml's (repeatable)",
    )
    add(
        "--py-module",
        action="append",
        default=[],
        metavar="PATH",
        help="your own package for every job, as runtime_env py_modules: its folder, a .whl, "
        "or a URI of a zip (repeatable); its networks then load in every job (docs/models.md)",
    )


def _add_patience(parser: argparse.ArgumentParser) -> None:
    """How long a cluster that does not answer is waited for."""
    add = parser.add_argument
    add(
        "--submit-timeout-s",
        type=float,
        default=Patience.submit_s,
        metavar="SECONDS",
        help="how long to try again a submission the cluster cannot take yet: not up, no job "
        "agent (default %(default).0f)",
    )
    add(
        "--reconnect-timeout-s",
        type=float,
        default=Patience.reconnect_s,
        metavar="SECONDS",
        help="how long to follow a job while its cluster does not answer before exit 3; the "
        "job may run on (default %(default).0f)",
    )


def _add_step(parser: argparse.ArgumentParser) -> None:
    """The step to run, and the options of the check and of status."""
    add = parser.add_argument
    add(
        "--check",
        action="store_true",
        help="run the cluster check (the check step) first; the steps only if it passes",
    )
    add(
        "--job",
        metavar="ID",
        help="with status: this job's state and progress (its submission id), not the chain's",
    )
    add("--json", action="store_true", help="with status: one JSON object, for schedulers")
    add(
        "step",
        choices=[*CONFIGS, "all", "status"],
        help="a step, all of the chain, or status: where the chain's run and inference are "
        "(epoch, step, images/s, ETA, last checkpoint, best score; pipeline/chain/status.py)",
    )


def run(args: argparse.Namespace) -> int:
    """The step `args` name (a job, the chain, or status), with logging set up; its exit code,
    an error of the user's or the cluster's as one line and its code."""
    setup_logging()
    logging.getLogger("ray").setLevel(logging.WARNING)  # the SDK's upload and websocket chatter
    # "Directory '.git' is now ignored by default ...": runtime_env.yaml excludes it anyway.
    logging.getLogger("ray._private.runtime_env").setLevel(logging.ERROR)
    try:
        if args.step == "status":
            jobs = plan(args.root, profile=args.profile, sets=args.set, recipe=args.recipe)
            return main_status(args, jobs)
        return run_chain(args)
    except ConnectionError as e:  # the dashboard did not answer: retrying later may help
        print(
            f"error: cannot reach the cluster at --address {args.address} ({first_line(e)}): is "
            "it up, and is that its dashboard? A job submitted before this may still run "
            "(ray job list)",
            file=sys.stderr,
        )
        return EXIT_CODES[ClusterError]
    except Exception as e:
        ended = failure(e)
        if ended is None:
            raise
        code, line = ended
        print(f"error: {line}", file=sys.stderr)
        return code
