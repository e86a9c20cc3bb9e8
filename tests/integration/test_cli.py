"""`sdserve generate` on the same pipeline as the server."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from PIL import Image


def test_generate_writes_a_png_of_the_requested_size(tiny_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "out.png"
    done = subprocess.run([sys.executable, "-m", "server.cli", "generate", "a lighthouse", "-o", str(out),
                           "--profile", "dev", "--model", str(tiny_model), "--size", "32x48", "--steps", "4",
                           "--scheduler", "ddim", "--seed", "9"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    with Image.open(out) as image:
        assert image.size == (32, 48)


def test_generate_rejects_a_bad_size_with_usage_code(tiny_model: Path, tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "server.cli", "generate", "x", "-o", str(tmp_path / "o.png"),
                           "--profile", "dev", "--model", str(tiny_model), "--size", "33x48"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "multiple of 16" in done.stderr
