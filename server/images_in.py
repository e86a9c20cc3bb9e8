"""Uploaded images for edits: decoded under limits, oriented, converted and resized; every problem a 400 naming the
field, never a 500, never more pixels decoded than the profile allows.

What arrives and what happens to it:
- Formats: PNG, JPEG, WebP, GIF (one frame), BMP; anything else (TIFF, PSD, SVG, a non-image) is refused by name.
  Only those decoders are tried (``Image.open(formats=...)``).
- Size: the declared width x height is read from the header first; more than ``limits.max_image_pixels`` is refused
  before a pixel is decoded (a decompression bomb is a tiny file declaring huge dimensions).
- Truncated or corrupt files: refused (never decoded partially).
- Animated GIF / APNG / WebP: refused (which frame to edit is ambiguous).
- EXIF orientation: applied (the image is edited as a viewer shows it).
- Modes: palette, grayscale, CMYK (a plain conversion, no ICC profile), 16-bit (scaled to 8 bits) become RGB. Alpha:
  dropped from the pixels; as OpenAI defines it, an image's or mask's fully transparent pixels mark where to edit.
- A mask without alpha: white repaints, as A1111's masks (luminance, 128 and above after diffusers' binarize).
"""

from __future__ import annotations

import base64
import binascii
import io
import warnings
from typing import Literal

from PIL import Image, ImageFilter, ImageOps, UnidentifiedImageError

from engines.errors import InvalidRequestError

FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
ResizeMode = Literal[0, 1, 2]
"""A1111's resize modes: 0 just resize (stretch), 1 crop and resize (fill, center crop), 2 resize and fill (fit,
the bands filled by stretching the image's edges)."""


def decode(data: bytes, field: str, max_pixels: int) -> Image.Image:
    """One still image, oriented, fully decoded, in RGB, RGBA or L; InvalidRequestError names ``field``."""
    if not data:
        raise InvalidRequestError(f"{field} is empty", param=field)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=FORMATS)
            width, height = image.size
            if width * height > max_pixels:
                raise InvalidRequestError(f"{field} declares {width}x{height} pixels, over this server's limit of "
                                          f"{max_pixels} pixels", param=field)
            frames = int(getattr(image, "n_frames", 1))
            if frames > 1 or getattr(image, "is_animated", False):
                raise InvalidRequestError(f"{field} is animated ({image.format}, {frames} frames): send one still "
                                          "image", param=field)
            image.load()
    except UnidentifiedImageError:
        raise InvalidRequestError(f"{field} is not an image in a supported format ({', '.join(FORMATS)})",
                                  param=field) from None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise InvalidRequestError(f"{field} declares more pixels than PIL decodes safely, over this server's limit "
                                  f"of {max_pixels} pixels", param=field) from None
    except (OSError, ValueError, SyntaxError, EOFError) as exc:
        raise InvalidRequestError(f"{field} is truncated or corrupt ({type(exc).__name__}: "
                                  f"{str(exc)[:120]})", param=field) from None
    return _normalize(ImageOps.exif_transpose(image) or image)


def _normalize(image: Image.Image) -> Image.Image:
    """RGB, RGBA or L; 16-bit and 32-bit integer images scaled to 8 bits, palette transparency kept as alpha."""
    if image.mode in ("I;16", "I;16B", "I;16L", "I"):
        high = image.getextrema()[1]
        top = 65535.0 if image.mode.startswith("I;16") or (isinstance(high, int | float) and high > 255) else 255.0
        return image.point(lambda v: v * (255.0 / top)).convert("L")
    if image.mode == "P":
        return image.convert("RGBA" if "transparency" in image.info else "RGB")
    if image.mode in ("RGB", "RGBA", "L"):
        return image
    if image.mode in ("LA", "PA", "RGBa", "La"):
        return image.convert("RGBA")
    return image.convert("RGB")  # CMYK, YCbCr, 1, F, ...


def from_base64(text: str, field: str, max_pixels: int) -> Image.Image:
    """A1111's base64 images, with or without a ``data:image/...;base64,`` prefix."""
    if text.startswith("data:"):
        head, _, text = text.partition(",")
        if not head.endswith(";base64"):
            raise InvalidRequestError(f"{field}: a data URL must be base64 (data:image/png;base64,...)", param=field)
    try:
        data = base64.b64decode("".join(text.split()), validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequestError(f"{field} is not valid base64", param=field) from None
    return decode(data, field, max_pixels)


def alpha_mask(image: Image.Image) -> Image.Image | None:
    """OpenAI's convention: the transparent pixels (alpha 0) mark where to edit -> L mask (255 - alpha); None
    without an alpha channel or when nothing is transparent."""
    if image.mode != "RGBA":
        return None
    alpha = image.getchannel("A")
    if alpha.getextrema()[0] == 255:
        return None
    return ImageOps.invert(alpha)


def mask_image(image: Image.Image) -> Image.Image:
    """A mask upload as an L mask (255 repaints): its alpha (transparent = edit) when it has one, else luminance."""
    return alpha_mask(image) or (image.convert("L") if image.mode != "RGBA" else Image.new("L", image.size, 0))


def resize(image: Image.Image, width: int, height: int, mode: ResizeMode) -> Image.Image:
    """Resize as A1111's resize modes 0-2 (LANCZOS, as A1111 uses without an upscaler)."""
    if image.size == (width, height):
        return image
    if mode == 0:
        return image.resize((width, height), Image.Resampling.LANCZOS)
    ratio, src = width / height, image.width / image.height
    if mode == 1:  # fill the target, crop the excess around the center
        scale = max(width / image.width, height / image.height)
    else:  # fit inside, then fill the bands
        scale = min(width / image.width, height / image.height)
    w, h = max(1, round(image.width * scale)), max(1, round(image.height * scale))
    resized = image.resize((w, h), Image.Resampling.LANCZOS)
    canvas = Image.new(image.mode, (width, height))
    canvas.paste(resized, ((width - w) // 2, (height - h) // 2))
    if mode == 2 and ratio != src:
        _fill_bands(canvas, resized, w, h)
    return canvas


def _fill_bands(canvas: Image.Image, resized: Image.Image, w: int, h: int) -> None:
    """Resize and fill: the empty bands take the image's first and last row (or column), stretched."""
    width, height = canvas.size
    x0, y0 = (width - w) // 2, (height - h) // 2
    if h < height:
        for box, top, size in (((0, 0, w, 1), 0, y0), ((0, h - 1, w, h), y0 + h, height - y0 - h)):
            if size > 0:
                canvas.paste(resized.crop(box).resize((w, size)), (x0, top))
    elif w < width:
        for box, left, size in (((0, 0, 1, h), 0, x0), ((w - 1, 0, w, h), x0 + w, width - x0 - w)):
            if size > 0:
                canvas.paste(resized.crop(box).resize((size, h)), (left, y0))


def blur_mask(mask: Image.Image, radius: int) -> Image.Image:
    """A1111's mask_blur: a Gaussian blur of the mask (PIL's, an approximation of A1111's OpenCV kernel)."""
    return mask.filter(ImageFilter.GaussianBlur(radius)) if radius > 0 else mask


def fill_masked(image: Image.Image, mask: Image.Image) -> Image.Image:
    """A1111's ``inpainting_fill`` 0 ("fill"): the area to repaint painted with its surroundings' colours (blurs of
    the kept pixels at falling radii, normalized by the blurred coverage), the kept pixels unchanged."""
    keep = ImageOps.invert(mask.convert("L"))
    layer = image.convert("RGB").convert("RGBA")
    layer.putalpha(keep)
    filled = Image.new("RGBA", image.size)
    premultiplied = layer.convert("RGBa")
    for radius, repeats in ((256, 1), (64, 1), (16, 2), (4, 4), (2, 2), (0, 1)):
        blurred = premultiplied.filter(ImageFilter.GaussianBlur(radius)).convert("RGBA")
        for _ in range(repeats):
            filled.alpha_composite(blurred)
    return Image.composite(image.convert("RGB"), filled.convert("RGB"), keep)
