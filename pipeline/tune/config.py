"""The sweep job's config: the train config every trial starts from, and what it searches."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import Field, model_validator

from pipeline.core.config import (
    AbsolutePathOrURI,
    Strict,
    describe_keys,
    validate_config,
)
from pipeline.core.errors import ConfigError
from pipeline.train.config import RunName, TrainConfig

if TYPE_CHECKING:  # the chain's client validates this config without torch
    from pipeline.model.checkpoint import Score

# How a key is searched: {kind: [values]} in the config file, or space.<key>='{kind: [...]}'.
KINDS = ("choice", "grid", "uniform", "loguniform")
RANGES = ("uniform", "loguniform")
# Keys the sweep sets for every trial itself, or that would make trials incomparable.
NOT_SEARCHED = {
    "dataset": "every trial trains on the sweep's dataset",
    "storage_path": "trials are runs under <storage_path>/<name>",
    "name": "each trial's run is named after the trial",
    "dataset_version": "the sweep pins one version for every trial",
    "switch_dataset": "the sweep pins one version for every trial",
    "checkpoint.metric": "trials are ranked by one score: set train.checkpoint.metric",
    "checkpoint.mode": "trials are ranked by one score: set train.checkpoint.mode",
    "tracking": "the sweep tracks its trials itself",
}
# Combinations of the discrete values validated before a sweep starts; past it, each value alone.
MAX_CHECKED = 1000


@dataclass(frozen=True)
class Param:
    """One searched key: `kind` over `values` (a choice's or grid's values, a range's bounds)."""

    key: str
    kind: str
    values: tuple

    def __str__(self) -> str:
        return f"{self.key}: {self.kind} {list(self.values)}"


def _flatten(space: dict, prefix: str = "") -> dict[str, Any]:
    """{dotted key: {kind: values}}: the space as YAML nests it, or as dotted keys."""
    flat = {}
    for key, value in space.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and value and not set(value) & set(KINDS):
            flat |= _flatten(value, dotted + ".")
        else:
            flat[dotted] = value
    return flat


def _parse(key: str, spec: Any) -> Param:
    kinds = " | ".join(f"{{{k}: [...]}}" for k in KINDS)
    if not isinstance(spec, dict) or len(spec) != 1 or next(iter(spec)) not in KINDS:
        raise ValueError(f"space.{key}: give one of {kinds} (got {spec!r})")
    ((kind, values),) = spec.items()
    if not isinstance(values, tuple | list) or not values:
        raise ValueError(f"space.{key}: {kind} takes a non-empty list (got {values!r})")
    values = tuple(values)
    if kind in RANGES:
        if len(values) != 2 or not all(
            isinstance(v, int | float) and not isinstance(v, bool) for v in values
        ):
            raise ValueError(f"space.{key}: {kind} takes [low, high], two numbers (got {values})")
        low, high = values
        if not low < high:
            raise ValueError(f"space.{key}: {kind} [{low}, {high}] is empty: low must be < high")
        if kind == "loguniform" and low <= 0:
            raise ValueError(
                f"space.{key}: loguniform [{low}, {high}] needs low > 0 (a log scale); use "
                "uniform for a range from 0"
            )
    return Param(key, kind, values)


def searchable_keys() -> dict[str, str]:
    """The train config's keys a space may name, with their type's name."""
    return {
        key: kind
        for key, kind, _, _ in describe_keys(TrainConfig)
        if key not in NOT_SEARCHED and not key.startswith("tracking.")
    }


class AshaConfig(Strict):
    enabled: bool = Field(
        True, description="Stop the trials that trail the others at each rung (ASHA)."
    )
    grace_period: int = Field(
        1, ge=1, description="Epochs every trial trains before it may be stopped."
    )
    reduction_factor: float = Field(
        2,
        gt=1,
        description="1 / the share of trials kept at each rung; rungs at grace_period * "
        "reduction_factor**k epochs.",
    )


class SweepConfig(Strict):
    dataset: AbsolutePathOrURI = Field(description="Output directory of the preprocess job.")
    storage_path: AbsolutePathOrURI = Field(
        description="Where runs live: the sweep is <storage_path>/<name>, each trial a run in it."
    )
    name: RunName = Field(
        "sweep", description="Sweep name: submitting again with the same name resumes it."
    )
    dataset_version: str | None = Field(
        None,
        description="The dataset version every trial trains on; default: the newest when the "
        "sweep starts (kept on resume).",
    )
    train: dict[str, Any] = Field(
        {},
        description="The train config every trial starts from (configs/train.yaml's keys, less "
        "dataset, storage_path and name).",
    )
    space: dict[str, Any] = Field(
        {},
        description="Train config keys to search: {choice|grid: [values]} or "
        "{uniform|loguniform: [low, high]}, e.g. space.optimizer.lr='{loguniform: [1e-4, 0.1]}'.",
    )
    num_samples: int = Field(
        1,
        ge=1,
        description="Samples of the space; each is every combination of the grid keys (one "
        "trial each).",
    )
    asha: AshaConfig = AshaConfig()
    max_concurrent_trials: int | None = Field(
        None,
        ge=1,
        description="Trials at once; null: as many as the cluster holds (each asks its "
        "train config's workers, CPUs and GPUs).",
    )
    retry_failed: bool = Field(
        False,
        description="On resume, train the trials that failed for good again (from their "
        "latest checkpoint).",
    )

    @model_validator(mode="after")
    def _every_trial_validates(self) -> SweepConfig:
        for key in ("dataset", "storage_path", "name", "dataset_version"):
            if key in self.train:
                raise ValueError(f"train.{key}: the sweep sets it: give it at the top level")
        allowed = searchable_keys()
        for key, spec in _flatten(self.space).items():
            if key in NOT_SEARCHED:
                raise ValueError(f"space.{key}: not searched ({NOT_SEARCHED[key]})")
            if key not in allowed and not key.startswith("model.kwargs."):
                raise ValueError(
                    f"space.{key}: unknown key of the train config (searchable: "
                    f"{', '.join(allowed)})"
                )
            _parse(key, spec)
        self.trial_configs()  # raises for the first value a trial would be refused
        return self

    @property
    def params(self) -> list[Param]:
        return [_parse(key, spec) for key, spec in _flatten(self.space).items()]

    @property
    def score(self) -> Score:
        """The train job's score: trials are ranked as their checkpoints are (a val_<name> of
        the user's Metric once `with_checkpoint_mode` has its order)."""
        from pipeline.model.checkpoint import config_score

        return config_score(self.base_train().model_dump())

    def with_checkpoint_mode(self, mode: str | None) -> SweepConfig:
        """This sweep with train.checkpoint.mode set: every trial ranks in that order."""
        train = _plain(self.train)
        if mode is not None:
            train.setdefault("checkpoint", {})["mode"] = mode
        return self.model_copy(update={"train": train})

    def base_train(self) -> TrainConfig:
        """The train config of every trial before the space's values."""
        return self._train(self.train_dict())

    def train_dict(self) -> dict[str, Any]:
        """The train section with the sweep's own keys, as plain data."""
        return {
            **_plain(self.train),
            "dataset": self.dataset,
            "storage_path": self.storage_path,
            "name": self.name,
            "dataset_version": self.dataset_version,
        }

    def trial_configs(self) -> list[TrainConfig]:
        """Train configs that cover the space: each value alone (a range's two ends), then
        every combination of the discrete values (past MAX_CHECKED, none) with the ranges at
        their low end. Raises ValueError naming the first value the train config refuses."""
        base, params = self.train_dict(), self.params
        configs = [self._train(base)]
        for p in params:
            for value in p.values:
                # A range's values are floats whatever its bounds: an int key takes none.
                value = float(value) if p.kind in RANGES else value
                hint = " (a range gives floats: for an int, choice or grid)" * (p.kind in RANGES)
                configs.append(self._train(base, {p.key: value}, hint))
        discrete = [p for p in params if p.kind not in RANGES]
        if len(discrete) > 1 and math.prod(len(p.values) for p in discrete) <= MAX_CHECKED:
            lows = {p.key: float(p.values[0]) for p in params if p.kind in RANGES}
            for values in itertools.product(*(p.values for p in discrete)):
                combo = dict(zip([p.key for p in discrete], values, strict=True))
                configs.append(self._train(base, combo | lows))
        return configs

    def _train(
        self, base: dict[str, Any], values: dict[str, Any] | None = None, hint: str = ""
    ) -> TrainConfig:
        data = _plain(base)
        for key, value in (values or {}).items():
            _set(data, key, value)
        try:
            return validate_config(TrainConfig, data, "train")
        except ConfigError as e:
            problem = str(e).removeprefix("invalid config (train): ")
            if not values:
                raise ValueError(f"train.{problem}") from None
            shown = ", ".join(f"{k}={v!r}" for k, v in values.items())
            if len(values) == 1:
                refused = f"a trial's train config is refused: {problem}{hint}"
                raise ValueError(f"space.{shown}: {refused}") from None
            raise ValueError(
                f"space values {shown} together: a trial's train config is refused: {problem}"
            ) from None


def _plain(value: Any) -> Any:
    """A config section as YAML gives it: dicts and lists (copies)."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def _set(data: dict[str, Any], key: str, value: Any) -> None:
    *parents, leaf = key.split(".")
    for part in parents:
        data = data.setdefault(part, {})
    data[leaf] = value
