"""A ControlNet preprocessor network the operator puts in the ControlNet folder (``annotators/<module>.onnx``,
server/controlnet_modules.py decides which modules and how their maps are read): one float32 [1, 3, H, W] RGB input
in [0, 1], one map out. It runs on ONNX Runtime's CPU provider: a preprocessor runs once per request, not per step,
and its file is untrusted input (the server refuses it by name when the session cannot be built). onnxruntime is
imported when the first annotator loads, so the HTTP layer imports none until then
(tests/unit/test_upscale_tiles.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np


class OnnxAnnotator:
    """One annotator file's session; call it with the [1, 3, H, W] float32 image, get its first output as float32."""

    def __init__(self, path: Path) -> None:
        import onnxruntime as ort

        self.session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        self.input = self.session.get_inputs()[0].name

    def __call__(self, image: np.ndarray) -> np.ndarray:
        return np.asarray(self.session.run(None, {self.input: image})[0], dtype=np.float32)
