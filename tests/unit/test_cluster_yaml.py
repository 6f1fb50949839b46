"""cluster.yaml and cluster-onprem.yaml: valid for Ray's cluster launcher, installing the lock
compiled from what pyproject.toml pins, token auth on; cluster.yaml's workers can reach S3.

No cloud calls: the schema check is the part of `ray up` that runs before it talks to AWS.
test_deploy.py launches cluster-onprem.yaml for real.
"""

from __future__ import annotations

import copy
import re
import shlex
import shutil
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml
from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

# Private, but it is exactly what `ray up` runs; a Ray upgrade that moves it fails loudly here.
from ray.autoscaler._private.util import prepare_config, validate_config

from scripts.lock import (
    COMMAND,
    CONSTRAINTS,
    LOCK,
    SOURCE,
    lock_problems,
    recorded_input,
    requirements_file,
)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pytest itself depends on tomli before 3.11
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]  # the bundle root: tests/unit/ is two down
SEPARATORS = {";", "&&", "||", "|", "&"}
ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")


CONFIGS = ["cluster.yaml", "cluster-onprem.yaml"]


@pytest.fixture(scope="module")
def cluster() -> dict:
    return yaml.safe_load((ROOT / "cluster.yaml").read_text())


@pytest.fixture(scope="module")
def onprem() -> dict:
    return yaml.safe_load((ROOT / "cluster-onprem.yaml").read_text())


@pytest.fixture(scope="module", params=CONFIGS)
def any_cluster(request) -> dict:
    return yaml.safe_load((ROOT / request.param).read_text())


@pytest.fixture(scope="module")
def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


@pytest.fixture(scope="module")
def project(pyproject) -> dict:
    """pyproject.toml's dependencies and extras, as setuptools reads them from requirements/."""
    dynamic = pyproject["tool"]["setuptools"]["dynamic"]

    def read(entry: dict) -> list[str]:
        return [str(r) for f in entry["file"] for r in requirements_file(ROOT / f)]

    return {
        "dependencies": read(dynamic["dependencies"]),
        "optional-dependencies": {
            extra: read(entry) for extra, entry in dynamic["optional-dependencies"].items()
        },
    }


def ray_validate(config: dict) -> None:
    # As `ray up` does: merge the provider's defaults.yaml, then check against ray-schema.json
    # and the cross-field rules. validate_config alone rejects any un-merged config.
    validate_config(prepare_config(copy.deepcopy(config)))


def simple_commands(command: str) -> list[tuple[list[str], list[str]]]:
    """Shell command line -> [(leading VAR=value words, argv)], one per simple command."""
    lexer = shlex.shlex(command, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    out: list[tuple[list[str], list[str]]] = []
    words: list[str] = []
    for token in [*lexer, ";"]:
        if token not in SEPARATORS:
            words.append(token)
            continue
        n = 0
        while n < len(words) and ASSIGNMENT.match(words[n]):
            n += 1
        if words:
            out.append((words[:n], words[n:]))
        words = []
    return out


def ray_starts(commands: list[str]) -> list[tuple[set[str], list[str]]]:
    """Every `ray start` in `commands`, with the variables set for it (inline or exported)."""
    found = []
    for command in commands:
        exported: set[str] = set()
        for env, argv in simple_commands(command):
            if argv[:1] == ["export"]:
                exported.update(word for word in argv[1:] if ASSIGNMENT.match(word))
            elif argv[:2] == ["ray", "start"]:
                found.append((exported | set(env), argv))
    return found


def option(argv: list[str], name: str) -> str | None:
    for i, word in enumerate(argv):
        if word.startswith(f"{name}="):
            return word.split("=", 1)[1]
        if word == name and i + 1 < len(argv):
            return argv[i + 1]
    return None


def local_path(config: dict, remote: str) -> Path:
    """The file in this checkout that the config's file_mounts put at `remote` on the nodes."""
    for target, source in config["file_mounts"].items():
        if remote == target or remote.startswith(target.rstrip("/") + "/"):
            return ROOT / source / remote[len(target) :].lstrip("/")
    raise AssertionError(f"{remote} is not under any of file_mounts: {config['file_mounts']}")


def pip_installs(config: dict, commands: list[str]) -> list[Requirement]:
    """What `pip install` installs in `commands`: its arguments and its `-r` files (the copies
    that file_mounts makes of this checkout's files)."""
    reqs = []
    for command in commands:
        for _, argv in simple_commands(command):
            if Path(argv[0]).name in ("python3", "python") if argv else False:
                argv = argv[2:] if argv[1:2] == ["-m"] else argv
            if argv[:1] and Path(argv[0]).name in ("pip", "pip3") and argv[1:2] == ["install"]:
                args = iter(argv[2:])
                for arg in args:
                    if arg in ("-r", "--requirement"):
                        reqs += requirements_file(local_path(config, next(args)))
                    elif not arg.startswith("-"):
                        reqs.append(Requirement(arg))
    return reqs


def key(req: Requirement) -> tuple:
    return canonicalize_name(req.name), frozenset(req.extras), str(req.specifier), str(req.marker)


def test_configs_pass_ray_validation(any_cluster):
    ray_validate(any_cluster)


@pytest.mark.parametrize(
    "break_it",
    [
        lambda c: c.update(max_worker=4),  # typo of a top-level key
        lambda c: c["available_node_types"]["gpu_worker"].update(min_worker=0),  # and nested
        lambda c: c["available_node_types"]["gpu_worker"]["resources"].update(GPU=0.5),
        lambda c: c.update(head_node_type="no_such_type"),
    ],
    ids=["top-level typo", "node-type typo", "fractional resource", "unknown head type"],
)
def test_ray_validation_rejects_a_broken_copy(cluster, break_it):
    broken = copy.deepcopy(cluster)
    break_it(broken)
    with pytest.raises((jsonschema.ValidationError, ValueError)):
        ray_validate(broken)


def test_nodes_install_the_ray_the_client_pins(any_cluster, project):
    (pinned,) = [Requirement(d) for d in project["dependencies"] if Requirement(d).name == "ray"]
    assert re.fullmatch(r"==[^,*]+", str(pinned.specifier)), f"pin ray exactly: {pinned}"
    installed = pip_installs(any_cluster, any_cluster["setup_commands"])
    (ray,) = [r for r in installed if r.name == "ray"]
    assert ray.specifier == pinned.specifier, f"cluster {ray}, client {pinned}"
    # The lock lists ray's extras' packages, not the extras: it was compiled from the pin itself.
    assert str(pinned) in recorded_input(ROOT / LOCK)


def test_the_lock_is_compiled_from_exactly_the_runtime_deps(project):
    # Runtime deps plus the hf extra (preprocessing's Hugging Face source), timm (models by
    # name), tracking (MLflow's client) and export (the export job's exporter and runtime);
    # never the bundle, never dev tools.
    runtime = [
        *project["dependencies"],
        *project["optional-dependencies"]["hf"],
        *project["optional-dependencies"]["tracking"],
        *project["optional-dependencies"]["export"],
        *[str(r) for r in requirements_file(ROOT / "requirements/timm.txt")],
    ]
    expected = {key(Requirement(d)) for d in runtime}
    compiled = [key(r) for r in requirements_file(ROOT / SOURCE)]
    assert len(compiled) == len(set(compiled)), "a requirement is listed twice"
    assert set(compiled) == expected


def test_the_lock_is_up_to_date():
    problems = lock_problems(ROOT / LOCK, ROOT / SOURCE, ROOT / CONSTRAINTS)
    assert not problems, f"{LOCK} is stale: run `make lock`\n" + "\n".join(problems)
    # Written by `make lock`: its header names the command that wrote it.
    assert f"#   {shlex.join(COMMAND)}\n" in (ROOT / LOCK).read_text()


@pytest.mark.parametrize(
    ("file", "edit", "found"),
    [
        (
            "runtime.txt",
            lambda t: t.replace("torch>=2.4", "torch>=99"),
            ["torch>=99: the lock has"],
        ),
        (
            "runtime.txt",
            lambda t: t + "ujson>=5\n",
            ["compiled from other requirements: now ['ujson>=5']", "ujson>=5 is not in the lock"],
        ),
        ("runtime.txt", lambda t: t.replace("pillow>=10", "pillow>=9"), ["now ['pillow>=9']"]),
        (
            "cluster-constraints.txt",
            lambda t: t.replace("python-dateutil<3", "python-dateutil<2"),
            ["python-dateutil<2: the lock has python-dateutil=="],
        ),
    ],
    ids=["a version the lock lacks", "a new requirement", "a looser one", "a new constraint"],
)
def test_a_stale_lock_is_found(tmp_path, file, edit, found):
    shutil.copytree(ROOT / "requirements", tmp_path / "requirements")
    files = [tmp_path / LOCK, tmp_path / SOURCE, tmp_path / CONSTRAINTS]
    assert lock_problems(*files) == []
    edited = tmp_path / "requirements" / file
    edited.write_text(edit(edited.read_text()))
    problems = "\n".join(lock_problems(*files))
    for part in found:
        assert part in problems


def test_this_venv_runs_the_locked_versions():
    # `make install` puts the lock in first, and the bundle's extras must not move any of it:
    # the tests run what the nodes run.
    from importlib.metadata import PackageNotFoundError, version

    differ = []
    for pin in requirements_file(ROOT / LOCK):
        if pin.marker is None or pin.marker.evaluate():
            (spec,) = pin.specifier
            try:
                installed = version(pin.name)
            except PackageNotFoundError:
                installed = None
            if installed != spec.version:
                differ.append(f"{pin.name}: locked {spec.version}, installed {installed}")
    assert not differ, "rebuild the venv (make install):\n" + "\n".join(differ)


def test_make_install_installs_the_lock_before_the_bundle():
    makefile = (ROOT / "Makefile").read_text()
    assert f"LOCK   := {LOCK}\n" in makefile
    stamp = makefile.split("\n$(STAMP):", 1)[1].split("\n\n", 1)[0]
    prerequisites, *recipe = stamp.splitlines()
    assert "$(LOCK)" in prerequisites.split()  # a new lock rebuilds the venv
    lock = recipe.index("\t$(PY) -m pip install --quiet --require-hashes -r $(LOCK)")
    bundle = recipe.index("\t$(PY) -m pip install --quiet -e '.[dev,docs]'")
    assert lock < bundle
    assert "\t$(PY) -m scripts.lock $(if $(UPGRADE),--upgrade)\n" in makefile


def test_the_versions_live_in_one_place(pyproject, cluster, onprem):
    # pyproject.toml lists none itself: setuptools reads them from requirements/, and both
    # configs install the lock compiled from those files, not copies of their lines.
    assert "dependencies" not in pyproject["project"]
    assert "optional-dependencies" not in pyproject["project"]
    for config in (cluster, onprem):
        assert config["file_mounts"]["~/ray-cv/requirements"] == "requirements"
        installs = 0
        for command in config["setup_commands"]:
            for _, argv in simple_commands(command):
                if "pip" in argv:
                    installs += 1
                    assert argv[argv.index("install") + 1 :] == [
                        "--require-hashes",
                        "-r",
                        f"~/ray-cv/{LOCK}",
                    ], command
        assert installs == 1


def test_the_installed_bundle_has_the_requirements_files_deps(project):
    # What `pip install -e .` recorded is what requirements/ says: setuptools read the files.
    from importlib.metadata import requires

    recorded = {key(Requirement(r)) for r in requires("ray-cv-bundle")}
    declared = {key(Requirement(d)) for d in project["dependencies"]}
    for extra, deps in project["optional-dependencies"].items():
        for dep in map(Requirement, deps):
            # As setuptools records it: the extra's marker after the requirement's own.
            own = f"{dep.marker} and " if dep.marker else ""
            dep.marker = Marker(f'{own}extra == "{extra}"')
            declared.add(key(dep))
    assert recorded == declared


def test_every_ray_start_uses_token_auth(any_cluster):
    for field in ("head_start_ray_commands", "worker_start_ray_commands"):
        starts = ray_starts(any_cluster[field])
        assert starts, f"no `ray start` in {field}"
        for env, argv in starts:
            assert "RAY_AUTH_MODE=token" in env, f"{field}: {shlex.join(argv)}"
    # The token itself reaches every node (file_mounts is remote: local).
    assert any_cluster["file_mounts"].get("~/.ray/auth_token") == "~/.ray/auth_token"


def test_file_mounts_come_from_the_bundle(any_cluster):
    for remote, local in any_cluster["file_mounts"].items():
        if remote != "~/.ray/auth_token":
            assert (ROOT / local).exists(), f"{remote}: {local} is not in the bundle"


def test_workers_get_the_heads_role_for_s3(cluster):
    # `ray up` gives the head Ray's default profile (EC2 and S3 full access) and the workers
    # nothing: each worker type must ask for it, or s3:// fails on every worker.
    from ray.autoscaler._private.aws.config import DEFAULT_RAY_INSTANCE_PROFILE

    head = cluster["available_node_types"][cluster["head_node_type"]]["node_config"]
    assert "IamInstanceProfile" not in head, "the head takes the default that `ray up` creates"
    for name, node_type in cluster["available_node_types"].items():
        if name != cluster["head_node_type"]:
            profile = node_type["node_config"].get("IamInstanceProfile")
            assert profile == {"Name": DEFAULT_RAY_INSTANCE_PROFILE}, name


def test_onprem_head_runs_no_tasks_and_every_node_names_its_address(onprem):
    (head,) = [argv for _, argv in ray_starts(onprem["head_start_ray_commands"])]
    assert option(head, "--num-cpus") == "0"
    assert option(head, "--dashboard-host") == "127.0.0.1"
    assert option(head, "--autoscaling-config") == "~/ray_bootstrap_config.yaml"
    ((env, _),) = [s for s in ray_starts(onprem["head_start_ray_commands"])]
    # The v2 autoscaler never sets up this provider's workers (test_deploy.py found it).
    assert "RAY_enable_autoscaler_v2=0" in env
    (worker,) = [argv for _, argv in ray_starts(onprem["worker_start_ray_commands"])]
    assert option(worker, "--address") == "$RAY_HEAD_IP:6379"
    for argv in (head, worker):
        assert option(argv, "--node-ip-address") == "$RAY_CV_NODE_IP"


def test_head_dashboard_only_on_loopback(cluster):
    (head,) = [argv for _, argv in ray_starts(cluster["head_start_ray_commands"])]
    assert "--head" in head
    assert option(head, "--dashboard-host") == "127.0.0.1"
    # Without it the head never launches a worker; Ray only warns.
    assert option(head, "--autoscaling-config") == "~/ray_bootstrap_config.yaml"


def workers_fitting(node_types: dict, demand: dict[str, float]) -> int:
    """How many bundles of `demand` the cluster's worker nodes hold, all scaled up to max."""
    total = 0
    for node in node_types.values():
        per_node = min(
            int(node["resources"].get(name, 0) // amount) for name, amount in demand.items()
        )
        total += per_node * node.get("max_workers", 0)
    return total


@pytest.fixture(scope="module")
def worker_types(cluster) -> dict:
    return {
        k: v for k, v in cluster["available_node_types"].items() if k != cluster["head_node_type"]
    }


def test_head_runs_no_training(cluster):
    head = cluster["available_node_types"][cluster["head_node_type"]]
    assert head["resources"].get("CPU") == 0 and not head["resources"].get("GPU")


def test_gpu_workers_scale_from_zero_one_gpu_each(worker_types):
    gpu = [t for t in worker_types.values() if t["resources"].get("GPU")]
    assert gpu, "no GPU worker type"
    for t in gpu:
        assert t["resources"]["GPU"] == 1 and t.get("min_workers", 0) == 0
        assert t["max_workers"] >= 1


def test_worker_types_can_hold_the_default_train_config(worker_types, cluster):
    from pipeline.core.config import load_config
    from pipeline.train.config import TrainConfig

    cfg = load_config(TrainConfig, ROOT / "configs/train.yaml").scaling
    demand = {"CPU": cfg.cpus_per_worker, **({"GPU": 1} if cfg.use_gpu else {})}
    # Each Ray Train worker starts loader_workers DataLoader processes within its CPUs.
    assert cfg.loader_workers <= cfg.cpus_per_worker
    assert workers_fitting(worker_types, demand) >= cfg.num_workers, demand
    assert cfg.num_workers <= cluster["max_workers"]


def test_worker_types_can_hold_the_default_infer_config(worker_types):
    from pipeline.core.config import load_config
    from pipeline.infer.config import InferConfig

    cfg = load_config(InferConfig, ROOT / "configs/infer.yaml")
    assert cfg.use_gpu
    assert workers_fitting(worker_types, {"GPU": 1}) >= cfg.num_actors
    # The read and decode stages need CPUs beside the GPU actors: at least one per GPU node.
    gpu_nodes = [t for t in worker_types.values() if t["resources"].get("GPU")]
    assert all(t["resources"]["CPU"] >= 2 for t in gpu_nodes)


def test_worker_types_can_hold_the_default_export_config(worker_types):
    from pipeline.core.config import load_config
    from pipeline.export.config import ExportConfig

    cfg = load_config(ExportConfig, ROOT / "configs/export.yaml")
    assert workers_fitting(worker_types, {"CPU": cfg.cpus}) >= 1


def test_workers_fitting_counts_what_a_node_holds():
    nodes = {
        "g": {"resources": {"CPU": 4, "GPU": 1}, "max_workers": 2},
        "c": {"resources": {"CPU": 8}, "max_workers": 1},
    }
    assert workers_fitting(nodes, {"CPU": 3, "GPU": 1}) == 2
    assert workers_fitting(nodes, {"CPU": 3}) == 2 + 2
    assert workers_fitting(nodes, {"CPU": 5, "GPU": 1}) == 0
