"""`sdserve generate` on the same pipeline as the server."""

from __future__ import annotations

import os
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


def _sdserve(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "server.cli", *args], capture_output=True, text=True, timeout=120,
                          env=env)


def test_generate_with_a_missing_model_exits_11_like_serve(tmp_path: Path) -> None:
    for command in (["generate", "x", "-o", str(tmp_path / "o.png")], ["serve", "--port", "0"]):
        done = _sdserve(*command, "--profile", "dev", "--model", str(tmp_path / "absent"))
        assert done.returncode == 11, (command, done.stderr)
        assert "does not exist" in done.stderr and "Traceback" not in done.stderr


def test_engines_export_from_an_onnx_folder_exits_11_naming_what_it_needs(tiny_model: Path, tmp_path: Path) -> None:
    done = _sdserve("engines", "export", "--from", str(tiny_model), "--out", str(tmp_path / "out"))
    assert done.returncode == 11, done.stderr
    assert "sdserve ONNX model folder already" in done.stderr and "Traceback" not in done.stderr
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "model_index.json").write_text("{}")
    done = _sdserve("engines", "export", "--from", str(tmp_path / "half"), "--out", str(tmp_path / "out"))
    assert done.returncode == 11 and "missing ['text_encoder/config.json'" in done.stderr, done.stderr
    assert not (tmp_path / "out").exists()


def test_bench_plot_without_matplotlib_fails_naming_it_before_any_load(tmp_path: Path) -> None:
    """A stand-in package path where matplotlib cannot be imported (a shadowing module that is not a package)."""
    (tmp_path / "shadow").mkdir()
    hide = tmp_path / "shadow" / "sitecustomize.py"
    hide.write_text("import sys\nsys.modules['matplotlib'] = None\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "shadow")}
    done = _sdserve("bench", "--url", "http://127.0.0.1:9", "--plot", str(tmp_path / "p.png"), env=env)
    assert done.returncode == 2, done.stderr
    assert "needs the matplotlib package" in done.stderr and not (tmp_path / "p.png").exists()
