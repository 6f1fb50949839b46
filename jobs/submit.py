"""Submit the bundle's jobs to a Ray cluster in order: the chain a scheduler runs.

    python -m jobs.submit --address http://127.0.0.1:8265 --root s3://bucket/ray-cv all
    python -m jobs.submit --address ... --root ... --set train.epochs=20 train
    python -m jobs.submit --address ... --root ... --recipe finetune all
    python -m jobs.submit --address ... --root ... export
    python -m jobs.submit --address ... --root ... --profile demo tune
    python -m jobs.submit --address ... --root ... --check all
    python -m jobs.submit --address ... --root ... --py-module ~/src/mynet \
        --set train.model.name=mynet:build all

Every job goes to the cluster with runtime_env.yaml, as `ray job submit` sends it; its log is
streamed here; `--py-module PATH` adds the user's own package (a folder, a .whl or a URI) to
every job's runtime env as `py_modules`, which Ray uploads with the job. Paths come from
`--root`: the dataset at <root>/dataset, training runs under <root>/runs (the run named by
the train config), predictions at <root>/predictions/<run name> (of another input than the
dataset's val split: at <run name>-<input name>[-<split>]-<hash of the input>), the export of the
run's best checkpoint at <root>/runs/<run name>/export/<checkpoint name>.
`--recipe NAME` layers configs/recipes/NAME.yaml over the train step's config.
`all` runs preprocess, train and infer; export and tune (a sweep of the train job, its trials
runs under <root>/runs/<sweep name>; docs/tune.md) run only when named. `check`, the cluster
check of the train step's config with storage <root> and the dataset at <root>/dataset
(docs/check.md), runs when named, or first with `--check`, before the steps named.
So each step can be retried on its own: preprocessing is a no-op when its dataset is up to date,
training resumes its run or says it is complete, inference replaces its output, and an export
already there is left as it is. Run as
`all`, training reads the dataset version the preprocess step left current; run alone, the
newest (`--set train.dataset_version=...` pins one). Inference and export of the run's own
dataset read the version the run was trained on, however they are run; inference of other
images (`--set infer.input=s3://.../photos`) reads them as they are.

Only a job that SUCCEEDED counts: `ray job submit` itself exits 0 for a job that was stopped.
A cluster that cannot take a job yet is tried again for `--submit-timeout-s` (60 s); a job
whose log stream drops is followed again from where it stopped, and its end read from its status,
while the cluster answers within `--reconnect-timeout-s` (300 s) (jobs/follow.py).

Exit codes: 0 every step succeeded; the failed job's own exit code (1 unusable input, 2 invalid
config, 3 the cluster could not do it; 1 when the job died without one); 3 also when the cluster
did not take a job or answered nothing for those times; 4 the job was stopped (`ray job stop`)
or this command interrupted (SIGTERM, Ctrl-C), which from the request that submits a job on
stops that job too; 2 an invalid config or argument here, before anything is submitted.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import logging
import secrets
import shlex
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from pydantic import BaseModel

from jobs.follow import Patience, Submission, follow, stop, submit
from jobs.status import PROGRESS_KEY, main_status, progress_places
from pipeline.check.config import CheckConfig, train_config
from pipeline.core.config import keys_help, load_config
from pipeline.core.errors import EXIT_CODES, ClusterError, ConfigError, failure, first_line
from pipeline.core.logs import CURRENT_DATASET_LINE, setup_logging
from pipeline.core.uris import check_scheme, join_uri
from pipeline.data.config import PreprocessConfig
from pipeline.export.config import ExportConfig
from pipeline.infer.config import InferConfig, predictions_output
from pipeline.train.config import TrainConfig
from pipeline.tune.config import SweepConfig

BUNDLE_ROOT = Path(__file__).resolve().parent.parent  # configs/ and runtime_env.yaml
CONFIGS = {
    "preprocess": PreprocessConfig,
    "train": TrainConfig,
    "infer": InferConfig,
    "export": ExportConfig,
    "tune": SweepConfig,
    "check": CheckConfig,
}
# The chain, in order: what `all` runs. An export and a sweep run only when named; the cluster
# check when named, or first with --check.
STEPS = ("preprocess", "train", "infer")
CHECK = "check"
STOPPED_EXIT = 4
# Lines of Ray's own that the streamed logs leave out. Ray's core worker logs this once per
# driver that starts a Ray Data actor pool, whose actors take their arguments by reference
# (ray-project/ray#53727); the driver holds those for the job's life, so nothing is at risk
# and nothing is for the user to do. `ray job logs` still has them.
RAY_NOISE = ("has constructor arguments in the object store and max_restarts > 0",)


@dataclass(frozen=True)
class Job:
    step: str
    entrypoint: list[str]  # what the job runs on the cluster
    config: BaseModel | None = field(default=None, compare=False)  # as plan() loaded it


def plan(root: str, *, profile: str = "", sets: list[str] = (), recipe: str = "") -> list[Job]:
    """The jobs, with their paths under `root` and the `step.key=value` overrides; with
    `recipe`, the train step's config file, then the recipe's file over it.

    Every config is loaded and validated here, so a bad one fails before anything is submitted."""
    try:
        check_scheme(root)
    except ValueError as e:
        raise ConfigError(f"--root {root}: {e}") from None
    root = root if "://" in root else str(Path(root).resolve())
    overrides: dict[str, list[str]] = {step: [] for step in CONFIGS}
    for item in sets:
        step, dot, rest = item.partition(".")
        if step not in overrides or not dot:
            raise ConfigError(
                f"--set {item!r}: must start with one of {', '.join(CONFIGS)}, "
                "then the job's key, e.g. train.epochs=20"
            )
        overrides[step].append(rest)
    dataset, runs = join_uri(root, "dataset"), join_uri(root, "runs")
    args = {
        "preprocess": [f"output={dataset}", *overrides["preprocess"]],
        "train": [f"dataset={dataset}", f"storage_path={runs}", *overrides["train"]],
        "tune": [f"dataset={dataset}", f"storage_path={runs}", *overrides["tune"]],
    }

    files = {step: [_config_file(step, profile)] for step in CONFIGS}
    if recipe:
        files["train"].append(recipe_file(recipe))

    loaded = {}

    def load(step: str):
        loaded[step] = load_config(
            CONFIGS[step], [BUNDLE_ROOT / f for f in files[step]], args[step]
        )
        return loaded[step]

    load("preprocess")
    name = load("train").name  # inference reads the run that training writes
    args["infer"] = [f"model={join_uri(runs, name)}", f"input={dataset}", *overrides["infer"]]
    # Keyed by the input, before the overrides (an output= of the user's wins): the
    # predictions of another input never replace the dataset's.
    output = predictions_output(join_uri(root, "predictions"), name, load("infer"), dataset=dataset)
    args["infer"].insert(2, f"output={output}")
    load("infer")
    args["export"] = [
        f"model={join_uri(runs, name)}",
        f"dataset={dataset}",
        *overrides["export"],
    ]
    load("export")
    load("tune")
    # The check measures the cluster against the train step as the chain runs it: its files
    # (named where the check's config names others) and its --set train.* settings.
    args["check"] = [f"storage={root}", f"dataset={dataset}"]
    if load("check").train != tuple(files["train"]):
        args["check"].append(f"train={json.dumps(files['train'])}")
    if overrides["train"]:
        args["check"].append(f"train_overrides={json.dumps(overrides['train'])}")
    args["check"] += overrides["check"]
    train_config(load("check"), root=BUNDLE_ROOT)
    return [
        Job(
            step,
            [
                *("python", "-m", f"jobs.{step}"),
                *(arg for f in files[step] for arg in ("--config", f)),
                *args[step],
            ],
            loaded[step],
        )
        for step in CONFIGS
    ]


def _config_file(step: str, profile: str) -> str:
    return f"configs/{profile + '-' if profile else ''}{step}.yaml"


RECIPES = "configs/recipes"


def recipe_file(name: str) -> str:
    """The bundle's file of training recipe `name`: the job reads it from the bundle's copy
    on the cluster, so only a recipe shipped in configs/recipes/ can be named."""
    path = f"{RECIPES}/{name}.yaml"
    if "/" in name or not (BUNDLE_ROOT / path).is_file():
        known = ", ".join(sorted(p.stem for p in (BUNDLE_ROOT / RECIPES).glob("*.yaml")))
        raise ConfigError(
            f"--recipe {name!r}: no such recipe; the bundle has {known} ({RECIPES}/<name>.yaml; "
            "add a file there for one of your own)"
        )
    return path


def step_command(
    address: str,
    root: str,
    step: str,
    *,
    profile: str = "",
    sets: list[str] = (),
    recipe: str = "",
    py_modules: list[str] = (),
) -> list[str]:
    """The command line that runs one step: what a scheduler's task runs (see examples/)."""
    return [
        "python",
        "-m",
        "jobs.submit",
        "--address",
        address,
        "--root",
        root,
        *(["--profile", profile] if profile else []),
        *(["--recipe", recipe] if recipe else []),
        *[f"--set={s}" for s in sets],
        *[f"--py-module={m}" for m in py_modules],
        step,
    ]


def runtime_env(env_vars: dict[str, str] | None = None, py_modules: list[str] = ()) -> dict:
    """runtime_env.yaml, with the working dir made absolute (the bundle, wherever we run from),
    `env_vars` on top of its own and `py_modules` (checked with `check_py_modules`) after its
    own."""
    env = yaml.safe_load((BUNDLE_ROOT / "runtime_env.yaml").read_text())
    env["working_dir"] = str((BUNDLE_ROOT / env.get("working_dir", ".")).resolve())
    env["env_vars"] = {**env.get("env_vars", {}), **(env_vars or {})}
    if py_modules:
        env["py_modules"] = [*env.get("py_modules", []), *py_modules]
    return env


def check_py_modules(items: list[str]) -> list[str]:
    """`--py-module` items as runtime env `py_modules`: a local folder (a Python package) or
    .whl file made absolute, which Ray uploads with each job; a URI (s3://.../pkg.zip,
    local:///path on every node) as it is. A local one that is neither is a ConfigError."""
    modules = []
    for item in items:
        if "://" in item:
            modules.append(item)
            continue
        path = Path(item).expanduser().resolve()
        if not (path.is_dir() or (path.is_file() and path.suffix == ".whl")):
            raise ConfigError(
                f"--py-module {item}: {'no such path' if not path.exists() else 'not a folder'}; "
                "give your package's folder (the one holding its __init__.py), a .whl file, or "
                "a URI of a zip of it (s3://...)"
            )
        modules.append(str(path))
    return modules


def parse_env(items: list[str]) -> dict[str, str]:
    """`--env NAME=VALUE` items as a dict; a malformed one is a ConfigError."""
    env = {}
    for item in items:
        name, eq, value = item.partition("=")
        if not eq or not name.isidentifier():
            raise ConfigError(f"--env {item!r}: expected NAME=VALUE, e.g. --env AWS_PROFILE=prod")
        env[name] = value
    return env


def pin_dataset(job: Job, version: str) -> Job:
    """The train `job` reading dataset `version`, unless its config is told which already."""
    if any(arg.startswith("dataset_version=") for arg in job.entrypoint):
        return job
    return Job(job.step, [*job.entrypoint, f"dataset_version={version}"], job.config)


def committed_version(log_text: str) -> str | None:
    """The dataset version a preprocess job's log says it left current."""
    found = [line.partition(CURRENT_DATASET_LINE)[2].strip() for line in log_text.splitlines()]
    return next((v for v in reversed(found) if v), None)


def submit_and_wait(
    address: str,
    job: Job,
    env_vars: dict[str, str] | None = None,
    log: list[str] | None = None,
    patience: Patience | None = None,
    py_modules: list[str] = (),
) -> int:
    """Submit `job` (with `py_modules` in its runtime env), stream its log to stdout (and into
    `log`), return its exit code (0 only for SUCCEEDED). A cluster that cannot take it yet, or
    a connection lost while it runs, is waited for as `patience` says (jobs/follow.py)."""
    from ray.job_submission import JobStatus

    # The job client sets its own logger to INFO on import: "WebSocket closed ..." per job.
    logging.getLogger("ray.dashboard.modules.job.sdk").setLevel(logging.WARNING)
    log = [] if log is None else log
    patience = patience or Patience()

    def say(line: str, file=sys.stdout) -> None:
        print(f"[{job.step}] {line}", file=file, flush=True)

    def write(text: str) -> None:
        sys.stdout.write(without_noise(text))
        sys.stdout.flush()
        log.append(text)

    started = time.monotonic()
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%S")
    submission_id = f"ray-cv-{job.step}-{stamp}-{secrets.token_hex(3)}"
    submission = Submission(address, submission_id)
    try:
        # From the submission on: a scheduler killing its task (or Ctrl-C) must not leave the
        # job running unseen, nor a retry of the task a second job of the step beside it.
        with _sigterm_as_interrupt():
            client = submit(
                submission,
                patience,
                say,
                entrypoint=shlex.join(job.entrypoint),
                runtime_env=runtime_env(env_vars, py_modules),
                metadata=progress_metadata(job),
            )
            print(
                f"[{job.step}] submitted {submission_id}: {shlex.join(job.entrypoint)}", flush=True
            )
            info = follow(client, submission_id, address, patience, write, say)
    except KeyboardInterrupt:
        say(stop(submission), sys.stderr)
        return STOPPED_EXIT
    if info.status == JobStatus.SUCCEEDED:
        took = time.monotonic() - started
        print(f"[{job.step}] {submission_id} succeeded in {took:.0f} s", flush=True)
        return 0
    if info.status == JobStatus.STOPPED:
        say(f"{submission_id} was stopped", sys.stderr)
        return STOPPED_EXIT
    code = info.driver_exit_code or 1
    say(f"{submission_id} failed with exit code {code}: {info.message}", sys.stderr)
    return code


def progress_metadata(job: Job) -> dict[str, str]:
    """The job's metadata: where its progress.json is, for `status --job` (train and infer)."""
    places = progress_places([job])
    return {PROGRESS_KEY: places[job.step]} if job.step in places else {}


def without_noise(text: str) -> str:
    """`text` less its lines of RAY_NOISE."""
    lines = text.splitlines(keepends=True)
    return "".join(line for line in lines if not any(noise in line for noise in RAY_NOISE))


@contextlib.contextmanager
def _sigterm_as_interrupt():
    # Airflow, cron wrappers and CI runners end a task with SIGTERM.
    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m jobs.submit",
        description=__doc__,
        epilog=steps_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
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
    parser.add_argument(
        "step",
        choices=[*CONFIGS, "all", "status"],
        help="a step, all of the chain, or status: where the chain's run and inference are "
        "(epoch, step, images/s, ETA, last checkpoint, best score; jobs/status.py)",
    )
    args = parser.parse_args(argv)
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


def run_chain(args: argparse.Namespace) -> int:
    """The steps `args` name, one job after another; the first failed job's exit code."""
    jobs = plan(args.root, profile=args.profile, sets=args.set, recipe=args.recipe)
    jobs.sort(key=lambda job: job.step != CHECK)  # the check, then the steps in their order
    env_vars = parse_env(args.env)
    py_modules = check_py_modules(args.py_module)
    patience = Patience(submit_s=args.submit_timeout_s, reconnect_s=args.reconnect_timeout_s)
    version = None
    for job in jobs:
        first = args.check and job.step == CHECK
        if first or args.step == job.step or (args.step == "all" and job.step in STEPS):
            if job.step == "train" and version is not None:
                job = pin_dataset(job, version)
            log: list[str] = []
            code = submit_and_wait(
                args.address, job, env_vars, log, patience, py_modules=py_modules
            )
            if code != 0:
                return code
            if job.step == "preprocess":
                # Training reads the version this chain made, even if another preprocess job
                # commits a newer one meanwhile; inference and export then read the version the
                # run was trained on, which its checkpoint records.
                version = committed_version("".join(log))
    return 0


if __name__ == "__main__":
    sys.exit(main())
