"""Memory per pixel of decoding and resizing one image, per format and kind: decode_image against
Pillow's plain open, load, exif_transpose and convert("RGB").

    .venv/bin/python -m bench.decode_memory [--megapixels 16]

Each file (harness/images.py's VARIANTS, square, plus a 1 px wide and a 1 px high PNG of as many
pixels) is decoded and resized to 224 px in a fork of its own of a process that has decoded
nothing yet; the figure is the resident memory that added, per pixel as decode_image's limit
counts them (a row is 2 more). docs/errors.md's bound is tests/corpus.py's BYTES_PER_PIXEL times
the limit: the largest figure here, with room for the allocator.
"""

import argparse
import tempfile
import warnings
from pathlib import Path

from bench.common import write_results
from harness.images import VARIANTS, decode_peaks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megapixels", type=float, default=16)
    args = parser.parse_args()
    side = int((args.megapixels * 1e6) ** 0.5)
    warnings.simplefilter("ignore")
    with tempfile.TemporaryDirectory(prefix="decode-memory-") as tmp:
        paths = []
        for name, make in VARIANTS.items():
            paths.append(Path(tmp) / name)
            paths[-1].write_bytes(make(side, side))
        for w, h in [(1, side * side // 3), (side * side // 3, 1)]:
            paths.append(Path(tmp) / f"png-{w}x{h}")
            paths[-1].write_bytes(VARIANTS["png"](w, h))
        ours = decode_peaks(paths)
        plain = decode_peaks(paths, plain=True)
    rows = []
    print(f"{'file':28s} {'MiB':>7s} {'B/px':>6s} {'plain B/px':>10s} {'ours/plain':>10s}")
    for a, b in zip(ours, plain, strict=True):
        row = {
            "file": a["file"],
            "pixels": a["pixels"],
            "peak_mib": a["peak"] / 2**20,
            "bytes_per_pixel": a["peak"] / a["pixels"],
            "plain_bytes_per_pixel": b["peak"] / b["pixels"],
        }
        rows.append(row)
        print(
            f"{row['file']:28s} {row['peak_mib']:7.1f} {row['bytes_per_pixel']:6.2f} "
            f"{row['plain_bytes_per_pixel']:10.2f} "
            f"{row['bytes_per_pixel'] / row['plain_bytes_per_pixel']:9.2f}x"
        )
    worst = max(rows, key=lambda r: r["bytes_per_pixel"])
    print(f"most: {worst['file']}, {worst['bytes_per_pixel']:.2f} bytes per pixel")
    write_results("decode_memory", {"side": side, "rows": rows})


if __name__ == "__main__":
    main()
