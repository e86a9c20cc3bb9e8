"""Hostile and unusual uploads through server/images_in.py: each decoded as documented or refused by name."""

from __future__ import annotations

import base64
import io
import struct
import zlib
from collections.abc import Iterator

import numpy as np
import pytest
from PIL import Image, ImageFile

from engines.errors import InvalidRequestError
from server import images_in
from server.errors import QueueFullError
from server.images_in import (
    MAX_JPEG_SCANS,
    alpha_mask,
    blur_mask,
    check_pixel_budget,
    decode,
    fill_masked,
    from_base64,
    jpeg_scans,
    mask_image,
    resize,
)

LIMIT = 1 << 20


def png(image: Image.Image, **options: object) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=options.pop("format", "PNG"), **options)  # type: ignore[arg-type]
    return buffer.getvalue()


def bomb(width: int, height: int) -> bytes:
    """A valid tiny PNG whose header declares width x height (a decompression bomb's shape)."""
    raw = png(Image.new("L", (1, 1)))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    chunk = b"IHDR" + ihdr
    return raw[:8] + struct.pack(">I", 13) + chunk + struct.pack(">I", zlib.crc32(chunk)) + raw[33:]


def gradient(mode: str = "RGB", size: tuple[int, int] = (32, 24)) -> Image.Image:
    x = np.linspace(0, 255, size[0] * size[1] * 3).reshape(size[1], size[0], 3).astype(np.uint8)
    return Image.fromarray(x).convert(mode)


def test_a_decompression_bomb_is_refused_before_decoding() -> None:
    for width, height in ((100_000, 100_000), (2048, 1024)):  # past PIL's own bomb bound, and past ours only
        data = bomb(width, height)
        assert len(data) < 200
        with pytest.raises(InvalidRequestError, match=r"declares .*pixels.* over this server's limit of 1048576") \
                as info:
            decode(data, "image", LIMIT)
        assert info.value.param == "image"


@pytest.mark.parametrize(("data", "named"), [
    (png(gradient())[:60], "truncated or corrupt"),
    (b"GIF89a" + b"\0" * 20, "truncated or corrupt|not an image"),
    (b"%PDF-1.4 not an image at all", "not an image in a supported format"),
    (png(gradient(), format="TIFF"), "not an image in a supported format"),
    (b"", "is empty"),
])
def test_broken_and_foreign_files_are_refused_by_name(data: bytes, named: str) -> None:
    with pytest.raises(InvalidRequestError, match=named):
        decode(data, "mask", LIMIT)


@pytest.mark.parametrize("fmt", ["GIF", "PNG", "WEBP"])
def test_animated_images_are_refused(fmt: str) -> None:
    frames = [gradient(), gradient().rotate(90, expand=False)]
    data = png(frames[0], format=fmt, save_all=True, append_images=frames[1:], duration=100)
    with pytest.raises(InvalidRequestError, match="is animated"):
        decode(data, "image", LIMIT)


@pytest.mark.parametrize(("image", "fmt", "mode"), [
    (gradient("CMYK"), "JPEG", "RGB"),
    (gradient("P"), "PNG", "RGB"),
    (gradient("RGBA"), "PNG", "RGBA"),
    (gradient("L"), "PNG", "L"),
    (gradient(), "WEBP", "RGB"),
    (gradient(), "BMP", "RGB"),
])
def test_modes_and_formats_are_converted(image: Image.Image, fmt: str, mode: str) -> None:
    out = decode(png(image, format=fmt), "image", LIMIT)
    assert out.mode == mode and out.size == (32, 24)


def test_16_bit_images_are_scaled_to_8_bits() -> None:
    deep = Image.fromarray((np.arange(32 * 24).reshape(24, 32) * 80).astype(np.uint16))
    out = decode(png(deep), "image", LIMIT)
    assert out.mode == "L" and 236 <= np.asarray(out).max() <= 240  # 61360 of 65535, scaled (not clipped)


def test_exif_orientation_is_applied() -> None:
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 CW to view
    out = decode(png(gradient(size=(40, 20)), format="JPEG", exif=exif), "image", LIMIT)
    assert out.size == (20, 40)


def test_base64_with_and_without_a_data_url_prefix() -> None:
    text = base64.b64encode(png(gradient())).decode()
    assert from_base64(text, "init_images.0", LIMIT).size == from_base64(
        "data:image/png;base64," + text, "init_images.0", LIMIT).size == (32, 24)
    with pytest.raises(InvalidRequestError, match="not valid base64"):
        from_base64("not base64 !!", "mask", LIMIT)


def test_transparent_pixels_mark_the_area_to_edit() -> None:
    image = gradient("RGBA")
    image.putalpha(Image.fromarray(np.where(np.arange(32)[None, :] < 16, 0, 255).repeat(24, 0).astype(np.uint8)))
    mask = np.asarray(alpha_mask(image))
    assert (mask[:, :16] == 255).all() and (mask[:, 16:] == 0).all()
    assert alpha_mask(gradient("RGBA")) is None and alpha_mask(gradient()) is None
    assert np.asarray(mask_image(gradient("L"))).shape == (24, 32)  # no alpha: luminance, white repaints


@pytest.mark.parametrize("mode", [0, 1, 2])
def test_resize_modes_give_the_target_size(mode: int) -> None:
    out = resize(gradient(size=(40, 20)), 32, 32, mode)  # type: ignore[arg-type]
    assert out.size == (32, 32)
    if mode == 2:  # the bands take the stretched edge rows, not black
        assert np.asarray(out)[0].mean() > 0


def test_fill_paints_the_masked_area_from_its_surroundings() -> None:
    image = Image.new("RGB", (32, 32), (200, 40, 40))
    image.paste((0, 0, 255), (8, 8, 24, 24))
    mask = Image.new("L", (32, 32), 0)
    mask.paste(255, (8, 8, 24, 24))
    out = np.asarray(fill_masked(image, mask))
    assert (out[0, 0] == (200, 40, 40)).all()
    assert abs(int(out[16, 16, 0]) - 200) < 30 and out[16, 16, 2] < 60  # the blue square is gone


@pytest.fixture
def loads(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Records every pixel decode (ImageFile.load): a refusal "before decoding" must leave it empty."""
    seen: list[str] = []
    original = ImageFile.ImageFile.load

    def spy(self: ImageFile.ImageFile) -> object:
        seen.append(str(self.format))
        return original(self)

    monkeypatch.setattr(ImageFile.ImageFile, "load", spy)
    images_in.configure(MAX_JPEG_SCANS, 4)
    yield seen
    images_in.configure(MAX_JPEG_SCANS, 4)


def progressive_jpeg(size: int = 256, flat: bool = False) -> bytes:
    image = Image.new("RGB", (size, size), (120, 130, 140)) if flat else gradient(size=(size, size))
    return png(image, format="JPEG", progressive=True, quality=90)


def scan_bomb(scans: int, size: int = 1024) -> bytes:
    """An encoder's progressive JPEG of a flat image with its smallest scan (header and entropy-coded data)
    repeated ``scans`` times: the shape of issue 32's 1 MB, 30,000-scan bomb, each repeat another decoding pass
    over the whole image."""
    data = progressive_jpeg(size, flat=True)
    markers = [i for i in range(len(data) - 1) if data[i] == 0xFF and data[i + 1] not in (0, *range(0xD0, 0xD8))]
    spans = [(i, next(j for j in markers if j > i)) for i in markers if data[i + 1] == 0xDA]
    start, end = min(spans, key=lambda span: span[1] - span[0])
    return data[:-2] + data[start:end] * scans + b"\xff\xd9"


def test_jpeg_scans_are_counted_in_the_byte_stream() -> None:
    baseline = png(gradient(size=(64, 64)), format="JPEG")
    assert jpeg_scans(baseline) == 1
    progressive = progressive_jpeg()
    assert 2 <= jpeg_scans(progressive) <= 20  # libjpeg's progressive script: 10 for colour
    assert jpeg_scans(scan_bomb(500, 64)) == jpeg_scans(progressive_jpeg(64, flat=True)) + 500
    # SOS bytes inside an APP1 segment (where an EXIF thumbnail lives) are skipped by the segment's length
    tricky = png(gradient(size=(64, 64)), format="JPEG", exif=b"Exif\x00\x00" + b"\xff\xda" * 300)
    assert tricky.count(b"\xff\xda") == 301 and jpeg_scans(tricky) == 1
    assert decode(progressive, "image", LIMIT).size == (256, 256)


def test_a_progressive_jpeg_scan_bomb_is_refused_before_any_pixel_is_decoded(loads: list[str]) -> None:
    """Issue 32: 30,000 tiny scans cost ~0.75 ms each at 4096x4096; the count is read from the bytes instead."""
    data = scan_bomb(30_000)
    assert len(data) < 2 << 20
    with pytest.raises(InvalidRequestError, match=r"JPEG of 30\d\d\d scans, over this server's limit of 100") as info:
        decode(data, "image", LIMIT)
    assert info.value.param == "image" and loads == []
    with pytest.raises(InvalidRequestError, match="scans") as info:
        from_base64(base64.b64encode(data).decode(), "init_images.3", LIMIT)
    assert info.value.param == "init_images.3" and loads == []


def test_the_scan_limit_is_the_configured_one(loads: list[str]) -> None:
    data = scan_bomb(10, 64)
    scans = jpeg_scans(data)
    images_in.configure(scans, 4)
    assert decode(data, "image", LIMIT).size == (64, 64)
    images_in.configure(scans - 1, 4)
    with pytest.raises(InvalidRequestError, match=f"{scans} scans"):
        decode(data, "image", LIMIT)


def test_the_pixel_budget_counts_every_image_and_mask_from_headers_only(loads: list[str]) -> None:
    """Issue 32: img2img with 16 init_images of 4096x4096 (tiny PNGs) peaked at 1.28 GB; the headers say it."""
    side = 4096
    image = base64.b64encode(bomb(side, side)).decode()
    uploads: list[tuple[str, bytes | str | None]] = [(f"init_images.{i}", image) for i in range(16)]
    with pytest.raises(InvalidRequestError, match=r"over this server's per-request budget of 33554432") as info:
        check_pixel_budget([*uploads, ("mask", None)], side * side, 2 * side * side)
    assert info.value.param == "init_images.2" and loads == []
    check_pixel_budget([uploads[0], ("mask", bomb(side, side))], side * side, 2 * side * side)  # at the budget
    with pytest.raises(InvalidRequestError, match="mask declares 4096x4096 pixels") as info:
        check_pixel_budget([("image", bomb(64, 64)), ("mask", bomb(side, side))], 1 << 20, 1 << 30)
    assert info.value.param == "mask" and loads == []


def test_decodes_are_bounded_per_process_with_a_429_not_a_wait(loads: list[str]) -> None:
    images_in.configure(MAX_JPEG_SCANS, 1)
    data = png(gradient())
    # another request's decode holds the only slot
    with images_in._decode_slot("init_images.0"), pytest.raises(QueueFullError, match="image decoder"):
        decode(data, "init_images.1", LIMIT)
    assert decode(data, "image", LIMIT).size == (32, 24)  # the slot came back


def raw_png(width: int, height: int, rows: int, iend: bool = True, interlace: int = 0) -> bytes:
    """An RGB PNG by hand: ``rows`` filtered rows of data (a complete zlib stream) under a header of ``height``."""

    def chunk(kind: bytes, payload: bytes) -> bytes:
        return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))

    raw = b"".join(b"\x00" + bytes([200, 100, 50]) * width for _ in range(rows))
    head = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, interlace)
    data = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", head) + chunk(b"IDAT", zlib.compress(raw))
    return data + (chunk(b"IEND", b"") if iend else b"")


def test_a_png_whose_data_ends_early_or_without_iend_is_refused() -> None:
    """Issue 32: 10 of 2,048 rows decoded to 200 with black rows; Pillow's PNG reader stops at the stream's end."""
    assert decode(raw_png(64, 64, 64), "image", LIMIT).getpixel((0, 63)) == (200, 100, 50)
    with pytest.raises(InvalidRequestError, match="truncated PNG: its image data holds 1930 of the 395264") as info:
        decode(raw_png(64, 2048, 10), "init_images.0", LIMIT)
    assert info.value.param == "init_images.0"
    with pytest.raises(InvalidRequestError, match="truncated PNG .it ends before its IEND"):
        decode(raw_png(64, 64, 64, iend=False), "mask", LIMIT)
    assert decode(raw_png(64, 64, 64) + b"\0" * 16, "image", LIMIT).size == (64, 64)  # bytes after IEND: ignored


@pytest.mark.parametrize("image", [gradient(size=(33, 17)), gradient("L", (7, 5)), gradient("P", (9, 9)),
                                   gradient("RGBA", (3, 1)), gradient("1", (13, 11))])
def test_whole_pngs_pass_the_row_count_interlaced_or_not(image: Image.Image) -> None:
    for interlace in (False, True):
        assert decode(png(image, interlace=interlace), "image", LIMIT).size == image.size


def test_a_mask_that_marks_nothing_is_refused_before_any_blur_or_fill() -> None:
    empty = Image.new("L", (64, 64), 0)
    for call in (lambda: mask_image(empty), lambda: blur_mask(empty, 4), lambda: blur_mask(empty, 0),
                 lambda: fill_masked(Image.new("RGB", (64, 64)), empty),
                 lambda: mask_image(Image.new("RGBA", (64, 64), (0, 0, 0, 255)))):
        with pytest.raises(InvalidRequestError, match="mask marks nothing") as info:
            call()
        assert info.value.param == "mask"
