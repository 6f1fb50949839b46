"""Weights into a network: a state_dict file read (torch.save, .safetensors, a training
checkpoint), fitted to all of the network but its head, with errors that name what does not fit;
tensor shapes found on the meta device, without memory or compute."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from pipeline.core.errors import InputError
from pipeline.core.storage import Location
from pipeline.model.checkpoint import load_tensors


class Buildable(Protocol):
    """What fitting weights asks of a network (pipeline.model.networks.Architecture): its name
    and builder arguments, for errors, and a build with a head of `num_classes`."""

    name: str
    kwargs: dict[str, Any]

    def build(self, num_classes: int) -> torch.nn.Module: ...


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


def head_keys(arch: Buildable, num_classes: int) -> set[str]:
    """The names of the head's tensors: those whose shapes change with num_classes."""
    a, b = (shapes(lambda n=n: arch.build(n)) for n in (num_classes, num_classes + 1))
    return {k for k, shape in a.items() if b.get(k) != shape}


def load_backbone(
    model: torch.nn.Module,
    state: dict[str, torch.Tensor],
    arch: Buildable,
    num_classes: int,
    *,
    what: str,
    error: type[Exception] = InputError,
) -> None:
    """Load `state` (`what`: said in errors) into all of `model` but its head; every other
    tensor must be there, with its shape."""
    head = head_keys(arch, num_classes)
    check_fit(shapes_of(state), shapes_of(model.state_dict()), head, arch, what, error)
    model.load_state_dict({k: v for k, v in state.items() if k not in head}, strict=False)


def check_fit(
    given: dict[str, tuple],
    wanted: dict[str, tuple],
    head: set[str],
    arch: Buildable,
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


def shapes_of(state: dict[str, torch.Tensor]) -> dict[str, tuple]:
    """Each tensor's name to its shape."""
    return {k: tuple(v.shape) for k, v in state.items()}


def shapes(build: Callable[[], torch.nn.Module]) -> dict[str, tuple]:
    """The shapes of the state_dict of the network that `build` makes, built on the meta device."""
    return shapes_of(on_meta(build).state_dict())


def on_meta(fn: Callable[[], Any]) -> Any:
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
