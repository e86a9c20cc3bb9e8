"""The DWT-DCT watermark (server/watermark.py): our colour conversion is OpenCV's, bit for bit; embed -> decode
returns the payload; the library (``imwatermark``, the test extra) decodes our marks and we decode its marks; an
image too small or whose mark does not read back is returned unchanged with the reason; re-encoding keeps the
format's metadata; verify compares the pixels' payload with the manifest's."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import cv2
import numpy as np
import pytest
from PIL import Image, PngImagePlugin

from server import watermark as wm
from server.provenance_verify import read_watermark

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
from bench_watermark import textured  # noqa: E402

PAYLOAD = wm.payload_for("req-1", 0)


def _bgr(rgb: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(rgb[..., ::-1])


def test_colour_conversion_is_opencv_s_for_every_colour() -> None:
    v = np.arange(1 << 24, dtype=np.uint32)
    rgb = np.stack([(v >> 16) & 255, (v >> 8) & 255, v & 255], -1).astype(np.uint8).reshape(4096, 4096, 3)
    y, u, w = wm.rgb_to_yuv(rgb)
    assert np.array_equal(np.stack([y, u, w], -1), cv2.cvtColor(_bgr(rgb), cv2.COLOR_BGR2YUV))
    assert np.array_equal(wm.yuv_to_rgb(*(rgb[..., i].astype(np.int64) for i in range(3))),
                          cv2.cvtColor(rgb, cv2.COLOR_YUV2BGR)[..., ::-1])


@pytest.mark.parametrize("size", [256, 512, 520])
def test_embed_then_read_returns_the_payload(size: int) -> None:
    image = textured(size, 3)
    reading = wm.read(wm.embed(image, wm.to_bits(PAYLOAD)))
    assert reading is not None and reading.payload == PAYLOAD and reading.agreement > 0.9
    unmarked = wm.read(image)
    assert unmarked is not None and unmarked.payload is None and unmarked.agreement < 0.7


def test_bit_compatible_with_imwatermark_both_ways() -> None:
    from imwatermark import WatermarkDecoder, WatermarkEncoder

    image = textured(512, 1)
    ours = wm.embed(image, wm.to_bits(PAYLOAD))
    assert WatermarkDecoder("bytes", 64).decode(_bgr(ours), "dwtDct") == PAYLOAD  # the library reads ours
    encoder = WatermarkEncoder()
    encoder.set_watermark("bytes", PAYLOAD)
    theirs = np.ascontiguousarray(encoder.encode(_bgr(image), "dwtDct")[..., ::-1])
    reading = wm.read(theirs)
    assert reading is not None and reading.payload == PAYLOAD  # we read the library's
    # the raw block votes agree: the same blocks, the same carrying coefficient, the same parity rule
    from imwatermark.maxDct import EmbedMaxDct

    assert np.array_equal(wm.decode(theirs)[0], EmbedMaxDct([], wmLen=64).decode(_bgr(theirs)).astype(np.uint8))
    import pywt

    library = EmbedMaxDct([], wmLen=64)
    approx = pywt.dwt2(cv2.cvtColor(_bgr(image), cv2.COLOR_BGR2YUV)[:, :, 1], "haar")[0]
    votes = [library.infer_dct_matrix(approx[i:i + 4, j:j + 4], 36)
             for i in range(0, approx.shape[0] // 4 * 4, 4) for j in range(0, approx.shape[1] // 4 * 4, 4)]
    # unmarked pixels: the same vote in every block but where pywt's float error (1/sqrt 2) meets a boundary
    assert np.mean(np.array(votes) == wm.block_bits(image)) > 0.99


def test_only_the_pixels_under_carrying_coefficients_change() -> None:
    image = textured(256, 2)
    changed = np.any(wm.embed(image, wm.to_bits(PAYLOAD)) != image, axis=-1)
    assert 0 < changed.mean() <= 1 / 16  # one 2x2 cell of each 8x8 block at most


def _png(rgb: np.ndarray, text: str = "") -> bytes:
    info = PngImagePlugin.PngInfo()
    if text:
        info.add_text("parameters", text)
    buffer = io.BytesIO()
    Image.fromarray(rgb).save(buffer, format="PNG", pnginfo=info)
    return buffer.getvalue()


def test_mark_bytes_keeps_png_text_and_jpeg_tables() -> None:
    image = textured(512, 4)
    marked = wm.mark_bytes(_png(image, "a lighthouse, Steps: 2"), PAYLOAD)
    assert marked.payload == PAYLOAD and marked.header == PAYLOAD.hex()
    with Image.open(io.BytesIO(marked.data)) as opened:
        assert opened.text["parameters"] == "a lighthouse, Steps: 2"  # type: ignore[attr-defined]
    jpeg = io.BytesIO()
    Image.fromarray(image).save(jpeg, format="JPEG", quality=97)
    marked = wm.mark_bytes(jpeg.getvalue(), PAYLOAD)
    assert marked.payload == PAYLOAD
    with Image.open(io.BytesIO(marked.data)) as a, Image.open(jpeg) as b:
        assert a.quantization == b.quantization  # type: ignore[attr-defined]


def test_what_cannot_carry_a_mark_is_returned_unchanged_with_the_reason() -> None:
    small = _png(textured(256, 5)[:128])
    assert wm.mark_bytes(small, PAYLOAD) == wm.Marked(small, None, "too_small")
    white = _png(np.full((256, 256, 3), 255, np.uint8))  # saturated: raising the chroma clips away
    assert wm.mark_bytes(white, PAYLOAD) == wm.Marked(white, None, "unreadable")
    assert wm.mark_bytes(b"not an image", PAYLOAD).skipped == "unsupported_image"
    assert wm.Marked(small, None, "too_small").record(2) == {"scheme": "dwtDct", "image": 2, "skipped": "too_small"}


def test_verify_says_whether_the_pixels_carry_the_manifest_s_payload() -> None:
    data = wm.mark_bytes(_png(textured(512, 6)), PAYLOAD).data
    same = read_watermark(data, {"watermark": {"payload": PAYLOAD.hex()}})
    assert same is not None and same["payload"] == PAYLOAD.hex() and same["matches_manifest"] is True
    other = wm.payload_for("req-2", 0)
    differs = read_watermark(data, {"watermark": {"payload": other.hex()}})
    assert differs is not None and differs["matches_manifest"] is False
    assert differs["bits_matching_manifest"] == int(np.sum(wm.to_bits(PAYLOAD) == wm.to_bits(other)))
    assert read_watermark(_png(textured(512, 6)), None) == {
        "scheme": "dwtDct", "payload": None, "agreement": pytest.approx(0.55, abs=0.1), "manifest_payload": None}
