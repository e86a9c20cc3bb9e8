"""Hostile and unusual uploads through server/images_in.py: each decoded as documented or refused by name."""

from __future__ import annotations

import base64
import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from engines.errors import InvalidRequestError
from server.images_in import alpha_mask, decode, fill_masked, from_base64, mask_image, resize

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
