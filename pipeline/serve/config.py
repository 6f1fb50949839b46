"""The online classifier's config: the `args` of a Serve config file."""

from __future__ import annotations

import os
import re
from typing import Annotated, Literal

from pydantic import AfterValidator, Field

from pipeline.core.config import (
    REGISTERED_MODEL,
    AllowedModules,
    Strict,
    absolute_or_uri,
    allow_modules_field,
    registered_model,
)


def _model_source(value: str) -> str:
    # $NAME or ${NAME}, expanded where the application is built: on Anyscale,
    # $ANYSCALE_ARTIFACT_STORAGE/... (a Serve config file expands nothing itself).
    value = os.path.expandvars(value)
    if unset := re.findall(r"\$\{?(\w+)", value):
        raise ValueError(
            f"{value!r} names the environment variable {unset[0]}, which is not set where the "
            "application is built: set it there (the application's runtime_env env_vars) or "
            "write the path out"
        )
    if value.startswith(REGISTERED_MODEL):
        name, version, alias = registered_model(value)
        if not name or not (version or alias):
            raise ValueError(
                f"{value!r} names no version: give models:/<name>/<version> or "
                "models:/<name>@<alias>"
            )
        return value
    return absolute_or_uri(value)


ModelSource = Annotated[str, AfterValidator(_model_source)]


class ServeConfig(Strict):
    """The online classifier's `args` in a Serve config file (configs/serve.yaml). Replicas,
    autoscaling, CPUs and GPUs are Serve's own deployment options, beside them in that file."""

    model: ModelSource = Field(
        description="A training run directory (its best checkpoint by its checkpoint.metric), one "
        "checkpoint directory, or a registered model version (models:/<name>/<version>, "
        "models:/<name>@<alias>); resolved once per deploy, so every replica serves one "
        "checkpoint. $NAME and ${NAME} are expanded from the environment."
    )
    tracking_uri: str | None = Field(
        None,
        description="MLflow server holding the registered model; null: MLFLOW_TRACKING_URI.",
    )
    top_k: int = Field(5, ge=1, description="Most likely classes in each answer.")
    max_batch_size: int = Field(
        16, ge=1, description="Most images per model call: requests that arrive together."
    )
    batch_wait_timeout_s: float = Field(
        0.005, ge=0, description="Longest wait for a batch to fill once its first image is in."
    )
    max_request_bytes: int = Field(
        10 * 2**20, ge=1, description="Largest request body accepted; a larger one gets 413."
    )
    precision: Literal["auto", "fp32", "bf16", "fp16"] = Field(
        "auto", description="auto: bf16 (else fp16) on a replica with a GPU, fp32 on CPU."
    )
    allow_modules: AllowedModules = allow_modules_field()
