"""The team's values: everything a platform team sets for its clusters, in one YAML file
(platforms/values.yaml is the documented example). Loaded like the jobs' configs: unknown keys
and wrong types fail with the key's name, `key=value` overrides on top."""

from __future__ import annotations

import re
import zoneinfo
from pathlib import Path, PurePosixPath
from typing import Annotated, Literal

from pydantic import AfterValidator, Field, model_validator

from pipeline.core.config import Strict, load_config

# The storage schemes the jobs are tested on (docs/storage.md): a platform's pods come and go,
# so a run's storage is a bucket every node reaches, never a node's disk.
STORAGE_SCHEMES = ("s3", "gs", "abfss")
# A Kubernetes object's name and a label value: DNS-1123 labels.
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")


def _storage(uri: str) -> str:
    scheme = uri.partition("://")[0] if "://" in uri else ""
    if scheme not in STORAGE_SCHEMES:
        offered = ", ".join(f"{s}://" for s in STORAGE_SCHEMES)
        raise ValueError(
            f"{uri!r} is not a bucket URI: the jobs' storage is one of {offered} (every node "
            "reaches it and it outlives the cluster; docs/storage.md)"
        )
    return uri.rstrip("/")


def _dns_label(name: str) -> str:
    if not (_DNS_LABEL.fullmatch(name) and len(name) <= 63):
        raise ValueError(
            f"{name!r} is not a Kubernetes name: lower-case letters, digits and '-', "
            "starting and ending with a letter or digit, at most 63 characters"
        )
    return name


def _bundle_path(path: str) -> str:
    if path and (PurePosixPath(path).is_absolute() or ".." in PurePosixPath(path).parts):
        raise ValueError(
            f"{path!r}: give a path below the bundle root (the image copies it from there, and "
            "the job's runtime env names it relative to the bundle)"
        )
    return path


# Anyscale's storage of the cloud the job runs in, which Anyscale sets on every node.
ARTIFACTS = "$ANYSCALE_ARTIFACT_STORAGE"


def _anyscale_storage(uri: str) -> str:
    return uri.rstrip("/") if uri.startswith(ARTIFACTS) else _storage(uri)


def _cron(schedule: str) -> str:
    if len(schedule.split()) != 5:
        raise ValueError(f"{schedule!r} is not a cron schedule: five fields, e.g. '0 2 * * *'")
    return schedule


def _timezone(name: str) -> str:
    if name not in zoneinfo.available_timezones():
        raise ValueError(f"{name!r} is not an IANA time zone, e.g. UTC or Europe/Berlin")
    return name


Storage = Annotated[str, AfterValidator(_storage)]
Name = Annotated[str, AfterValidator(_dns_label)]


# An image reference as container runtimes parse it (the distribution project's grammar).
_REFERENCE = re.compile(
    r"[A-Za-z0-9.-]+(:[0-9]+)?(/[a-z0-9]+([._-]+[a-z0-9]+)*)+(:[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?"
)


class Image(Strict):
    registry: str = Field(
        "REGISTRY", description="Where the team's images are pushed, e.g. 1234.dkr.ecr..."
    )
    repository: str = Field("ray-cv", description="The images' repository in the registry.")
    tag: str = Field("", description="The images' tag; empty: the lock's Ray version.")
    pull_secrets: tuple[str, ...] = Field(
        (),
        description="KubeRay: the Secrets (docker-registry) the pods pull with. Anyscale: the "
        "first is the job's registry_login_secret (a secret of the cloud's secret manager).",
    )

    @model_validator(mode="after")
    def _a_reference(self) -> Image:
        reference = f"{self.registry}/{self.repository}" + (f":{self.tag}" if self.tag else "")
        if not _REFERENCE.fullmatch(reference):
            raise ValueError(
                f"{reference!r} is no image reference: registry host[:port][/path], a "
                "lower-case repository, a tag of letters, digits, '_', '.' and '-'"
            )
        return self


class Toleration(Strict):
    key: str = Field(description="The taint's key, e.g. nvidia.com/gpu.")
    value: str | None = Field(None, description="The taint's value; null: any (Exists).")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] = Field(
        "NoSchedule", description="The taint's effect."
    )


class InstanceTypes(Strict):
    aws: str = Field("", description="An EC2 instance type; empty: no AWS compute config.")
    gcp: str = Field("", description="A GCE machine type; empty: no GCP compute config.")


class Node(Strict):
    cpus: int = Field(gt=0, description="CPUs a pod requests (and Ray offers) per node.")
    memory_gi: int = Field(gt=0, description="Memory per node, GiB; /dev/shm is half of it.")
    instance_types: InstanceTypes = InstanceTypes()
    node_selector: dict[str, str] = Field({}, description="This group's nodeSelector (KubeRay).")
    tolerations: tuple[Toleration, ...] = Field(
        (), description="Taints of this group's nodes its pods tolerate (the GPU taint)."
    )


class Head(Node):
    cpus: int = Field(4, gt=0, description="CPUs of the head, which runs the drivers.")
    memory_gi: int = Field(16, gt=0, description="Memory of the head, GiB.")


class WorkerGroup(Node):
    name: Name = Field(description="The group's name.")
    gpus: int = Field(0, ge=0, description="GPUs per node: a CUDA image and nvidia.com/gpu.")
    min_nodes: int = Field(0, ge=0, description="Nodes kept up while a cluster lives.")
    max_nodes: int = Field(gt=0, description="The autoscaler's upper bound.")


class Jobs(Strict):
    profile: Literal["", "demo"] = Field(
        "", description="configs/<profile>-<job>.yaml; empty: configs/<job>.yaml."
    )
    set: tuple[str, ...] = Field(
        (), description="step.key=value overrides of the configs, e.g. train.epochs=20."
    )
    recipe: str = Field("", description="configs/recipes/<name>.yaml over the train config.")
    check: bool = Field(True, description="The chain runs the cluster check first.")
    schedule: Annotated[str, AfterValidator(_cron)] = Field(
        "0 2 * * *", description="The chain's cron schedule (five fields)."
    )
    timezone: Annotated[str, AfterValidator(_timezone)] = Field(
        "UTC", description="The schedule's time zone (an IANA name)."
    )


class Package(Strict):
    path: Annotated[str, AfterValidator(_bundle_path)] = Field(
        "",
        description="The team's own package: a folder (a Python package) or a .whl below the "
        "bundle root, shipped with every job as py_modules; empty: none.",
    )

    module: str = Field(
        "",
        description="Its import name; empty: the folder's name, or the wheel's distribution "
        "name with '-' as '_'.",
    )

    @property
    def import_name(self) -> str:
        if self.module:
            return self.module
        name = PurePosixPath(self.path).name
        return name.split("-")[0].replace(".", "_") if name.endswith(".whl") else name


class Kubernetes(Strict):
    namespace: Name = Field("ray-cv", description="The namespace of every object.")
    service_account: Name = Field(
        "ray-cv", description="The Ray pods' service account: the one storage trusts."
    )
    node_selector: dict[str, str] = Field({}, description="Every Ray pod's nodeSelector.")
    tolerations: tuple[Toleration, ...] = Field((), description="Every Ray pod's tolerations.")
    priority_class: str = Field("", description="The pods' priorityClassName; empty: none.")
    pod_labels: dict[str, str] = Field(
        {}, description="Labels of every Ray pod, e.g. azure.workload.identity/use: 'true'."
    )
    env: dict[str, str] = Field({}, description="Environment of every Ray container.")
    monitor_labels: dict[str, str] = Field(
        {},
        description="Labels of the PodMonitor: those your Prometheus picks monitors by, e.g. "
        "release: <its Helm release> for kube-prometheus-stack.",
    )
    keep_failed_hours: int = Field(
        24, ge=0, description="How long a failed job's cluster (its head: logs, dashboard) stays."
    )
    keep_jobs_days: int = Field(
        7,
        ge=1,
        description="How long a finished or failed RayJob (its status, its submitter's log) "
        "stays before it deletes itself.",
    )
    ray_cron_job: bool = Field(
        False,
        description="Also write raycronjob.yaml (KubeRay's RayCronJob: alpha, its feature "
        "gate off by default).",
    )
    kubectl_image: str = Field(
        "registry.k8s.io/kubectl:v1.32.4",
        description="The CronJob's image that creates the chain's RayJob.",
    )

    @model_validator(mode="after")
    def _jobs_outlive_their_clusters(self) -> Kubernetes:
        if self.keep_jobs_days * 24 < self.keep_failed_hours:
            raise ValueError(
                "kubernetes.keep_jobs_days: a RayJob goes after its cluster (KubeRay's rule), so "
                f"keep it at least keep_failed_hours ({self.keep_failed_hours} h)"
            )
        return self


class Anyscale(Strict):
    cloud: str = Field("", description="The Anyscale cloud; empty: the organization's default.")
    storage: Annotated[str, AfterValidator(_anyscale_storage)] = Field(
        f"{ARTIFACTS}/ray-cv",
        description="The jobs' storage on Anyscale: below the cloud's artifact storage, or a URI.",
    )


class Values(Strict):
    name: Name = Field("ray-cv", description="Prefix of every job, service and config name.")
    storage: Storage = Field(description="The jobs' storage root on Kubernetes: s3, gs or abfss.")
    image: Image = Image()
    head: Head = Head()
    worker_groups: tuple[WorkerGroup, ...] = Field(min_length=1)
    jobs: Jobs = Jobs()
    package: Package = Package()
    kubernetes: Kubernetes = Kubernetes()
    anyscale: Anyscale = Anyscale()

    @model_validator(mode="after")
    def _one_name_per_group(self) -> Values:
        names = [g.name for g in self.worker_groups]
        if len(set(names)) < len(names):
            raise ValueError(f"worker_groups: each group needs a name of its own (got {names})")
        return self

    @property
    def gpus(self) -> bool:
        return any(g.gpus for g in self.worker_groups)


def load_values(path: str | Path, overrides: list[str] = ()) -> Values:
    return load_config(Values, path, overrides)
