"""The Anyscale and KubeRay files under platforms/, checked by what can check them here: they are
what `make platforms` writes now; their entrypoints load with the jobs' own config loading;
the KubeRay manifests validate against the pinned CRDs (OpenAPI schema, unknown fields, CEL
rules); the Anyscale files load with the `anyscale` package's own models (its own venv)."""

from __future__ import annotations

import copy
import hashlib
import os
import re
import shlex
from pathlib import Path

import celpy
import jsonschema
import pytest
import yaml

from jobs.cli import job_config, job_parser
from jobs.submit import BUNDLE_ROOT, CONFIGS
from pipeline.core.config import validate_config
from pipeline.core.errors import ConfigError
from pipeline.serve.config import ServeConfig
from scripts.platforms import OUT, main

CRDS = OUT / "kuberay" / "crds"
KINDS = {"RayJob": "rayjobs", "RayService": "rayservices", "RayCronJob": "raycronjobs"}
ARTIFACTS = "s3://anyscale-artifacts/org_1/cld_1/artifact_storage"  # as Anyscale sets it


def platform_files() -> list[Path]:
    """Every committed file under platforms/ but the vendored CRDs."""
    return sorted(p for p in OUT.rglob("*") if p.is_file() and CRDS not in p.parents)


def load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def manifests() -> list[Path]:
    return sorted((OUT / "kuberay").glob("*.yaml"))


def anyscale_jobs() -> list[tuple[Path, dict]]:
    """(file, job config) of every Anyscale job file and schedule."""
    found = [(p, load(p)) for p in sorted((OUT / "anyscale" / "jobs").glob("*.yaml"))]
    return found + [(p, load(p)["job_config"]) for p in (OUT / "anyscale").glob("*schedule.yaml")]


# One source of truth ----------------------------------------------------------------------------


def test_committed_files_are_what_make_platforms_writes(tmp_path):
    main(["--out", str(tmp_path)])
    written = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    assert written == [p.relative_to(OUT) for p in platform_files()], (
        "platforms/ holds other files than `make platforms` writes: run it, commit the result"
    )
    for path in written:
        assert (OUT / path).read_text() == (tmp_path / path).read_text(), (
            f"platforms/{path} is not what `make platforms` writes from runtime_env.yaml, "
            "requirements/cluster.lock, configs/ and cluster.yaml now: run it, commit the result"
        )


def test_the_files_carry_runtime_env_and_the_lock():
    runtime_env = load(BUNDLE_ROOT / "runtime_env.yaml")
    for path, job in anyscale_jobs():
        assert {k: job[k] for k in runtime_env} == runtime_env, path
    for path in manifests():
        spec = load(path)["spec"]
        spec = spec.get("jobTemplate", spec)
        if "runtimeEnvYAML" in spec:
            assert yaml.safe_load(spec["runtimeEnvYAML"]) == runtime_env, path
    lock = (BUNDLE_ROOT / "requirements" / "cluster.lock").read_text()
    (ray,) = [line.split("==")[1].split()[0] for line in lock.splitlines() if line[:5] == "ray=="]
    assert f"FROM rayproject/ray:{ray}-" in (OUT / "kuberay" / "Dockerfile").read_text()
    pins = (OUT / "anyscale" / "requirements.txt").read_text()
    assert f"\nray=={ray}\n" in pins and "--hash" not in pins


# Entrypoints and the jobs' own config loading ---------------------------------------------------


def shell_words(line: str) -> list[str]:
    """The words a shell makes of `line`, its operators (&&, ;, |, ...) words of their own."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    return list(lexer)


def is_operator(word: str) -> bool:
    return bool(word) and set(word) <= set("();<>|&")


def check_entrypoint(entrypoint: str, *, pasted: bool = False) -> list[str]:
    """Load each command's config as its job would (its argument parser, then its files and
    overrides, from the bundle root); returns the job modules. Raises as the job would fail.

    `pasted`: KubeRay's submitter pastes the entrypoint into its own bash line, `ray job submit
    ... -- <entrypoint> ; fi ; ray job logs ...`, so an operator there would be its shell's; one
    `bash -c '...'` word holds a chain."""
    words = shell_words(os.path.expandvars(entrypoint))
    assert "$" not in " ".join(words), f"an environment variable left unset: {entrypoint}"
    if pasted:
        assert not [w for w in words if is_operator(w)], f"the submitter's shell: {entrypoint}"
        if words[:2] == ["bash", "-c"] and len(words) == 3:
            words = shell_words(words[2])
    commands, steps = [[]], []
    for word in words:
        if word == "&&":
            commands.append([])
        else:
            assert not is_operator(word), f"{word} in {entrypoint}"
            commands[-1].append(word)
    for command in commands:
        assert command[:2] == ["python", "-m"] and command[2].startswith("jobs."), command
        step = command[2].removeprefix("jobs.")
        assert (BUNDLE_ROOT / "jobs" / f"{step}.py").is_file(), command
        default = f"configs/{step}.yaml"
        args = job_parser("", CONFIGS[step], default, docs_page="").parse_args(command[3:])
        assert args.config, f"no --config: the job would read its default: {command}"
        job_config(CONFIGS[step], default, args)
        steps.append(step)
    return steps


@pytest.fixture
def in_bundle(monkeypatch):
    monkeypatch.chdir(BUNDLE_ROOT)  # the jobs run from the bundle root (their working dir)
    monkeypatch.setenv("ANYSCALE_ARTIFACT_STORAGE", ARTIFACTS)


def test_every_entrypoint_loads_with_its_jobs_config(in_bundle):
    entrypoints = [(p, job["entrypoint"], False) for p, job in anyscale_jobs()]
    for path in manifests():
        spec = load(path)["spec"]
        spec = spec.get("jobTemplate", spec)
        if "entrypoint" in spec:
            entrypoints.append((path, spec["entrypoint"], True))
    steps = {
        path.name: check_entrypoint(entrypoint, pasted=pasted)
        for path, entrypoint, pasted in entrypoints
    }
    assert steps["rayjob-train.yaml"] == ["train"]
    assert steps["schedule.yaml"] == steps["raycronjob.yaml"] == ["preprocess", "train", "infer"]
    assert {s for found in steps.values() for s in found} == set(CONFIGS)
    assert len(entrypoints) == 5 * 3 + 3  # 2 Anyscale profiles and KubeRay, 3 chains


def test_a_typo_in_an_entrypoint_fails_as_the_job_would(in_bundle):
    job = load(OUT / "anyscale" / "jobs" / "train.yaml")
    with pytest.raises(ConfigError, match="epochz"):
        check_entrypoint(job["entrypoint"] + " epochz=3")
    with pytest.raises(ConfigError):
        check_entrypoint(job["entrypoint"].replace("configs/train.yaml", "configs/train.yml"))
    # A chain that KubeRay's submitter would split: its later steps would run in the submitter.
    cron = load(OUT / "kuberay" / "raycronjob.yaml")["spec"]["jobTemplate"]["entrypoint"]
    with pytest.raises(AssertionError, match="the submitter's shell"):
        check_entrypoint(shlex.split(cron)[2], pasted=True)


def test_the_serve_apps_args_load_as_the_application_does(in_bundle):
    service = load(OUT / "anyscale" / "service.yaml")
    rayservice = yaml.safe_load(load(OUT / "kuberay" / "rayservice.yaml")["spec"]["serveConfigV2"])
    for app in service["applications"] + rayservice["applications"]:
        assert app["import_path"] == "pipeline.serve.app:build_app"
        cfg = validate_config(ServeConfig, app["args"])
        assert cfg.model.endswith("/ray-cv/runs/resnet18-food101-lite")
    assert service["applications"][0]["args"]["model"].startswith("$ANYSCALE_ARTIFACT_STORAGE/")
    assert cfg.model.startswith("s3://BUCKET/")


def test_the_serve_model_names_environment_variables(monkeypatch):
    monkeypatch.setenv("ANYSCALE_ARTIFACT_STORAGE", ARTIFACTS)
    cfg = ServeConfig(model="${ANYSCALE_ARTIFACT_STORAGE}/runs/x")
    assert cfg.model == f"{ARTIFACTS}/runs/x"
    monkeypatch.delenv("ANYSCALE_ARTIFACT_STORAGE")
    with pytest.raises(ConfigError, match="ANYSCALE_ARTIFACT_STORAGE, which is not set"):
        validate_config(ServeConfig, {"model": "$ANYSCALE_ARTIFACT_STORAGE/runs/x"})


# KubeRay: the CRDs' schemas and CEL rules -------------------------------------------------------


def crd_schema(kind: str) -> dict:
    crd = yaml.load((CRDS / f"ray.io_{KINDS[kind]}.yaml").read_text(), Loader=yaml.CSafeLoader)
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return version["schema"]["openAPIV3Schema"]


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


def cel_rules(schema: dict, value, where: str = ""):
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


def check_manifest(manifest: dict, schemas: dict) -> int:
    """Raise where the manifest breaks its CRD's schema or a CEL rule; returns the rules run."""
    assert manifest["apiVersion"] == "ray.io/v1", manifest["apiVersion"]
    schema, validator = schemas[manifest["kind"]]
    validator.validate(manifest)
    env = celpy.Environment()
    ran = 0
    for where, rule, message, value in cel_rules(schema, manifest):
        verdict = env.program(env.compile(rule)).evaluate({"self": celpy.json_to_cel(value)})
        assert bool(verdict) is True, f"{where}: {message} ({rule})"
        ran += 1
    return ran


@pytest.fixture(scope="module")
def schemas():
    """{kind: (its CRD's schema, a validator of the schema closed to unknown fields)}."""
    found = {kind: crd_schema(kind) for kind in KINDS}
    return {k: (s, jsonschema.Draft4Validator(closed(s))) for k, s in found.items()}


def test_manifests_validate_against_the_pinned_kuberay_crds(schemas):
    kinds, rules = {}, 0
    for path in manifests():
        manifest = load(path)
        kinds[path.name] = manifest["kind"]
        rules += check_manifest(manifest, schemas)
    # The CEL rules of these CRDs guard fields the manifests leave out (deletionStrategy,
    # managedBy), so none applies here; the next test shows each one refusing.
    assert rules == 0
    assert sorted(set(kinds.values())) == sorted(KINDS)
    assert sum(k == "RayJob" for k in kinds.values()) == len(CONFIGS)


def test_the_crd_check_refuses_unknown_fields_and_broken_rules(schemas):
    job = load(OUT / "kuberay" / "rayjob-train.yaml")
    check_manifest(job, schemas)
    bad = copy.deepcopy(job)
    bad["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["maxReplica"] = 4  # misspelt
    with pytest.raises(jsonschema.ValidationError, match="maxReplica"):
        check_manifest(bad, schemas)
    bad = copy.deepcopy(job)
    bad["spec"]["backoffLimit"] = "2"
    with pytest.raises(jsonschema.ValidationError):
        check_manifest(bad, schemas)
    # Schema-valid, but the CRD's CEL rule wants onSuccess and onFailure together.
    bad = copy.deepcopy(job)
    bad["spec"]["deletionStrategy"] = {"onSuccess": {"policy": "DeleteCluster"}}
    with pytest.raises(AssertionError, match="BOTH onSuccess and onFailure"):
        check_manifest(bad, schemas)
    bad = copy.deepcopy(job)
    bad["spec"]["managedBy"] = "someone-else"
    with pytest.raises(AssertionError, match="managedBy"):
        check_manifest(bad, schemas)


# The operator's own checks, in Go and no part of the CRDs (ray-operator/controllers/ray/utils/
# validation.go and constant.go at v1.7.0), that these manifests could break.
MAX_NAME = {"RayJob": 47, "RayService": 47, "RayCronJob": 36}
TOKEN_AUTH_RAY = (2, 52, 0)


def test_manifests_pass_the_operators_own_checks():
    for path in manifests():
        manifest = load(path)
        name, kind = manifest["metadata"]["name"], manifest["kind"]
        assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name), f"{path.name}: not DNS-1035"
        assert len(name) <= MAX_NAME[kind], f"{path.name}: name longer than {MAX_NAME[kind]}"
        spec = manifest["spec"].get("jobTemplate", manifest["spec"])
        cluster = spec.get("rayClusterSpec") or spec["rayClusterConfig"]
        if cluster.get("authOptions", {}).get("mode") == "token":
            version = tuple(int(part) for part in cluster["rayVersion"].split("."))
            assert version >= TOKEN_AUTH_RAY, f"{path.name}: token auth needs Ray 2.52+"
        for group in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]:
            params = group.get("rayStartParams", {})
            in_params = any(params.get(k) for k in ("num-cpus", "num-gpus", "memory", "resources"))
            assert not (in_params and group.get("resources")), f"{path.name}: resources twice"
        if "backoffLimit" in spec:
            assert spec["backoffLimit"] > 0 and spec["activeDeadlineSeconds"] > 0, path.name


def test_vendored_crds_are_the_pinned_release():
    readme = (CRDS / "README.md").read_text()
    for plural in KINDS.values():
        path = CRDS / f"ray.io_{plural}.yaml"
        data = path.read_bytes()
        blob = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()  # git's object id
        assert f"`{blob}`" in readme, f"{path.name}: not the blob README.md names"


# Anyscale: its own models -----------------------------------------------------------------------


@pytest.mark.slow
def test_anyscale_files_load_with_the_anyscale_packages_models(tmp_path):
    from harness.anyscale_venv import load as load_with_anyscale

    models = {}
    for path in platform_files():
        rel = str(path.relative_to(BUNDLE_ROOT))
        if path.parent.name == "jobs":
            models[rel] = "JobConfig"
        elif path.name.startswith("compute"):
            models[rel] = "ComputeConfig"
        elif path.name == "service.yaml" and path.parent.name == "anyscale":
            models[rel] = "ServiceConfig"
        elif path.name.endswith("schedule.yaml"):
            models[rel] = "ScheduleConfig"
    # One wrong on purpose: the check must be able to fail.
    broken = tmp_path / "compute.yaml"
    broken.write_text(
        (OUT / "anyscale" / "compute-spot.yaml").read_text().replace("PREFER_SPOT", "CHEAP")
    )
    results = load_with_anyscale({**models, str(broken): "ComputeConfig"})
    assert "CHEAP" in results.pop(str(broken))
    assert results == dict.fromkeys(models, "ok")
    assert len(models) == 10 + 2 + 2 + 1  # jobs of 2 profiles, compute, schedules, service
    compute = {f"ray-cv{'-spot' if 'spot' in p else ''}" for p in models if "compute" in p}
    for path, job in anyscale_jobs():
        assert job["compute_config"] in compute, path
