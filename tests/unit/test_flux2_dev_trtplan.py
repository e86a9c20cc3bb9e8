"""The TensorRT plan (engines/build/trtplan_dit.py) of FLUX.2 [dev] on its tiny faithful export: every component
planned in bf16 (the Mistral states pass fp16's range as Qwen3's do), the transformer's embedded ``guidance`` input
profiled a row per image like ``timestep`` (no CFG rows), the text encoder's ids and mask at max_sequence_length
(the registry row's ``text_ids`` "padded": what engines/pipelines/flux2_dev.py feeds, recorded from its real text
encoding on ONNX Runtime's CPU provider), and every option set accepted by ONNX Runtime's real Python option parser
(onnxruntime/python/onnxruntime_pybind_state.cc, ``CreateExecutionProviderFactoryInstance``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engines.build import trtplan
from engines.build.trt_build import parser_verdicts
from engines.config import RuntimeSettings
from engines.pipelines import flux2_dev
from engines.runtime.sessions import Runtime
from engines.types.request import Batch, ImageSpec

Builder = Callable[[str], tuple[Path, Path]]
SIZES = [(64, 48), (32, 32)]
BATCH_MAX, BATCH_OPT = 4, 2


def _shapes(options: dict[str, str], bound: str) -> dict[str, list[int]]:
    return {name: [int(d) for d in dims.split("x")] for name, dims in
            (item.split(":") for item in options[f"trt_profile_{bound}_shapes"].split(","))}


def test_every_part_is_planned_and_passes_orts_parser(dit_build: Builder) -> None:
    folder = dit_build("flux2-dev")[0]
    plan = trtplan.plan(folder, trtplan.profiles_from(SIZES, BATCH_MAX, BATCH_OPT), trtplan.BuildFlags())
    components = plan["sizes"]["64x48"]["components"]
    assert set(components) == {"text_encoder", "transformer", "vae_decoder", "vae_encoder"}
    assert plan["build_flags"]["precision"] == dict.fromkeys(components, "bf16")
    verdicts = parser_verdicts(folder, plan)
    assert len(verdicts) == len(SIZES) * len(components)
    assert all(v["accepted"] for v in verdicts.values()), verdicts
    options = components["transformer"]["provider_options"]
    low, high = _shapes(options, "min"), _shapes(options, "max")
    assert (low["guidance"], high["guidance"]) == ([1], [BATCH_MAX]) == (low["timestep"], high["timestep"])


def test_the_pipelines_text_feeds_fit_the_plan(dit_build: Builder, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = dit_build("flux2-dev")[0]
    plan = trtplan.plan(folder, trtplan.profiles_from(SIZES, BATCH_MAX, BATCH_OPT), trtplan.BuildFlags())
    options = plan["sizes"]["64x48"]["components"]["text_encoder"]["provider_options"]
    pipe = flux2_dev.Flux2DevPipeline(folder, Runtime(RuntimeSettings(providers=("CPUExecutionProvider",),
                                                                      allow_cpu=True)))
    seen: dict[str, tuple[int, ...]] = {}
    real = flux2_dev.run

    def recording(model: Any, feeds: dict[str, np.ndarray], *args: Any) -> Any:
        seen.update({k: v.shape for k, v in feeds.items()})
        return real(model, feeds, *args)

    monkeypatch.setattr(flux2_dev, "run", recording)
    batch = Batch(tuple(ImageSpec(p, "", seed=1, guidance_scale=4.0) for p in ("a cat", "a long red barn at dusk")),
                  width=64, height=48, steps=2)
    assert not pipe.uses_cfg(np.full(2, 4.0, np.float32))
    pipe.encode(batch, pipe.max_sequence_length, False, None)
    low, high = _shapes(options, "min"), _shapes(options, "max")
    assert seen["input_ids"] == seen["attention_mask"] == (2, 512)
    for name, shape in seen.items():
        assert all(a <= s <= b for a, s, b in zip(low[name], shape, high[name], strict=True)), (name, shape)
