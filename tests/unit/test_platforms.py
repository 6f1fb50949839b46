"""The Anyscale and KubeRay files, rendered from a team's values, checked by what can check them
here: the committed files are the rendering of platforms/values.yaml; a team's values reach
every pod (namespace, registry, nodes, /dev/shm, GPUs); their entrypoints load with the jobs'
own config loading; the KubeRay files validate against the pinned CRDs (OpenAPI schema, unknown
fields, CEL rules), the operator's own rules and Kubernetes' schemas. The Anyscale files load
with the `anyscale` package's own models in tests/deploy/test_anyscale_models.py, and
tests/jobs/test_platform_jobs.py runs them."""

from __future__ import annotations

import copy
import hashlib
import json
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.dashboard import Dashboard
from platform_values import TEAM, files, render

from jobs.cli import job_config, job_parser
from pipeline.chain.plan import BUNDLE_ROOT, CONFIGS
from pipeline.core.config import validate_config
from pipeline.core.errors import ConfigError
from pipeline.serve.config import ServeConfig
from scripts.platforms import grafana
from scripts.platforms.__main__ import main
from scripts.platforms.render import EXAMPLE, OUT
from scripts.platforms.validate import CRDS, KINDS, Refused, check, check_crd, documents
from scripts.platforms.values import load_values

ARTIFACTS = "s3://anyscale-artifacts/org_1/cld_1/artifact_storage"  # as Anyscale sets it


def manifests(root: Path) -> list[dict]:
    """Every object of the KubeRay files, and the RayJob a ConfigMap holds for the CronJob."""
    found = [d for p in sorted((root / "kuberay").glob("*.yaml")) for d in documents(p)]
    for d in list(found):
        if d["kind"] == "ConfigMap":
            found += [yaml.safe_load(text) for text in d["data"].values()]
    return found


def clusters(root: Path) -> list[dict]:
    """The RayCluster spec of every RayJob, RayCronJob and RayService."""
    specs = [m["spec"] for m in manifests(root) if m["apiVersion"] == "ray.io/v1"]
    specs = [s.get("jobTemplate", s) for s in specs]
    return [s.get("rayClusterSpec") or s["rayClusterConfig"] for s in specs]


def anyscale_jobs(root: Path) -> list[tuple[Path, dict]]:
    """(file, job config) of every Anyscale job file and the schedule's."""
    found = [(p, load(p)) for p in sorted((root / "anyscale" / "jobs").glob("*.yaml"))]
    schedule = root / "anyscale" / "schedule.yaml"
    return [*found, (schedule, load(schedule)["job_config"])]


def load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


# One source of truth ----------------------------------------------------------------------------


def test_committed_files_are_the_rendering_of_the_example_values(tmp_path):
    assert main(["--out", str(tmp_path)]) == 0
    written = [p.relative_to(tmp_path) for p in files(tmp_path)]
    assert written == [p.relative_to(OUT) for p in files(OUT)], (
        "platforms/ holds other files than `make platforms` writes: run it, commit the result"
    )
    for path in written:
        assert (OUT / path).read_text() == (tmp_path / path).read_text(), (
            f"platforms/{path} is not what `make platforms` renders from platforms/values.yaml, "
            "runtime_env.yaml, requirements/cluster.lock and configs/ now: run it, commit it"
        )


def test_every_key_of_the_values_is_in_the_example_and_the_docs():
    from pipeline.core.config import describe_keys
    from scripts.platforms.values import Values

    example = yaml.safe_load(EXAMPLE.read_text())
    docs = (BUNDLE_ROOT / "docs" / "platforms.md").read_text()
    for key, *_ in describe_keys(Values):
        assert key.split(".")[0] in example, f"platforms/values.yaml has no {key}"
        assert f"`{key}`" in docs, f"docs/platforms.md says nothing of {key}"


# A team's values, everywhere ----------------------------------------------------------------------


def test_a_teams_values_reach_every_pod(tmp_path):
    out = render(tmp_path, TEAM)
    objects = manifests(out)
    assert {m["metadata"]["namespace"] for m in objects} == {"ml-vision"}
    ray_pods = 0
    for cluster in clusters(out):
        head = cluster["headGroupSpec"]
        for group in [head, *cluster["workerGroupSpecs"]]:
            pod = group["template"]["spec"]
            (container,) = pod["containers"]
            ray_pods += 1
            assert pod["serviceAccountName"] == "vision-runner"
            assert pod["priorityClassName"] == "batch-low"
            assert pod["imagePullSecrets"] == [{"name": "acme-registry"}]
            assert pod["nodeSelector"]["pool"] == "ml"
            assert {
                "key": "dedicated",
                "operator": "Equal",
                "value": "ml",
                "effect": "NoExecute",
            } in (pod["tolerations"])
            assert group["template"]["metadata"]["labels"] == {
                "team": "vision",
                "app.kubernetes.io/part-of": "ray-cv",
            }
            assert container["env"] == [{"name": "GOOGLE_CLOUD_PROJECT", "value": "acme"}]
            # A memory-backed /dev/shm of half the pod's memory.
            memory = int(container["resources"]["limits"]["memory"].removesuffix("Gi"))
            (shm,) = [v for v in pod["volumes"] if v["name"] == "dshm"]
            assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": f"{memory * 512}Mi"}
            assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
            gpus = container["resources"]["limits"].get("nvidia.com/gpu")
            if group is not head and group["groupName"] == "l4":
                assert gpus == "1" and container["resources"]["requests"]["nvidia.com/gpu"] == "1"
                assert (
                    container["image"] == "europe-docker.pkg.dev/acme/ml/vision-ray:2026.11.1-gpu"
                )
                assert pod["nodeSelector"]["cloud.google.com/gke-accelerator"] == "nvidia-l4"
                assert {
                    "key": "nvidia.com/gpu",
                    "operator": "Equal",
                    "value": "present",
                    "effect": "NoSchedule",
                } in (pod["tolerations"])
            else:
                assert gpus is None
                assert container["image"] == "europe-docker.pkg.dev/acme/ml/vision-ray:2026.11.1"
    # The pods that submit the jobs and the schedule's pod are placed and pulled the same way.
    submitters = [
        m["spec"].get("jobTemplate", m["spec"])["submitterPodTemplate"]["spec"]
        for m in objects
        if m["kind"] in ("RayJob", "RayCronJob")
    ]
    assert len(submitters) == len(CONFIGS) + 2
    for pod in submitters:
        assert pod["imagePullSecrets"] == [{"name": "acme-registry"}]
        assert pod["nodeSelector"] == {"pool": "ml"} and pod["priorityClassName"] == "batch-low"
        assert pod["containers"][0]["image"] == "europe-docker.pkg.dev/acme/ml/vision-ray:2026.11.1"
    (cron,) = [m for m in objects if m["kind"] == "CronJob"]
    scheduler = cron["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    assert scheduler["nodeSelector"] == {"pool": "ml"}
    assert scheduler["serviceAccountName"] == "vision-scheduler"
    # 6 RayJobs, the CronJob's RayJob, the RayCronJob, the RayService: a head and two groups.
    assert ray_pods == (len(CONFIGS) + 3) * 3
    # The storage and the team's package in every job; the package as py_modules.
    for m in objects:
        spec = m.get("spec", {})
        spec = spec.get("jobTemplate", spec)
        if "entrypoint" in spec:
            assert "gs://acme-ml/vision/" in spec["entrypoint"]
            env = yaml.safe_load(spec["runtimeEnvYAML"])
            assert env["py_modules"] == ["./examples/custom_model"]
    dockerfile = (out / "Dockerfile").read_text()
    assert "COPY examples/custom_model examples/custom_model\n" in dockerfile
    assert "-t europe-docker.pkg.dev/acme/ml/vision-ray:2026.11.1-gpu ." in dockerfile
    assert "BASE=anyscale/ray:" in dockerfile and "-cu128 -t " in dockerfile
    # Anyscale: the GCP compute configs only, the cloud, the CUDA image, the bucket.
    assert sorted(p.name for p in (out / "anyscale").glob("compute-*")) == [
        "compute-gcp-spot.yaml",
        "compute-gcp.yaml",
    ]
    assert load(out / "anyscale" / "compute-gcp.yaml")["cloud"] == "acme-gcp"
    for path, job in anyscale_jobs(out):
        assert job["image_uri"].endswith(":2026.11.1-anyscale"), path
        assert job["registry_login_secret"] == "acme-registry"
        assert job["py_modules"] == ["./examples/custom_model"]
        assert "gs://acme-ml/vision-anyscale/" in job["entrypoint"]
    service = load(out / "anyscale" / "service.yaml")
    assert service["applications"][0]["args"]["allow_modules"] == ["custom_model"]


def test_no_node_installs_packages_when_it_starts(tmp_path):
    for out in (OUT, render(tmp_path, TEAM)):
        for path, job in anyscale_jobs(out):
            assert "requirements" not in job and "containerfile" not in job, path
        assert "requirements" not in load(out / "anyscale" / "service.yaml")
        for m in manifests(out):
            spec = m.get("spec", {})
            spec = spec.get("jobTemplate", spec)
            env = yaml.safe_load(spec.get("runtimeEnvYAML", "{}"))
            assert not {"pip", "uv", "conda"} & set(env), m["metadata"]
        lock = (BUNDLE_ROOT / "requirements" / "cluster.lock").read_text()
        (ray,) = re.findall(r"^ray==([\w.]+)", lock, re.MULTILINE)
        dockerfile = (out / "Dockerfile").read_text()
        assert f"ARG BASE=rayproject/ray:{ray}-py310\n" in dockerfile
        assert (
            "RUN pip install --no-cache-dir --require-hashes -r /tmp/cluster.lock\n" in dockerfile
        )


def test_the_example_has_a_cuda_image_where_a_group_has_gpus(tmp_path):
    example = yaml.safe_load(EXAMPLE.read_text())
    for cluster in clusters(OUT):
        for group in cluster["workerGroupSpecs"]:
            (container,) = group["template"]["spec"]["containers"]
            gpus = "nvidia.com/gpu" in container["resources"]["limits"]
            assert container["image"].endswith("-gpu") == gpus
    assert "anyscale/ray:" in (OUT / "Dockerfile").read_text()
    cpu_only = example | {"worker_groups": example["worker_groups"][:1]}
    dockerfile = (render(tmp_path, cpu_only) / "Dockerfile").read_text()
    assert "-cu128" not in dockerfile and "-gpu " not in dockerfile


# Values the platform refuses fail when rendered, naming the value --------------------------------


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"storage": "/mnt/shared/ray-cv"}, "storage: '/mnt/shared/ray-cv' is not a bucket URI"),
        ({"name": "vision-team-of-the-computer-vision-group"}, "values name='vision-team-of-"),
        ({"kubernetes": {"namespace": "ML_Vision"}}, "kubernetes.namespace: 'ML_Vision'"),
        (
            {"image": {"registry": "acme registry"}},
            "image: 'acme registry/vision-ray:2026.11.1' is no image",
        ),
        ({"jobs": {"schedule": "nightly"}}, "jobs.schedule: 'nightly' is not a cron"),
        ({"jobs": {"set": ["train.epochz=3"]}}, "epochz"),
        ({"package": {"path": "teamnet"}}, "package.path: teamnet is not below the bundle root"),
        (
            {"head": {"cpus": 4, "memory_gi": 16, "instance_types": {}}},
            "values instance_types: no cloud has a machine type for every node",
        ),
        (
            {"kubernetes": {"keep_failed_hours": 200, "keep_jobs_days": 2}},
            "kubernetes.keep_jobs_days: a RayJob goes after its cluster",
        ),
    ],
)
def test_a_value_the_platform_refuses_fails_when_rendered_naming_it(
    tmp_path, change, named, capsys
):
    values = {k: copy.deepcopy(v) for k, v in TEAM.items()}
    for key, value in change.items():
        values[key] = values[key] | value if isinstance(value, dict) else value
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    assert main(["--values", str(path), "--out", str(tmp_path / "out")]) == 2
    error = capsys.readouterr().err
    assert named in error and error.count("\n") == 1, error
    assert not (tmp_path / "out").exists(), "a refused rendering wrote files"


def test_a_refused_manifest_names_the_value_it_came_from():
    values = load_values(EXAMPLE, ["kubernetes.service_account=runner"])
    manifest = yaml.safe_load((OUT / "kuberay" / "rayjob-train.yaml").read_text())
    manifest["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"][
        "serviceAccountName"
    ] = 7
    with pytest.raises(Refused, match="serviceAccountName"):
        check(manifest)
    from scripts.platforms.render import blame

    assert blame(values, Refused(".x", "too long", "ray-cv-preprocess")) == "name"
    assert blame(values, Refused(".x", "bad", "runner")) == "kubernetes.service_account"


# Entrypoints and the jobs' own config loading ---------------------------------------------------


def shell_words(line: str) -> list[str]:
    """The words a shell makes of `line`, its operators (&&, ;, |, ...) words of their own."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    return list(lexer)


def is_operator(word: str) -> bool:
    return bool(word) and set(word) <= set("();<>|&")


def expand(line: str) -> str:
    """`line` with its ${NAME:?message} and $NAME expanded from the environment, as sh does;
    KeyError for an unset one."""
    line = re.sub(r"\$\{(\w+):\?[^}]*\}", lambda m: os.environ[m[1]], line)
    return re.sub(r"\$(\w+)", lambda m: os.environ[m[1]], line)


def check_entrypoint(entrypoint: str, *, pasted: bool = False) -> list[str]:
    """Load each command's config as its job would (its argument parser, then its files and
    overrides, from the bundle root); returns the job modules. Raises as the job would fail.

    `pasted`: KubeRay's submitter pastes the entrypoint into its own bash line, `ray job submit
    ... -- <entrypoint> ; fi ; ray job logs ...`, so an operator there would be its shell's; one
    `bash -c '...'` word holds a chain."""
    words = shell_words(expand(entrypoint))
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


def entrypoints(root: Path) -> list[tuple[str, str, bool]]:
    """(where, entrypoint, pasted by KubeRay's submitter) of every job of both platforms."""
    found = [(p.name, job["entrypoint"], False) for p, job in anyscale_jobs(root)]
    for m in manifests(root):
        spec = m.get("spec", {})
        spec = spec.get("jobTemplate", spec)
        if "entrypoint" in spec:
            name = m["metadata"].get("name") or m["metadata"]["generateName"]
            found.append((f"{m['kind']} {name}", spec["entrypoint"], True))
    return found


def test_every_entrypoint_loads_with_its_jobs_config(in_bundle, tmp_path):
    for out in (OUT, render(tmp_path, TEAM)):
        steps = {
            where: check_entrypoint(line, pasted=pasted) for where, line, pasted in entrypoints(out)
        }
        chain = ["check", "preprocess", "train", "infer"]
        assert steps["schedule.yaml"] == chain
        assert steps["RayJob ray-cv-chain-" if out == OUT else "RayJob vision-chain-"] == chain
        assert {s for found in steps.values() for s in found} == set(CONFIGS)
    assert len(steps) == 2 * (len(CONFIGS) + 1) + 1  # both platforms' jobs and chains, RayCronJob


def test_a_typo_in_an_entrypoint_fails_as_the_job_would(in_bundle):
    job = load(OUT / "anyscale" / "jobs" / "train.yaml")
    with pytest.raises(ConfigError, match="epochz"):
        check_entrypoint(job["entrypoint"] + " epochz=3")
    with pytest.raises(ConfigError):
        check_entrypoint(job["entrypoint"].replace("configs/train.yaml", "configs/train.yml"))
    # A chain that KubeRay's submitter would split: its later steps would run in the submitter.
    (chain,) = [line for where, line, _ in entrypoints(OUT) if where == "RayJob ray-cv-chain-"]
    with pytest.raises(AssertionError, match="the submitter's shell"):
        check_entrypoint(shlex.split(chain)[2], pasted=True)


def test_anyscale_jobs_refuse_an_unset_artifact_storage_before_anything_runs(tmp_path):
    """The job's shell (sh, as Ray runs an entrypoint) stops at the variable: exit 2 and one
    line naming it and the value to set, before any job's code runs."""
    job = load(OUT / "anyscale" / "jobs" / "preprocess.yaml")
    line = job["entrypoint"].replace("python -m", "echo python -m", 1)
    env = {k: v for k, v in os.environ.items() if k != "ANYSCALE_ARTIFACT_STORAGE"}
    unset = subprocess.run(["sh", "-c", line], env=env, capture_output=True, text=True, check=False)
    assert unset.returncode == 2 and unset.stdout == ""
    assert (
        "ANYSCALE_ARTIFACT_STORAGE: is not set: set anyscale.storage in the values" in unset.stderr
    )
    env["ANYSCALE_ARTIFACT_STORAGE"] = ARTIFACTS
    run = subprocess.run(["sh", "-c", line], env=env, capture_output=True, text=True, check=False)
    assert run.returncode == 0 and f"output={ARTIFACTS}/ray-cv/dataset" in run.stdout
    schedule = load(OUT / "anyscale" / "schedule.yaml")["job_config"]["entrypoint"]
    assert schedule.index("${ANYSCALE_ARTIFACT_STORAGE:?") < schedule.index("&&")


def test_the_serve_apps_args_load_as_the_application_does(in_bundle):
    service = load(OUT / "anyscale" / "service.yaml")
    (rayservice,) = [m for m in manifests(OUT) if m["kind"] == "RayService"]
    served = yaml.safe_load(rayservice["spec"]["serveConfigV2"])
    for app in service["applications"] + served["applications"]:
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


# KubeRay and Kubernetes: the schemas, CEL rules and the operator's rules -------------------------


def test_every_kuberay_object_validates(tmp_path):
    for out in (OUT, render(tmp_path, TEAM)):
        kinds = [m["kind"] for m in manifests(out)]
        for m in manifests(out):
            check(m)
        assert kinds.count("RayJob") == len(CONFIGS) + 1  # and the chain's, in the ConfigMap
        assert {
            "CronJob",
            "Role",
            "RoleBinding",
            "ServiceAccount",
            "ConfigMap",
            "RayService",
            "PodMonitor",
        } <= set(kinds)
    assert "RayCronJob" in kinds and "RayCronJob" not in [m["kind"] for m in manifests(OUT)]


def test_finished_clusters_go_and_failed_ones_keep_their_head():
    for m in manifests(OUT):
        if m["kind"] not in ("RayJob", "RayCronJob"):
            continue
        spec = m["spec"].get("jobTemplate", m["spec"])
        rules = {
            (r["condition"].get("jobStatus") or r["condition"]["jobDeploymentStatus"]): r
            for r in spec["deletionStrategy"]["deletionRules"]
            if r["policy"] == "DeleteCluster"
        }
        assert rules["SUCCEEDED"] == {
            "policy": "DeleteCluster",
            "condition": {"jobStatus": "SUCCEEDED", "ttlSeconds": 0},
        }
        assert (
            rules["FAILED"]["condition"]["ttlSeconds"]
            == rules["Failed"]["condition"]["ttlSeconds"]
            == 86400
        )
        # The RayJob, with its submitter Job and the driver's log, goes a week later.
        selves = [
            r for r in spec["deletionStrategy"]["deletionRules"] if r["policy"] == "DeleteSelf"
        ]
        assert [r["condition"]["ttlSeconds"] for r in selves] == [7 * 86400] * 3
        assert spec["shutdownAfterJobFinishes"] is False


def test_the_checks_refuse_unknown_fields_broken_rules_and_the_operators_rules():
    job = load(OUT / "kuberay" / "rayjob-train.yaml")
    check(job)

    def refused(change, match):
        bad = copy.deepcopy(job)
        change(bad["spec"])
        with pytest.raises(Refused, match=match):
            check(bad)

    refused(lambda s: s["rayClusterSpec"]["workerGroupSpecs"][0].update(maxReplica=4), "maxReplica")
    refused(lambda s: s.update(backoffLimit="2"), "is not of type 'integer'")
    refused(lambda s: s.update(managedBy="someone-else"), "managedBy")
    refused(
        lambda s: s["deletionStrategy"]["deletionRules"][0]["condition"].update(
            jobDeploymentStatus="Failed"
        ),
        "cannot be used together",
    )
    refused(lambda s: s.update(shutdownAfterJobFinishes=True), "excludes deletionRules")
    refused(
        lambda s: s["deletionStrategy"]["deletionRules"][1].update(policy="DeleteWorkers"),
        "DeleteWorkers with autoscaling",
    )
    (cron,) = [m for m in manifests(OUT) if m["kind"] == "CronJob"]
    bad = copy.deepcopy(cron)
    bad["spec"]["jobTemplate"]["spec"]["template"]["spec"]["restartPolicy"] = ["Never"]
    with pytest.raises(Refused, match="restartPolicy"):
        check(bad)
    bad = copy.deepcopy(cron)
    bad["spec"]["jobTemplate"]["spec"]["template"]["spec"]["nodeSelectr"] = {}
    with pytest.raises(Refused, match="nodeSelectr"):
        check(bad)
    assert check_crd(job) == 14  # deletionStrategy's 2 CEL rules, 2 for each of 6 conditions


def test_prometheus_scrapes_every_ray_pod_on_its_metrics_port(tmp_path):
    for out in (OUT, render(tmp_path, TEAM)):
        (monitor,) = documents(out / "kuberay" / "podmonitor.yaml")
        selector = monitor["spec"]["selector"]["matchLabels"]
        (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
        ray_pods = 0
        for cluster in clusters(out):
            for group in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]:
                # A pod's labels: its template's, and those KubeRay gives every Ray pod.
                labels = group["template"]["metadata"]["labels"] | {"ray.io/is-ray-node": "yes"}
                assert selector.items() <= labels.items()
                (container,) = group["template"]["spec"]["containers"]
                (port,) = [p for p in container["ports"] if p["name"] == endpoint["port"]]
                exported = group["rayStartParams"]["metrics-export-port"]
                assert str(port["containerPort"]) == exported == "8080"
                ray_pods += 1
        assert ray_pods >= 3 * (len(CONFIGS) + 2)
        # The submitters are not Ray nodes: KubeRay labels them no ray.io/is-ray-node.
        assert "ray.io/is-ray-node" in selector
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    assert monitor["metadata"]["namespace"] == "ml-vision"
    bad = copy.deepcopy(monitor)
    bad["spec"]["podMetricsEndpoints"][0]["prot"] = "metrics"
    with pytest.raises(Refused, match="prot"):
        check(bad)


# Grafana: the dashboard -------------------------------------------------------------------------


def promql_reads(expr: str) -> tuple[set[str], set[str]]:
    """(the metrics, the labels) a PromQL expression or a label_values() query reads."""
    metrics, labels = set(), set()
    for body in re.findall(r"\{([^}]*)\}", expr):
        for label, value in re.findall(r'(\w+)\s*=~?\s*"([^"]*)"', body):
            if label == "__name__":
                metrics |= set(value.split("|"))
            else:
                labels.add(label)
    rest = re.sub(r"\{[^}]*\}", "", expr)
    for group in re.findall(r"\bby \(([^)]*)\)", rest):
        labels |= {label.strip() for label in group.split(",")}
    rest = re.sub(r"\bby \([^)]*\)", "", rest)
    if found := re.fullmatch(r"label_values\((.*), (\w+)\)", rest):
        rest, labels = found[1], labels | {found[2]}
    metrics |= set(re.findall(r"[A-Za-z_:][\w:]*", rest)) - {"max", "sum"}
    return metrics, labels


def test_the_dashboard_reads_only_the_metrics_the_jobs_publish():
    board = json.loads((OUT / grafana.PATH).read_text())
    panels = [p for p in board["panels"] if p["type"] != "row"]
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert list(variables) == ["datasource", "run", "output", "job_id"]
    assert variables["datasource"]["query"] == "prometheus"  # as Ray's dashboards pick theirs
    queries = [v["query"] for v in variables.values() if v["type"] == "query"]
    queries += [t["expr"] for p in panels for t in p["targets"]]
    read = set()
    for query in queries:
        metrics, labels = promql_reads(query)
        assert metrics and metrics <= set(grafana.METRICS), query
        for metric in metrics:
            assert labels <= set(grafana.METRICS[metric]), f"{query}: {metric}'s labels"
        read |= metrics
    assert read == set(grafana.METRICS), "a metric no panel shows"
    for panel in panels:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        for target in panel["targets"]:
            # Every panel follows the variables: the runs' or the outputs', and the jobs'.
            assert 'job_id=~"$job_id"' in target["expr"], panel["title"]
            assert '=~"$run"' in target["expr"] or '=~"$output"' in target["expr"]
    assert len({p["id"] for p in board["panels"]}) == len(board["panels"])
    # The SDK's own model (no validator of its own) reads every field back as it wrote it.
    assert json.loads(json.dumps(Dashboard.from_json(board), cls=JSONEncoder)) == board
    titles = [p["title"] for p in panels]
    for title in ("Progress", "Time left", "Images/s", "Input wait", "Step time", "Spend"):
        assert title in titles
    docs = (BUNDLE_ROOT / "docs" / "metrics.md").read_text()
    assert [m for m in grafana.METRICS if f"| `{m}` |" not in docs] == [], "docs/metrics.md"


def test_vendored_crds_are_the_pinned_release():
    readme = (CRDS / "README.md").read_text()
    for name in KINDS.values():
        path = CRDS / name
        data = path.read_bytes()
        blob = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()  # git's object id
        assert f"`{blob}`" in readme, f"{path.name}: not the blob README.md names"
