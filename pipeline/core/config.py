"""Typed job configs: defaults < YAML file < `key=value` command-line overrides; the types and
sections every job's schema shares. Each job's own schema lives beside its wing
(pipeline/<wing>/config.py)."""

from __future__ import annotations

import json
import re
import textwrap
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError
from pydantic_core import PydanticUndefined

from pipeline.core.errors import ConfigError
from pipeline.core.uris import check_scheme


class Strict(BaseModel):
    # strict: YAML and overrides are parsed to real types, so "5" for an int is a mistake.
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


def absolute_or_uri(value: str | None) -> str | None:
    if value:
        check_scheme(value)
    # A Ray job runs in a temporary copy of the bundle: a relative path would vanish with it.
    if value and "://" not in value and not value.startswith("/"):
        raise ValueError(
            f"{value!r} is relative; use an absolute path or a URI such as s3://bucket/path "
            "(jobs run in a temporary copy of the bundle, where relative paths are lost)"
        )
    return value


AbsolutePathOrURI = Annotated[str, AfterValidator(absolute_or_uri)]


# A model version in MLflow's registry: models:/<name>/<version> or models:/<name>@<alias>.
REGISTERED_MODEL = "models:/"


def registered_model(uri: str) -> tuple[str, str, str]:
    """(name, version, alias) of models:/<name>/<version> (alias "") or models:/<name>@<alias>
    (version "")."""
    name, at, alias = uri.removeprefix(REGISTERED_MODEL).partition("@")
    if at:
        return name, "", alias
    name, _, version = name.rpartition("/")
    return name, version, ""


class TrackingConfig(Strict):
    uri: str | None = Field(
        None,
        description="MLflow tracking server (http://host:5000); null: MLFLOW_TRACKING_URI if set, "
        "else no tracking.",
    )
    experiment: str = Field("ray-cv-bundle", description="MLflow experiment of the job's runs.")


class StallConfig(Strict):
    multiple: float = Field(
        20,
        gt=1,
        description="End the job (exit 3) once a training step or an inference batch is held "
        "this many times the median one's time, naming the rank or actor that holds it.",
    )
    min_s: float = Field(
        300,
        gt=0,
        description="Seconds without progress that never count as stalled, whatever the "
        "multiple: checkpoints, an epoch's first steps, an actor's first batch are slow.",
    )


def _module_name(value: str) -> str:
    if not all(part.isidentifier() for part in value.split(".")):
        raise ValueError(f"{value!r} is not a module name: give a dotted name such as mynets.vit")
    return value


def allow_modules_field() -> Any:
    """The `allow_modules` key of every job that loads a checkpoint (pipeline.model.trust:
    check_model_code)."""
    return Field(
        (),
        description="Modules a checkpoint's module:function model may import from outside the "
        "job's working dir, e.g. [mynets] installed on the nodes (docs/models.md).",
    )


AllowedModules = tuple[Annotated[str, AfterValidator(_module_name)], ...]


# A cloud node takes minutes to boot and run its setup commands (cluster.yaml installs torch).
CAPACITY_TIMEOUT_S = 600


C = TypeVar("C", bound=BaseModel)


class _YAMLLoader(yaml.SafeLoader):
    """YAML with numbers as people write them. PyYAML follows YAML 1.1, where `1e-3` and
    `1.0e3` are strings (an exponent needs a dot and a sign); YAML 1.2 reads them as floats."""


_YAMLLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9][0-9_]*)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def parse_yaml(text: str) -> Any:
    return yaml.load(text, Loader=_YAMLLoader)


def load_config(
    cls: type[C],
    path: str | Path | list[str | Path] | None = None,
    overrides: list[str] = (),
) -> C:
    """Build `cls` from YAML files and `dotted.key=value` overrides (values parsed as YAML).

    With several files (a base config, then a recipe), each later file overrides the earlier
    ones key by key: a section it names is merged, not replaced."""
    paths = [] if path is None else [path] if isinstance(path, str | Path) else list(path)
    data: dict[str, Any] = {}
    for p in paths:
        _merge(data, _read_yaml(p))
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} must look like key=value, e.g. {_example(cls)}")
        try:
            value = parse_yaml(raw) if raw else None
        except yaml.YAMLError as e:
            raise ConfigError(
                f"override {item!r}: the value is not valid YAML ({_yaml_problem(e)}); quote it "
                f"to give a string: {key}='{raw}'"
            ) from None
        _set_dotted(data, key, value)
    return validate_config(cls, data, " + ".join(map(str, paths)) or "overrides")


def _read_yaml(path: str | Path) -> dict[str, Any]:
    try:
        data = parse_yaml(Path(path).read_text(encoding="utf-8")) or {}
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except IsADirectoryError:
        raise ConfigError(f"config file {path} is a directory: give a YAML file") from None
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"config file {path} is not UTF-8 text (byte {e.start}): save it as UTF-8 YAML"
        ) from None
    except OSError as e:
        raise ConfigError(f"config file {path} cannot be read: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {_yaml_problem(e)}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping, not {type(data).__name__}")
    return data


def _yaml_problem(error: yaml.YAMLError) -> str:
    """What PyYAML found wrong and where, on one line."""
    mark = getattr(error, "problem_mark", None)
    if mark is None:
        return " ".join(str(error).split())
    return f"{error.problem} at line {mark.line + 1}, column {mark.column + 1}"


def _merge(base: dict[str, Any], over: dict[str, Any]) -> None:
    """`over` into `base`, section by section: a leaf of `over` replaces `base`'s."""
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _merge(base[key], value)
        else:
            base[key] = value


def validate_config(cls: type[C], data: dict[str, Any], where: str = "config") -> C:
    """Validate a plain dict (e.g. a config sent to a Ray worker) into `cls`."""
    try:
        return cls.model_validate(_lists_to_tuples(data))
    except ValidationError as e:
        problems = [_describe(cls, err) for err in e.errors()]
        if len(problems) == 1:  # on the first line, which is what a scheduler's alert shows
            raise ConfigError(f"invalid config ({where}): {problems[0]}") from None
        raise ConfigError(f"invalid config ({where}):\n  " + "\n  ".join(problems)) from None


def dump_config(cfg: BaseModel) -> str:
    """The resolved config as YAML, loadable again with load_config."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


def _set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    *parents, leaf = key.split(".")
    node = data
    for i, part in enumerate(parents):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {key}: {'.'.join(parents[: i + 1])} is not a section")
        node = child
    node[leaf] = value


def _lists_to_tuples(value: Any) -> Any:
    # YAML gives lists; configs are frozen and hold tuples.
    if isinstance(value, dict):
        return {k: _lists_to_tuples(v) for k, v in value.items()}
    if isinstance(value, list):
        return tuple(_lists_to_tuples(v) for v in value)
    return value


def _describe(cls: type[BaseModel], err: dict[str, Any]) -> str:
    loc = [str(p) for p in err["loc"]]
    key = ".".join(loc)
    if err["type"] == "extra_forbidden":
        allowed = ", ".join(_fields_at(cls, loc[:-1]))
        return f"{key}: unknown key (allowed here: {allowed})"
    if err["type"] == "missing":
        return f"{key}: required, but not set (set it in the YAML file or as {key}=...)"
    msg = err["msg"].removeprefix("Value error, ")  # our validators' own words
    if not loc:  # a check across keys: its message names them
        return msg
    got = err.get("input")
    shown = f" (got {got!r}, a {type(got).__name__})" if not isinstance(got, dict) else ""
    return f"{key}: {msg}{shown}"


def _fields_at(cls: type[BaseModel], loc: list[str]) -> list[str]:
    model: Any = cls
    for part in loc:
        field = model.model_fields.get(part) if hasattr(model, "model_fields") else None
        if field is None:
            return []
        model = field.annotation
    return list(model.model_fields) if hasattr(model, "model_fields") else []


def _example(cls: type[BaseModel]) -> str:
    key, _, default, _ = next(k for k in describe_keys(cls) if k[2] != "required")
    return f"{key}={default}"


def describe_keys(cls: type[BaseModel], prefix: str = "") -> list[tuple[str, str, str, str]]:
    """(dotted key, type, default, description) of every setting of `cls`, sections flattened."""
    keys = []
    for name, field in cls.model_fields.items():
        key, annotation = prefix + name, field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            keys += describe_keys(annotation, key + ".")
            continue
        if field.default is PydanticUndefined:
            default = "required"
        else:
            default = json.dumps(field.default) if field.default is not None else "null"
            default = default.replace('"', "")
        keys.append((key, _type_name(annotation), default, field.description or ""))
    return keys


def keys_help(cls: type[BaseModel]) -> str:
    """The settings of `cls` as `key=value` help text: one entry per key."""
    lines = []
    for key, kind, default, description in describe_keys(cls):
        lines.append(f"  {key} ({kind}, default {default})")
        lines += textwrap.wrap(
            description, width=96, initial_indent=" " * 6, subsequent_indent=" " * 6
        )
    return "\n".join(lines)


def _type_name(annotation: Any) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Annotated:
        return _type_name(args[0])
    if origin is Literal:
        return "|".join(map(str, args))
    if origin in (typing.Union, types.UnionType):
        named = [_type_name(a) for a in args if a is not type(None)]
        return " or ".join(named) + (" or null" if type(None) in args else "")
    if origin is tuple:
        return f"list of {_type_name(args[0])}"
    return getattr(annotation, "__name__", str(annotation))


def flatten_config(config: dict, prefix: str = "") -> dict:
    """A config as one level of dotted keys (`optimizer.lr`), as overrides name them."""
    flat = {}
    for key, value in config.items():
        if isinstance(value, dict):
            flat |= flatten_config(value, f"{prefix}{key}.")
        else:
            flat[prefix + key] = value
    return flat
