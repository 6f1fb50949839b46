"""What code a checkpoint's model name may import and run: only what the user chose (the
bundle's builders, the job's own files, its runtime env's py_modules, `allow_modules`), decided
without importing anything, since a checkpoint's metadata is as untrusted as its tensors."""

from __future__ import annotations

import csv
import importlib.util
import re
import sys
from collections.abc import Sequence
from importlib.machinery import PathFinder
from pathlib import Path

from pipeline.core.errors import ConfigError
from pipeline.model.checkpoint import ModelSpec
from pipeline.model.networks import TIMM

# The bundle's own packages: code that acts (jobs, storage, the cluster), never a network.
BUNDLE_PACKAGES = ("pipeline", "jobs", "scripts", "harness")
# timm's arguments that read or fetch weights from where they say: a checkpoint holds its own.
TIMM_LOADING = ("pretrained", "pretrained_cfg", "pretrained_cfg_overlay", "checkpoint_path")


def check_model_code(
    spec: ModelSpec,
    *,
    allow_modules: Sequence[str] = (),
    code_root: Path | None = None,
    shipped: Sequence[Path] | None = None,
) -> None:
    """Raise ConfigError unless rebuilding the network of a checkpoint's `spec` runs only code
    that the user chose: a torchvision or timm builder (with no argument that loads weights), or
    a `module:function` whose module is a file below `code_root` (default: the working dir, the
    job's as submitted; a pyfunc model's code/) or below a folder of `shipped` (default: the
    py_modules of this process's runtime env, `shipped_module_dirs`), or one of
    `allow_modules`. Nothing is imported to decide: a checkpoint's metadata is as untrusted as
    its tensors, so what may run comes from the user's config and runtime env alone."""
    if spec.name.startswith(TIMM):
        if loading := sorted(set(spec.kwargs) & set(TIMM_LOADING)):
            raise ConfigError(
                f"the checkpoint's model {spec.name} has model.kwargs {loading}, which load "
                "weights from elsewhere: a checkpoint holds its own weights. Use a checkpoint "
                "written by this bundle's train job"
            )
        return
    if ":" not in spec.name:
        return  # a torchvision builder by name
    module = spec.name.partition(":")[0]
    if any(module == a or module.startswith(f"{a}.") for a in allow_modules):
        return
    root = (code_root or Path.cwd()).resolve()
    shipped = [Path(d).resolve() for d in (shipped_module_dirs() if shipped is None else shipped)]
    files = None if module.split(".")[0] in BUNDLE_PACKAGES else _module_files(module)
    # An installed package is no code of the job's, even where its environment lies below the
    # working dir (a checkout's .venv). A py_module is the user's by their runtime env, wherever
    # Ray unpacked it; of a wheel, its own files only, not the dependencies pip put beside them.
    installed = {Path(p).resolve() for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    outside = [
        f
        for f in files or []
        if not any(f.is_relative_to(d) for d in shipped)
        and (not f.is_relative_to(root) or any(f.is_relative_to(p) for p in installed))
    ]
    if files and not outside:
        return
    where = f" ({outside[0]})" if outside else ""
    if module.split(".")[0] in BUNDLE_PACKAGES:
        where = " (the bundle's own code, no network)"
    raise ConfigError(
        f"the checkpoint's model.name={spec.name!r} names module {module}{where}, which is not "
        f"a file below {root} outside installed packages: a checkpoint runs only the bundle's "
        "builders or a module that ships with the job (its working dir as submitted, its "
        "runtime env's py_modules; a pyfunc model's code/). Ship your package with "
        "--py-module, or if you trust this checkpoint, allow it with "
        f"allow_modules=[{module}]"
    )


# Where Ray unpacks a py_modules entry that it downloads: <session>/runtime_resources/<this>/.
PY_MODULES_FILES = "py_modules_files"


def shipped_module_dirs() -> list[Path]:
    """The folders of the py_modules in this process's runtime env (the user's `py_modules`,
    as submitted with the job or the Serve application), where Ray put them on sys.path; none
    outside a Ray worker or driver."""
    ray = sys.modules.get("ray")  # a Ray process has imported it; a pyfunc's may have not
    if ray is None or not ray.is_initialized():
        return []
    return py_module_dirs(ray.get_runtime_context().runtime_env.py_modules(), sys.path)


def py_module_dirs(uris: Sequence[str], path: Sequence[str]) -> list[Path]:
    """Where the user's code of the py_modules `uris` of a runtime env lies: a `local://` one
    is its path; one Ray downloads (gcs://_ray_pkg_<hash>.zip as uploaded, s3://.../pkg.zip)
    is unpacked into a folder below PY_MODULES_FILES named by Ray from the URI, which Ray puts
    on `path`; a .whl is pip-installed into such a folder with its dependencies, and only the
    files of its own distribution are the user's (`wheel_files`)."""
    from pipeline.core.ray_internals import get_local_dir_from_uri, get_local_dir_uri_path

    dirs = []
    for uri in uris:
        if (local := get_local_dir_uri_path(uri)) is not None:
            dirs.append(local)
            continue
        name = get_local_dir_from_uri(uri, PY_MODULES_FILES).name
        folders = [
            Path(p)
            for p in path
            if Path(p).name == name and Path(p).parent.name == PY_MODULES_FILES
        ]
        if uri.endswith(".whl"):
            dirs += [file for folder in folders for file in wheel_files(folder, uri)]
        else:
            dirs += folders
    return dirs


def wheel_files(folder: Path, wheel: str) -> list[Path]:
    """The files that `pip install <wheel> --target <folder>` (Ray's install of a .whl
    py_module) put there from the wheel itself, as its RECORD lists them: not those of the
    dependencies pip installed beside them, which are no code the user shipped."""
    # A wheel's file name and its .dist-info folder start with the distribution's name, its
    # dashes escaped: mynet-1.0-py3-none-any.whl, mynet-1.0.dist-info.
    dist = _distribution(wheel.rsplit("/", 1)[-1])
    for info in folder.glob("*.dist-info"):
        if _distribution(info.name) == dist and (record := info / "RECORD").is_file():
            rows = csv.reader(record.read_text().splitlines())
            own = [row[0] for row in rows if row and not row[0].startswith(("..", "/"))]
            return [folder / f for f in own if not f.startswith(f"{info.name}/")]
    return []


def _distribution(file_name: str) -> str:
    """The normalised distribution name that a wheel's or a .dist-info folder's name starts
    with (PEP 503: case, dots, dashes and underscores alike)."""
    return re.sub(r"[-_.]+", "-", file_name.split("-", 1)[0]).lower()


def _module_files(module: str) -> list[Path] | None:
    """The files that `import module` runs (each package's __init__.py down to the module's
    own), found as the import system would, importing none; None where it finds no file."""
    files, locations = [], None
    parts = module.split(".")
    for i in range(len(parts)):
        name = ".".join(parts[: i + 1])
        loaded = sys.modules.get(name)
        if loaded is not None:
            spec = getattr(loaded, "__spec__", None)
        elif i == 0:
            spec = importlib.util.find_spec(name)  # a top-level name: no parent to import
        else:
            # By its last part: a namespace parent that is not imported would make PathFinder
            # look the parent up in sys.modules. The locations alone place it.
            spec = PathFinder.find_spec(parts[i], locations)
        if spec is None:
            return None
        own = spec.origin if spec.has_location else None  # a namespace package has none
        if own:
            files.append(Path(own).resolve())
        search = spec.submodule_search_locations
        if search is None:
            if i < len(parts) - 1:
                return None  # a module, not a package: it has no submodules
        elif own or loaded is not None:
            locations = list(search)
        else:  # a namespace package (not imported): its folders, as PathFinder finds them
            parent = sys.path if locations is None else locations
            locations = [str(Path(d, parts[i])) for d in parent if Path(d, parts[i]).is_dir()]
    return files if own else None  # the module itself is a file
