"""The KubeRay files: a RayJob per job, the chain on a schedule (a CronJob that creates a RayJob,
which needs no feature gate, and the RayCronJob where its gate is on), a RayService, all in the
team's namespace, on its nodes, with its image."""

from __future__ import annotations

import shlex

from scripts.platforms.common import (
    MAX_RETRIES,
    SERVE,
    chain,
    dump,
    entrypoints,
    image,
    runtime_env,
    serve_config,
    timeout_s,
    to_yaml,
)
from scripts.platforms.values import Node, Toleration, Values

WORKDIR = "/home/ray/ray-cv"  # the bundle in the image (platforms/Dockerfile)
LABELS = {"app.kubernetes.io/part-of": "ray-cv"}
# Where each Ray node's metrics agent exports Ray's metrics and the jobs' (docs/metrics.md):
# KubeRay's default port, named `metrics`, written out for the PodMonitor that scrapes it.
METRICS_PORT = 8080
SHM_SHARE = 2  # /dev/shm is 1/SHM_SHARE of a pod's memory: the object store and loader batches


def toleration(t: Toleration) -> dict:
    found = {"key": t.key, "operator": "Equal" if t.value is not None else "Exists"}
    return found | ({"value": t.value} if t.value is not None else {}) | {"effect": t.effect}


def placement(values: Values, node: Node | None = None) -> dict:
    """The team's pod spec fields: identity, priority, pull secrets, nodes and taints, and a
    Ray node's own selector and taints over them."""
    k8s = values.kubernetes
    spec: dict = {"serviceAccountName": k8s.service_account}
    if k8s.priority_class:
        spec["priorityClassName"] = k8s.priority_class
    if values.image.pull_secrets:
        spec["imagePullSecrets"] = [{"name": s} for s in values.image.pull_secrets]
    own = (node.node_selector, node.tolerations) if node else ({}, ())
    if selector := k8s.node_selector | own[0]:
        spec["nodeSelector"] = selector
    if tolerations := [toleration(t) for t in (*k8s.tolerations, *own[1])]:
        spec["tolerations"] = tolerations
    return spec


def metadata(values: Values) -> dict:
    """The pods' labels: the team's, and ours, which the PodMonitor selects Ray pods by."""
    return {"metadata": {"labels": values.kubernetes.pod_labels | LABELS}}


def env(values: Values) -> dict:
    found = values.kubernetes.env
    return {"env": [{"name": k, "value": v} for k, v in found.items()]} if found else {}


def pod(values: Values, lock: str, node: Node, container: str, gpus: int = 0) -> dict:
    """A Ray pod's template: the node's requests as limits too (Guaranteed QoS: the kubelet
    evicts such a pod last), a memory-backed /dev/shm, and the team's placement and pull rules."""
    resources = {"cpu": str(node.cpus), "memory": f"{node.memory_gi}Gi"}
    if gpus:
        resources["nvidia.com/gpu"] = str(gpus)
    spec = placement(values, node)
    spec["containers"] = [
        {
            "name": container,
            "image": image(values, lock, "gpu" if gpus else ""),
            "resources": {"requests": resources, "limits": resources},
            "ports": [{"name": "metrics", "containerPort": METRICS_PORT}],
            **env(values),
            # Docker's 64 MiB /dev/shm would fail the loader's worker processes and push the
            # object store to disk at real image sizes.
            "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}],
        }
    ]
    shm = f"{node.memory_gi * 1024 // SHM_SHARE}Mi"
    spec["volumes"] = [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": shm}}]
    return {**metadata(values), "spec": spec}


def submitter(values: Values, lock: str) -> dict:
    """The pod that runs `ray job submit` from the image: placed and pulled as the Ray pods
    are; the operator gives it its command, the token and the dashboard's address."""
    spec = placement(values)
    spec["restartPolicy"] = "Never"
    resources = {"requests": {"cpu": "500m", "memory": "512Mi"}, "limits": {"memory": "1Gi"}}
    spec["containers"] = [
        {"name": "ray-job-submitter", "image": image(values, lock), "resources": resources}
    ]
    return {**metadata(values), "spec": spec}


def ray_cluster(values: Values, lock: str, ray: str) -> dict:
    groups = [
        {
            "groupName": g.name,
            "replicas": g.min_nodes,
            "minReplicas": g.min_nodes,
            "maxReplicas": g.max_nodes,
            "rayStartParams": {"metrics-export-port": str(METRICS_PORT)},
            "template": pod(values, lock, g, "ray-worker", g.gpus),
        }
        for g in values.worker_groups
    ]
    return {
        "rayVersion": ray,
        # RAY_AUTH_MODE=token and the token (a Secret the operator makes) in every Ray
        # container and the submitter, as `ray up` gives every node cluster.yaml's token.
        "authOptions": {"mode": "token"},
        "enableInTreeAutoscaling": True,
        "autoscalerOptions": {"idleTimeoutSeconds": 60},
        "headGroupSpec": {
            # num-cpus 0: no task runs on the head, which runs the drivers.
            "rayStartParams": {"num-cpus": "0", "metrics-export-port": str(METRICS_PORT)},
            "template": pod(values, lock, values.head, "ray-head"),
        },
        "workerGroupSpecs": groups,
    }


def deletion_rules(values: Values) -> dict:
    """A finished job's cluster goes at once; a failed one's stays `keep_failed_hours` (its head
    with the logs and the dashboard: the autoscaler has taken the idle workers away). The RayJob
    and its submitter Job stay `keep_jobs_days`: `kubectl logs job/<name>` has the driver's log
    after the cluster is gone, and a scheduled chain's RayJobs do not pile up."""
    keep = values.kubernetes.keep_failed_hours * 3600
    days = values.kubernetes.keep_jobs_days * 86400
    # Never submitted, or past activeDeadlineSeconds: no Ray job status to go by.
    deployment = {"jobDeploymentStatus": "Failed"}
    return {
        "deletionRules": [
            {"policy": "DeleteCluster", "condition": {"jobStatus": "SUCCEEDED", "ttlSeconds": 0}},
            {"policy": "DeleteCluster", "condition": {"jobStatus": "FAILED", "ttlSeconds": keep}},
            {"policy": "DeleteCluster", "condition": deployment | {"ttlSeconds": keep}},
            # The RayJob itself, and with it its submitter and the driver's log, days later.
            {"policy": "DeleteSelf", "condition": {"jobStatus": "SUCCEEDED", "ttlSeconds": days}},
            {"policy": "DeleteSelf", "condition": {"jobStatus": "FAILED", "ttlSeconds": days}},
            {"policy": "DeleteSelf", "condition": deployment | {"ttlSeconds": days}},
        ]
    }


def rayjob_spec(values: Values, lock: str, entrypoint: str, cluster: dict, step: str) -> dict:
    return {
        "entrypoint": entrypoint,
        # Uploaded by the submitter pod from the image's copy of the bundle (its WORKDIR), as
        # `ray job submit --runtime-env runtime_env.yaml` does from a laptop.
        "runtimeEnvYAML": to_yaml(runtime_env(values)),
        "submissionMode": "K8sJobMode",
        "submitterPodTemplate": submitter(values, lock),
        # Deletion by the rules below, which exclude shutdownAfterJobFinishes.
        "shutdownAfterJobFinishes": False,
        "deletionStrategy": deletion_rules(values),
        # A retry is a new cluster and the same command: the step resumes (jobs.submit's doc).
        "backoffLimit": MAX_RETRIES,
        "activeDeadlineSeconds": timeout_s(values, step),
        "rayClusterSpec": cluster,
    }


def rayjob(values: Values, name: str, spec: dict, *, generate: bool = False) -> dict:
    metadata = {"generateName": f"{name}-"} if generate else {"name": name}
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayJob",
        "metadata": metadata | {"namespace": values.kubernetes.namespace, "labels": LABELS},
        "spec": spec,
    }


def in_one_word(command: str) -> str:
    """KubeRay's submitter pastes the entrypoint into a bash line of its own (`ray job submit
    ... -- <entrypoint> ; ...`): a bare && would run the later steps in the submitter pod. In
    one word, `ray job submit` passes it on whole."""
    return shlex.join(["bash", "-c", command])


def schedule(values: Values, chain_job: dict) -> list[dict]:
    """The chain on a schedule with no feature gate: a CronJob whose pod creates the chain's
    RayJob (a new name each time, generateName) with kubectl, allowed to by a Role of its own."""
    ns, name = values.kubernetes.namespace, f"{values.name}-scheduler"
    meta = {"name": name, "namespace": ns, "labels": LABELS}
    pod_spec = placement(values) | {
        "serviceAccountName": name,
        "restartPolicy": "Never",
        "containers": [
            {
                "name": "create-rayjob",
                "image": values.kubernetes.kubectl_image,
                "command": ["kubectl", "create", "-f", "/etc/ray-cv/rayjob.yaml"],
                "volumeMounts": [{"name": "rayjob", "mountPath": "/etc/ray-cv"}],
            }
        ],
        "volumes": [{"name": "rayjob", "configMap": {"name": f"{values.name}-chain"}}],
    }
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": meta,
            "rules": [{"apiGroups": ["ray.io"], "resources": ["rayjobs"], "verbs": ["create"]}],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": meta,
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": ns}],
        },
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": f"{values.name}-chain", "namespace": ns, "labels": LABELS},
            "data": {"rayjob.yaml": to_yaml(chain_job)},
        },
        {
            "apiVersion": "batch/v1",
            "kind": "CronJob",
            "metadata": {"name": f"{values.name}-chain", "namespace": ns, "labels": LABELS},
            "spec": {
                "schedule": values.jobs.schedule,
                "timeZone": values.jobs.timezone,
                # A night's chain is one RayJob; its train step refuses a run another holds.
                "concurrencyPolicy": "Forbid",
                "jobTemplate": {"spec": {"backoffLimit": 2, "template": {"spec": pod_spec}}},
            },
        },
    ]


def pod_monitor(values: Values) -> dict:
    """Prometheus (prometheus-operator's) scrapes every Ray pod of these files, head and
    workers, on their metrics port: Ray's metrics and the jobs' own. `ray_io_cluster` names
    each series' cluster, as Ray's own Grafana dashboards filter by it."""
    cluster = {"sourceLabels": ["__meta_kubernetes_pod_label_ray_io_cluster"]}
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PodMonitor",
        "metadata": {
            "name": f"{values.name}-ray",
            "namespace": values.kubernetes.namespace,
            "labels": values.kubernetes.monitor_labels | LABELS,
        },
        "spec": {
            # KubeRay's label of its Ray pods (not the submitters), and ours.
            "selector": {"matchLabels": {"ray.io/is-ray-node": "yes", **LABELS}},
            "podMetricsEndpoints": [
                {
                    "port": "metrics",
                    "relabelings": [cluster | {"targetLabel": "ray_io_cluster"}],
                }
            ],
        },
    }


def files(values: Values, lock: str, ray: str) -> dict[str, str]:
    cluster = ray_cluster(values, lock, ray)
    commands = entrypoints(values, values.storage)
    found = {
        f"kuberay/rayjob-{step}.yaml": dump(
            rayjob(
                values, f"{values.name}-{step}", rayjob_spec(values, lock, command, cluster, step)
            )
        )
        for step, command in commands.items()
    }
    chain_spec = rayjob_spec(values, lock, in_one_word(chain(commands, values)), cluster, "chain")
    found["kuberay/schedule.yaml"] = dump(
        *schedule(values, rayjob(values, f"{values.name}-chain", chain_spec, generate=True))
    )
    if values.kubernetes.ray_cron_job:
        found["kuberay/raycronjob.yaml"] = dump(
            {
                "apiVersion": "ray.io/v1",
                "kind": "RayCronJob",
                "metadata": {
                    "name": f"{values.name}-chain",
                    "namespace": values.kubernetes.namespace,
                    "labels": LABELS,
                },
                "spec": {
                    "schedule": values.jobs.schedule,
                    "timeZone": values.jobs.timezone,
                    "jobTemplate": chain_spec,
                },
            }
        )
    serve = serve_config(values.storage, values)
    (app,) = serve["applications"]
    # The Serve app imports pipeline/ from the image (PYTHONPATH): a RayService uploads nothing.
    app["runtime_env"] = {"env_vars": runtime_env(values)["env_vars"]}
    found["kuberay/podmonitor.yaml"] = dump(pod_monitor(values))
    found["kuberay/rayservice.yaml"] = dump(
        {
            "apiVersion": "ray.io/v1",
            "kind": "RayService",
            "metadata": {
                "name": f"{values.name}-{SERVE}",
                "namespace": values.kubernetes.namespace,
                "labels": LABELS,
            },
            "spec": {"serveConfigV2": to_yaml(serve), "rayClusterConfig": cluster},
        }
    )
    return found
