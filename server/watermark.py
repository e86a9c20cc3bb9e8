"""Invisible watermark: the DWT-DCT scheme ``invisible-watermark`` (``imwatermark``, method ``dwtDct``) writes,
implemented here on numpy alone ([provenance] watermark; docs/provenance.md#invisible-watermark).

The scheme, as the library does it: the image's chroma U (OpenCV's 8-bit BGR->YUV) is split by a level-1 Haar DWT;
in every 4x4 block of the approximation band the largest-magnitude coefficient other than the block's first is
moved to the centre of a quantization cell of step 36 whose parity is the payload bit (bit ``k`` of the payload in
block ``k mod n``, blocks in row order); decoding reads each block's parity and takes the majority per bit. (Despite
the name there is no DCT in the library's ``dwtDct`` path: the blocks are quantized as they are.)

Why ours and not the library: ``imwatermark`` imports torch when imported (``watermark.py`` imports ``rivaGan.py``)
and needs OpenCV; serving imports neither, and needs no PyWavelets either: a level-1 Haar approximation
coefficient is half the sum of its 2x2 pixels, so changing it by d is exactly changing those pixels by d/2. Ours is
bit-compatible (the library decodes our marks and we decode its marks, tests/unit/test_watermark.py) and differs
from the library's embedder in three ways, none the decoder sees: only the 2x2 pixels under a carrying coefficient
change (the library rebuilds the whole chroma plane through ``pywt.idwt2`` with the horizontal and vertical detail
bands swapped, transposing every 2x2 block of it); the colour conversion rounds where the library truncates; and
each coefficient goes to the nearest cell of its bit that keeps it the block's largest and survives 4:2:0 chroma
subsampling (the library's always-the-cell-below can sink it under another coefficient, and then the decoder
reads that one). The measured robustness: docs/provenance.md.
"""

from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

SCHEME = "dwtDct"
SCALE = 36.0
"""Quantization step on the U channel's approximation band (the library's default for ``dwtDct``)."""
BLOCK = 4
MARGIN = 18.0
"""How far above the block's runner-up coefficient the carrying one is put (half the step), so that
compression and rounding do not make the decoder read another one."""
MIN_PIXELS = 256 * 256
"""The library refuses images of fewer pixels; so do we (too few blocks per payload bit to survive anything)."""
ID_BYTES = 6
CHECK_BYTES = 2
PAYLOAD_BITS = 8 * (ID_BYTES + CHECK_BYTES)
"""64 bits: a 48-bit id and a 16-bit check that tells a mark from noise (a false match once in 65536 images)."""

_SHIFT, _HALF = 14, 1 << 13
"""OpenCV's fixed-point colour conversion (8-bit): coefficients scaled by 2^14, rounded."""

Array = NDArray[np.int64]


def rgb_to_yuv(rgb: NDArray[np.uint8]) -> tuple[Array, Array, Array]:
    """Y, U, V of an 8-bit RGB image exactly as OpenCV's 8-bit COLOR_BGR2YUV computes them (every colour)."""
    r, g, b = (rgb[..., i].astype(np.int64) for i in range(3))
    y = (r * 4899 + g * 9617 + b * 1868 + _HALF) >> _SHIFT
    u = ((b - y) * 8061 + (128 << _SHIFT) + _HALF) >> _SHIFT
    v = ((r - y) * 14369 + (128 << _SHIFT) + _HALF) >> _SHIFT
    return y, np.clip(u, 0, 255), np.clip(v, 0, 255)


def yuv_to_rgb(y: Array, u: Array, v: Array) -> NDArray[np.uint8]:
    """8-bit RGB from Y, U, V exactly as OpenCV's 8-bit COLOR_YUV2BGR computes it."""
    du, dv = u - 128, v - 128
    r = y + ((dv * 18678 + _HALF) >> _SHIFT)
    g = y + ((du * -6472 + dv * -9519 + _HALF) >> _SHIFT)
    b = y + ((du * 33292 + _HALF) >> _SHIFT)
    rgb: NDArray[np.uint8] = np.clip(np.stack([r, g, b], axis=-1), 0, 255).astype(np.uint8)
    return rgb


def too_small(width: int, height: int) -> bool:
    """Whether an image is too small to carry a mark (the library's rule: under 256x256 pixels in area)."""
    return width * height < MIN_PIXELS or min(width, height) < 2 * BLOCK


def _approximation(u: Array) -> NDArray[np.float64]:
    """The level-1 Haar approximation band (cA) of the U plane, cropped as the library crops it."""
    rows, cols = u.shape[0] // BLOCK * BLOCK, u.shape[1] // BLOCK * BLOCK
    x = u[:rows, :cols].astype(np.float64)
    return np.asarray((x[0::2, 0::2] + x[0::2, 1::2] + x[1::2, 0::2] + x[1::2, 1::2]) / 2)


def _blocks(approx: NDArray[np.float64]) -> tuple[NDArray[np.float64], NDArray[np.intp], NDArray[np.float64]]:
    """The approximation band cut into 4x4 blocks (rows, cols, 16), the index in each block of the coefficient
    that carries the bit, and that coefficient."""
    br, bc = approx.shape[0] // BLOCK, approx.shape[1] // BLOCK
    tiles = approx[:br * BLOCK, :bc * BLOCK].reshape(br, BLOCK, bc, BLOCK).transpose(0, 2, 1, 3)
    blocks = tiles.reshape(br, bc, BLOCK * BLOCK)
    pos = np.argmax(np.abs(blocks[..., 1:]), axis=-1) + 1  # the first coefficient never carries a bit
    return blocks, pos, np.take_along_axis(blocks, pos[..., None], axis=-1)[..., 0]


def _bit_of_block(count: int, n_bits: int) -> NDArray[np.intp]:
    return np.arange(count) % n_bits


def embed(rgb: NDArray[np.uint8], bits: NDArray[np.uint8], margin: float = MARGIN) -> NDArray[np.uint8]:
    """``rgb`` (H, W, 3 uint8) carrying ``bits`` (0/1). Only the 2x2 pixels under each block's carrying
    coefficient change; the caller checks the size with ``too_small``."""
    y, u, v = rgb_to_yuv(rgb)
    approx = _approximation(u)
    blocks, pos, val = _blocks(approx)
    br, bc = val.shape
    bit = bits[_bit_of_block(br * bc, len(bits))].reshape(br, bc).astype(np.float64)
    arow = np.arange(br)[:, None] * BLOCK + pos // BLOCK  # the carrying coefficient's place in the band
    acol = np.arange(bc)[None, :] * BLOCK + pos % BLOCK
    new = _magnitude(np.abs(val), _runner_up(blocks, pos), _surround(approx, arow, acol), bit, margin)
    delta = np.where(val < 0, -1.0, 1.0) * new - val
    # coefficient (band row, col) -> its 2x2 pixels, each moved by delta / 2
    prow, pcol = arow * 2, acol * 2
    rr = (prow[..., None] + np.array([0, 0, 1, 1])).ravel()
    cc = (pcol[..., None] + np.array([0, 1, 0, 1])).ravel()
    moved = np.repeat(delta.ravel() / 2, 4)
    u2 = np.clip(np.rint(u[rr, cc] + moved), 0, 255).astype(np.int64)
    out = rgb.copy()
    out[rr, cc] = yuv_to_rgb(y[rr, cc], u2, v[rr, cc])
    return out


def _runner_up(blocks: NDArray[np.float64], pos: NDArray[np.intp]) -> NDArray[np.float64]:
    """The largest magnitude in each block after the carrying coefficient's (the first coefficient excluded)."""
    others = np.abs(blocks[..., 1:]).copy()
    np.put_along_axis(others, (pos - 1)[..., None], -1.0, axis=-1)
    return np.asarray(others.max(axis=-1))


_CENTRE, _EDGE, _CORNER = 9 / 16, 3 / 32, 1 / 64
"""What a coefficient becomes after 4:2:0 chroma subsampling and libjpeg's (and libwebp's) "fancy" triangular
upsampling: 9/16 of itself, 3/32 of each edge neighbour and 1/64 of each corner one."""
GUARD = 4.0
"""How far from a cell boundary the carrying coefficient must stay after that smoothing."""


def _surround(approx: NDArray[np.float64], rows: NDArray[np.intp], cols: NDArray[np.intp]) -> NDArray[np.float64]:
    """The neighbours' share of each carrying coefficient after chroma subsampling (edges replicated)."""
    pad = np.pad(np.abs(approx), 1, mode="edge")
    r, c = rows + 1, cols + 1
    edges = pad[r - 1, c] + pad[r + 1, c] + pad[r, c - 1] + pad[r, c + 1]
    corners = pad[r - 1, c - 1] + pad[r - 1, c + 1] + pad[r + 1, c - 1] + pad[r + 1, c + 1]
    return np.asarray(_EDGE * edges + _CORNER * corners)


def _magnitude(now: NDArray[np.float64], floor: NDArray[np.float64], surround: NDArray[np.float64],
               bit: NDArray[np.float64], margin: float) -> NDArray[np.float64]:
    """The new magnitude of each carrying coefficient: the centre of a cell of the wanted parity nearest its
    magnitude now (the library always takes the one in the cell below, which may sink it under another
    coefficient, and then the decoder reads that one) among those at least ``margin`` above the runner-up, so
    the decoder finds it again; never over 510, the largest a coefficient of 8-bit pixels can be."""
    offset = (0.25 + 0.5 * bit) * SCALE
    k = np.floor(now / SCALE)
    candidates = np.stack([(k + d) * SCALE + offset for d in (-2, -1, 0, 1, 2, 3)], axis=-1)
    on_top = (candidates >= floor[..., None] + margin) & (candidates >= 0) & (candidates <= 510)
    smoothed = (_CENTRE * candidates + surround[..., None]) % SCALE  # where it lands after 4:2:0
    want_one = bit[..., None] > 0
    kept = np.where(want_one, (smoothed > SCALE / 2 + GUARD) & (smoothed < SCALE - GUARD),
                    (smoothed > GUARD) & (smoothed < SCALE / 2 - GUARD))
    distance = np.abs(candidates - now[..., None])
    best = np.full(now.shape, np.nan)
    for ok in (on_top & kept, on_top):  # survives subsampling too if it can, else at least stays on top
        cost = np.where(ok, distance, np.inf)
        pick = np.take_along_axis(candidates, np.argmin(cost, axis=-1)[..., None], axis=-1)[..., 0]
        best = np.where(np.isnan(best) & np.isfinite(cost.min(axis=-1)), pick, best)
    return np.where(np.isnan(best), k * SCALE + offset, best)


def block_bits(rgb: NDArray[np.uint8]) -> NDArray[np.uint8]:
    """Each block's bit, in block order (the raw votes)."""
    _, _, val = _blocks(_approximation(rgb_to_yuv(rgb)[1]))
    return (np.abs(val).ravel() % SCALE > SCALE / 2).astype(np.uint8)


def decode(rgb: NDArray[np.uint8], n_bits: int = PAYLOAD_BITS) -> tuple[NDArray[np.uint8], float]:
    """The ``n_bits`` bits a mark in ``rgb`` says (the library's majority: mean vote * 255 > 127) and the share of
    blocks that agree with them (about 0.5 to 0.6 in an unmarked image, near 1 in a marked one)."""
    votes = block_bits(rgb)
    which = _bit_of_block(len(votes), n_bits)
    means = np.bincount(which, weights=votes, minlength=n_bits) / np.maximum(np.bincount(which, minlength=n_bits), 1)
    bits = (means * 255 > 127).astype(np.uint8)
    return bits, float(np.mean(votes == bits[which])) if len(votes) else 0.0


def payload_for(request_id: str, index: int) -> bytes:
    """The 8-byte payload of image ``index`` of request ``request_id``: the first 48 bits of
    SHA-256("<request id>/<index>"), then the 16-bit check."""
    ident = hashlib.sha256(f"{request_id}/{index}".encode()).digest()[:ID_BYTES]
    return ident + _check(ident)


def _check(ident: bytes) -> bytes:
    return hashlib.sha256(b"sdserve-watermark:" + ident).digest()[:CHECK_BYTES]


def to_bits(payload: bytes) -> NDArray[np.uint8]:
    return np.unpackbits(np.frombuffer(payload, dtype=np.uint8))


@dataclass(frozen=True)
class Reading:
    """What an image's pixels say: the payload when its check holds (else None), the raw bits, the agreement."""

    payload: bytes | None
    bits: bytes
    agreement: float

    def matches(self, payload: bytes) -> int:
        """How many of ``payload``'s bits the image's bits equal."""
        return int(np.sum(to_bits(self.bits) == to_bits(payload)))


def read(rgb: NDArray[np.uint8]) -> Reading | None:
    """The mark of an RGB image; None when the image is too small to carry one."""
    if too_small(rgb.shape[1], rgb.shape[0]):
        return None
    bits, agreement = decode(rgb)
    raw = np.packbits(bits).tobytes()
    ident, check = raw[:ID_BYTES], raw[ID_BYTES:]
    return Reading(raw if _check(ident) == check else None, raw, agreement)


def pixels(data: bytes) -> NDArray[np.uint8]:
    """An encoded image's RGB pixels (PIL: PNG, JPEG, WebP)."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as image:
        return np.asarray(image.convert("RGB"))


def read_bytes(data: bytes) -> Reading | None:
    return read(pixels(data))


SKIP_REASONS = ("too_small", "unsupported_image", "unreadable")
"""Why an image was served without a mark: under 256x256 pixels; not an RGB PNG, JPEG or WebP; or the mark did
not read back from the encoded image (flat, saturated pixels, or a lossy encoding that erased it)."""


@dataclass(frozen=True)
class Marked:
    """One image after the watermark stage: its bytes, and the payload it carries or why it carries none."""

    data: bytes
    payload: bytes | None
    skipped: str = ""

    def record(self, image: int) -> dict[str, str | int]:
        """The ``watermark`` entry of the org.sdserve.generation assertion of the response's image ``image``
        (0-based; the payload is ``payload_for(request id, image)``)."""
        if self.payload is None:
            return {"scheme": SCHEME, "image": image, "skipped": self.skipped}
        return {"scheme": SCHEME, "image": image, "payload": self.payload.hex(), "bits": PAYLOAD_BITS}

    @property
    def header(self) -> str:
        """This image's entry in x-sdserve-watermark: the payload in hex, or ``skipped:<reason>``."""
        return self.payload.hex() if self.payload is not None else f"skipped:{self.skipped}"


def mark_bytes(data: bytes, payload: bytes) -> Marked:
    """``data`` (an encoded image) re-encoded carrying ``payload``: same format, PNG text chunks, JPEG quantization
    tables, subsampling and EXIF, WebP EXIF kept (a WebP does not record its quality: it is re-encoded at 100).
    The mark is read back from the new bytes; an image too small, of another kind, or whose mark does not read
    back is returned unchanged with the reason."""
    from PIL import Image

    try:
        source = Image.open(io.BytesIO(data))
        source.load()
    except (OSError, ValueError):
        return Marked(data, None, "unsupported_image")
    if source.format not in ("PNG", "JPEG", "WEBP") or source.mode != "RGB":
        return Marked(data, None, "unsupported_image")
    if too_small(*source.size):
        return Marked(data, None, "too_small")
    marked = _encode_like(source, embed(np.asarray(source), to_bits(payload)))
    reading = read_bytes(marked)
    if reading is None or reading.payload != payload:
        return Marked(data, None, "unreadable")
    return Marked(marked, payload)


def _encode_like(source: object, rgb: NDArray[np.uint8]) -> bytes:
    from PIL import Image, JpegImagePlugin, PngImagePlugin

    assert isinstance(source, Image.Image)
    image, out, info = Image.fromarray(rgb, "RGB"), io.BytesIO(), source.info
    extra = {key: info[key] for key in ("exif", "icc_profile") if info.get(key)}
    if source.format == "PNG":
        text = PngImagePlugin.PngInfo()
        for key, value in getattr(source, "text", {}).items():
            text.add_text(key, value)
        image.save(out, format="PNG", pnginfo=text, **extra)
    elif isinstance(source, JpegImagePlugin.JpegImageFile):
        sampling = JpegImagePlugin.get_sampling(source)
        image.save(out, format="JPEG", qtables=source.quantization, **extra,
                   **({"subsampling": sampling} if sampling >= 0 else {}),
                   **({"comment": info["comment"]} if info.get("comment") else {}))
    else:
        image.save(out, format="WEBP", quality=100, **extra)
    return out.getvalue()
