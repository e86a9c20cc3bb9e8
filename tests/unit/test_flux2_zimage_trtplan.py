"""The TensorRT plans (engines/build/trtplan_dit.py) of FLUX.2 [klein] and Z-Image on their tiny faithful exports:
every input of every component gets its profile from the folder and the serving pipelines' own feeds (FLUX.2's
text ids and attention mask padded to max_sequence_length, its 2x2-patchified 128-channel latents at 1/16, one latent
per token; Z-Image's variable-length text ids and its image tables padded to a multiple of 32), rows doubled under
CFG exactly where the pipeline runs it (never for the step-distilled FLUX.2 checkpoint), and every option set passes
ONNX Runtime's real Python option parser (onnxruntime/python/onnxruntime_pybind_state.cc,
``CreateExecutionProviderFactoryInstance``). Before, the FLUX.2 plan failed on the text encoder's
``attention_mask`` ("no cfg_batch") and Z-Image's on ``image_index``.

The pipelines' feeds are read by running their real text encoding (ONNX Runtime's CPU provider) with ``run``
wrapped to record what goes in; nothing is replaced."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engines.build import trtplan
from engines.build.trt_build import parser_verdicts
from engines.config import RuntimeSettings
from engines.pipelines.flow_family import detect_dit
from engines.runtime.sessions import Runtime
from engines.types.request import Batch, ImageSpec

Builder = Callable[[str], tuple[Path, Path]]
SIZES = [(64, 48), (32, 32)]
BATCH_MAX, BATCH_OPT = 4, 2
FAMILIES = ["flux2-klein", "flux2-klein-base", "z-image", "z-image-turbo"]


def _plan(folder: Path) -> dict[str, Any]:
    return trtplan.plan(folder, trtplan.profiles_from(SIZES, BATCH_MAX, BATCH_OPT), trtplan.BuildFlags())


def _shapes(options: dict[str, str], bound: str) -> dict[str, list[int]]:
    return {name: [int(d) for d in dims.split("x")] for name, dims in
            (item.split(":") for item in options[f"trt_profile_{bound}_shapes"].split(","))}


def _fits(options: dict[str, str], feeds: dict[str, tuple[int, ...]]) -> None:
    low, high = _shapes(options, "min"), _shapes(options, "max")
    for name, shape in feeds.items():
        assert all(a <= s <= b for a, s, b in zip(low[name], shape, high[name], strict=True)), (name, shape)


def _encoded(folder: Path, pipeline: type, module: Any, prompts: list[str], guidance: float,
             monkeypatch: pytest.MonkeyPatch) -> tuple[Any, dict[str, tuple[int, ...]], Any]:
    """The pipeline's text-encoder feeds' shapes for ``prompts`` (CFG as the pipeline decides it) and its
    conditioning."""
    pipe = pipeline(folder, Runtime(RuntimeSettings(providers=("CPUExecutionProvider",), allow_cpu=True)))
    seen: dict[str, tuple[int, ...]] = {}
    real = module.run

    def recording(model: Any, feeds: dict[str, np.ndarray], *args: Any) -> Any:
        seen.update({k: v.shape for k, v in feeds.items()})
        return real(model, feeds, *args)

    monkeypatch.setattr(module, "run", recording)
    batch = Batch(tuple(ImageSpec(p, "", seed=1, guidance_scale=guidance) for p in prompts), width=64, height=48,
                  steps=2)
    cfg = pipe.uses_cfg(np.full(len(prompts), guidance, np.float32))
    return pipe.encode(batch, pipe.max_sequence_length, cfg, None), seen, pipe


@pytest.mark.parametrize("family", FAMILIES)
def test_every_part_is_planned_and_passes_orts_parser(family: str, dit_build: Builder) -> None:
    folder = dit_build(family)[0]
    plan = _plan(folder)
    components = plan["sizes"]["64x48"]["components"]
    assert {"text_encoder", "transformer", "vae_decoder"} <= set(components)
    assert plan["build_flags"]["precision"] == dict.fromkeys(components, "bf16")  # Qwen3 overflows fp16 too
    verdicts = parser_verdicts(folder, plan)
    assert len(verdicts) == len(SIZES) * len(components)
    refused = {k: v for k, v in verdicts.items() if not v["accepted"]}
    assert not refused, refused


@pytest.mark.parametrize(("family", "per_image"), [("flux2-klein", 1), ("flux2-klein-base", 2)])
def test_flux2_profiles(family: str, per_image: int, dit_build: Builder) -> None:
    """64x48: latents [rows, 128, 3, 4] (1/16, 2x2-patchified by the VAE), one token each; text at the fixed 512
    with its mask; rope over 512 + 12 tokens. The distilled checkpoint never doubles its rows."""
    folder = dit_build(family)[0]
    text = detect_dit(folder).max_sequence_length
    plan = _plan(folder)
    sizes = plan["sizes"]["64x48"]
    # with the VAE encoder the folder serves reference edits: the latents become a one-row image [rows, 128, 1,
    # 12 + references] (engines/build/trtplan_edit.py); min: txt2img's tokens, opt: one reference, max: the most
    one, most = plan["dims"].get("ref_tokens_one", 0), plan["dims"].get("ref_tokens", 0)
    grids = {"min": (1, 4) if most else (3, 4), "opt": (1, 12 + one) if one else (3, 4),
             "max": (3, 12 + most) if most else (3, 4)}
    extra = {"min": 0, "opt": one, "max": most}
    for bound, rows in (("min", 1), ("opt", per_image * BATCH_OPT), ("max", per_image * BATCH_MAX)):
        encoder = _shapes(sizes["components"]["text_encoder"]["provider_options"], bound)
        assert encoder == {"input_ids": [rows, text], "attention_mask": [rows, text]}
        shapes = _shapes(sizes["components"]["transformer"]["provider_options"], bound)
        assert shapes["hidden_states"] == [rows, 128, *grids[bound]]
        assert shapes["encoder_hidden_states"][:2] == [rows, text] and shapes["timestep"] == [rows]
        assert shapes["rope_cos"][0] == shapes["rope_sin"][0] == text + 3 * 4 + extra[bound]
    assert _shapes(sizes["components"]["vae_decoder"]["provider_options"], "max")["latent_sample"] == \
        [BATCH_MAX, 128, 3, 4]
    assert sizes[trtplan.RECORD]["transformer"]["rows"]["per_image"] == per_image


@pytest.mark.parametrize(("family", "guidance"), [("flux2-klein", 4.0), ("flux2-klein-base", 4.0)])
def test_flux2_feeds_fit_the_plan(family: str, guidance: float, dit_build: Builder,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from engines.pipelines import flux2

    folder = dit_build(family)[0]
    prompts = ["a cat", "a very long prompt " * 200] * 2
    cond, fed, pipe = _encoded(folder, flux2.Flux2Pipeline, flux2, prompts, guidance, monkeypatch)
    assert fed["input_ids"][0] == len(prompts) * (1 if family == "flux2-klein" else 2)
    components = _plan(folder)["sizes"]["64x48"]["components"]
    _fits(components["text_encoder"]["provider_options"], fed)
    tables = pipe.position_feeds(cond, 3, 4)
    _fits(components["transformer"]["provider_options"],
          {"encoder_hidden_states": cond.states.shape, **{k: v.shape for k, v in tables.items()}})


@pytest.mark.parametrize("family", ["z-image", "z-image-turbo"])
def test_zimage_feeds_fit_the_plan(family: str, dit_build: Builder, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every text length the pipeline can feed (the template alone, a short prompt, one cut at 512) fits the text
    encoder's profile; the image tables of 64x48 (12 tokens) and 32x32 (4) are padded to 32; rows doubled under CFG
    (Turbo too: a request with guidance above 0 runs it)."""
    from engines.pipelines import zimage

    folder = dit_build(family)[0]
    plan = _plan(folder)
    for prompts in ([""], ["a cat"], ["a very long prompt " * 400] * BATCH_MAX):
        cond, fed, pipe = _encoded(folder, zimage.ZImagePipeline, zimage, prompts, 5.0, monkeypatch)
        assert fed["input_ids"][0] == 2 * len(prompts)
        for size, (h, w) in (("64x48", (6, 8)), ("32x32", (4, 4))):
            components = plan["sizes"][size]["components"]
            _fits(components["text_encoder"]["provider_options"], fed)
            tables = {k: v.shape for k, v in pipe.position_feeds(cond, h, w).items()}
            assert tables["image_index"] == (32,)
            _fits(components["transformer"]["provider_options"],
                  {"encoder_hidden_states": cond.states.shape, "encoder_hidden_states_mask": cond.mask.shape,
                   **tables})
    high = _shapes(plan["sizes"]["64x48"]["components"]["text_encoder"]["provider_options"], "max")
    assert high["input_ids"] == [2 * BATCH_MAX, fed["input_ids"][1]] == [2 * BATCH_MAX, 512]
