"""Image transforms shared by preprocessing, training and inference."""

from __future__ import annotations

import io
import warnings

from PIL import Image, UnidentifiedImageError
from torchvision.transforms.v2 import functional as F

# ImageNet statistics: ResNet-18's pretrained weights expect them, and training normalises with
# the pair the manifest records.
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


class BadImageError(ValueError):
    """The bytes are not a usable image; the message is the reason recorded in the manifest."""


def decode_image(data: bytes) -> Image.Image:
    """Decode fully (so truncation shows here, not later) and convert to RGB."""
    if not data:
        raise BadImageError("empty file")
    try:
        with warnings.catch_warnings():
            # PIL warns, then raises, on decompression bombs: make both an error we can record.
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data))
            img.load()
    except UnidentifiedImageError:
        raise BadImageError("not an image (unrecognised format)") from None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise BadImageError(f"too large to decode safely: {e}") from None
    except (OSError, SyntaxError, ValueError) as e:
        # PIL reports truncated and corrupt data as OSError, some broken headers as SyntaxError.
        raise BadImageError(f"truncated or corrupt image: {e}") from None
    return img.convert("RGB")


def resize_center_crop(img: Image.Image, *, size: int) -> Image.Image:
    """Resize the short side to `size`, then center crop to `size` x `size`."""
    img = F.resize(img, [size], antialias=True)
    return F.center_crop(img, [size, size])


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
