"""Networks by name: a torchvision classifier, a timm model (`timm/<name>`) or the user's own
(`module:function`), built fresh or from initial weights (a name, or a state_dict file).

Every network comes from its builder with a head for the dataset's classes (`num_classes=`), so
that a checkpoint rebuilds the very same network from its name and builder arguments alone.
Pretrained weights go into all of it but the head: the tensors whose shapes follow num_classes
(`fc`, `classifier.3`, `heads.head`, timm's classifier, whatever the architecture calls it).
"""

from __future__ import annotations

import difflib
import importlib
import logging
from collections.abc import Callable
from typing import Any

import torch

from pipeline.core.errors import ConfigError, InputError
from pipeline.core.storage import Location
from pipeline.model.config import is_weights_file
from pipeline.model.weights import load_backbone, read_state_dict

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


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The bare model inside DDP (or torch.compile), whose state_dict has no 'module.' prefix."""
    while hasattr(model, "module") or hasattr(model, "_orig_mod"):
        model = getattr(model, "module", None) or model._orig_mod
    return model
