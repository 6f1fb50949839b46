"""The network a run trains: its builder, initial weights and input."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, model_validator

from pipeline.core.config import Strict, absolute_or_uri

# A model by name: a torchvision builder, timm/<name>, or the user's own module:function.
MODEL_NAME = re.compile(r"^(timm/)?[A-Za-z0-9_][A-Za-z0-9_.\-]*$|^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
WEIGHTS_FILE_SUFFIXES = (".pt", ".pth", ".bin", ".safetensors")


def is_weights_file(weights: str) -> bool:
    """A weights setting that names a file (a path or a URI), not weights by name."""
    return "/" in weights or weights.endswith(WEIGHTS_FILE_SUFFIXES)


def _model_name(value: str) -> str:
    if not MODEL_NAME.match(value):
        raise ValueError(
            "not a model name: give a torchvision builder (resnet50), timm/<name> "
            "(timm/convnext_tiny) or module:function (examples.custom_model.tiny_cnn:build)"
        )
    return value


class ModelInputConfig(Strict):
    image_size: int | None = Field(
        None,
        ge=8,
        description="Side of the square images the network takes (stored images are resized to "
        "it); default: the weights' own, else the dataset's.",
    )
    interpolation: Literal["bilinear", "bicubic"] | None = Field(
        None, description="How stored images are resized to image_size; default: the weights' own."
    )
    mean: tuple[float, float, float] | None = Field(
        None,
        description="Per-channel mean of 0-1 pixels; default: the weights' own, else the "
        "dataset's (ImageNet's).",
    )
    std: tuple[float, float, float] | None = Field(
        None,
        description="Per-channel std of 0-1 pixels; default: the weights' own, else the "
        "dataset's (ImageNet's).",
    )

    @model_validator(mode="after")
    def _positive_std(self) -> ModelInputConfig:
        if self.std is not None and min(self.std) <= 0:
            raise ValueError(f"std={list(self.std)}: every value must be above 0")
        return self


class ModelConfig(Strict):
    name: Annotated[str, AfterValidator(_model_name)] = Field(
        "resnet18",
        description="A torchvision classifier (resnet50, efficientnet_b0, vit_b_16, ...), "
        "timm/<name>, or module:function returning an nn.Module.",
    )
    weights: str | None = Field(
        None,
        description="Initial weights: a name (DEFAULT, IMAGENET1K_V2, ...) or a state_dict file "
        "(absolute path or URI); the head is always new.",
    )
    kwargs: dict[str, Any] = Field(
        {}, description="Keyword arguments to the model's builder, e.g. {image_size: 32} for a ViT."
    )
    bn_momentum: float | None = Field(
        None,
        gt=0,
        le=1,
        description="Every BatchNorm layer's momentum (the weight of each batch in its running "
        "statistics; PyTorch's default 0.1); null: the architecture's own (MobileNetV3 0.01).",
    )
    bn_eps: float | None = Field(
        None, gt=0, description="Every BatchNorm layer's epsilon; null: the architecture's own."
    )
    input: ModelInputConfig = ModelInputConfig()

    @model_validator(mode="after")
    def _name_and_weights(self) -> ModelConfig:
        if "num_classes" in self.kwargs:
            raise ValueError("kwargs.num_classes: the dataset's classes set it; leave it out")
        w = self.weights
        if w and is_weights_file(w):
            if "://" not in w:
                absolute_or_uri(w)
        elif w and ":" in self.name:
            raise ValueError(
                f"weights={w!r}: a module:function model takes weights from a state_dict file "
                "only (absolute path or URI); or load them in the function itself"
            )
        return self
