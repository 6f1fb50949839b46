"""The chain's plan: which jobs, their entrypoints under `--root`, and the runtime env they go
with; every config loaded and checked here, before anything is submitted."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from pydantic import BaseModel

from pipeline.check.config import CheckConfig, train_config
from pipeline.core.config import load_config
from pipeline.core.errors import ConfigError
from pipeline.core.uris import check_scheme, join_uri
from pipeline.data.config import PreprocessConfig
from pipeline.export.config import ExportConfig
from pipeline.infer.config import InferConfig, predictions_output
from pipeline.train.config import TrainConfig
from pipeline.tune.config import SweepConfig

BUNDLE_ROOT = Path(__file__).resolve().parents[2]  # configs/ and runtime_env.yaml
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
RECIPES = "configs/recipes"


@dataclass(frozen=True)
class Job:
    step: str
    entrypoint: list[str]  # what the job runs on the cluster
    config: BaseModel | None = field(default=None, compare=False)  # as plan() loaded it


def plan(root: str, *, profile: str = "", sets: list[str] = (), recipe: str = "") -> list[Job]:
    """The jobs, with their paths under `root` and the `step.key=value` overrides; with
    `recipe`, the train step's config file, then the recipe's file over it.

    Every config is loaded and validated here, so a bad one fails before anything is submitted."""
    root = _checked_root(root)
    overrides = _overrides(sets)
    files = {step: [_config_file(step, profile)] for step in CONFIGS}
    if recipe:
        files["train"].append(recipe_file(recipe))
    dataset, runs = join_uri(root, "dataset"), join_uri(root, "runs")
    args = {
        "preprocess": [f"output={dataset}", *overrides["preprocess"]],
        "train": [f"dataset={dataset}", f"storage_path={runs}", *overrides["train"]],
    }
    configs = {step: _load(step, files[step], args[step]) for step in args}
    name = configs["train"].name  # inference and export read the run that training writes
    args["infer"] = _infer_args(root, runs, name, dataset, files["infer"], overrides["infer"])
    args["export"] = [f"model={join_uri(runs, name)}", f"dataset={dataset}", *overrides["export"]]
    args["tune"] = [f"dataset={dataset}", f"storage_path={runs}", *overrides["tune"]]
    args["check"] = _check_args(root, dataset, files, overrides)
    for step in ("infer", "export", "tune", "check"):
        configs[step] = _load(step, files[step], args[step])
    train_config(configs["check"], root=BUNDLE_ROOT)
    return [
        Job(step, _entrypoint(step, files[step], args[step]), configs[step]) for step in CONFIGS
    ]


def _checked_root(root: str) -> str:
    """`--root` as the jobs get it: a URI as it is, a local path made absolute."""
    try:
        check_scheme(root)
    except ValueError as e:
        raise ConfigError(f"--root {root}: {e}") from None
    return root if "://" in root else str(Path(root).resolve())


def _overrides(sets: list[str]) -> dict[str, list[str]]:
    """`--set step.key=value` items as {step: [key=value, ...]}."""
    overrides: dict[str, list[str]] = {step: [] for step in CONFIGS}
    for item in sets:
        step, dot, rest = item.partition(".")
        if step not in overrides or not dot:
            raise ConfigError(
                f"--set {item!r}: must start with one of {', '.join(CONFIGS)}, "
                "then the job's key, e.g. train.epochs=20"
            )
        overrides[step].append(rest)
    return overrides


def _load(step: str, files: list[str], args: list[str]) -> BaseModel:
    return load_config(CONFIGS[step], [BUNDLE_ROOT / f for f in files], args)


def _infer_args(
    root: str, runs: str, name: str, dataset: str, files: list[str], overrides: list[str]
) -> list[str]:
    """The infer job's arguments: the run training writes, of the dataset unless told otherwise,
    into an output keyed by the input. That output goes before the overrides (an output= of
    the user's wins), so the predictions of another input never replace the dataset's."""
    args = [f"model={join_uri(runs, name)}", f"input={dataset}", *overrides]
    config = _load("infer", files, args)
    output = predictions_output(join_uri(root, "predictions"), name, config, dataset=dataset)
    args.insert(2, f"output={output}")
    return args


def _check_args(
    root: str, dataset: str, files: dict[str, list[str]], overrides: dict[str, list[str]]
) -> list[str]:
    """The check job's arguments: it measures the cluster against the train step as the chain
    runs it, its files (named where the check's config names others) and its --set train.*
    settings."""
    args = [f"storage={root}", f"dataset={dataset}"]
    if _load("check", files["check"], args).train != tuple(files["train"]):
        args.append(f"train={json.dumps(files['train'])}")
    if overrides["train"]:
        args.append(f"train_overrides={json.dumps(overrides['train'])}")
    return [*args, *overrides["check"]]


def _entrypoint(step: str, files: list[str], args: list[str]) -> list[str]:
    return [
        *("python", "-m", f"jobs.{step}"),
        *(arg for f in files for arg in ("--config", f)),
        *args,
    ]


def _config_file(step: str, profile: str) -> str:
    return f"configs/{profile + '-' if profile else ''}{step}.yaml"


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
