"""Tiled upscaling (engines/pipelines/upscale.py) and A1111's extras steps (server/upscale.py) with a fake x4 network
behind the upscaler's session (nearest-neighbour repeats): the tiles cover every pixel once and never read more than
tile + 2 x overlap per side, a 4x of a 1024x1024 image holds one tile's floats at a time (measured with
tracemalloc), a passed deadline stops between tiles, and the size rules (A1111's multiple-of-8 target, its three
passes, the crop canvas, the pixel bound checked before a pass runs) hold. The real network's parity is
tests/integration/test_a1111_extras.py."""

from __future__ import annotations

import time
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from engines.errors import InvalidRequestError
from engines.pipelines.upscale import OnnxUpscaler, TilesStopped, tiles
from server.upscale import UpscaleJob, infotext, upscale_image


class RepeatX4:
    """A session whose network is a nearest x4 (local: tiling cannot change it), recording each input's shape."""

    def __init__(self) -> None:
        self.shapes: list[tuple[int, ...]] = []

    def run(self, outputs: list[str], feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        x = feeds["image"]
        self.shapes.append(x.shape)
        return [np.repeat(np.repeat(x, 4, axis=2), 4, axis=3)]


def fake_upscaler() -> OnnxUpscaler:
    model = object.__new__(OnnxUpscaler)
    model.path, model.name, model.provider = Path("fake-4x.onnx"), "fake-4x", "CPUExecutionProvider"
    model.session = RepeatX4()  # type: ignore[assignment]
    model.input, model.output, model.dtype, model.scale = "image", "upscaled", np.float32, 4
    return model


@pytest.mark.parametrize(("width", "height", "tile", "overlap"),
                         [(1, 1, 16, 8), (17, 33, 16, 8), (192, 192, 192, 8), (500, 130, 64, 0), (64, 40, 16, 30)])
def test_tiles_cover_each_pixel_once_and_read_a_bounded_box(width: int, height: int, tile: int, overlap: int) -> None:
    covered = np.zeros((height, width), dtype=np.int32)
    for t in tiles(width, height, tile, overlap):
        x0, y0, x1, y1 = t.core
        rx0, ry0, rx1, ry1 = t.read
        covered[y0:y1, x0:x1] += 1
        assert 0 <= rx0 <= x0 < x1 <= rx1 <= width and 0 <= ry0 <= y0 < y1 <= ry1 <= height
        assert x0 - rx0 <= overlap and rx1 - x1 <= overlap and y0 - ry0 <= overlap and ry1 - y1 <= overlap
        assert rx1 - rx0 <= tile + 2 * overlap and ry1 - ry0 <= tile + 2 * overlap
        assert x0 - rx0 == min(overlap, x0) and rx1 - x1 == min(overlap, width - x1)  # all the context there is
    assert (covered == 1).all()


def test_a_4x_of_1024_squared_holds_one_tile_of_floats_at_a_time() -> None:
    model = fake_upscaler()
    rgb = np.random.default_rng(0).integers(0, 256, (1024, 1024, 3), dtype=np.uint8)
    tracemalloc.start()
    try:
        out = model.run(rgb, tile=192, overlap=8)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert np.array_equal(out, np.repeat(np.repeat(rgb, 4, axis=0), 4, axis=1))
    shapes = model.session.shapes  # type: ignore[attr-defined]
    assert len(shapes) == 36 and max(s[2] * s[3] for s in shapes) <= 208 * 208
    output_bytes = 4096 * 4096 * 3
    # the uint8 result plus one tile's float input and x4 output (~4.2 MB each way); a whole-image float run would
    # hold 201 MB for its output alone
    assert peak < output_bytes + 24 * 2**20, peak


def test_a_passed_deadline_stops_before_the_next_tile() -> None:
    model = fake_upscaler()
    with pytest.raises(TilesStopped, match="deadline"):
        model.run(np.zeros((64, 64, 3), dtype=np.uint8), 16, 0, deadline=time.monotonic() - 1)
    assert model.session.shapes == []  # type: ignore[attr-defined]


def _job(**changes: Any) -> UpscaleJob:
    base: dict[str, Any] = {"resize_mode": 0, "by": 2.0, "to_width": 512, "to_height": 512, "crop": True,
                            "first": ("Lanczos", Image.Resampling.LANCZOS), "second": ("None", None),
                            "second_visibility": 0.0, "tile": 64, "overlap": 4, "max_pixels": 4096 * 4096}
    return UpscaleJob(**(base | changes))


def test_an_x4_model_runs_twice_for_8x_then_lands_on_the_multiple_of_8() -> None:
    model = fake_upscaler()
    out, info = upscale_image(Image.new("RGB", (13, 10), (9, 90, 200)), _job(by=7.5, first=("fake-4x", model)))
    assert len(model.session.shapes) > 1 and out.size == (96, 72)  # type: ignore[attr-defined]
    assert infotext(info) == "Postprocess upscale by: 7.5, Postprocess upscaler: fake-4x"


def test_a_size_target_is_cropped_onto_its_canvas() -> None:
    out, info = upscale_image(Image.new("RGB", (30, 20)), _job(resize_mode=1, to_width=64, to_height=64))
    assert out.size == (64, 64)
    assert info["Postprocess crop to"] == "64x64" and info["Postprocess upscale to"] == "64x64"
    uncropped, _ = upscale_image(Image.new("RGB", (30, 20)), _job(resize_mode=1, to_width=64, to_height=64,
                                                                   crop=False))
    assert uncropped.size == (96, 64)  # factor max(64/30, 64/20) = 3.2, rounded down to multiples of 8


def test_a_pass_over_the_pixel_bound_is_refused_before_it_runs() -> None:
    model = fake_upscaler()
    with pytest.raises(InvalidRequestError) as refused:  # 1.1x fits, the x4 pass it takes would not
        upscale_image(Image.new("RGB", (600, 600)), _job(by=1.1, first=("fake-4x", model), max_pixels=1_000_000))
    assert refused.value.param == "upscaler_1" and "x4 pass" in refused.value.message
    assert model.session.shapes == []  # type: ignore[attr-defined]


def test_the_upscaler_dir_flag_sets_the_folder_or_names_what_is_wrong(tmp_path: Path) -> None:
    from engines.errors import ConfigError
    from server.settings import load_settings
    from server.upscale import with_upscaler_dir

    settings = load_settings("dev")
    assert with_upscaler_dir(settings, None) is settings and settings.runtime.upscaler_dir == ""
    assert with_upscaler_dir(settings, tmp_path).runtime.upscaler_dir == str(tmp_path.resolve())
    with pytest.raises(ConfigError, match="--upscaler-dir .*not a folder"):
        with_upscaler_dir(settings, tmp_path / "missing")


def test_the_extras_routes_import_no_onnxruntime_until_an_upscaler_loads() -> None:
    """server/ talks to engines, never to onnxruntime: the extras router (and the upscaler listing) import
    engines/pipelines/upscale.py, which imports ORT only when an ONNX upscaler is loaded (checked in a fresh
    interpreter)."""
    import subprocess
    import sys

    script = ("import sys, server.app, server.routes.a1111_extras, server.upscale; "
              "print('onnxruntime' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "False"
