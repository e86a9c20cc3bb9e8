"""ESRGAN-family upscalers as ONNX files, run tiled so memory stays bounded whatever the image (issue 57 point 4).

A model is one ``<name>.onnx`` in ``[runtime] upscaler_dir``: one NCHW float input (RGB in [0, 1], fp32 or fp16)
and one output ``scale`` times larger (RRDBNet: Real-ESRGAN, 4x-UltraSharp, ...; engines/build/esrgan.py builds a
tiny one). The scale is measured at load, on a small probe, never trusted from the name.

Tiling follows A1111's modules/upscaler_utils.py (``tile_size``/``tile_overlap`` = its ESRGAN_tile and
ESRGAN_tile_overlap, 192 and 8) with one difference: A1111 blends the overlapping bands of neighbouring tiles
(images.split_grid / combine_grid); here each tile reads ``overlap`` pixels of context past each side and only its
core is kept (Real-ESRGAN's tile_pad), so the tiled result equals the whole-image run wherever the overlap covers
the network's receptive field, and the seams are never blends of two different guesses. Peak memory is one tile's
activations plus the uint8 output: a 4x of a 1024x1024 image holds 48 MiB of output and (208x208) tiles in flight.
Channels go in as RGB, as the networks' own inference code feeds them (ESRGAN's test.py, Real-ESRGAN's
RealESRGANer.enhance); A1111's paths hand them BGR (upscale_without_tiling's flip, a PIL array given to
RealESRGANer as if it came from cv2), and the output is rounded where A1111 truncates.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engines.config import RuntimeSettings
from engines.errors import ModelLoadError

log = logging.getLogger(__name__)

PROBE = 16
"""Side of the probe image the scale is measured on at load."""
LOADED = 2
"""Upscaler sessions kept loaded at once (least recently used dropped first)."""
NAME_SCALE = re.compile(r"(\d)[xX]|[xX](\d)")
"""A1111's reading of a scale from an upscaler's name (scripts/postprocessing_upscale.py), for the listing only."""


class TilesStopped(Exception):
    """The run passed its deadline between two tiles (the caller answers 504)."""


@dataclass(frozen=True)
class Tile:
    """One tile: ``core`` (x0, y0, x1, y1) is the part of the image it produces; ``read`` is the larger box it runs
    on (the core plus up to ``overlap`` context pixels per side, clamped to the image)."""

    core: tuple[int, int, int, int]
    read: tuple[int, int, int, int]


def tiles(width: int, height: int, tile: int, overlap: int) -> list[Tile]:
    """Cores of at most ``tile`` x ``tile`` covering the image exactly once, row by row; each reads at most
    ``tile + 2 * overlap`` pixels per side."""
    out = []
    for y0 in range(0, height, tile):
        for x0 in range(0, width, tile):
            x1, y1 = min(x0 + tile, width), min(y0 + tile, height)
            read = (max(0, x0 - overlap), max(0, y0 - overlap), min(width, x1 + overlap), min(height, y1 + overlap))
            out.append(Tile((x0, y0, x1, y1), read))
    return out


class OnnxUpscaler:
    """One upscaler model's session (thread-safe: ORT's run is) and its measured scale."""

    def __init__(self, path: Path, settings: RuntimeSettings) -> None:
        import onnxruntime as ort  # here, not at import: the listing (and server/ importing this) needs no ORT

        from engines.runtime import plugins
        from engines.runtime.sessions import session_providers

        self.path, self.name = path, path.stem
        options = ort.SessionOptions()
        options.log_severity_level = settings.ort_log_severity
        if settings.intra_op_threads:
            options.intra_op_num_threads = settings.intra_op_threads
        providers: list[tuple[str, dict[str, str]]] | None = session_providers(settings, in_process=True)
        if settings.plugin is not None:
            plugins.add_to(options, settings.plugin)
            providers = None
        try:
            self.session = ort.InferenceSession(str(path), options, providers=providers)
        except Exception as exc:  # ORT raises its own types (Fail, InvalidGraph, ...)
            raise ModelLoadError(f"upscaler {self.name}: the ONNX file does not load ({str(exc)[:300]})") from exc
        self.session.disable_fallback()  # never the wrapper's silent retry on the CPU
        used = self.session.get_providers()
        if not settings.allow_cpu and used and used[0] == "CPUExecutionProvider":
            raise ModelLoadError(f"upscaler {self.name}: runs on {used[0]}, which this profile does not allow")
        self.provider = used[0] if used else "none"
        inputs, outputs = self.session.get_inputs(), self.session.get_outputs()
        if len(inputs) != 1 or len(outputs) < 1 or len(inputs[0].shape) != 4:
            raise ModelLoadError(f"upscaler {self.name}: expected one NCHW image input and an image output, got "
                                 f"inputs {[(i.name, i.shape) for i in inputs]}")
        self.input, self.output = inputs[0].name, outputs[0].name
        self.dtype = np.float16 if inputs[0].type == "tensor(float16)" else np.float32
        self.scale = self._measure_scale()

    def _measure_scale(self) -> int:
        probe = np.full((1, 3, PROBE, PROBE), 0.5, dtype=self.dtype)
        shape = self.session.run([self.output], {self.input: probe})[0].shape
        scale = shape[-1] // PROBE
        if len(shape) != 4 or shape[1] != 3 or scale < 1 or shape[-1] != scale * PROBE or shape[-2] != shape[-1]:
            raise ModelLoadError(f"upscaler {self.name}: a {PROBE}x{PROBE} RGB input gave {list(shape)}, not an "
                                 "integer upscale of it")
        return int(scale)

    def run(self, rgb: np.ndarray, tile: int, overlap: int, deadline: float | None = None) -> np.ndarray:
        """``rgb`` (H, W, 3) uint8 upscaled by ``self.scale``, tile by tile, into one uint8 array (rounded, as
        the float output is clamped to [0, 1]); TilesStopped once ``deadline`` (monotonic) passes."""
        height, width = rgb.shape[:2]
        out = np.empty((height * self.scale, width * self.scale, 3), dtype=np.uint8)
        for t in tiles(width, height, tile, overlap):
            if deadline is not None and time.monotonic() > deadline:
                raise TilesStopped(f"the deadline passed during the upscale ({self.name})")
            self._tile(rgb, t, out)
        return out

    def _tile(self, rgb: np.ndarray, t: Tile, out: np.ndarray) -> None:
        """One tile run and its core written into ``out`` (its floats freed on return, before the next run)."""
        rx0, ry0, rx1, ry1 = t.read
        x0, y0, x1, y1 = t.core
        s = self.scale
        patch = np.ascontiguousarray(np.multiply(rgb[ry0:ry1, rx0:rx1], 1.0 / 255.0, dtype=self.dtype)
                                     .transpose(2, 0, 1)[None])
        result = self.session.run([self.output], {self.input: patch})[0][0]
        core = np.clip(result[:, (y0 - ry0) * s:(y1 - ry0) * s, (x0 - rx0) * s:(x1 - rx0) * s], 0.0, 1.0,
                       dtype=np.float32)  # one float copy of the core, worked on in place
        core *= 255.0
        np.rint(core, out=core)
        out[y0 * s:y1 * s, x0 * s:x1 * s] = core.transpose(1, 2, 0)


class UpscalerLibrary:
    """The ONNX upscalers of ``[runtime] upscaler_dir``: listed from the folder (``*.onnx``, by file name), loaded
    on first use, at most ``LOADED`` kept."""

    def __init__(self, settings: RuntimeSettings) -> None:
        self.settings = settings
        self.folder = Path(settings.upscaler_dir) if settings.upscaler_dir else None
        self._loaded: OrderedDict[str, OnnxUpscaler] = OrderedDict()
        self._lock = threading.Lock()

    def files(self) -> dict[str, Path]:
        """name -> file, sorted by name; empty without a folder (or when it cannot be read)."""
        if self.folder is None:
            return {}
        try:
            found = sorted(p for p in self.folder.iterdir() if p.suffix == ".onnx" and p.is_file())
        except OSError as exc:
            log.warning("upscaler_dir %s cannot be listed: %s", self.folder, exc)
            return {}
        return {p.stem: p for p in found}

    def listed(self) -> Iterator[tuple[str, float]]:
        """(name, scale) per file; the scale read from the name as A1111 does (4 when it names none)."""
        for name in self.files():
            match = NAME_SCALE.search(name)
            yield name, float(match.group(1) or match.group(2)) if match else 4.0

    def get(self, name: str) -> OnnxUpscaler | None:
        """The loaded upscaler ``name`` (loaded now when needed), None when the folder has no such file;
        ModelLoadError when its file does not load."""
        with self._lock:
            if name in self._loaded:
                self._loaded.move_to_end(name)
                return self._loaded[name]
            path = self.files().get(name)
            if path is None:
                return None
            model = OnnxUpscaler(path, self.settings)
            self._loaded[name] = model
            while len(self._loaded) > LOADED:
                self._loaded.popitem(last=False)
            log.info("upscaler %s loaded: x%d on %s", name, model.scale, model.provider)
            return model
