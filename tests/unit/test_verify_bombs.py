"""Issue 57, a leftover of the last hostile pass: `sdserve verify` on a 93-byte PNG declaring 14000x14000 ended in
Pillow's uncaught DecompressionBombError (exit 1, a traceback), and a 79 KB 9000x9000 PNG took 33.9 s and 5.27 GB
(the watermark reader decodes every pixel). Both are refused by ``--max-pixels`` from the header, exit 2 (USAGE,
documented in server/cli/verify.py and the exit-code reference) with a line naming the file and its size. Real
files written here; Pillow's bound is PIL/Image.py ``_decompression_bomb_check``."""

from __future__ import annotations

import io
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
from PIL import Image, ImageFile

from server.cli.main import main
from server.cli.verify import MAX_PIXELS
from server.exitcodes import ExitCode


def _chunk(kind: bytes, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))


def tiny_bomb(width: int, height: int) -> bytes:
    """A PNG header declaring ``width`` x ``height`` RGB pixels with one byte of image data: 93 bytes."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", zlib.compress(b"\x00", 9))
            + _chunk(b"tEXt", b"Comment\x00" + b"x" * 7) + _chunk(b"IEND", b""))


def test_a_93_byte_png_declaring_14000_squared_exits_2_with_a_line_not_a_traceback(tmp_path: Path) -> None:
    bomb = tmp_path / "bomb.png"
    bomb.write_bytes(tiny_bomb(14000, 14000))
    assert bomb.stat().st_size == 93
    run = subprocess.run([sys.executable, "-m", "server.cli", "verify", str(bomb)], capture_output=True, text=True,
                         timeout=120, check=False)
    assert run.returncode == ExitCode.USAGE == 2, run.stderr
    assert "Traceback" not in run.stderr and "DecompressionBomb" not in run.stderr, run.stderr
    assert f"declares 14000x14000 pixels, over --max-pixels {MAX_PIXELS}" in run.stderr, run.stderr
    assert "bomb.png" in run.stderr


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_a_9000_squared_image_is_refused_before_a_pixel_is_decoded(tmp_path: Path, fmt: str,
                                                                   monkeypatch: pytest.MonkeyPatch,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """The file is real (a 9000x9000 image, 79 KB as PNG); decoding it would go through ImageFile.load, which
    fails the test here, so the refusal comes from the header alone."""
    buffer = io.BytesIO()
    Image.new("L", (9000, 9000)).save(buffer, fmt)
    path = tmp_path / f"big.{fmt.lower()}"
    path.write_bytes(buffer.getvalue())

    def no_decode(self: ImageFile.ImageFile) -> None:
        raise AssertionError("a pixel was decoded")

    monkeypatch.setattr(ImageFile.ImageFile, "load", no_decode)
    assert main(["verify", str(path)]) == ExitCode.USAGE
    assert f"declares 9000x9000 pixels, over --max-pixels {MAX_PIXELS}" in caplog.text
    caplog.clear()
    assert main(["verify", str(path), "--max-pixels", str(9000 * 9000 - 1)]) == ExitCode.USAGE
    assert "over --max-pixels 80999999" in caplog.text


def test_an_image_within_the_bound_is_verified_as_before(tmp_path: Path) -> None:
    """A 512x512 PNG without a manifest: read (its watermark too) and reported as unsigned, exit 42."""
    buffer = io.BytesIO()
    Image.new("RGB", (512, 512), (10, 20, 30)).save(buffer, "PNG")
    path = tmp_path / "plain.png"
    path.write_bytes(buffer.getvalue())
    assert main(["verify", str(path)]) == ExitCode.VERIFY_NO_MANIFEST == 42
    assert main(["verify", str(path), "--max-pixels", str(512 * 512 - 1)]) == ExitCode.USAGE
