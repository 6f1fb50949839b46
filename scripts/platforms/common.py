"""What the Anyscale and KubeRay files share: the bundle's runtime env and lock, the jobs'
entrypoints as the chain plans them, the images, the limits, and the YAML they are in."""

from __future__ import annotations

import re
import shlex
from pathlib import PurePosixPath

import yaml

from pipeline.chain.plan import BUNDLE_ROOT, STEPS, plan
from scripts.platforms.values import Values

LOCK = BUNDLE_ROOT / "requirements" / "cluster.lock"
HEADER = (
    "# Written by `make platforms` (scripts/platforms/) from the team's values, runtime_env.yaml,\n"
    "# requirements/cluster.lock and configs/: edit those and render again, not this file.\n"
)
PYTHON_TAG = "py310"  # the lock's floor (scripts/lock.py)
HOUR = 3600
TIMEOUT_S = {"check": HOUR // 4, "preprocess": 4 * HOUR, "train": 24 * HOUR, "infer": 4 * HOUR}
TIMEOUT_S |= {"export": HOUR, "tune": 48 * HOUR}
# Retries resume: train and tune from their checkpoints, infer from the parts it committed,
# preprocessing from a dataset already up to date; an export is written once.
MAX_RETRIES = 2
SERVE = "classifier"  # the service's name after the values' name


def ray_version(lock: str) -> str:
    found = re.search(r"^ray==([\w.]+)", lock, re.MULTILINE)
    assert found, "requirements/cluster.lock pins no ray"
    return found[1]


def chain_steps(values: Values) -> tuple[str, ...]:
    """The chain a schedule runs: the cluster check first where the values ask for it."""
    return ("check",) * values.jobs.check + STEPS


def timeout_s(values: Values, step: str) -> int:
    """A job's limit; the chain's is its steps' together."""
    if step == "chain":
        return sum(TIMEOUT_S[s] for s in chain_steps(values))
    return TIMEOUT_S[step]


def entrypoints(values: Values, root: str) -> dict[str, str]:
    """{step: the job's command line}, each path under `root`, as the chain plans them
    (`pipeline.chain.plan`)."""
    sets = list(values.jobs.set)
    if values.package.path and not any(s.startswith("check.packages=") for s in sets):
        sets.append(f"check.packages=[{values.package.import_name}]")  # on every node
    jobs = plan(root, profile=values.jobs.profile, sets=sets, recipe=values.jobs.recipe)
    return {job.step: shlex.join(job.entrypoint) for job in jobs}


def chain(commands: dict[str, str], values: Values) -> str:
    """The chain as one command line: each step after the last succeeded."""
    return " && ".join(commands[step] for step in chain_steps(values))


def runtime_env(values: Values) -> dict:
    """runtime_env.yaml, with the team's package as py_modules: Ray ships it with every job,
    and the jobs' model-code rules take a checkpoint's network from it (docs/models.md)."""
    env = yaml.safe_load((BUNDLE_ROOT / "runtime_env.yaml").read_text())
    if values.package.path:
        env["py_modules"] = [f"./{PurePosixPath(values.package.path)}"]
    return env


def tag(values: Values, lock: str) -> str:
    return values.image.tag or ray_version(lock)


def image(values: Values, lock: str, flavour: str = "") -> str:
    """The team's image: `flavour` "" (CPU pods), "gpu" (GPU pods), "anyscale" (Anyscale)."""
    suffix = f"-{flavour}" if flavour else ""
    return f"{values.image.registry}/{values.image.repository}:{tag(values, lock)}{suffix}"


def bases(values: Values, lock: str) -> dict[str, str]:
    """{flavour: the base image it builds on}: Ray's own, of the lock's Ray. An Anyscale cluster
    runs one image on every node: a CUDA one where a group has GPUs."""
    ray = ray_version(lock)
    anyscale = f"anyscale/ray:{ray}-{PYTHON_TAG}" + ("-cu128" if values.gpus else "")
    return {
        "": f"rayproject/ray:{ray}-{PYTHON_TAG}",
        "gpu": f"rayproject/ray:{ray}-{PYTHON_TAG}-gpu",
        "anyscale": anyscale,
    }


def serve_config(root: str, values: Values) -> dict:
    """configs/serve.yaml's application, its model the train config's run under `root`. Its
    loopback host and port stay behind: the platform puts the proxy behind its load balancer."""
    serve = yaml.safe_load((BUNDLE_ROOT / "configs" / "serve.yaml").read_text())
    (app,) = serve["applications"]
    name = yaml.safe_load((BUNDLE_ROOT / "configs" / "train.yaml").read_text())["name"]
    app["args"]["model"] = f"{root}/runs/{name}"
    if values.package.path:
        # The service imports the team's package from the image (the Dockerfile installs it):
        # installed code, so the checkpoint's network may come from it only by name.
        app["args"]["allow_modules"] = [values.package.import_name]
    timeout = serve["http_options"]["request_timeout_s"]
    return {"applications": serve["applications"], "http_options": {"request_timeout_s": timeout}}


class _Dumper(yaml.SafeDumper):
    """No anchors (one dict in two places is written twice); text of several lines as a block."""

    def ignore_aliases(self, data) -> bool:
        return True


def _text(dumper: yaml.SafeDumper, text: str) -> yaml.ScalarNode:
    style = "|" if "\n" in text else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", text, style=style)


_Dumper.add_representer(str, _text)


def to_yaml(data: dict) -> str:
    return yaml.dump(data, Dumper=_Dumper, sort_keys=False, width=100)


def dump(*documents: dict) -> str:
    return HEADER + "---\n".join(to_yaml(d) for d in documents)
