"""Image files of every format and kind that decode_image reads, made here from a seed, and the
memory that decoding one takes, measured in a fork of a fresh process: for the tests
(tests/corpus.py) and bench/decode_memory.py.

    python -m harness.images [--plain] [--size 224] FILE...   # prints the measurements as JSON
"""

from __future__ import annotations

import argparse
import io
import json
import os
import resource
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps, TiffImagePlugin

from harness.cluster import BUNDLE_ROOT


def picture(w: int, h: int, seed: int = 0) -> np.ndarray:
    """uint8 (h, w, 3): smooth colour ramps, cheap to make at any size."""
    x = np.linspace(0, 1, w, dtype=np.float32)[None, :]
    y = np.linspace(0, 1, h, dtype=np.float32)[:, None]
    phase = np.random.default_rng(seed).uniform(0, 6)
    ramps = [x * 0.7 + y * 0.3, 1 - x * y, 0.5 + 0.5 * np.sin(12 * x + 7 * y + phase)]
    return (np.stack(np.broadcast_arrays(*ramps), axis=-1) * 255).astype(np.uint8)


def rgb(w: int, h: int) -> Image.Image:
    return Image.fromarray(picture(w, h))


def rgba(w: int, h: int) -> Image.Image:
    """The picture, transparent at the left edge to opaque at the right."""
    img = rgb(w, h)
    img.putalpha(Image.fromarray(np.broadcast_to(np.linspace(0, 255, w), (h, w)).astype(np.uint8)))
    return img


def grey16(w: int, h: int) -> np.ndarray:
    return picture(w, h)[..., 0].astype(np.uint16) * 257


def save(img: Image.Image, fmt: str, **options) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **options)
    return buf.getvalue()


def exif(orientation: int) -> bytes:
    """EXIF with an orientation to turn by, and a string."""
    tags = Image.Exif()
    tags[0x0112], tags[0x010F] = orientation, "camera"
    return tags.tobytes()


def one_strip_tiff(img: Image.Image, **options) -> bytes:
    """A TIFF in one strip: libtiff's buffer is then the whole image, its largest."""
    old, TiffImagePlugin.STRIP_SIZE = TiffImagePlugin.STRIP_SIZE, 1 << 40
    try:
        return save(img, "TIFF", **options)
    finally:
        TiffImagePlugin.STRIP_SIZE = old


def mpo(w: int, h: int) -> bytes:
    """A phone's multi-picture JPEG: a second picture after the first."""
    return save(rgb(w, h), "MPO", save_all=True, append_images=[rgb(w, h).rotate(90)])


def pgm16(w: int, h: int) -> bytes:
    return f"P5\n{w} {h}\n65535\n".encode() + grey16(w, h).astype(">u2").tobytes()


def tiled_tiff(w: int, h: int, tile: int) -> bytes:
    """An RGB TIFF of one deflated tile of `tile` x `tile` px (Pillow writes no tiles)."""
    import struct
    import zlib

    pixels = zlib.compress(rgb(w, h).resize((tile, tile)).tobytes() if tile <= 256 else b"")
    tags = [(256, w), (257, h), (258, 8), (259, 8), (262, 2), (277, 3)]
    tags += [(322, tile), (323, tile), (324, 0), (325, len(pixels))]  # width, length, offset, size
    start = 8 + 2 + 12 * len(tags) + 4  # the tile follows the header and the one directory
    out = b"II*\x00" + struct.pack("<IH", 8, len(tags))
    for tag, value in tags:
        out += struct.pack("<HHII", tag, 4, 1, start if tag == 324 else value)  # 4: LONG
    return out + struct.pack("<I", 0) + pixels


# name -> (w, h) -> a file's bytes: each format decode_image reads, in the kinds that take their
# own path through it (bit depth, transparency, orientation, progressive JPEG, one TIFF strip).
VARIANTS: dict[str, Callable[[int, int], bytes]] = {
    "jpeg": lambda w, h: save(rgb(w, h), "JPEG", quality=90),
    "jpeg-exif-turned": lambda w, h: save(rgb(w, h), "JPEG", exif=exif(6)),
    "jpeg-progressive-444": lambda w, h: save(rgb(w, h), "JPEG", progressive=True, subsampling=0),
    "jpeg-cmyk": lambda w, h: save(rgb(w, h).convert("CMYK"), "JPEG"),
    "jpeg-grey": lambda w, h: save(rgb(w, h).convert("L"), "JPEG"),
    "mpo": mpo,
    "png": lambda w, h: save(rgb(w, h), "PNG"),
    "png-rgba": lambda w, h: save(rgba(w, h), "PNG"),
    "png-la": lambda w, h: save(rgba(w, h).convert("LA"), "PNG"),
    "png-palette-transparent": lambda w, h: save(rgb(w, h).quantize(64), "PNG", transparency=0),
    "png-16bit-grey": lambda w, h: save(Image.fromarray(grey16(w, h)), "PNG"),
    "png-exif-turned": lambda w, h: save(rgba(w, h), "PNG", exif=exif(8)),
    "gif": lambda w, h: save(rgb(w, h), "GIF", transparency=0),
    "webp": lambda w, h: save(rgb(w, h), "WEBP", quality=80),
    "webp-alpha": lambda w, h: save(rgba(w, h), "WEBP", lossless=True),
    "webp-alpha-turned": lambda w, h: save(rgba(w, h), "WEBP", quality=80, exif=exif(3)),
    "tiff": lambda w, h: one_strip_tiff(rgb(w, h)),
    "tiff-deflate": lambda w, h: save(rgb(w, h), "TIFF", compression="tiff_adobe_deflate"),
    "tiff-float": lambda w, h: one_strip_tiff(Image.fromarray(picture(w, h)[..., 1] / 255.0)),
    "tiff-16bit": lambda w, h: one_strip_tiff(Image.fromarray(grey16(w, h))),
    "tiff-32bit": lambda w, h: one_strip_tiff(Image.fromarray(grey16(w, h).astype(np.int32))),
    "tiff-rgba-turned": lambda w, h: one_strip_tiff(rgba(w, h), exif=exif(5)),
    "bmp": lambda w, h: save(rgb(w, h), "BMP"),
    "bmp-rgba": lambda w, h: save(rgba(w, h), "BMP"),
    "qoi": lambda w, h: save(rgb(w, h), "QOI"),
    "qoi-rgba": lambda w, h: save(rgba(w, h), "QOI"),
    "pgm-16bit": pgm16,
    "avif": lambda w, h: save(rgb(w, h), "AVIF", quality=50),
    "avif-alpha": lambda w, h: save(rgba(w, h), "AVIF", quality=50),
}


def decode_plain(data: bytes) -> Image.Image:
    """The plain alternative to decode_image: Pillow's usual open, load, turn and convert."""
    img = Image.open(io.BytesIO(data))
    img.load()
    return ImageOps.exif_transpose(img).convert("RGB")


def decode_peaks(paths: list[Path], *, size: int = 224, plain: bool = False) -> list[dict]:
    """For each file: the most memory (resident bytes) that decoding and resizing it to `size`
    added, each in its own fork of a process that has decoded nothing yet (one that decoded
    other images before may reuse the memory they freed, and add less); its pixels, counted as
    decode_image's limit counts them (from the file's header: also for a file that does not
    decode); and the error, if any. Linux only (/proc)."""
    args = ["--size", str(size), *(["--plain"] if plain else []), *map(str, paths)]
    proc = subprocess.run(
        [sys.executable, "-m", "harness.images", *args],
        cwd=BUNDLE_ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"measuring failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout)


def header_pixels(data: bytes) -> int:
    """The pixels the file's header declares, as decode_image counts them (0: no header)."""
    from pipeline.data.images import FORMATS, ROW_PIXELS

    try:
        img = Image.open(io.BytesIO(data), formats=FORMATS)
    except Exception:
        return 0
    w, h = img.size
    tile = (img.tag_v2.get(322, 0), img.tag_v2.get(323, 0)) if img.format == "TIFF" else (0, 0)
    return max((w + ROW_PIXELS) * h, tile[0] * tile[1])


def measure(path: Path, size: int, plain: bool) -> dict:
    """Decode and resize `path` in a fork: the peak resident bytes that added, and the error."""
    from pipeline.data.images import BadImageError, decode_image, resize_center_crop

    data = path.read_bytes()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        start = int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        try:
            resize_center_crop((decode_plain if plain else decode_image)(data), size=size)
            error = None
        except BadImageError as e:
            error = str(e)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        os.write(write, json.dumps([peak - start, error]).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        out = f.read()
    _, status = os.waitpid(pid, 0)
    if status != 0 or not out:
        raise RuntimeError(f"decoding {path} killed its fork (wait status {status})")
    peak, error = json.loads(out)
    return {"file": path.name, "pixels": header_pixels(data), "peak": peak, "error": error}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=224, help="side to resize and crop to")
    parser.add_argument("--plain", action="store_true", help="decode as decode_plain does")
    parser.add_argument("paths", nargs="+", type=Path)
    args = parser.parse_args()
    warnings.simplefilter("ignore")  # Pillow's, on damaged files
    Image.init()  # Pillow imports its format plugins at the first open: once a process
    print(json.dumps([measure(p, args.size, args.plain) for p in args.paths]))


if __name__ == "__main__":
    main()
