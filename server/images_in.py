"""Uploaded images for edits: decoded under limits, oriented, converted and resized; every problem a 400 naming the
field, never a 500, never more pixels decoded than the profile allows.

What arrives and what happens to it:
- Formats: PNG, JPEG, WebP, GIF (one frame), BMP; anything else (TIFF, PSD, SVG, a non-image) is refused by name.
  Only those decoders are tried (``Image.open(formats=...)``).
- Size: the declared width x height is read from the header first; more than ``limits.max_image_pixels`` is refused
  before a pixel is decoded (a decompression bomb is a tiny file declaring huge dimensions).
- Decode cost: a progressive JPEG decodes once per scan over the whole image, so its scan count (counted in the
  byte stream before decoding) is bounded by ``limits.max_jpeg_scans``; at most ``limits.decode_concurrency``
  images decode at once in the process (one more is a 429, never a queue of threads), shared fairly across tenants
  (``DecoderSlots``: a slot freed while another tenant waits goes to that tenant).
- Per request: the pixels all its images and masks declare, read from their headers before any is decoded, are
  bounded by ``limits.max_request_pixels`` (``check_pixel_budget``).
- Truncated or corrupt files: refused (never decoded partially); a PNG must end with IEND and its image data must
  hold every row its header declares (Pillow fills missing rows with black when the zlib stream ends early).
- Animated GIF / APNG / WebP: refused (which frame to edit is ambiguous).
- EXIF orientation: applied (the image is edited as a viewer shows it).
- Modes: palette, grayscale, CMYK (a plain conversion, no ICC profile), 16-bit (scaled to 8 bits) become RGB. Alpha:
  dropped from the pixels; as OpenAI defines it, an image's or mask's fully transparent pixels mark where to edit.
- A mask without alpha: white repaints, as A1111's masks (luminance, 128 and above after diffusers' binarize).
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import io
import math
import threading
import time
import warnings
import zlib
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar
from typing import Literal

from PIL import Image, ImageFilter, ImageOps, UnidentifiedImageError

from engines.errors import InvalidRequestError
from server import png_text
from server.errors import QueueFullError

FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
MAX_JPEG_SCANS = 100
"""Default bound on a JPEG's scans: libjpeg's progressive script writes 10 for colour images (6 for grayscale);
each scan costs a pass over the whole image (~0.75 ms per scan at 4096x4096, issue 32)."""
_policy = {"max_jpeg_scans": MAX_JPEG_SCANS}
DEFAULT_TENANT = "default"
WAIT_WINDOW_S = 10.0
"""How long a refused tenant counts as waiting for a decoder: longer than the refusal's Retry-After (1 s), so the
slot kept for it is there at its retry; a tenant that gave up stops counting after it."""
_tenant: ContextVar[str] = ContextVar("sdserve_decode_tenant", default=DEFAULT_TENANT)


class DecoderSlots:
    """At most ``slots`` images decoding at once, shared fairly across tenants (issue 52 point 4).

    A tenant refused a slot is waiting (from its first refusal until it takes one, or ``window_s`` after it last
    asked). A free slot goes to a waiting tenant before any tenant that holds more slots or waited less: a tenant
    takes one only while more are free than the other tenants ahead of it need (a tenant ahead: waiting, holding
    fewer slots, or as many and waiting longer). Alone, a tenant may use every slot, as before tenants; with
    another one waiting, each slot one tenant gives back goes to the other until they hold equal shares
    (``ceil(slots / tenants)``). Never a wait (``try_acquire``): a waiting worker thread would be one the
    threadpool (JSON parsing, the engine's batches) no longer has. Thread-safe; ``clock`` is injectable."""

    def __init__(self, slots: int, window_s: float = WAIT_WINDOW_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.slots, self.window_s, self.clock = max(1, slots), window_s, clock
        self.held: dict[str, int] = {}
        self._waiting: dict[str, tuple[float, float]] = {}
        """tenant -> (first refusal, last refusal) since it last took a slot."""
        self._lock = threading.Lock()

    def try_acquire(self, tenant: str) -> str | None:
        """Take a slot for ``tenant``: None when taken, else why not (a refusal makes the tenant waiting)."""
        with self._lock:
            now = self.clock()
            for name in [t for t, (_, last) in self._waiting.items() if now - last > self.window_s]:
                del self._waiting[name]
            free = self.slots - sum(self.held.values())
            mine = (self.held.get(tenant, 0), self._waiting.get(tenant, (math.inf, now))[0])
            ahead = sum(1 for t, (since, _) in self._waiting.items()
                        if t != tenant and (self.held.get(t, 0), since) < mine)
            if free > ahead:
                self.held[tenant] = mine[0] + 1
                self._waiting.pop(tenant, None)
                return None
            self._waiting[tenant] = (self._waiting.get(tenant, (now, now))[0], now)
            if free <= 0:
                return "every image decoder of this server is busy (limits.decode_concurrency)"
            return ("every free image decoder of this server is kept for another caller's request that waited "
                    "longer (decoders are shared fairly across API keys; limits.decode_concurrency)")

    def release(self, tenant: str) -> None:
        with self._lock:
            left = self.held.get(tenant, 0) - 1
            if left > 0:
                self.held[tenant] = left
            else:
                self.held.pop(tenant, None)


_slots = DecoderSlots(4)


def configure(max_jpeg_scans: int, decode_concurrency: int) -> None:
    """Process-wide decode bounds (server/app.py sets them from ``limits`` at start)."""
    global _slots
    _policy["max_jpeg_scans"] = max_jpeg_scans
    _slots = DecoderSlots(decode_concurrency)


@contextlib.contextmanager
def decoding_for(tenant: str | None) -> Iterator[None]:
    """Decodes started inside (in this task, or in worker threads it starts: the context is copied) count against
    ``tenant``'s share of the decoders (the request's owner label; None: the one tenant without auth)."""
    token = _tenant.set(tenant or DEFAULT_TENANT)
    try:
        yield
    finally:
        _tenant.reset(token)


@contextlib.contextmanager
def _decode_slot(field: str) -> Iterator[None]:
    """A try-acquire, never a wait (``DecoderSlots``): a 429 naming ``field`` when the caller's tenant has no slot."""
    slots, tenant = _slots, _tenant.get()
    refused = slots.try_acquire(tenant)
    if refused is not None:
        raise QueueFullError(f"{field}: {refused}: retry shortly", 1)
    try:
        yield
    finally:
        slots.release(tenant)


ResizeMode = Literal[0, 1, 2]
"""A1111's resize modes: 0 just resize (stretch), 1 crop and resize (fill, center crop), 2 resize and fill (fit,
the bands filled by stretching the image's edges)."""


def decode(data: bytes, field: str, max_pixels: int) -> Image.Image:
    """One still image, oriented, fully decoded, in RGB, RGBA or L; InvalidRequestError names ``field``."""
    try:
        image = _open(data, field, max_pixels)
        with warnings.catch_warnings(), _decode_slot(field):
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image.load()
            if image.format == "PNG":
                _require_whole_png(data, image, field)
            return _normalize(ImageOps.exif_transpose(image) or image)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise InvalidRequestError(f"{field} declares more pixels than PIL decodes safely, over this server's limit "
                                  f"of {max_pixels} pixels", param=field) from None
    except (OSError, ValueError, SyntaxError, EOFError, zlib.error) as exc:
        raise InvalidRequestError(f"{field} is truncated or corrupt ({type(exc).__name__}: "
                                  f"{str(exc)[:120]})", param=field) from None


def _open(data: bytes, field: str, max_pixels: int) -> Image.Image:
    """The image's header read (no pixel decoded) and checked: format, declared size, frames, JPEG scans."""
    if not data:
        raise InvalidRequestError(f"{field} is empty", param=field)
    png_text.check(data, field)  # chunk and text bounds before Pillow inflates any text (issue 43)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=FORMATS)
            width, height = image.size
            if width * height > max_pixels:
                raise InvalidRequestError(f"{field} declares {width}x{height} pixels, over this server's limit of "
                                          f"{max_pixels} pixels", param=field)
            frames = int(getattr(image, "n_frames", 1))
    except UnidentifiedImageError:
        raise InvalidRequestError(f"{field} is not an image in a supported format ({', '.join(FORMATS)})",
                                  param=field) from None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise InvalidRequestError(f"{field} declares more pixels than PIL decodes safely, over this server's limit "
                                  f"of {max_pixels} pixels", param=field) from None
    except (OSError, ValueError, SyntaxError, EOFError) as exc:
        raise InvalidRequestError(f"{field} is truncated or corrupt ({type(exc).__name__}: "
                                  f"{str(exc)[:120]})", param=field) from None
    if frames > 1 or getattr(image, "is_animated", False):
        raise InvalidRequestError(f"{field} is animated ({image.format}, {frames} frames): send one still "
                                  "image", param=field)
    if image.format == "JPEG" and (scans := jpeg_scans(data)) > _policy["max_jpeg_scans"]:
        raise InvalidRequestError(f"{field} is a JPEG of {scans} scans, over this server's limit of "
                                  f"{_policy['max_jpeg_scans']} (limits.max_jpeg_scans): re-encode it (a "
                                  "progressive JPEG has about 10)", param=field)
    return image


def open_header(data: bytes, field: str, max_pixels: int) -> Image.Image:
    """The image opened and checked as every upload is (``_open``: bounds, format, size, frames, scans) with no
    pixel decoded and no decoder slot taken: for what reads metadata only (png-info)."""
    return _open(data, field, max_pixels)


def jpeg_scans(data: bytes) -> int:
    """Start-of-scan (SOS, FF DA) markers in a JPEG stream, without decoding it.

    Pillow's JpegImagePlugin reads the header only up to the first SOS and exposes ``info["progressive"]``, not
    a scan count; libjpeg then decodes a progressive image scan by scan, each a pass over the whole image, so the
    count is the decode's cost. Segments before the first scan are skipped by their lengths (an EXIF thumbnail in
    APP1 is not counted). After it, entropy-coded data holds 0xFF only as FF 00 or a marker, so every FF DA found
    is a scan (a table segment's bytes may add a few: they count against the sender)."""
    pos = 2
    while pos + 4 <= len(data):
        if data[pos] != 0xFF:  # junk Pillow would skip: count from here
            return data.count(b"\xff\xda", pos)
        marker = data[pos + 1]
        if marker == 0xDA:
            return 1 + data.count(b"\xff\xda", pos + 2)
        if marker == 0xFF:  # fill byte
            pos += 1
        elif marker in (0x00, 0x01) or 0xD0 <= marker <= 0xD9:  # standalone markers
            pos += 2
        else:
            pos += 2 + int.from_bytes(data[pos + 2:pos + 4], "big")
    return 0


ADAM7 = ((0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2), (0, 1, 1, 2))
PNG_CHANNELS = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}


def _png_chunks(data: bytes) -> Iterator[tuple[bytes, bytes]]:
    pos = 8
    while pos + 8 <= len(data):
        length = int.from_bytes(data[pos:pos + 4], "big")
        yield data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]
        pos += 12 + length


def _png_expected_bytes(ihdr: bytes) -> int:
    """Bytes of filtered scanlines the header declares (one filter byte per row, Adam7's passes when interlaced)."""
    width, height = int.from_bytes(ihdr[0:4], "big"), int.from_bytes(ihdr[4:8], "big")
    bits = ihdr[8] * PNG_CHANNELS.get(ihdr[9], 4)
    passes = ADAM7 if ihdr[12] else ((0, 0, 1, 1),)
    total = 0
    for x0, y0, dx, dy in passes:
        cols, rows = -(-(width - x0) // dx), -(-(height - y0) // dy)
        if cols > 0 and rows > 0:
            total += rows * (1 + -(-(cols * bits) // 8))
    return total


def _require_whole_png(data: bytes, image: Image.Image, field: str) -> None:
    """Pillow accepts a PNG whose zlib stream ends before the last row (the rest stays black) and one without
    IEND (PngImagePlugin's load_read / load_end stop at the stream's end); both are refused here. The image data
    is inflated again in 1 MiB pieces to count it: bounded by the pixel limit, never held whole."""
    chunks = []
    for chunk in _png_chunks(data):  # bytes after IEND are ignored, as Pillow does
        chunks.append(chunk)
        if chunk[0] == b"IEND":
            break
    else:
        raise InvalidRequestError(f"{field} is a truncated PNG (it ends before its IEND chunk)", param=field)
    want = _png_expected_bytes(chunks[0][1])
    inflate, got = zlib.decompressobj(), 0
    for kind, payload in chunks:
        if kind != b"IDAT":
            continue
        piece = inflate.decompress(payload, 1 << 20)
        got += len(piece)
        while inflate.unconsumed_tail and got <= want:
            piece = inflate.decompress(inflate.unconsumed_tail, 1 << 20)
            got += len(piece)
        if got > want:
            break
    if got < want:
        raise InvalidRequestError(f"{field} is a truncated PNG: its image data holds {got} of the {want} bytes "
                                  f"its {image.width}x{image.height} header declares", param=field)


def check_pixel_budget(uploads: Sequence[tuple[str, bytes | str | None]], max_pixels: int, budget: int) -> None:
    """The pixels every image and mask of one request declares, read from their headers (no pixel decoded),
    against ``limits.max_request_pixels``; each one's own limits (``max_pixels``, JPEG scans) are checked on
    the way. ``uploads`` are (field, bytes or A1111's base64 text, or None for a field left out)."""
    total = 0
    for field, item in uploads:
        if item is None:
            continue
        data = _from_base64_text(item, field) if isinstance(item, str) else item
        image = _open(data, field, max_pixels)
        total += image.width * image.height
        if total > budget:
            raise InvalidRequestError(f"{field}: the request's images and masks declare {total} pixels in all (up "
                                      f"to this one), over this server's per-request budget of {budget} pixels "
                                      "(limits.max_request_pixels): send fewer or smaller images", param=field)


def declared_size(item: bytes | str, field: str, max_pixels: int) -> tuple[int, int]:
    """The (width, height) an upload (bytes, or A1111's base64 text) is edited at, as its header declares it and
    after its EXIF orientation (a 90-degree turn swaps them), with no pixel decoded: an instruction edit's output
    size is chosen, and the request admitted, before its images are decoded."""
    data = _from_base64_text(item, field) if isinstance(item, str) else item
    image = _open(data, field, max_pixels)
    turned = image.getexif().get(0x0112) in (5, 6, 7, 8)
    return (image.height, image.width) if turned else (image.width, image.height)


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
    return decode(_from_base64_text(text, field), field, max_pixels)


def from_base64_bytes(text: str, field: str) -> bytes:
    """The bytes of A1111's base64 image text (with or without a data: prefix), not yet decoded as an image."""
    return _from_base64_text(text, field)


def _from_base64_text(text: str, field: str) -> bytes:
    if text.startswith("data:"):
        head, _, text = text.partition(",")
        if not head.endswith(";base64"):
            raise InvalidRequestError(f"{field}: a data URL must be base64 (data:image/png;base64,...)", param=field)
    try:
        return base64.b64decode("".join(text.split()), validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequestError(f"{field} is not valid base64", param=field) from None


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
    """A mask upload as an L mask (255 repaints): its alpha (transparent = edit) when it has one, else luminance.
    A mask that marks nothing is refused here, before the image is resized or anything else costs."""
    mask = alpha_mask(image) or (image.convert("L") if image.mode != "RGBA" else Image.new("L", image.size, 0))
    return require_marks(mask)


def require_marks(mask: Image.Image) -> Image.Image:
    """``mask`` (L), or a 400 naming ``mask`` when no pixel of it repaints: a cheap check that belongs before the
    blurs and resizes (a 4096x4096 empty mask cost 4.1 s and 450 MB before its refusal, issue 32)."""
    if mask.getbbox() is None:
        raise InvalidRequestError("mask marks nothing to repaint (no white, or no transparent, pixels)",
                                  param="mask")
    return mask


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
    """A1111's mask_blur: a Gaussian blur of the mask (PIL's, an approximation of A1111's OpenCV kernel); a mask
    that marks nothing is refused first (``require_marks``)."""
    mask = require_marks(mask)
    return mask.filter(ImageFilter.GaussianBlur(radius)) if radius > 0 else mask


def fill_masked(image: Image.Image, mask: Image.Image) -> Image.Image:
    """A1111's ``inpainting_fill`` 0 ("fill"): the area to repaint painted with its surroundings' colours (blurs of
    the kept pixels at falling radii, normalized by the blurred coverage), the kept pixels unchanged."""
    keep = ImageOps.invert(require_marks(mask.convert("L")))
    layer = image.convert("RGB").convert("RGBA")
    layer.putalpha(keep)
    filled = Image.new("RGBA", image.size)
    premultiplied = layer.convert("RGBa")
    for radius, repeats in ((256, 1), (64, 1), (16, 2), (4, 4), (2, 2), (0, 1)):
        blurred = premultiplied.filter(ImageFilter.GaussianBlur(radius)).convert("RGBA")
        for _ in range(repeats):
            filled.alpha_composite(blurred)
    return Image.composite(image.convert("RGB"), filled.convert("RGB"), keep)
