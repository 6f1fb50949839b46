"""The driver's model check, before any worker starts (name, builder arguments, weights, head,
a forward pass), and the network's input resolved from model.input, the weights or the dataset."""

from __future__ import annotations

import logging

import torch

from pipeline.core.errors import ConfigError, InputError
from pipeline.core.storage import Location
from pipeline.model.checkpoint import ModelInput
from pipeline.model.config import ModelConfig, is_weights_file
from pipeline.model.networks import Architecture, architecture
from pipeline.model.weights import check_fit, head_keys, on_meta, read_state_dict, shapes, shapes_of

log = logging.getLogger(__name__)


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
        wanted = shapes(lambda: arch.build(num_classes))
        head = head_keys(arch, num_classes)
        what = f"model.weights {cfg.weights}"
        check_fit(shapes_of(state), wanted, head, arch, what, InputError)
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
        out = on_meta(forward)
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
