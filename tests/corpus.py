"""A seeded corpus of image files for the decoding fuzz tests (tests/unit/test_transforms.py, and a
share of it through the Serve app in tests/ray/test_serve.py): every format and kind decode_image
reads, extreme shapes and every EXIF orientation, each whole, cut short at many places, and
with bytes changed at many places. Made in the test, the same on every run."""

from __future__ import annotations

import random
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from harness.images import VARIANTS, exif, rgb, save
from pipeline.data.images import MAX_PIXELS, MAX_WHOLE_RESIZE

SEED = 20261126
# docs/errors.md's bound: the most resident memory decoding and resizing one image adds, per
# pixel of the limit. WebP holds the most: libwebp's two frame buffers, its frame's copy and the
# image, 16 bytes a pixel (bench/decode_memory.py, 16 MP). At some sizes the allocator keeps a
# freed buffer and takes new pages for the next: up to 21 measured, at 4 MP.
BYTES_PER_PIXEL = 24
# How the reason of each BadImageError starts (docs/errors.md): every failure is one of them.
REASONS = (
    "truncated or corrupt image",
    "not an image (unrecognised format)",
    "too large to decode",
)
# What a decode adds besides its pixels: a decoder's state, Python's objects, the process's pages.
# The most is AVIF's (dav1d's state): 2.9 MiB here for a 416 px image with one thread, 4.4 MiB
# on a CI machine with two; it varies by machine.
SLACK = 6 * 2**20


def resize_bytes(size: int) -> int:
    """The most that resize_center_crop(size=size) adds beside its input: the whole resize of an
    image MAX_WHOLE_RESIZE times longer than wide (and as large as the limit allows), whose
    first pass is `size` x its length, 4 bytes a pixel and 8 a row, then its output and crop,
    and the filter's coefficients (2 passes of at most 8 x size outputs of 64 weights of 8)."""
    longest = int((MAX_WHOLE_RESIZE * MAX_PIXELS) ** 0.5) + 1
    first_pass = (4 * size + 8) * longest
    output = (4 * MAX_WHOLE_RESIZE * size + 8) * size + (4 * size + 8) * size
    return first_pass + output + 2 * MAX_WHOLE_RESIZE * size * 64 * 8


def memory_bound_mib(size: int = 224) -> int:
    """The figure docs/errors.md gives: MiB, rounded up."""
    return -(-(BYTES_PER_PIXEL * MAX_PIXELS + resize_bytes(size)) // 2**20)


@dataclass(frozen=True)
class Case:
    name: str  # the original's, then what was done to it: "png-rgba/cut@57"
    data: bytes
    intact: bool


def originals() -> dict[str, bytes]:
    """Whole files: each variant at 24 x 16, extreme shapes on both paths of resize_center_crop,
    and a JPEG for each EXIF orientation."""
    files = {name: make(24, 16) for name, make in VARIANTS.items()}
    for w, h in [(1, 3000), (3000, 1), (2, 15), (15, 2), (5, 400), (400, 5)]:
        files[f"png-{w}x{h}"] = VARIANTS["png"](w, h)
        files[f"jpeg-{w}x{h}"] = VARIANTS["jpeg"](w, h)
    for orientation in range(1, 9):
        files[f"jpeg-orientation-{orientation}"] = save(rgb(24, 16), "JPEG", exif=exif(orientation))
    return files


def damaged(data: bytes, rng: random.Random) -> dict[str, bytes]:
    """Copies of `data` cut short, at 4 places in its first 64 bytes (the header) and 4 beyond,
    and with 1 to 4 bytes changed, 4 times in the header and 6 anywhere."""
    n = len(data)
    cuts = {rng.randrange(1, min(n, 64)) for _ in range(4)} | {
        rng.randrange(1, n) for _ in range(4)
    }
    out = {f"cut@{end}": data[:end] for end in sorted(cuts)}
    for i in range(10):
        copy = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            at = rng.randrange(min(n, 64) if i < 4 else n)
            copy[at] = rng.choice([0, 0xFF, copy[at] ^ 1 << rng.randrange(8), rng.randrange(256)])
        out[f"changed#{i}"] = bytes(copy)
    return out


def resized_header(data: bytes, w: int, h: int) -> bytes:
    """`data` with a header that says `w` x `h` px (and its pixels unchanged, too few): what a
    decoder allocates for before it finds the data short. Each format's own place for the size."""
    out = bytearray(data)

    def put(at: int, fmt: str, *values: int) -> None:
        out[at : at + struct.calcsize(fmt)] = struct.pack(fmt, *values)

    if data.startswith(b"\x89PNG"):
        put(16, ">II", w, h)
        put(29, ">I", zlib.crc32(out[12:29]))  # the header's checksum, made right again
    elif data.startswith(b"\xff\xd8"):  # JPEG: the frame header (baseline or progressive)
        at = min(i for i in (data.find(b"\xff\xc0"), data.find(b"\xff\xc2")) if i > 0)
        put(at + 5, ">HH", h, w)
    elif data.startswith(b"GIF"):
        put(6, "<HH", w, h)  # the screen; then the first image's own, after the extensions
        at = 13 + (3 << (data[10] & 7) + 1 if data[10] & 0x80 else 0)
        while data[at] == 0x21:
            at += 2
            while data[at]:
                at += data[at] + 1
            at += 1
        put(at + 5, "<HH", w, h)
    elif data.startswith(b"BM"):
        put(18, "<ii", w, h)
    elif data.startswith(b"qoif"):
        put(4, ">II", w, h)
    elif data.startswith(b"P5"):
        body = data.split(b"\n", 3)[3]
        return f"P5\n{w} {h}\n65535\n".encode() + body
    elif data.startswith(b"II*"):  # TIFF: the image width and length tags of its directory
        ifd = struct.unpack_from("<I", data, 4)[0]
        for i in range(struct.unpack_from("<H", data, ifd)[0]):
            tag, kind = struct.unpack_from("<HH", data, ifd + 2 + 12 * i)
            if tag in (256, 257):
                put(ifd + 10 + 12 * i, "<H" if kind == 3 else "<I", w if tag == 256 else h)
    elif data[8:16] == b"WEBPVP8X":
        put(24, "<I", w - 1), put(27, "<I", h - 1)  # 24-bit each; the next byte is rewritten
        out[30] = data[30]
    elif data[8:16] == b"WEBPVP8 ":
        put(26, "<HH", w, h)
    elif data[8:16] == b"WEBPVP8L":
        put(21, "<I", (w - 1) | (h - 1) << 14 | data[24] >> 4 << 28)
    elif data[4:12] == b"ftypavif":
        put(data.find(b"ispe") + 8, ">II", w, h)
    else:
        raise ValueError(f"no header to resize in {data[:12]!r}")
    return bytes(out)


def corpus(seed: int = SEED) -> list[Case]:
    """Every original whole and damaged, and with a header that says 3000 x 2000 px (within the
    limit: a decoder allocates for them) and 20000 x 20000 (over: refused before that). Some
    1,100 files, the same for a seed."""
    rng = random.Random(seed)
    cases = []
    for name, data in originals().items():
        cases.append(Case(name, data, intact=True))
        cases += [Case(f"{name}/{how}", d, intact=False) for how, d in damaged(data, rng).items()]
        for w, h in [(3000, 2000), (20_000, 20_000)]:
            cases.append(Case(f"{name}/says-{w}x{h}", resized_header(data, w, h), intact=False))
    return cases


def share(count: int, max_bytes: int, seed: int = SEED) -> list[Case]:
    """`count` cases of the corpus of at most `max_bytes`, a sixth of them whole, picked by seed."""
    cases = [c for c in corpus(seed) if 0 < len(c.data) <= max_bytes]
    rng = random.Random(seed)
    whole = rng.sample([c for c in cases if c.intact], count // 6)
    return whole + rng.sample([c for c in cases if not c.intact], count - len(whole))


def damage_page_header(shard: Path, group: int) -> None:
    """Overwrites the first bytes of the image column's first page header in row group `group`
    of a preprocessed shard, the file's size unchanged."""
    at = pq.ParquetFile(shard).metadata.row_group(group).column(0).data_page_offset
    data = bytearray(shard.read_bytes())
    data[at : at + 4] = bytes(4)
    shard.write_bytes(data)


def damage_stored_image(shard: Path, group: int, row: int) -> None:
    """Overwrites the first 3 bytes of the image that row `row` of row group `group` of a
    preprocessed shard stores (its format's signature): the file's size stays the same, as when
    storage damages bytes in place."""
    image = pq.ParquetFile(shard).read_row_group(group, columns=["image"])["image"][row].as_py()
    data = bytearray(shard.read_bytes())
    # The value as Parquet stores it, PLAIN-encoded: its length, then its bytes.
    at = data.index(struct.pack("<I", len(image)) + image) + 4
    data[at : at + 3] = b"BAD"
    shard.write_bytes(data)


def rewrite_shard(shard: Path, *, page_checksums: bool, label: tuple[int, int] | None = None):
    """Writes a preprocessed shard again, its row groups as they were: with or without page
    checksums (as preprocessing wrote them before it wrote checksums), and with `label`
    (row, value) stored in place of that row's label."""
    parquet = pq.ParquetFile(shard)
    table = parquet.read()
    if label is not None:
        row, value = label
        labels = table["label"].to_pylist()
        labels[row] = value
        table = table.set_column(1, table.schema.field("label"), pa.array(labels, pa.int64()))
    pq.write_table(
        table,
        shard,
        row_group_size=parquet.metadata.row_group(0).num_rows,
        compression={"image": "NONE", "label": "ZSTD", "label_name": "ZSTD", "source_id": "ZSTD"},
        use_dictionary=["label_name"],
        write_page_checksum=page_checksums,
    )


def damage_footer(shard: Path) -> None:
    """Overwrites the first bytes of a shard's footer, the file's size unchanged."""
    data = bytearray(shard.read_bytes())
    at = len(data) - 8 - int.from_bytes(data[-8:-4], "little")
    data[at : at + 4] = b"\xff" * 4
    shard.write_bytes(data)
