"""Networks by name: a torchvision classifier, a timm model (`timm/<name>`) or the user's own
(`module:function`); built fresh, from pretrained weights, or from one of our checkpoints.

Every network comes from its builder with a head for the dataset's classes (`num_classes=`), so
that a checkpoint rebuilds the very same network from its name and builder arguments alone.
Pretrained weights go into all of it but the head: the tensors whose shapes follow num_classes
(`fc`, `classifier.3`, `heads.head`, timm's classifier, whatever the architecture calls it).
"""

from __future__ import annotations

import csv
import difflib
import importlib
import importlib.util
import logging
import re
import sys
from collections.abc import Callable, Sequence
from importlib.machinery import PathFinder
from pathlib import Path
from typing import Any

import torch

from pipeline.core.errors import ConfigError, InputError
from pipeline.core.storage import Location
from pipeline.model.checkpoint import (
    CheckpointMeta,
    ModelInput,
    ModelSpec,
    load_tensors,
    load_weights,
    read_meta,
    served_weights,
)
from pipeline.model.config import ModelConfig, is_weights_file

log = logging.getLogger(__name__)

TIMM = "timm/"
DEFAULT_WEIGHTS = "DEFAULT"  # the builder's own best weights, in torchvision and timm alike


# --- the three kinds of names -------------------------------------------------------------------


class Architecture:
    """A network by name and builder arguments: builds it with a head of `num_classes`."""

    def __init__(self, name: str, kwargs: dict[str, Any]):
        self.name, self.kwargs = name, dict(kwargs)

    def _call(self, builder: Callable[..., Any], num_classes: int, **extra) -> torch.nn.Module:
        try:
            model = builder(num_classes=num_classes, **extra, **self.kwargs)
        except (ConfigError, InputError):
            raise
        except Exception as e:  # the builder's own words: an argument it does not take, ...
            raise ConfigError(
                f"model {self.name} with model.kwargs={self.kwargs} cannot be built: "
                f"{type(e).__name__}: {e}"
            ) from None
        if not isinstance(model, torch.nn.Module):
            raise ConfigError(
                f"model {self.name} returned a {type(model).__name__}, not a torch.nn.Module"
            )
        return model

    def build(self, num_classes: int) -> torch.nn.Module:
        """A new network, randomly initialised."""
        raise NotImplementedError

    def check_weights_name(self, weights: str) -> None:
        """Raise ConfigError if `weights` names no weights of this model."""
        raise ConfigError(
            f"model.weights={weights!r}: a module:function model takes weights from a "
            "state_dict file only"
        )

    def pretrained(self, weights: str, num_classes: int) -> torch.nn.Module:
        """The network with weights by name in all but its head (downloaded once per node)."""
        self.check_weights_name(weights)
        raise NotImplementedError(f"{type(self).__name__} names weights but cannot load them")

    def weights_input(self, weights: str) -> dict[str, Any]:
        """What the named weights were trained on (image_size, interpolation, mean, std)."""
        return {}


def _torchvision_models():
    """torchvision.models, imported on first use: the import costs about 1.5 CPU-seconds (it
    imports torch._dynamo), which a job that builds the user's own network goes without."""
    import torchvision.models

    return torchvision.models


class TorchvisionModel(Architecture):
    """Any classifier of torchvision.models, by builder name (resnet50, vit_b_16, ...)."""

    def __init__(self, name: str, kwargs: dict[str, Any]):
        super().__init__(name, kwargs)
        models = _torchvision_models()
        names = models.list_models(module=models)
        if name not in names:
            raise ConfigError(
                f"model.name={name!r} is not a torchvision classification model"
                f"{_close(name, names)}; or give timm/<name> for a timm model, or "
                "module:function for your own"
            )
        self.builder = models.get_model_builder(name)

    def build(self, num_classes: int) -> torch.nn.Module:
        return self._call(self.builder, num_classes, weights=None)

    def _weights(self, weights: str):
        enum = _torchvision_models().get_model_weights(self.name)
        if weights not in enum.__members__:
            raise ConfigError(
                f"model.weights={weights!r} is not a weights name of {self.name} "
                f"({', '.join(enum.__members__)}), nor the path of a state_dict file"
            )
        return enum[weights]

    def check_weights_name(self, weights: str) -> None:
        self._weights(weights)

    def pretrained(self, weights: str, num_classes: int) -> torch.nn.Module:
        w = self._weights(weights)
        model = self.build(num_classes)
        # The builder loads its weights itself (some need their keys renamed), into its own head,
        # downloading them into $TORCH_HOME once per node: a failed download is raised as it is.
        state = self.builder(weights=w, progress=False, **self.kwargs).state_dict()
        load_backbone(model, state, self, num_classes, what=f"weights {w.name}", error=ConfigError)
        return model

    def weights_input(self, weights: str) -> dict[str, Any]:
        t = self._weights(weights).transforms()
        return {
            "image_size": t.crop_size[0],
            "interpolation": t.interpolation.value,
            "mean": tuple(t.mean),
            "std": tuple(t.std),
        }


class TimmModel(Architecture):
    """Any timm model, as timm/<name> (a pretrained tag may follow: timm/resnet50.a1_in1k)."""

    def __init__(self, name: str, kwargs: dict[str, Any]):
        super().__init__(name, kwargs)
        try:
            import timm
        except ImportError:
            raise ConfigError(
                f"model.name={name!r} needs timm, which is not installed: install the bundle's "
                "timm extra (pip install -r requirements/timm.txt) on the cluster and here"
            ) from None
        self.timm, self.arch = timm, name.removeprefix(TIMM)
        if not timm.is_model(self.arch):
            names = [TIMM + n for n in timm.list_models()]
            raise ConfigError(f"model.name={name!r} is not a timm model{_close(name, names)}")

    def build(self, num_classes: int) -> torch.nn.Module:
        return self._call(self.timm.create_model, num_classes, model_name=self.arch)

    def check_weights_name(self, weights: str) -> None:
        if weights != DEFAULT_WEIGHTS:
            raise ConfigError(
                f"model.weights={weights!r}: a timm model's weights by name are "
                f"{DEFAULT_WEIGHTS} (its pretrained tag, which the name may give: "
                "timm/resnet50.a1_in1k), or the path of a state_dict file"
            )
        tags = self.timm.list_pretrained(self.arch if "." in self.arch else self.arch + ".*")
        if not tags:
            raise ConfigError(
                f"model.weights={weights}: timm has no pretrained weights for {self.arch}"
                f"{_close(self.arch, self.timm.list_pretrained())}"
            )

    def pretrained(self, weights: str, num_classes: int) -> torch.nn.Module:
        self.check_weights_name(weights)
        # timm's own loading: from the Hugging Face hub (or the URL the tag names) into its
        # cache, once per node, adapted to our num_classes; a failed download is raised as it is.
        model = self.timm.create_model(
            self.arch, pretrained=True, num_classes=num_classes, **self.kwargs
        )
        model.reset_classifier(num_classes)  # new even where the weights had as many classes
        return model

    def weights_input(self, weights: str) -> dict[str, Any]:
        from timm.data import resolve_data_config
        from timm.models import get_pretrained_cfg

        data = resolve_data_config(pretrained_cfg=get_pretrained_cfg(self.arch).to_dict())
        return {
            "image_size": data["input_size"][-1],
            "interpolation": data["interpolation"],
            "mean": tuple(data["mean"]),
            "std": tuple(data["std"]),
        }


class UserModel(Architecture):
    """The user's own `module:function(num_classes, **kwargs) -> nn.Module`; the module ships
    with the job (the runtime env's working_dir), as the bundle's code does."""

    def __init__(self, name: str, kwargs: dict[str, Any]):
        super().__init__(name, kwargs)
        self.function = user_function(name, "model.name")

    def build(self, num_classes: int) -> torch.nn.Module:
        return self._call(self.function, num_classes)


def user_function(name: str, key: str) -> Callable[..., Any]:
    """The user's function that setting `key` names as module:function, imported; ConfigError
    where the module does not import or has no such function."""
    module_name, _, function = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if not (module_name + ".").startswith(f"{e.name}."):  # one the module imports
            raise ConfigError(f"{key}={name!r}: importing {module_name} failed: {e}") from None
        raise ConfigError(
            f"{key}={name!r}: there is no module {module_name} (a .py file below the "
            "bundle's root, which every job ships as its working_dir; dots for folders)"
        ) from None
    except Exception as e:  # the module's own error, at import
        raise ConfigError(
            f"{key}={name!r}: importing {module_name} failed: {type(e).__name__}: {e}"
        ) from None
    found = getattr(module, function, None)
    if not callable(found):
        names = [n for n, v in vars(module).items() if callable(v) and not n.startswith("_")]
        raise ConfigError(
            f"{key}={name!r}: {module_name} has no function {function}{_close(function, names)}"
        )
    return found


def architecture(name: str, kwargs: dict[str, Any] | None = None) -> Architecture:
    """The network `name` stands for: torchvision's, timm's or the user's."""
    if name.startswith(TIMM):
        return TimmModel(name, kwargs or {})
    if ":" in name:
        return UserModel(name, kwargs or {})
    return TorchvisionModel(name, kwargs or {})


def _close(name: str, names: list[str]) -> str:
    close = difflib.get_close_matches(name, names, n=5, cutoff=0.6)
    return f" (close names: {', '.join(close)})" if close else ""


# --- weights ------------------------------------------------------------------------------------


def build_model(
    num_classes: int,
    *,
    name: str = "resnet18",
    kwargs: dict[str, Any] | None = None,
    weights: str | None = None,
    bn_momentum: float | None = None,
    bn_eps: float | None = None,
) -> torch.nn.Module:
    """The network `name` with a new head of `num_classes`; its other tensors from `weights`
    (a name, or a state_dict file local or on storage) where given, else randomly initialised.
    `bn_momentum`, `bn_eps`: set on every BatchNorm layer where given."""
    arch = architecture(name, kwargs)
    if weights is None:
        model = arch.build(num_classes)
    elif is_weights_file(weights):
        model = arch.build(num_classes)
        state = read_state_dict(Location.parse(weights))
        load_backbone(model, state, arch, num_classes, what=f"model.weights {weights}")
    else:
        model = arch.pretrained(weights, num_classes)
    for layer in batchnorm_layers(model):
        layer.momentum = layer.momentum if bn_momentum is None else bn_momentum
        layer.eps = layer.eps if bn_eps is None else bn_eps
    return model


def batchnorm_layers(model: torch.nn.Module) -> list[torch.nn.modules.batchnorm._BatchNorm]:
    """Every BatchNorm layer of `model`, of any dimension (SyncBatchNorm too), timm's included."""
    return [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]


def read_state_dict(loc: Location) -> dict[str, torch.Tensor]:
    """A state_dict file (torch.save or .safetensors), or a training checkpoint that holds one
    under "model" or "state_dict"; DDP's "module." prefix is dropped."""
    if not loc.exists():
        raise InputError(f"model.weights {loc.uri} do not exist")
    try:
        if loc.path.endswith(".safetensors"):
            from safetensors.torch import load

            state = load(loc.read_bytes())
        else:
            state = load_tensors(loc)
    except ImportError:
        raise InputError(
            f"model.weights {loc.uri}: reading .safetensors needs the safetensors package "
            "(timm's extra installs it)"
        ) from None
    except Exception as e:  # pickle, zip or safetensors errors: not a file of tensors
        raise InputError(
            f"model.weights {loc.uri} is not a state_dict file: {type(e).__name__}: {e}"
        ) from None
    for key in ("model", "state_dict"):
        if isinstance(state, dict) and isinstance(state.get(key), dict):
            state = state[key]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise InputError(f"model.weights {loc.uri} is not a state_dict (names to tensors)")
    if state and all(k.startswith("module.") for k in state):
        state = {k.removeprefix("module."): v for k, v in state.items()}
    return state


def head_keys(arch: Architecture, num_classes: int) -> set[str]:
    """The names of the head's tensors: those whose shapes change with num_classes."""
    a, b = (_shapes(lambda n=n: arch.build(n)) for n in (num_classes, num_classes + 1))
    return {k for k, shape in a.items() if b.get(k) != shape}


def load_backbone(
    model: torch.nn.Module,
    state: dict[str, torch.Tensor],
    arch: Architecture,
    num_classes: int,
    *,
    what: str,
    error: type[Exception] = InputError,
) -> None:
    """Load `state` (`what`: said in errors) into all of `model` but its head; every other
    tensor must be there, with its shape."""
    head = head_keys(arch, num_classes)
    check_fit(_shapes_of(state), _shapes_of(model.state_dict()), head, arch, what, error)
    model.load_state_dict({k: v for k, v in state.items() if k not in head}, strict=False)


def check_fit(
    given: dict[str, tuple],
    wanted: dict[str, tuple],
    head: set[str],
    arch: Architecture,
    what: str,
    error: type[Exception],
) -> None:
    """Raise `error` if tensors of the `given` shapes do not fill every tensor of the network
    but its head (ConfigError for weights by name, InputError for a file)."""
    problems = _misfit(given, wanted, head)
    if problems:
        raise error(
            f"{what} do not fit model {arch.name} with "
            f"model.kwargs={arch.kwargs}: {problems}. Give weights of this architecture (and the "
            "builder arguments they were trained with), or model.weights=null to train from "
            "scratch"
        )


def _misfit(given: dict[str, tuple], wanted: dict[str, tuple], head: set[str]) -> str:
    """What keeps tensors of `given` shapes from loading into `wanted` (head aside); '' if
    nothing."""
    given = {k: s for k, s in given.items() if k not in head}
    missing = sorted(wanted.keys() - given.keys() - head)
    unexpected = sorted(given.keys() - wanted.keys())
    shaped = sorted(k for k in given.keys() & wanted.keys() if given[k] != wanted[k])
    found = [
        (missing, "tensors missing", str),
        (unexpected, "unexpected", str),
        (shaped, "of another shape", lambda k: f"{k} {list(given[k])} for {list(wanted[k])}"),
    ]
    parts = []
    for keys, said, shown in found:
        if keys:
            more = ", ..." if len(keys) > 3 else ""
            parts.append(f"{len(keys)} {said} ({', '.join(map(shown, keys[:3]))}{more})")
    return "; ".join(parts)


def _shapes_of(state: dict[str, torch.Tensor]) -> dict[str, tuple]:
    return {k: tuple(v.shape) for k, v in state.items()}


def _shapes(build: Callable[[], torch.nn.Module]) -> dict[str, tuple]:
    return _shapes_of(_on_meta(build).state_dict())


def _on_meta(fn: Callable[[], Any]) -> Any:
    """`fn()` with tensors on the meta device (shapes, no memory, no compute), else on the CPU
    where it needs their values (RegNet's builder computes its widths with tensors)."""
    try:
        with torch.device("meta"):
            return fn()
    except Exception as e:
        if not _needs_values(e):
            raise  # a shape, an argument: the same on any device
    return fn()


def _needs_values(error: BaseException) -> bool:
    """Whether `error` (or what caused it) came from reading a meta tensor's values."""
    while error is not None:
        if isinstance(error, NotImplementedError) or "meta" in str(error):
            return True
        error = error.__cause__ or error.__context__
    return False


# --- the model's input --------------------------------------------------------------------------


def resolve_input(
    cfg: ModelConfig, arch: Architecture, *, stored_size: int, mean: tuple, std: tuple
) -> tuple[ModelInput, dict[str, str]]:
    """What the network takes, each part from model.input, else the named weights' metadata,
    else the dataset (its stored size, its normalisation, bilinear); and where each came from."""
    named = cfg.weights if cfg.weights and not is_weights_file(cfg.weights) else None
    from_weights = arch.weights_input(named) if named else {}
    if from_weights.get("interpolation") not in (None, "bilinear", "bicubic"):
        log.warning(
            "weights %s resize with %s, which this bundle does not: bilinear instead",
            *(named, from_weights.pop("interpolation")),
        )
    dataset = {"image_size": stored_size, "interpolation": "bilinear", "mean": mean, "std": std}
    chosen, source = {}, {}
    for key, fallback in dataset.items():
        given = getattr(cfg.input, key)
        if given is not None:
            chosen[key], source[key] = given, "model.input"
        elif key in from_weights:
            chosen[key], source[key] = from_weights[key], f"weights {named}"
        else:
            chosen[key], source[key] = fallback, "the dataset"
    chosen["mean"], chosen["std"] = tuple(chosen["mean"]), tuple(chosen["std"])
    return ModelInput(**chosen), source


def check_model(cfg: ModelConfig, *, num_classes: int, stored_size: int, mean, std, dataset: str):
    """On the driver, before any worker starts: the name, the builder arguments, the weights
    (a name is looked up, a file is read and fitted; nothing downloads), the head, and a forward
    pass at the input size. Returns the model's input (ModelInput)."""
    arch = architecture(cfg.name, cfg.kwargs)
    if cfg.weights and not is_weights_file(cfg.weights):
        arch.check_weights_name(cfg.weights)
    inputs, source = resolve_input(cfg, arch, stored_size=stored_size, mean=mean, std=std)
    if inputs.image_size > stored_size:
        raise InputError(
            f"dataset {dataset} stores {stored_size} px images, smaller than the "
            f"{inputs.image_size} px model {cfg.name} takes (from {source['image_size']}): "
            f"preprocess it with image_size={inputs.image_size} or more, or set "
            f"model.input.image_size={stored_size}"
        )
    if cfg.weights and is_weights_file(cfg.weights):
        state = read_state_dict(Location.parse(cfg.weights))
        wanted = _shapes(lambda: arch.build(num_classes))
        head = head_keys(arch, num_classes)
        what = f"model.weights {cfg.weights}"
        check_fit(_shapes_of(state), wanted, head, arch, what, InputError)
    _check_forward(arch, num_classes, inputs.image_size)
    log.info(
        "model %s%s: %d px (from %s), %s (from %s), mean %s std %s (from %s)",
        cfg.name,
        f" with weights {cfg.weights}" if cfg.weights else "",
        *(inputs.image_size, source["image_size"], inputs.interpolation, source["interpolation"]),
        *(list(inputs.mean), list(inputs.std), source["mean"]),
    )
    return inputs


def _check_forward(arch: Architecture, num_classes: int, size: int) -> None:
    """Two images through the network in training mode must give (2, num_classes) logits."""

    def forward():
        model = arch.build(num_classes).train()
        return model(torch.zeros(2, 3, size, size))

    try:
        out = _on_meta(forward)
    except (ConfigError, InputError):
        raise
    except Exception as e:
        raise ConfigError(
            f"model {arch.name} does not take {size} px images: {type(e).__name__}: {e}. Set "
            "model.input.image_size to a size it takes, or model.kwargs for this size (a ViT's "
            "image_size)"
        ) from None
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != (2, num_classes):
        got = f"shape {list(out.shape)}" if isinstance(out, torch.Tensor) else type(out).__name__
        raise ConfigError(
            f"model {arch.name} returns {got} for 2 images in training mode; training needs "
            f"logits of shape [2, {num_classes}] (one per class). Turn auxiliary outputs off in "
            "model.kwargs (aux_logits: false), or make the function size its head by num_classes"
        )


# --- checkpoints --------------------------------------------------------------------------------


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The bare model inside DDP (or torch.compile), whose state_dict has no 'module.' prefix."""
    while hasattr(model, "module") or hasattr(model, "_orig_mod"):
        model = getattr(model, "module", None) or model._orig_mod
    return model


def load_model(
    checkpoint: Location,
    *,
    weights: str | None = None,
    allow_modules: Sequence[str] = (),
    code_root: Path | None = None,
) -> tuple[torch.nn.Module, CheckpointMeta]:
    """The checkpoint's model (local or on storage) on the CPU in eval mode, and its metadata:
    rebuilt from the checkpoint alone, with no code but what the user chose
    (`check_model_code`). `weights`: "raw" or "ema"; by default the better on val of those it
    holds (`served_weights`)."""
    meta = read_meta(checkpoint)
    spec = meta.model
    check_model_code(spec, allow_modules=allow_modules, code_root=code_root)
    model = build_model(
        len(meta.classes),
        name=spec.name,
        kwargs=spec.kwargs,
        bn_momentum=spec.bn_momentum,
        bn_eps=spec.bn_eps,
    )
    model.load_state_dict(load_weights(checkpoint, meta, weights or served_weights(meta)))
    return model.eval(), meta


# --- the code a checkpoint names ----------------------------------------------------------------

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
