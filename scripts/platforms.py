"""Write the Anyscale and KubeRay files under platforms/ from what the bundle already says.

    python -m scripts.platforms                 # make platforms: rewrites platforms/
    python -m scripts.platforms --out DIR --s3-root s3://my-bucket/ray-cv --image REPO/ray-cv:TAG

Sources: runtime_env.yaml (working dir, excludes, env vars), requirements/cluster.lock (the Ray
version and every package's pin), configs/ through `jobs.submit.plan` (the entrypoints, with
every path under one root) and cluster.yaml (node sizes). Edit those, then run this again:
tests/test_platforms.py fails while the committed files differ from what it writes.
"""

from __future__ import annotations

import argparse
import hashlib
import re
import shlex
from pathlib import Path

import yaml

from jobs.submit import BUNDLE_ROOT, CONFIGS, STEPS, plan

OUT = BUNDLE_ROOT / "platforms"
LOCK = BUNDLE_ROOT / "requirements" / "cluster.lock"
HEADER = (
    "# Written by `make platforms` (scripts/platforms.py) from runtime_env.yaml,\n"
    "# requirements/cluster.lock, configs/ and cluster.yaml: edit those, not this file.\n"
)
PYTHON_TAG = "py310"  # cluster.yaml's nodes and the lock's floor (scripts/lock.py)
S3_ROOT = "s3://BUCKET/ray-cv"
# Anyscale's storage: a job's entrypoint runs in a shell on the cluster, which expands it.
ARTIFACTS = "$ANYSCALE_ARTIFACT_STORAGE"
_ARTIFACTS_STAND_IN = "s3://ANYSCALE-ARTIFACT-STORAGE"  # plan() wants a URI; replaced after
# Storage per profile: the default profile's runs outlive the cluster (a retried job, on a new
# cluster, resumes from them); the demo's live and die with its one cluster.
ANYSCALE_ROOTS = {"": f"{_ARTIFACTS_STAND_IN}/ray-cv", "demo": "/mnt/cluster_storage/ray-cv"}
# Spot workers where a retry resumes: train and tune from their checkpoints, infer from the parts
# it committed, the chain from its last step (a committed dataset is up to date). Preprocessing
# and export start over, and the service must stay up: on demand.
SPOT_STEPS = ("train", "infer", "tune", "chain")
COMPUTE = {"ray-cv": "compute.yaml", "ray-cv-spot": "compute-spot.yaml"}
HOUR = 3600
TIMEOUT_S = {"preprocess": 4 * HOUR, "train": 24 * HOUR, "infer": 4 * HOUR, "export": HOUR}
TIMEOUT_S |= {"tune": 48 * HOUR, "chain": sum(TIMEOUT_S[step] for step in STEPS)}
MAX_RETRIES = 2
SCHEDULE = "0 2 * * *"  # the chain every night at 02:00 UTC
SERVICE = "ray-cv-classifier"


def ray_version(lock: str) -> str:
    found = re.search(r"^ray==([\w.]+)", lock, re.MULTILINE)
    assert found, "requirements/cluster.lock pins no ray"
    return found[1]


def pins(lock: str) -> list[str]:
    """The lock's requirement lines, without hashes: Anyscale reads a requirements file line by
    line (no continuation lines, so no --hash)."""
    return [
        line.removesuffix("\\").strip()
        for line in lock.splitlines()
        if line and not line[0].isspace() and not line.startswith(("#", "-"))
    ]


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


def dump(data: dict) -> str:
    return HEADER + to_yaml(data)


def entrypoints(root: str, profile: str = "") -> dict[str, str]:
    """{step: the job's command line}, each path under `root`, as jobs.submit runs them."""
    return {job.step: shlex.join(job.entrypoint) for job in plan(root, profile=profile)}


def chain(commands: dict[str, str]) -> str:
    """The chain (what `jobs.submit all` runs) as one entrypoint: each step after the last
    succeeded."""
    return " && ".join(commands[step] for step in STEPS)


# Anyscale -------------------------------------------------------------------------------------


def anyscale_files(runtime_env: dict, lock: str, nodes: dict) -> dict[str, str]:
    ray = ray_version(lock)
    files = {"anyscale/requirements.txt": HEADER + "".join(f"{pin}\n" for pin in pins(lock))}
    for name, filename in COMPUTE.items():
        market = "PREFER_SPOT" if name.endswith("-spot") else "ON_DEMAND"
        files[f"anyscale/{filename}"] = dump(
            {
                # CPU 0: tasks never run on the head, as in cluster.yaml; it runs the drivers.
                "head_node": {
                    "instance_type": nodes["head"]["node_config"]["InstanceType"],
                    "resources": {"CPU": 0},
                },
                "worker_nodes": [
                    {
                        "name": group,
                        "instance_type": nodes[f"{group}_worker"]["node_config"]["InstanceType"],
                        "min_nodes": 0,
                        "max_nodes": nodes[f"{group}_worker"]["max_workers"],
                        "market_type": market,
                    }
                    for group in ("cpu", "gpu")
                ],
            }
        )
    image = f"anyscale/ray:{ray}-{PYTHON_TAG}"

    def job(name: str, step: str, entrypoint: str) -> dict:
        return {
            "name": name,
            "entrypoint": entrypoint.replace(_ARTIFACTS_STAND_IN, ARTIFACTS),
            "image_uri": image,
            "requirements": "platforms/anyscale/requirements.txt",
            "compute_config": "ray-cv-spot" if step in SPOT_STEPS else "ray-cv",
            "working_dir": runtime_env["working_dir"],
            "excludes": runtime_env["excludes"],
            "env_vars": runtime_env["env_vars"],
            "max_retries": MAX_RETRIES,
            "timeout_s": TIMEOUT_S[step],
        }

    for profile, root in ANYSCALE_ROOTS.items():
        prefix = f"{profile}-" if profile else ""
        commands = entrypoints(root, profile)
        for step, command in commands.items():
            files[f"anyscale/jobs/{prefix}{step}.yaml"] = dump(
                job(f"ray-cv-{prefix}{step}", step, command)
            )
        files[f"anyscale/{prefix}schedule.yaml"] = dump(
            {
                "cron_expression": SCHEDULE,
                "timezone": "UTC",
                "job_config": job(f"ray-cv-{prefix}chain", "chain", chain(commands)),
            }
        )
    serve = serve_config(f"{ARTIFACTS}/ray-cv")
    files["anyscale/service.yaml"] = dump(
        {
            "name": SERVICE,
            "image_uri": image,
            "requirements": "platforms/anyscale/requirements.txt",
            "compute_config": "ray-cv",
            "working_dir": runtime_env["working_dir"],
            "excludes": runtime_env["excludes"],
            "env_vars": runtime_env["env_vars"],
            **serve,
        }
    )
    return files


def serve_config(root: str) -> dict:
    """configs/serve.yaml's applications, with the model of the train config's run under
    `root`, and its request timeout. Its loopback host and port stay behind: the platform puts
    the proxy where its load balancer (Anyscale) or Service (KubeRay) reaches it."""
    serve = yaml.safe_load((BUNDLE_ROOT / "configs" / "serve.yaml").read_text())
    (app,) = serve["applications"]
    name = yaml.safe_load((BUNDLE_ROOT / "configs" / "train.yaml").read_text())["name"]
    app["args"]["model"] = f"{root}/runs/{name}"
    timeout = serve["http_options"]["request_timeout_s"]
    return {"applications": serve["applications"], "http_options": {"request_timeout_s": timeout}}


# KubeRay --------------------------------------------------------------------------------------

WORKDIR = "/home/ray/ray-cv"


def pod(name: str, image: str, cpus: int, gpus: int = 0) -> dict:
    """A Ray container's pod template; its requests are the node type's of cluster.yaml."""
    resources = {"cpu": str(cpus), "memory": f"{4 * cpus}Gi"}
    if gpus:
        resources["nvidia.com/gpu"] = str(gpus)
    spec: dict = {
        # The S3 credentials: a service account your cluster maps to an IAM role (docs).
        "serviceAccountName": "ray-cv",
        "containers": [
            {
                "name": name,
                "image": image,
                "resources": {"requests": resources, "limits": resources},
            }
        ],
    }
    if gpus:
        spec["tolerations"] = [
            {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
        ]
    return {"spec": spec}


def ray_cluster(image: str, lock: str, nodes: dict) -> dict:
    head_cpus = 4  # cluster.yaml's head, an m5.xlarge: room for the jobs' drivers
    groups = []
    for group in ("cpu", "gpu"):
        node = nodes[f"{group}_worker"]
        groups.append(
            {
                "groupName": group,
                "replicas": 0,
                "minReplicas": 0,
                "maxReplicas": node["max_workers"],
                "rayStartParams": {},
                "template": pod(
                    "ray-worker", image, node["resources"]["CPU"], node["resources"].get("GPU", 0)
                ),
            }
        )
    return {
        "rayVersion": ray_version(lock),
        # RAY_AUTH_MODE=token and the token (a Secret the operator makes) in every Ray
        # container and the submitter, as `ray up` gives every node cluster.yaml's token.
        "authOptions": {"mode": "token"},
        "enableInTreeAutoscaling": True,
        "autoscalerOptions": {"idleTimeoutSeconds": 60},
        "headGroupSpec": {
            # num-cpus 0: no task runs on the head, as in cluster.yaml.
            "rayStartParams": {"num-cpus": "0"},
            "template": pod("ray-head", image, head_cpus),
        },
        "workerGroupSpecs": groups,
    }


def rayjob_spec(entrypoint: str, runtime_env: dict, cluster: dict, step: str) -> dict:
    return {
        "entrypoint": entrypoint,
        # Uploaded by the submitter pod from the image's copy of the bundle (its WORKDIR), as
        # `ray job submit --runtime-env runtime_env.yaml` does from a laptop.
        "runtimeEnvYAML": to_yaml(runtime_env),
        "submissionMode": "K8sJobMode",
        "shutdownAfterJobFinishes": True,
        "ttlSecondsAfterFinished": 3600,
        # A retry is a new cluster and the same command: the step resumes (jobs.submit's doc).
        "backoffLimit": MAX_RETRIES,
        "activeDeadlineSeconds": TIMEOUT_S[step],
        "rayClusterSpec": cluster,
    }


def kuberay_files(runtime_env: dict, lock: str, nodes: dict, s3_root: str, image: str):
    ray = ray_version(lock)
    cluster = ray_cluster(image, lock, nodes)
    labels = {"app.kubernetes.io/part-of": "ray-cv"}
    files = {}
    commands = entrypoints(s3_root)
    for step, command in commands.items():
        files[f"kuberay/rayjob-{step}.yaml"] = dump(
            {
                "apiVersion": "ray.io/v1",
                "kind": "RayJob",
                "metadata": {"name": f"ray-cv-{step}", "labels": labels},
                "spec": rayjob_spec(command, runtime_env, cluster, step),
            }
        )
    files["kuberay/raycronjob.yaml"] = dump(
        {
            "apiVersion": "ray.io/v1",
            "kind": "RayCronJob",
            "metadata": {"name": "ray-cv-chain", "labels": labels},
            "spec": {
                "schedule": SCHEDULE,
                "timeZone": "Etc/UTC",
                # KubeRay's submitter pastes the entrypoint into a bash line of its own
                # (`ray job submit ... -- <entrypoint> ; ...`): a bare && would run the later
                # steps in the submitter pod. In one word, `ray job submit` passes it on whole.
                "jobTemplate": rayjob_spec(
                    shlex.join(["bash", "-c", chain(commands)]), runtime_env, cluster, "chain"
                ),
            },
        }
    )
    serve = serve_config(s3_root)
    (app,) = serve["applications"]
    # The Serve app imports pipeline/ from the image (PYTHONPATH): a RayService uploads nothing.
    app["runtime_env"] = {"env_vars": runtime_env["env_vars"]}
    files["kuberay/rayservice.yaml"] = dump(
        {
            "apiVersion": "ray.io/v1",
            "kind": "RayService",
            "metadata": {"name": SERVICE, "labels": labels},
            "spec": {
                "serveConfigV2": to_yaml(serve),
                "rayClusterConfig": cluster,
            },
        }
    )
    digest = hashlib.sha256(lock.encode()).hexdigest()
    files["kuberay/Dockerfile"] = HEADER + (
        f"# The image of every Ray pod: Ray {ray} and the lock's exact versions, and the\n"
        "# bundle's code, which a RayJob's submitter uploads as the job's working dir and a\n"
        "# RayService imports. From the bundle root:\n"
        "#   docker build -f platforms/kuberay/Dockerfile -t REPO/ray-cv:TAG . && docker push ...\n"
        f"FROM rayproject/ray:{ray}-{PYTHON_TAG}\n"
        f"LABEL ray-cv.cluster-lock-sha256={digest}\n"
        "COPY requirements/cluster.lock /tmp/cluster.lock\n"
        "RUN pip install --no-cache-dir --require-hashes -r /tmp/cluster.lock\n"
        f"WORKDIR {WORKDIR}\n"
        "COPY runtime_env.yaml pyproject.toml ./\n"
        "COPY configs/ configs/\n"
        "COPY jobs/ jobs/\n"
        "COPY pipeline/ pipeline/\n"
        f"ENV PYTHONPATH={WORKDIR}\n"
    )
    return files


def generate(*, s3_root: str = S3_ROOT, image: str = "") -> dict[str, str]:
    """{path under platforms/: its text}."""
    runtime_env = yaml.safe_load((BUNDLE_ROOT / "runtime_env.yaml").read_text())
    lock = LOCK.read_text()
    nodes = yaml.safe_load((BUNDLE_ROOT / "cluster.yaml").read_text())["available_node_types"]
    image = image or f"REGISTRY/ray-cv:{ray_version(lock)}"
    assert set(TIMEOUT_S) == {*CONFIGS, "chain"}
    return {
        **anyscale_files(runtime_env, lock, nodes),
        **kuberay_files(runtime_env, lock, nodes, s3_root, image),
    }


def write(out: Path, files: dict[str, str]) -> None:
    for path, text in files.items():
        (out / path).parent.mkdir(parents=True, exist_ok=True)
        (out / path).write_text(text)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=OUT, help="default: platforms/")
    parser.add_argument("--s3-root", default=S3_ROOT, help=f"KubeRay's storage (default {S3_ROOT})")
    parser.add_argument(
        "--image", default="", help="KubeRay's image (default REGISTRY/ray-cv:<ray>)"
    )
    args = parser.parse_args(argv)
    files = generate(s3_root=args.s3_root, image=args.image)
    write(args.out, files)
    print(f"{len(files)} files under {args.out}")


if __name__ == "__main__":
    main()
