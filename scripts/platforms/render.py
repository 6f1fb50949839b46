"""Every file of platforms/ from the values, checked before it is written."""

from __future__ import annotations

import hashlib
from pathlib import Path, PurePosixPath

import yaml

from pipeline.chain.plan import BUNDLE_ROOT, CONFIGS
from pipeline.core.errors import ConfigError
from scripts.platforms import anyscale, kuberay
from scripts.platforms.common import HEADER, LOCK, TIMEOUT_S, bases, image, ray_version
from scripts.platforms.validate import Refused, check
from scripts.platforms.values import Values

try:
    from scripts.platforms import grafana
except ImportError:  # grafana-foundation-sdk is the dev extra's, and needs Python 3.11+
    grafana = None

OUT = BUNDLE_ROOT / "platforms"
EXAMPLE = OUT / "values.yaml"


def dockerfile(values: Values, lock: str) -> str:
    """One Dockerfile, three images: Ray's CPU and CUDA images for KubeRay's pods, Anyscale's
    for its clusters. Each holds the lock's exact versions, so no node installs anything when
    it starts, and the bundle's code, which KubeRay's submitter uploads as the job's working
    dir (and the team's package as its py_modules) and a RayService imports."""
    builds = [
        f"#   docker build -f DOCKERFILE --build-arg BASE={base} "
        f"-t {image(values, lock, flavour)} .\n"
        for flavour, base in bases(values, lock).items()
        if flavour != "gpu" or values.gpus
    ]
    package = values.package.path
    copy_package = ""
    if package:
        where = f"{kuberay.WORKDIR}/{package}"
        copy_package = f"COPY {package} {package}\n"
        if package.endswith(".whl"):
            copy_package += f"RUN pip install --no-cache-dir --no-deps {where}\n"
    path = kuberay.WORKDIR
    if package and not package.endswith(".whl") and PurePosixPath(package).parent.name:
        path += f":{kuberay.WORKDIR}/{PurePosixPath(package).parent}"
    digest = hashlib.sha256(lock.encode()).hexdigest()
    return HEADER + (
        "# From the bundle root, DOCKERFILE this file's path (platforms/Dockerfile for the\n"
        "# example; Docker reads Dockerfile.dockerignore beside it), then `docker push` each:\n"
        + "".join(builds)
        + f"ARG BASE={bases(values, lock)['']}\n"
        "FROM ${BASE}\n"
        f"LABEL ray-cv.cluster-lock-sha256={digest}\n"
        "COPY requirements/cluster.lock /tmp/cluster.lock\n"
        "RUN pip install --no-cache-dir --require-hashes -r /tmp/cluster.lock\n"
        f"WORKDIR {kuberay.WORKDIR}\n"
        "COPY runtime_env.yaml pyproject.toml ./\n"
        "COPY requirements/ requirements/\n"
        "COPY configs/ configs/\n"
        "COPY jobs/ jobs/\n"
        "COPY pipeline/ pipeline/\n" + copy_package + f"ENV PYTHONPATH={path}\n"
    )


def dockerignore(values: Values) -> str:
    """The build context is the bundle root: only what the Dockerfile copies goes to the
    builder, not the venvs, data and docs beside it."""
    keep = ["requirements/", "configs/", "jobs/", "pipeline/", "runtime_env.yaml", "pyproject.toml"]
    keep += [values.package.path] if values.package.path else []
    return (
        "# Written by `make platforms` (scripts/platforms/): Docker reads it for the Dockerfile\n"
        "# beside it, whose build context is the bundle root.\n"
        "*\n" + "".join(f"!{path}\n" for path in keep) + "**/__pycache__/\n"
    )


def _leaves(data, prefix: str = "") -> dict[str, object]:
    """{dotted key: value} of every leaf of the values."""
    if isinstance(data, dict):
        items = data.items()
    elif isinstance(data, list | tuple):
        items = enumerate(data)
    else:
        return {prefix: data}
    found = {}
    for key, value in items:
        found |= _leaves(value, f"{prefix}.{key}" if prefix else str(key))
    return found


def blame(values: Values, refused: Refused) -> str:
    """The values key that a refused field was rendered from: the one whose value it is, else
    the longest text value it holds (a name within a job's name); "" when none is."""
    leaves = _leaves(values.model_dump())
    for key, value in leaves.items():
        if value == refused.value or (value and str(value) == str(refused.value)):
            return key
    held = [
        k
        for k, v in leaves.items()
        if isinstance(v, str) and len(v) > 2 and v in str(refused.value)
    ]
    return max(held, key=lambda k: len(leaves[k]), default="")


def generate(values: Values) -> dict[str, str]:
    """{path under platforms/: its text}; ConfigError naming the value where a KubeRay file is
    one the API server or the operator would refuse."""
    lock = LOCK.read_text()
    if values.package.path and not (BUNDLE_ROOT / values.package.path).exists():
        raise ConfigError(
            f"values package.path: {values.package.path} is not below the bundle root "
            f"{BUNDLE_ROOT}: put the package's folder (or .whl) there"
        )
    assert set(CONFIGS) == set(TIMEOUT_S), "a job without a time limit"
    nodes = [values.head, *values.worker_groups]
    if not any(
        all(getattr(n.instance_types, cloud) for n in nodes) for cloud in anyscale.PROVIDERS
    ):
        raise ConfigError(
            "values instance_types: no cloud has a machine type for every node (head and each "
            "worker group): give instance_types.aws or instance_types.gcp to all of them"
        )
    if grafana is None:
        raise ConfigError(
            "platforms/grafana/: the dashboard is built with grafana-foundation-sdk, which is "
            "not installed here: `make install` on Python 3.11+ (requirements/dev.txt pins it)"
        )
    files = {
        **anyscale.files(values, lock),
        **kuberay.files(values, lock, ray_version(lock)),
        **grafana.files(),
        "Dockerfile": dockerfile(values, lock),
        "Dockerfile.dockerignore": dockerignore(values),
    }
    for path, text in files.items():
        if not path.startswith("kuberay/"):
            continue
        for manifest in yaml.safe_load_all(text):
            try:
                check(manifest)
            except Refused as e:
                key = blame(values, e)
                leaves = _leaves(values.model_dump())
                named = f"values {key}={leaves[key]!r}" if key else "the values"
                raise ConfigError(
                    f"{named}: {manifest['kind']} {path} refuses it at {e.where}: {e.problem}"
                ) from None
    return files


def write(out: Path, files: dict[str, str]) -> None:
    for path, text in files.items():
        (out / path).parent.mkdir(parents=True, exist_ok=True)
        (out / path).write_text(text)
