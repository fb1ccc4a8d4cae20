"""Images from request bytes to the processor's pixels, in the API process (Pillow and numpy only).

Every image a client sends is hostile until decoded: the format is read from the bytes (not the
declared media type) and must be one of `ALLOWED_FORMATS`; the dimensions are checked against
`ImageLimits.max_pixels` from the header, before any pixel is decoded, so a small file that
would inflate to gigabytes (a decompression bomb) costs nothing; Pillow's own bomb check stays on
behind it; truncated or corrupt data fails the decode. Each failure is an `InvalidRequestError`
(HTTP 400) saying which rule the image broke, never the decoder's internals.

`preprocess` is CLIPImageProcessor's rules (resize the shortest edge with bicubic, center crop,
rescale, normalize), written on Pillow and numpy so the API process needs neither torch nor
torchvision; `tests/models/test_llava.py` checks it against transformers' processor.
"""
from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from tessera.sampling_params import InvalidRequestError
from tessera.vision import ImageInput, ImageProcessing, VisionConfig

if TYPE_CHECKING:
    from PIL import Image

# Raster formats a request may hold (Pillow's names). SVG and other vector or container formats
# are not decoded at all: they run scripts or reference other files, and Pillow does not read them.
ALLOWED_FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
DEFAULT_MAX_IMAGE_PIXELS = 25_000_000  # 5,000 x 5,000: larger than any camera image a model reads well
DEFAULT_MAX_IMAGES = 4


@dataclass(frozen=True)
class ImageLimits:
    """What one request's images may be (`--max-image-pixels`, `--limit-mm-per-prompt image=N`)."""

    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    max_images: int = DEFAULT_MAX_IMAGES

    def __post_init__(self) -> None:
        if self.max_pixels < 1:
            raise ValueError("--max-image-pixels must be at least 1")
        if self.max_images < 0:
            raise ValueError("--limit-mm-per-prompt image=N must not be negative")


def decode_image(data: bytes, limits: ImageLimits) -> "Image.Image":
    """The image in `data` as RGB, or InvalidRequestError naming what is wrong with it."""
    from PIL import Image, UnidentifiedImageError

    if not data:
        raise InvalidRequestError("an image is empty")
    try:  # reads the header only; Pillow refuses a canvas past twice its own MAX_IMAGE_PIXELS here
        img = Image.open(io.BytesIO(data), formats=ALLOWED_FORMATS)
    except UnidentifiedImageError:
        raise InvalidRequestError(f"an image is not in an accepted format ({', '.join(ALLOWED_FORMATS)}) "
                                  "or is corrupt") from None
    except Image.DecompressionBombError:
        raise InvalidRequestError("an image is too large to decode (a decompression bomb?)") from None
    except (OSError, ValueError, SyntaxError, EOFError):
        raise InvalidRequestError("an image could not be read; it is corrupt or truncated") from None
    width, height = img.size
    if width < 1 or height < 1:
        raise InvalidRequestError("an image has no pixels")
    if width * height > limits.max_pixels:
        raise InvalidRequestError(f"an image of {width}x{height} pixels is larger than this server's limit of "
                                  f"{limits.max_pixels} pixels (--max-image-pixels)")
    try:
        img.seek(0)  # an animation: its first frame only
        img.load()
        return img.convert("RGB")
    except Image.DecompressionBombError:
        raise InvalidRequestError("an image is too large to decode (a decompression bomb?)") from None
    except (OSError, ValueError, SyntaxError, EOFError, MemoryError):
        raise InvalidRequestError("an image could not be decoded; it is corrupt or truncated") from None


def preprocess(img: "Image.Image", p: ImageProcessing) -> np.ndarray:
    """CLIPImageProcessor's pixels of an RGB image: float32 [3, crop height, crop width]."""
    if p.do_resize:
        w, h = img.size
        short, long = (w, h) if w <= h else (h, w)
        new_long = int(p.shortest_edge * long / short)
        size = (p.shortest_edge, new_long) if w <= h else (new_long, p.shortest_edge)
        img = img.resize(size, resample=p.resample)
    pixels = np.asarray(img)  # [H, W, 3] uint8
    if p.do_center_crop:
        pixels = _center_crop(pixels, p.crop_height, p.crop_width)
    out = pixels.astype(np.float32)
    if p.do_rescale:
        out = (pixels.astype(np.float64) * p.rescale_factor).astype(np.float32)
    if p.do_normalize:
        out = (out - np.asarray(p.image_mean, dtype=np.float32)) / np.asarray(p.image_std, dtype=np.float32)
    return np.ascontiguousarray(out.transpose(2, 0, 1), dtype=np.float32)


def _center_crop(pixels: np.ndarray, ch: int, cw: int) -> np.ndarray:
    """transformers' center_crop: the middle (rounding the offset down), padded with zeros where
    the image is smaller than the crop."""
    h, w = pixels.shape[:2]
    if h < ch or w < cw:
        padded = np.zeros((max(h, ch), max(w, cw), pixels.shape[2]), dtype=pixels.dtype)
        top, left = (max(h, ch) - h) // 2, (max(w, cw) - w) // 2
        padded[top:top + h, left:left + w] = pixels
        pixels, h, w = padded, max(h, ch), max(w, cw)
    top, left = (h - ch) // 2, (w - cw) // 2
    return pixels[top:top + ch, left:left + cw]


def image_input(data: bytes, vision: VisionConfig, limits: ImageLimits) -> ImageInput:
    """An image's bytes as the engine takes them: decoded, checked, processed, hashed (SHA-256
    of the processed pixels, so the same picture in another encoding is the same image)."""
    pixels = preprocess(decode_image(data, limits), vision.processing)
    raw = pixels.tobytes()
    digest = hashlib.sha256(raw)
    digest.update(repr(pixels.shape).encode())
    return ImageInput(digest.hexdigest(), raw, tuple(pixels.shape))
