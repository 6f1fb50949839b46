"""The KubeRay files against what the API server would check: KubeRay's CRDs and
prometheus-operator's PodMonitor (OpenAPI schemas, unknown fields refused, CEL rules; vendored in
platforms/kuberay/crds/), Kubernetes' own schemas for its built-in kinds (the
`kubernetes-validate` package), and the operator's checks that are Go code, no part of the CRDs
(ray-operator/controllers/ray/utils/validation.go at v1.7.0)."""

from __future__ import annotations

import copy
import functools
import re
from collections.abc import Iterator
from pathlib import Path

import celpy
import jsonschema
import kubernetes_validate
import yaml

from pipeline.chain.plan import BUNDLE_ROOT

CRDS = BUNDLE_ROOT / "platforms" / "kuberay" / "crds"
# {kind: its vendored CRD}
KINDS = {
    "RayJob": "ray.io_rayjobs.yaml",
    "RayService": "ray.io_rayservices.yaml",
    "RayCronJob": "ray.io_raycronjobs.yaml",
    "PodMonitor": "monitoring.coreos.com_podmonitors.yaml",
}
KUBERNETES = "1.35.0"  # the API version the built-in kinds are checked against
MAX_NAME = {"RayJob": 47, "RayService": 47, "RayCronJob": 36}  # utils/constant.go
TOKEN_AUTH_RAY = (2, 52, 0)


def crd_schema(kind: str) -> tuple[str, dict]:
    """(the apiVersion, the schema) of the kind's CRD at v1."""
    crd = yaml.load((CRDS / KINDS[kind]).read_text(), Loader=yaml.CSafeLoader)
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return f"{crd['spec']['group']}/v1", version["schema"]["openAPIV3Schema"]


def closed(schema: dict) -> dict:
    """The schema with additionalProperties false on every object that lists its properties
    and keeps no unknown fields: the API server prunes (drops) unknown fields, which jsonschema
    would let through, so a misspelt field would be lost without a word."""
    schema = copy.deepcopy(schema)

    def close(node):
        if isinstance(node, dict):
            if (
                "properties" in node
                and "additionalProperties" not in node
                and not node.get("x-kubernetes-preserve-unknown-fields")
            ):
                node["additionalProperties"] = False
            for value in node.values():
                close(value)
        elif isinstance(node, list):
            for value in node:
                close(value)

    close(schema)
    return schema


@functools.cache
def schemas() -> dict[str, tuple[str, dict, jsonschema.Draft4Validator]]:
    """{kind: (its apiVersion, its CRD's schema, a validator of the schema closed to unknown
    fields)}."""
    found = {kind: crd_schema(kind) for kind in KINDS}
    return {k: (a, s, jsonschema.Draft4Validator(closed(s))) for k, (a, s) in found.items()}


def cel_rules(schema: dict, value, where: str = "") -> Iterator[tuple[str, str, str, object]]:
    """(where, rule, message, value) for every x-kubernetes-validations rule whose field the
    value holds. Transition rules (oldSelf) apply to updates only, so not to a new object."""
    for rule in schema.get("x-kubernetes-validations", []):
        if "oldSelf" not in rule["rule"]:
            yield where, rule["rule"], rule.get("message", ""), value
    if isinstance(value, dict):
        for key, item in value.items():
            if key in schema.get("properties", {}):
                yield from cel_rules(schema["properties"][key], item, f"{where}.{key}")
            elif isinstance(schema.get("additionalProperties"), dict):
                yield from cel_rules(schema["additionalProperties"], item, f"{where}.{key}")
    elif isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            yield from cel_rules(schema["items"], item, f"{where}[{i}]")


class Refused(ValueError):
    """A manifest that its schema, a CEL rule or the operator refuses: `where` is the field's
    path in the manifest, `value` what it holds there."""

    def __init__(self, where: str, problem: str, value: object = None):
        super().__init__(f"{where}: {problem}")
        self.where, self.problem, self.value = where, problem, value


def _path(parts) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in parts)


def check_crd(manifest: dict) -> int:
    """Raise Refused where a manifest of a vendored CRD's kind breaks the CRD's schema or a CEL
    rule; returns the number of CEL rules run."""
    api_version, schema, validator = schemas()[manifest["kind"]]
    if manifest.get("apiVersion") != api_version:
        raise Refused(".apiVersion", f"not {api_version}", manifest.get("apiVersion"))
    error = jsonschema.exceptions.best_match(validator.iter_errors(manifest))
    if error is not None:
        raise Refused(_path(error.absolute_path), error.message, error.instance)
    env = celpy.Environment()
    ran = 0
    for where, rule, message, value in cel_rules(schema, manifest):
        verdict = env.program(env.compile(rule)).evaluate({"self": celpy.json_to_cel(value)})
        if bool(verdict) is not True:
            raise Refused(where, f"{message} ({rule})", value)
        ran += 1
    return ran


def check_builtin(manifest: dict) -> None:
    """Raise Refused where a built-in kind (CronJob, Role, ...) breaks Kubernetes' schema."""
    try:
        kubernetes_validate.validate(manifest, KUBERNETES, strict=True)
    except (kubernetes_validate.ValidationError, jsonschema.ValidationError) as e:
        cause = getattr(e, "caused_by", e)
        raise Refused(_path(cause.absolute_path), cause.message, cause.instance) from None


def check_operator(manifest: dict) -> None:
    """The operator's own checks that these files could break."""
    kind, name = manifest["kind"], manifest["metadata"].get("name", "")
    name = name or manifest["metadata"]["generateName"] + "x" * 5  # the suffix Kubernetes adds
    if not re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name):
        raise Refused(".metadata.name", "not a DNS-1035 label", name)
    if len(name) > MAX_NAME[kind]:
        raise Refused(".metadata.name", f"longer than {MAX_NAME[kind]} characters", name)
    spec = manifest["spec"].get("jobTemplate", manifest["spec"])
    cluster = spec.get("rayClusterSpec") or spec["rayClusterConfig"]
    if cluster.get("authOptions", {}).get("mode") == "token":
        version = tuple(int(part) for part in cluster["rayVersion"].split("."))
        if version < TOKEN_AUTH_RAY:
            raise Refused(".rayVersion", "token authentication needs Ray 2.52+", version)
    for group in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]:
        params = group.get("rayStartParams", {})
        if any(params.get(k) for k in ("num-cpus", "num-gpus", "memory", "resources")) and (
            group.get("resources")
        ):
            raise Refused(".resources", "resources both in rayStartParams and resources")
    rules = spec.get("deletionStrategy", {}).get("deletionRules", [])
    if rules and spec.get("shutdownAfterJobFinishes"):
        raise Refused(".spec.shutdownAfterJobFinishes", "excludes deletionRules", True)
    if spec.get("ttlSecondsAfterFinished", 0) > 0 and not spec.get("shutdownAfterJobFinishes"):
        raise Refused(".spec.ttlSecondsAfterFinished", "needs shutdownAfterJobFinishes", True)
    for i, rule in enumerate(rules):
        if rule["policy"] == "DeleteWorkers" and cluster.get("enableInTreeAutoscaling"):
            raise Refused(f".deletionRules[{i}]", "DeleteWorkers with autoscaling", "DeleteWorkers")
    if "backoffLimit" in spec and not (spec["backoffLimit"] > 0 < spec["activeDeadlineSeconds"]):
        raise Refused(".spec.backoffLimit", "a retry needs a deadline", spec["backoffLimit"])


def check(manifest: dict) -> int:
    """Raise Refused where the API server or the operator would refuse `manifest`."""
    if manifest["apiVersion"].startswith("ray.io/"):
        ran = check_crd(manifest)
        check_operator(manifest)
        for embedded in _embedded(manifest):
            ran += check(embedded)
        return ran
    if manifest["kind"] in KINDS:
        return check_crd(manifest)
    check_builtin(manifest)
    return sum(check(embedded) for embedded in _embedded(manifest))


def _embedded(manifest: dict) -> list[dict]:
    """The RayJob a ConfigMap holds for the CronJob to create."""
    if manifest["kind"] != "ConfigMap":
        return []
    return [yaml.safe_load(text) for text in manifest.get("data", {}).values()]


def documents(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]
