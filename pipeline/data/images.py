"""Image transforms shared by preprocessing, training and inference."""

from __future__ import annotations

import io
import sys
import warnings
from dataclasses import dataclass

from PIL import AvifImagePlugin, Image, ImageOps, UnidentifiedImageError

# ImageNet statistics: ResNet-18's pretrained weights expect them, and training normalises with
# the pair the manifest records.
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
# The longest side to short side ratio that resize_center_crop resizes whole (every photo and
# scan): beyond, it resizes only the crop's region, so an image of extreme shape costs no more.
MAX_WHOLE_RESIZE = 8
# The most pixels decode_image decodes: Pillow's default limit, held here so that no other import
# can lift it (Image.MAX_IMAGE_PIXELS is a global). Pillow keeps a pointer (8 bytes) per row
# besides the pixels, so a row counts ROW_PIXELS more: else a 1 px wide image would take 3 times
# the memory of a square one of as many pixels. docs/errors.md gives the memory this bounds.
MAX_PIXELS = 89_478_485
ROW_PIXELS = 2
# The formats decode_image reads; Pillow reads some 40 more, each another decoder for untrusted
# bytes to reach, fuzzed and measured here only for these (JPEG includes its multi-picture MPO).
FORMATS = ("JPEG", "PNG", "GIF", "WEBP", "TIFF", "BMP", "QOI", "PPM", "AVIF")
# AVIF's decoder starts a thread for each CPU the process may use, each with buffers of its own
# (about 0.8 MiB each, measured). Images are decoded one at a time in one-CPU tasks and loader
# processes: one thread each. Pillow offers no other control than this module global.
AvifImagePlugin.DEFAULT_MAX_THREADS = 1
# Where an image has transparency, it is shown on white, as a browser page shows it: a fully
# transparent pixel's hidden colour is not part of the picture.
BACKGROUND = (255, 255, 255)
# Pillow's raw unpackers that keep the high byte of each 16-bit sample, by the mode's byte order.
HIGH_BYTE = {
    "I;16": "L;16",
    "I;16L": "L;16",
    "I;16B": "L;16B",
    "I;16N": "L;16" if sys.byteorder == "little" else "L;16B",
}
ALPHA_MODES = ("RGBA", "LA", "PA", "RGBa")


# The JPEG markers that start a frame (SOF0-SOF15, less DHT C4, JPG C8 and DAC CC): their segment
# holds the sample precision, height, width and number of components.
SOF_MARKERS = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
# Markers that stand alone, without a length: TEM and RST0-RST7.
BARE_MARKERS = frozenset({0x01, *range(0xD0, 0xD8)})
# The segments of a plain JPEG's header, what Pillow writes: JFIF (APP0), quantisation and
# Huffman tables, restart interval, comment, a Huffman-coded frame (baseline, extended,
# progressive). Pillow acts on others: the orientation of EXIF or XMP (APP1), MPO's index
# (APP2), Adobe's colour transform (APP14); and lossless or arithmetic-coded frames are decoded
# only by some libjpeg-turbo versions.
PLAIN_SEGMENTS = frozenset({0xE0, 0xDB, 0xC4, 0xDD, 0xFE, 0xC0, 0xC1, 0xC2})


class BadImageError(ValueError):
    """The bytes are not a usable image; the message is the reason recorded in the manifest."""


def decode_image(data: bytes) -> Image.Image:
    """Decode fully (so truncation shows here, not later), turn upright as the EXIF orientation
    says (a phone stores a portrait photo sideways and records the turn), and make it 8-bit RGB
    (`to_rgb`). Whatever fails on the way is the file's: a BadImageError with the reason."""
    if not data:
        raise BadImageError("empty file")
    try:
        with warnings.catch_warnings():
            # PIL warns, then raises, on decompression bombs: make both an error we can record.
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data), formats=FORMATS)
            check_size(img)  # from the header, before a pixel is allocated
            img.load()
            ImageOps.exif_transpose(img, in_place=True)  # no copy when there is nothing to turn
            return to_rgb(img)
    except BadImageError:
        raise
    except UnidentifiedImageError:
        raise BadImageError(
            f"not an image (unrecognised format): the formats read are {', '.join(FORMATS)}"
        ) from None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise BadImageError(f"too large to decode safely: {e}") from None
    except (OSError, SyntaxError, ValueError) as e:
        # PIL reports truncated and corrupt data as OSError, some broken headers as SyntaxError.
        raise BadImageError(f"truncated or corrupt image: {e}") from None
    except Exception as e:
        # The bytes are untrusted and each format's decoder fails its own way on damage
        # (IndexError from a truncated QOI, TypeError from one changed byte of EXIF, struct.error
        # from a WEBP): any failure to decode is the file's, to skip and count, not the job's.
        raise BadImageError(f"truncated or corrupt image ({type(e).__name__}: {e})") from None


@dataclass(frozen=True)
class JpegHeader:
    width: int
    height: int
    components: int
    precision: int  # bits per sample
    plain: bool  # no segment but PLAIN_SEGMENTS


def jpeg_header(data: bytes) -> JpegHeader | None:
    """A JPEG's frame header, read from its markers up to the first scan, nothing decoded: a few
    microseconds. None where the bytes do not start as a JPEG or its markers end first."""
    if data[:2] != b"\xff\xd8":
        return None
    pos, end, frame, plain = 2, len(data), None, True
    while pos + 4 <= end:
        if data[pos] != 0xFF:
            return None
        marker = data[pos + 1]
        if marker == 0xFF:  # a fill byte before the marker
            pos += 1
            continue
        if marker in BARE_MARKERS:
            pos += 2
            continue
        length = int.from_bytes(data[pos + 2 : pos + 4], "big")
        if marker == 0xDA:  # start of scan: the header is over
            if frame is None:
                return None
            return JpegHeader(*frame, plain=plain)
        if marker in (0xD8, 0xD9) or length < 2:
            return None
        plain = plain and marker in PLAIN_SEGMENTS
        if marker in SOF_MARKERS:
            if length < 8 or pos + 10 > end:
                return None
            height = int.from_bytes(data[pos + 5 : pos + 7], "big")
            width = int.from_bytes(data[pos + 7 : pos + 9], "big")
            frame = (width, height, data[pos + 9], data[pos + 4])
        pos += 2 + length
    return None


def check_size(img: Image.Image) -> None:
    """Refuse an image of more than MAX_PIXELS, each row counted ROW_PIXELS more, and a TIFF
    whose tiles are as large: libtiff holds one tile, as large as the file says, besides the
    image (a 16 x 16 px file of 32768 px square tiles took 1 GiB)."""
    w, h = img.size
    tile = (img.tag_v2.get(322, 0), img.tag_v2.get(323, 0)) if img.format == "TIFF" else (0, 0)
    if (w + ROW_PIXELS) * h > MAX_PIXELS or tile[0] * tile[1] > MAX_PIXELS:
        tiles = f" in tiles of {tile[0]} x {tile[1]} px" if tile[0] else ""
        raise BadImageError(
            f"too large to decode safely: {w} x {h} px{tiles}, over the limit of {MAX_PIXELS} px "
            f"(each row counts {ROW_PIXELS} more)"
        )


def to_rgb(img: Image.Image) -> Image.Image:
    """8-bit RGB, scaled rather than clipped from higher bit depths (`to_8bit`), transparency
    shown on BACKGROUND. Closes `img` where it makes a new image, so that the two are not held at
    once for longer than the conversion takes."""
    if img.mode in HIGH_BYTE or img.mode in ("I", "F"):
        img = to_8bit(img)  # a 16-bit file's single transparent grey (tRNS) is not kept
    elif img.mode in ALPHA_MODES or "transparency" in img.info:
        rgba = img if img.mode == "RGBA" else img.convert("RGBA")
        if rgba is not img:
            img.close()
        out = Image.new("RGB", rgba.size, BACKGROUND)
        out.paste(rgba, mask=rgba)  # blends by alpha, rounded
        return out
    if img.mode == "RGB":
        return img
    out = img.convert("RGB")
    img.close()
    return out


def to_8bit(img: Image.Image) -> Image.Image:
    """A grey image of a high bit depth -> mode L, scaled to 0..255 rather than clipped there:
    16-bit samples (I;16 modes) by their high byte, as Pillow reads 16-bit colour files; 32-bit
    integers (mode I: PGM and PPM files over 8 bits, which Pillow scales to 0..65535, and signed
    or 32-bit TIFF) as 16-bit samples too, clipped outside 0..65535; floats (mode F) as 0..1, the
    range most tools write, clipped outside it, NaN black."""
    if img.mode in HIGH_BYTE:
        out = Image.frombytes("L", img.size, img.tobytes(), "raw", HIGH_BYTE[img.mode])
        img.close()
        return out
    # Pillow's point() on I and F is a linear map; converting to L then clips to 0..255 and
    # truncates (hence + 0.5 to round floats).
    scaled = img.point(lambda v: v / 256) if img.mode == "I" else img.point(lambda v: v * 255 + 0.5)
    img.close()
    return scaled.convert("L")


def resize_center_crop(img: Image.Image, *, size: int) -> Image.Image:
    """Resize the short side to `size` (bilinear, antialiased), then center crop to `size` x
    `size`: torchvision's `resize(img, [size])` and `center_crop` on PIL images, pixel for
    pixel, in PIL alone, so that preprocessing tasks never import torch (seconds per process).

    Past an aspect ratio of MAX_WHOLE_RESIZE, only the crop is computed: PIL resizes the source
    region it comes from (`box`), at the same filter positions, within 1 of each value. Resized
    whole, a 1 x 20,000 image would take gigabytes; this way memory stays near `size` x `size`."""
    w, h = img.size
    short, long = (w, h) if w <= h else (h, w)
    new_long = int(size * long / short)
    new_w, new_h = (size, new_long) if w <= h else (new_long, size)
    left, top = round((new_w - size) / 2), round((new_h - size) / 2)
    if new_long > MAX_WHOLE_RESIZE * size:
        sx, sy = w / new_w, h / new_h  # source pixels per resized pixel
        box = (left * sx, top * sy, (left + size) * sx, (top + size) * sy)
        return img.resize((size, size), Image.Resampling.BILINEAR, box=box)
    if (new_w, new_h) != (w, h):
        img = img.resize((new_w, new_h), Image.Resampling.BILINEAR)
    return img.crop((left, top, left + size, top + size))


def encode_image(img: Image.Image, *, image_format: str, jpeg_quality: int = 95) -> bytes:
    """Encode to JPEG or PNG bytes."""
    buf = io.BytesIO()
    if image_format == "jpeg":
        img.save(buf, format="JPEG", quality=jpeg_quality)
    elif image_format == "png":
        img.save(buf, format="PNG")
    else:
        raise ValueError(f"image_format must be 'jpeg' or 'png', not {image_format!r}")
    return buf.getvalue()
