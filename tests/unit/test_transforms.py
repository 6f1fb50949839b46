import io
import struct
import subprocess
import sys
import zlib
from collections import Counter

import numpy as np
import pytest
from corpus import BYTES_PER_PIXEL, REASONS, SLACK, corpus, memory_bound_mib
from PIL import Image

from harness.cluster import BUNDLE_ROOT
from harness.images import VARIANTS, decode_peaks, header_pixels, tiled_tiff
from pipeline.core.config import load_config
from pipeline.data.config import PreprocessConfig
from pipeline.data.images import (
    MAX_PIXELS,
    MAX_WHOLE_RESIZE,
    BadImageError,
    decode_image,
    encode_image,
    resize_center_crop,
)
from pipeline.data.preprocess import process_items
from pipeline.data.sources import Item


def encoded(img: Image.Image, fmt: str) -> bytes:
    return encoded_with(img, fmt)


def encoded_with(img: Image.Image, fmt: str, **options) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **options)
    return buf.getvalue()


@pytest.mark.parametrize("size", [(300, 200), (200, 300), (50, 50), (20, 90)])
def test_resize_center_crop_is_square(size):
    out = resize_center_crop(Image.new("RGB", size), size=64)
    assert out.size == (64, 64)


def test_center_crop_keeps_the_middle():
    # A wide image: left third black, middle white, right third black.
    img = Image.new("RGB", (300, 100))
    img.paste((255, 255, 255), (100, 0, 200, 100))
    out = resize_center_crop(img, size=32)
    assert out.getpixel((16, 16)) == (255, 255, 255)
    assert out.getpixel((0, 16))[0] > 200  # the crop is the white middle, not a black edge


@pytest.mark.parametrize("mode", ["L", "RGBA", "P", "CMYK"])
def test_decode_converts_to_rgb(mode):
    fmt = "JPEG" if mode in ("L", "CMYK") else "PNG"
    img = decode_image(encoded(Image.new(mode, (10, 12)), fmt))
    assert img.mode == "RGB" and img.size == (10, 12)


def grey(data: bytes) -> list[int]:
    """The decoded image's grey levels, left to right along its first row."""
    img = decode_image(data)
    assert img.mode == "RGB"
    pixels = np.asarray(img)[0]
    assert (pixels == pixels[:, :1]).all()  # grey: R = G = B
    return pixels[:, 0].tolist()


def test_a_16_bit_grey_png_is_scaled_to_8_bits_not_clipped():
    # A 16-bit grey PNG opens as mode I;16: converted as it was, every level above 255 was white.
    half = encoded(Image.fromarray(np.full((4, 4), 32768, dtype=np.uint16)), "PNG")
    assert grey(half) == [128] * 4
    ramp = np.linspace(0, 65535, 256).astype(np.uint16)[None, :].repeat(2, axis=0)
    assert Image.open(io.BytesIO(encoded(Image.fromarray(ramp), "PNG"))).mode == "I;16"
    levels = grey(encoded(Image.fromarray(ramp), "PNG"))
    assert levels == list(range(256)) and np.mean(levels) == 127.5


def test_a_big_endian_16_bit_tiff_is_scaled_by_its_own_byte_order():
    img = Image.new("I;16B", (3, 1))
    img.putpixel((0, 0), 32768), img.putpixel((1, 0), 65535), img.putpixel((2, 0), 257)
    data = encoded(img, "TIFF")
    assert Image.open(io.BytesIO(data)).mode == "I;16B"
    assert grey(data) == [128, 255, 1]


def test_a_float_tiff_is_read_as_0_to_1():
    values = np.array([[0.5, 0.25, 1.0, 0.0, 2.0, -1.0, np.nan, np.inf]], dtype=np.float32)
    assert grey(encoded(Image.fromarray(values), "TIFF")) == [128, 64, 255, 0, 255, 0, 0, 255]


def test_32_bit_integers_are_read_as_16_bit_samples():
    # PGM over 8 bits opens as mode I, scaled by Pillow to 0..65535; a 32-bit TIFF too, clipped.
    pgm = b"P5\n3 1\n1023\n" + b"".join(v.to_bytes(2, "big") for v in (512, 1023, 0))
    assert Image.open(io.BytesIO(pgm)).mode == "I"
    assert grey(pgm) == [128, 255, 0]
    ints = np.array([[32768, 70_000, -5, 2**31 - 1]], dtype=np.int32)
    assert grey(encoded(Image.fromarray(ints), "TIFF")) == [128, 255, 0, 255]


def test_a_16_bit_png_is_stored_scaled_by_preprocessing():
    cfg = load_config(PreprocessConfig, overrides=["output=/unused", "image_size=8"])
    cfg = cfg.model_copy(update={"image_format": "png"})
    half = encoded(Image.fromarray(np.full((12, 10), 32768, dtype=np.uint16)), "PNG")
    reader = type("Reader", (), {"read": lambda self, item: half})()
    rows, skipped = process_items(cfg, ["grey"], [Item("grey/0.png", 0)], reader)
    [row] = [r for split in rows.values() for r in split]
    assert skipped == [] and row["source_id"] == "grey/0.png"
    assert np.unique(np.asarray(decode_image(row["image"]))).tolist() == [128]


def test_transparency_is_shown_on_white_whatever_colour_it_hides():
    # Each row: opaque blue, half-transparent red, then a fully transparent pixel hiding black,
    # and one hiding green. A viewer shows both as its background: so do we, on white.
    img = Image.new("RGBA", (4, 1))
    for x, pixel in enumerate([(0, 0, 255, 255), (255, 0, 0, 128), (0, 0, 0, 0), (0, 255, 0, 0)]):
        img.putpixel((x, 0), pixel)
    decoded = np.asarray(decode_image(encoded(img, "PNG")))[0].tolist()
    assert decoded == [[0, 0, 255], [255, 127, 127], [255, 255, 255], [255, 255, 255]]
    assert np.asarray(decode_image(encoded(img.convert("LA"), "PNG")))[0, 2].tolist() == [255] * 3


@pytest.mark.parametrize("fmt", ["PNG", "GIF"])
def test_a_palette_images_transparent_colour_is_shown_on_white(fmt):
    img = Image.new("P", (2, 1))
    img.putpalette([10, 20, 30, 200, 100, 0])
    img.putpixel((0, 0), 0), img.putpixel((1, 0), 1)
    data = encoded_with(img, fmt, transparency=0)
    assert np.asarray(decode_image(data))[0].tolist() == [[255, 255, 255], [200, 100, 0]]
    # Without transparency, the palette's colours.
    assert np.asarray(decode_image(encoded(img, fmt)))[0].tolist() == [[10, 20, 30], [200, 100, 0]]


@pytest.mark.parametrize("fmt", ["TGA", "ICO", "JPEG2000", "PCX", "SGI", "DDS", "SPIDER"])
def test_formats_outside_the_read_ones_are_not_images(fmt):
    # Pillow reads them all; each is one more decoder of untrusted bytes, and none is fuzzed here.
    data = encoded(Image.new("RGB", (16, 16), "red"), fmt)
    assert Image.open(io.BytesIO(data)).format == fmt
    with pytest.raises(BadImageError, match=r"^not an image \(unrecognised format\): .* JPEG, PNG"):
        decode_image(data)


@pytest.mark.parametrize("fmt", ["MPO", "PPM", "AVIF", "QOI", "BMP"])
def test_the_read_formats_beyond_jpeg_and_png_decode(fmt):
    # MPO: a phone's JPEG with a second picture (depth, or the other eye) after the first.
    img = Image.new("RGB", (16, 12), (200, 30, 90))
    extra = {"save_all": True, "append_images": [img.copy()]} if fmt == "MPO" else {}
    data = encoded_with(img, fmt, **extra)
    assert Image.open(io.BytesIO(data)).format == fmt
    out = decode_image(data)
    assert out.size == (16, 12)
    assert np.abs(np.asarray(out, dtype=int) - (200, 30, 90)).max() <= 8


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"", "empty file"),
        (b"hello, I am text", "not an image"),
        (encoded(Image.new("RGB", (64, 64), "red"), "JPEG")[:300], "truncated or corrupt"),
        (encoded(Image.new("RGB", (64, 64), "red"), "PNG")[:60], "truncated or corrupt"),
    ],
)
def test_decode_rejects_bad_bytes_with_reason(data, reason):
    with pytest.raises(BadImageError, match=reason):
        decode_image(data)


@pytest.mark.parametrize("fmt", ["jpeg", "png"])
def test_encode_round_trip(fmt):
    img = Image.new("RGB", (16, 16), (10, 200, 30))
    back = decode_image(encode_image(img, image_format=fmt))
    assert back.size == (16, 16)
    assert max(abs(a - b) for a, b in zip(back.getpixel((8, 8)), (10, 200, 30), strict=True)) <= 3


def test_encode_rejects_unknown_format():
    with pytest.raises(ValueError, match="'jpeg' or 'png'"):
        encode_image(Image.new("RGB", (4, 4)), image_format="gif")


@pytest.mark.parametrize("size", [(300, 200), (200, 300), (64, 64), (65, 64), (20, 90), (97, 31)])
def test_resize_center_crop_is_torchvisions_pixel_for_pixel(size):
    # Preprocessing resizes in PIL alone (no torch in its tasks): the very pixels torchvision's
    # resize + center_crop give, which inference on raw images and users' own code may use.
    from torchvision.transforms.v2 import functional as F

    img = Image.effect_noise(size, 64).convert("RGB")
    expected = F.center_crop(F.resize(img, [64], antialias=True), [64, 64])
    assert resize_center_crop(img, size=64).tobytes() == expected.tobytes()


def test_a_photo_is_turned_upright_as_its_exif_orientation_says():
    # Stored 40 x 20, red on the left; EXIF orientation 6: shown turned 90 degrees clockwise,
    # 20 x 40 with red on top, as every photo viewer shows it.
    img = Image.new("RGB", (40, 20), (0, 0, 255))
    img.paste((255, 0, 0), (0, 0, 20, 20))
    exif = Image.Exif()
    exif[0x0112] = 6  # Orientation
    buf = io.BytesIO()
    img.save(buf, format="JPEG", exif=exif.tobytes())
    upright = decode_image(buf.getvalue())
    assert upright.size == (20, 40)
    red, blue = upright.getpixel((10, 5)), upright.getpixel((10, 35))
    assert red[0] > 200 > red[2] and blue[2] > 200 > blue[0]


@pytest.mark.parametrize("size", [(5, 400), (700, 3), (1, 97), (64, 1000)])
def test_an_image_of_extreme_shape_is_resized_by_its_crop_within_1_of_the_whole(size):
    img = Image.effect_noise(size, 64).convert("RGB")
    w, h = size
    long = int(32 * max(w, h) / min(w, h))
    whole = img.resize((32, long) if w <= h else (long, 32), Image.Resampling.BILINEAR)
    left, top = round((whole.width - 32) / 2), round((whole.height - 32) / 2)
    expected = whole.crop((left, top, left + 32, top + 32)).tobytes()
    got = resize_center_crop(img, size=32).tobytes()
    assert max(abs(a - b) for a, b in zip(got, expected, strict=True)) <= 1


def test_a_tiny_file_of_extreme_shape_takes_no_gigabytes():
    # 1 x 20,000 px, a few hundred bytes as PNG: resized whole to 224 px it would be 224 x
    # 4,480,000 (3 GB). Under a 1 GiB address-space limit the crop alone fits.
    code = (
        "import resource, io\n"
        "resource.setrlimit(resource.RLIMIT_AS, (2**30, 2**30))\n"
        "from PIL import Image\n"
        "from pipeline.data.images import decode_image, resize_center_crop\n"
        "buf = io.BytesIO(); Image.new('RGB', (1, 20_000), (9, 99, 199)).save(buf, 'PNG')\n"
        "out = resize_center_crop(decode_image(buf.getvalue()), size=224)\n"
        "print(len(buf.getvalue()), out.size, out.getpixel((100, 100)))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=BUNDLE_ROOT, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    nbytes, result = proc.stdout.split(" ", 1)
    assert int(nbytes) < 1000 and result.strip() == "(224, 224) (9, 99, 199)"


@pytest.mark.filterwarnings("ignore::UserWarning")  # PIL's own, on the damaged EXIF
def test_every_file_of_the_corpus_decodes_or_is_a_bad_image(monkeypatch):
    # Seeded: every format read, whole, cut short and with bytes changed at many places, and
    # extreme shapes. Whatever a decoder raises on damage is a BadImageError, which
    # preprocessing skips and counts, inference lists and serving answers with a 4xx.
    resized = []
    resize = Image.Image.resize

    def recorded(self, *args, **kwargs):
        out = resize(self, *args, **kwargs)
        resized.append(out.width * out.height)
        return out

    monkeypatch.setattr(Image.Image, "resize", recorded)
    reasons = Counter()
    cases = corpus()
    for case in cases:
        try:
            out = np.asarray(resize_center_crop(decode_image(case.data), size=32))
        except BadImageError as e:
            assert not case.intact, f"{case.name}: {e}"
            reasons[next((r for r in REASONS if str(e).startswith(r)), str(e))] += 1
            continue
        assert out.shape == (32, 32, 3) and out.dtype == np.uint8, case.name
        assert "says-20000x20000" not in case.name, f"{case.name} decoded"
    assert len(cases) > 1000 and set(reasons) <= set(REASONS), reasons
    assert reasons["truncated or corrupt image"] > 300  # the damage was seen
    assert reasons["too large to decode"] > 40  # refused from the header
    # No resize made more than the widest whole resize: 32 x 8 times 32.
    assert 32 * 32 < max(resized) <= MAX_WHOLE_RESIZE * 32 * 32


@pytest.mark.filterwarnings("ignore::UserWarning")  # PIL's own, reading the damaged headers
def test_no_file_of_the_corpus_takes_more_memory_than_its_pixels_allow(tmp_path):
    # The whole files, and those whose header says more pixels than any original's (10,000; on
    # purpose, or by the damage): each in a fork of its own, the resident memory that decoding
    # and resizing it added, against the bound for the pixels the header says.
    cases = [c for c in corpus() if c.intact or header_pixels(c.data) > 10_000]
    for i, case in enumerate(cases):
        (tmp_path / str(i)).write_bytes(case.data)
    measured = decode_peaks([tmp_path / str(i) for i in range(len(cases))], size=32)
    over = [
        (cases[int(m["file"])].name, m["pixels"], m["peak"])
        for m in measured
        if m["peak"] > BYTES_PER_PIXEL * m["pixels"] + SLACK
    ]
    assert len(cases) > 100 and not over


def test_decoding_takes_at_most_the_documented_bytes_per_pixel(tmp_path):
    # 768 x 768 px of every kind, and the two extreme shapes, cold, one fork each: the
    # measurement docs/errors.md's figure scales to the limit (bench/decode_memory.py: 16 MP).
    files = {name: make(768, 768) for name, make in VARIANTS.items()}
    files["png-1x300000"] = VARIANTS["png"](1, 300_000)
    files["png-300000x1"] = VARIANTS["png"](300_000, 1)
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    measured = decode_peaks([tmp_path / name for name in files])
    assert [m["error"] for m in measured] == [None] * len(files)
    per_pixel = {m["file"]: round((m["peak"] - SLACK) / m["pixels"], 1) for m in measured}
    assert max(per_pixel.values()) <= BYTES_PER_PIXEL, per_pixel


def test_the_docs_give_the_memory_bound():
    text = " ".join((BUNDLE_ROOT / "docs" / "errors.md").read_text().split())
    assert f"at most {memory_bound_mib():,} MiB while it is decoded and resized" in text


def header_only_png(w: int, h: int) -> bytes:
    """A PNG's header and an empty first block of pixels: what a decoder allocates for, cheaply."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    header = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)  # 8-bit RGB
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b""))


def test_the_pixel_limit_holds_whatever_pillows_global_says(monkeypatch):
    # Image.MAX_IMAGE_PIXELS is a global any import may lift (None: no limit); ours is our own.
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", None)
    with pytest.raises(BadImageError, match=r"^too large to decode safely: 10000 x 10000 px"):
        decode_image(header_only_png(10_000, 10_000))


def test_a_row_counts_as_two_more_pixels():
    # Pillow keeps an 8-byte pointer per row: 1 x 40 M px is 40 M pointers, 320 MB more. Within
    # Pillow's own limit, that counts pixels alone.
    assert 40_000_000 < MAX_PIXELS < 3 * 40_000_000
    with pytest.raises(BadImageError, match=r"^too large to decode safely: 1 x 40000000 px"):
        decode_image(header_only_png(1, 40_000_000))


def test_a_tiff_of_tiles_too_large_is_refused_before_its_tile_is_allocated():
    # 16 x 16 px in one 16384 px square tile: libtiff would allocate the tile's 768 MiB.
    assert decode_image(tiled_tiff(16, 16, 16)).size == (16, 16)
    with pytest.raises(BadImageError, match=r"^too large .* 16 x 16 px in tiles of 16384 x 16384"):
        decode_image(tiled_tiff(16, 16, 16_384))


def test_a_qoi_cut_short_anywhere_is_a_bad_image():
    # QOI's decoder raises IndexError, ValueError or OSError, by where the file ends.
    buf = io.BytesIO()
    Image.effect_noise((24, 16), 60).convert("RGB").save(buf, format="QOI")
    data = buf.getvalue()
    for end in range(len(data) - 8):  # its last 8 bytes are an end marker
        with pytest.raises(BadImageError):
            decode_image(data[:end])
