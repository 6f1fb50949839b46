"""The two programs an export holds, each of the network alone: a float32 NCHW batch of
normalised pixels in (`INPUT`, any batch size), logits out (`OUTPUT`).

model.onnx  torch.onnx.export (the dynamo exporter) at a stated opset: ONNX Runtime, TensorRT
model.pt2   torch.export.export, saved with torch.export.save: AOTInductor, ExecuTorch, torch

onnx, onnxscript and onnxruntime (requirements/export.txt) are imported inside the functions
that need them: the job clients and the chain never load them.
"""

from __future__ import annotations

import importlib.metadata
import logging
import time
from pathlib import Path

import numpy as np
import torch

from pipeline.core.errors import InputError

ONNX, ONNX_DATA, PT2 = "model.onnx", "model.onnx.data", "model.pt2"
INPUT, OUTPUT = "pixels", "logits"
# protobuf caps one file at 2 GiB: weights near that go beside model.onnx, in ONNX_DATA.
ONNX_INLINE_BYTES = 2**31 - 2**27
# The exporter's optimisation passes log each step at INFO: kept to their warnings.
EXPORTER_LOGGERS = ("onnxscript", "onnx_ir")
# What an export records of the software that made it.
PACKAGES = ("torch", "onnx", "onnxscript", "onnxruntime")


def example_batch(image_size: int) -> torch.Tensor:
    """What the exporters trace with: two images, so that the batch dimension stays free (an
    example batch of 1 would be specialised to 1)."""
    return torch.randn(2, 3, image_size, image_size, generator=torch.Generator().manual_seed(0))


def _dynamic_batch() -> tuple[dict[int, torch.export.Dim]]:
    return ({0: torch.export.Dim("batch", min=1)},)


def export_onnx(
    model: torch.nn.Module | torch.export.ExportedProgram,
    example: torch.Tensor,
    path: Path,
    *,
    opset: int,
) -> None:
    """`model` (eval mode) as an ONNX file at `path`, of `opset`, with a dynamic batch dimension;
    its weights inside the file unless they near protobuf's 2 GiB limit. `model` may be the
    program export_pt2 returned: the ONNX exporter then translates it, not tracing the network
    again (what it would trace is that program: torch.export.export, strict=False)."""
    program = isinstance(model, torch.export.ExportedProgram)
    state = model.state_dict if program else model.state_dict()
    weights = sum(t.numel() * t.element_size() for t in state.values())
    levels = {name: logging.getLogger(name).level for name in EXPORTER_LOGGERS}
    for name in EXPORTER_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    try:
        torch.onnx.export(
            model,
            (example,),
            str(path),
            dynamo=True,
            opset_version=opset,
            input_names=[INPUT],
            output_names=[OUTPUT],
            dynamic_shapes=_dynamic_batch(),
            external_data=weights > ONNX_INLINE_BYTES,
            verbose=False,
        )
    except Exception as e:  # the exporter's own words: an operator it cannot translate, ...
        raise InputError(f"the network does not export to ONNX: {type(e).__name__}: {e}") from None
    finally:
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)


def export_pt2(
    model: torch.nn.Module, example: torch.Tensor, path: Path
) -> torch.export.ExportedProgram:
    """`model` (eval mode) as torch.export's program at `path`, with a dynamic batch dimension;
    returns the program."""
    try:
        program = torch.export.export(model, (example,), dynamic_shapes=_dynamic_batch())
    except Exception as e:  # data-dependent control flow, an unsupported construct, ...
        raise InputError(
            f"the network does not export with torch.export: {type(e).__name__}: {e}"
        ) from None
    torch.export.save(program, str(path))
    return program


def export_both(
    model: torch.nn.Module, example: torch.Tensor, directory: Path, *, opset: int
) -> dict[str, float]:
    """`model` (eval mode) as PT2 and ONNX in `directory`, from one trace: the ONNX exporter
    translates the program torch.export made. The seconds each took: {"onnx": s, "pt2": s}."""
    started = time.perf_counter()
    program = export_pt2(model, example, directory / PT2)
    traced = time.perf_counter()
    export_onnx(program, example, directory / ONNX, opset=opset)
    return {"onnx": time.perf_counter() - traced, "pt2": traced - started}


class OnnxRuntime:
    """model.onnx on ONNX Runtime's CPU provider: float32 NCHW in, logits out."""

    name = "onnxruntime"

    def __init__(self, path: Path, *, threads: int):
        import onnxruntime

        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        self.session = onnxruntime.InferenceSession(
            str(path), options, providers=["CPUExecutionProvider"]
        )

    def __call__(self, pixels: np.ndarray) -> np.ndarray:
        return self.session.run([OUTPUT], {INPUT: pixels})[0]


class ExportedProgram:
    """model.pt2 loaded back with torch.export.load: float32 NCHW in, logits out."""

    name = "torch.export"

    def __init__(self, path: Path):
        self.module = torch.export.load(str(path)).module()

    @torch.inference_mode()
    def __call__(self, pixels: np.ndarray) -> np.ndarray:
        return self.module(torch.from_numpy(pixels)).numpy()


def versions() -> dict[str, str]:
    """The installed versions of the packages that made and checked an export."""
    return {name: importlib.metadata.version(name) for name in PACKAGES}
