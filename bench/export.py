"""Export and its runtimes on the CPU: the export job's two exporters timed, and ONNX Runtime
and the loaded torch.export program against PyTorch eager, side by side on the same batches.

    .venv/bin/python -m bench.export                   # ResNet-18 at 32 and 224 px, batch 16

For each size: ResNet-18 (10 classes, random weights: speed does not depend on them) exported
by the export wing's own functions (`model.onnx`, opset 18, and `model.pt2`), then images/s of
PyTorch eager (eval, fp32, inference mode), ONNX Runtime (CPUExecutionProvider) and the loaded
.pt2 program on one random float32 batch, `--threads` threads each, in rounds that alternate
the three for `--seconds` each, after a warm-up. Reports the medians and their ratios to eager.
Results go to bench/results/export.json.
"""

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from bench.common import write_results
from pipeline.export import formats
from pipeline.model.networks import build_model


def images_per_s(run, batch: np.ndarray, seconds: float) -> float:
    """Batches of `batch` through `run` for about `seconds`: images per second."""
    done, started = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - started) < seconds or done == 0:
        run(batch)
        done += len(batch)
    return done / elapsed


def measure(size: int, batch_size: int, threads: int, seconds: float, rounds: int) -> dict:
    torch.manual_seed(0)
    model = build_model(10, name="resnet18").eval()
    example = formats.example_batch(size)
    with tempfile.TemporaryDirectory() as tmp:
        export_s = formats.export_both(model, example, Path(tmp), opset=18)

        def eager(x: np.ndarray) -> np.ndarray:
            with torch.inference_mode():
                return model(torch.from_numpy(x)).numpy()

        runtimes = {
            "pytorch_eager": eager,
            "onnxruntime": formats.OnnxRuntime(Path(tmp) / formats.ONNX, threads=threads),
            "torch_export": formats.ExportedProgram(Path(tmp) / formats.PT2),
        }
        batch = np.random.default_rng(0).standard_normal((batch_size, 3, size, size), np.float32)
        for run in runtimes.values():  # warm-up: first-call allocations, ORT's arena
            images_per_s(run, batch, 0.5)
        per_round = {name: [] for name in runtimes}
        for _ in range(rounds):
            for name, run in runtimes.items():
                per_round[name].append(images_per_s(run, batch, seconds))
    median = {name: round(statistics.median(v), 1) for name, v in per_round.items()}
    eager_rate = median["pytorch_eager"]
    return {
        "image_size": size,
        "batch_size": batch_size,
        "threads": threads,
        "export_s": {name: round(s, 2) for name, s in export_s.items()},
        "images_per_s": median,
        "rounds": {name: [round(r, 1) for r in v] for name, v in per_round.items()},
        "vs_eager": {name: round(rate / eager_rate, 2) for name, rate in median.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[32, 224])
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=3.0, help="per runtime and round")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results = []
    for size in args.sizes:
        r = measure(size, args.batch_size, args.threads, args.seconds, args.rounds)
        results.append(r)
        rates, ratios = r["images_per_s"], r["vs_eager"]
        print(
            f"{size:4d} px, batch {r['batch_size']}, {r['threads']} threads: export "
            f"{r['export_s']['onnx']:.1f} s (ONNX), {r['export_s']['pt2']:.1f} s (.pt2); "
            f"images/s eager {rates['pytorch_eager']}, onnxruntime {rates['onnxruntime']} "
            f"({ratios['onnxruntime']}x), .pt2 {rates['torch_export']} "
            f"({ratios['torch_export']}x)",
            flush=True,
        )
    write_results("export", {**formats.versions(), "runs": results})


if __name__ == "__main__":
    main()
