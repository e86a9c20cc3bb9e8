"""The TensorRT plans (engines/build/trtplan_dit.py, trtplan_edit.py) of the instruction-edit models on their tiny
faithful exports — FLUX.1 Kontext, Qwen-Image-Edit-Plus 2509 and 2511, FLUX.2 [klein] with reference images: every
image-token dim spans txt2img (no references) to the most reference tokens the pipeline adds, the VAE encoder the
reference sizes, Qwen-Image-Edit's vision tower and image-carrying text encoder get profiles of their own, 2511's
``modulate_index`` is planned, and every option set passes ONNX Runtime's real Python option parser
(onnxruntime/python/onnxruntime_pybind_state.cc, ``CreateExecutionProviderFactoryInstance``). Before, the
transformer's profiles held the noisy tokens only (an edit fit no profile) and Qwen-Image-Edit's plan was refused
on the text encoder's ``image_embeds``.

The feeds checked are the pipelines' own for a one- and a two-image edit: their real reference encoding, text
encoding and rotary tables on ONNX Runtime's CPU provider, with the modules' ``run`` wrapped to record what goes
in, and the joined transformer input made by the pipeline's own join graph (engines/pipelines/flow_extra.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engines.build import trtplan, trtplan_edit
from engines.build.trt_build import parser_verdicts
from engines.config import RuntimeSettings
from engines.pipelines.flux2_refs import LatentJoin
from engines.runtime.sessions import Runtime
from engines.types.request import Batch, EditImage, ImageSpec

Builder = Callable[[str], tuple[Path, Path]]
SIZES = [(64, 48), (32, 32)]
BATCH_MAX, BATCH_OPT = 2, 1


@pytest.fixture(scope="module")
def folders(dit_build: Builder, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from engines.build.flux2_refs import build_tiny_flux2_refs
    from engines.build.qwen_edit import build_tiny_qwen_edit

    root = tmp_path_factory.mktemp("edit_trtplan")
    return {"flux-kontext": dit_build("flux-kontext")[0],
            "qwen-2509": build_tiny_qwen_edit(root / "qwen-2509"),
            "qwen-2511": build_tiny_qwen_edit(root / "qwen-2511", zero_cond_t=True),
            "flux2-klein": build_tiny_flux2_refs(root / "flux2")}


def _plan(folder: Path) -> dict[str, Any]:
    return trtplan.plan(folder, trtplan.profiles_from(SIZES, BATCH_MAX, BATCH_OPT), trtplan.BuildFlags())


def _shapes(options: dict[str, str], bound: str) -> dict[str, list[int]]:
    return {name: [int(d) for d in dims.split("x")] for name, dims in
            (item.split(":") for item in options[f"trt_profile_{bound}_shapes"].split(","))}


def _fits(options: dict[str, str], feeds: dict[str, tuple[int, ...]]) -> None:
    low, high = _shapes(options, "min"), _shapes(options, "max")
    for name, shape in feeds.items():
        assert all(a <= s <= b for a, s, b in zip(low[name], shape, high[name], strict=True)), \
            (name, shape, low[name], high[name])


def _picture(width: int, height: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


PIPELINES = {"flux-kontext": ("engines.pipelines.kontext", "KontextPipeline"),
             "qwen-2509": ("engines.pipelines.qwen_edit", "QwenEditPipeline"),
             "qwen-2511": ("engines.pipelines.qwen_edit", "QwenEditPipeline"),
             "flux2-klein": ("engines.pipelines.flux2", "Flux2Pipeline")}
INPUTS = {"flux-kontext": [[(64, 48)]], "qwen-2509": [[(64, 48)]],
          "qwen-2511": [[(64, 48)], [(40, 72), (64, 64)]], "flux2-klein": [[(64, 64)], [(96, 64), (64, 128)]]}
"""A one-image edit for every model and a two-image one where the model takes several (Kontext takes one; 2509's
feeds are 2511's without ``modulate_index``: one edit, each reference encoded at ~1024² on the CPU, is enough)."""


def _edit_feeds(name: str, folder: Path, inputs: list[tuple[int, int]], width: int, height: int,
                monkeypatch: pytest.MonkeyPatch) -> dict[str, dict[str, tuple[int, ...]]]:
    """Per component, the largest shape of each input the pipeline fed (or would feed) for a 2-image batch of an
    edit with ``inputs``: the recorded encoder, vision and text-encoder calls, and the transformer's inputs."""
    import importlib

    module = importlib.import_module(PIPELINES[name][0])
    pipe = getattr(module, PIPELINES[name][1])(folder, Runtime(RuntimeSettings(providers=("CPUExecutionProvider",),
                                                                               allow_cpu=True)))
    fed: dict[str, dict[str, tuple[int, ...]]] = {}
    names = {id(getattr(pipe, attr, None)): component for attr, component in
             (("text_encoder", "text_encoder"), ("vision", "vision"))}
    names[id(pipe.editor.encoder)] = "vae_encoder"
    real = module.run

    def recording(model: Any, feeds: dict[str, np.ndarray], *args: Any) -> Any:
        part = fed.setdefault(names.get(id(model), "other"), {})
        for key, value in feeds.items():
            part[key] = tuple(max(a, b) for a, b in zip(part.get(key, value.shape), value.shape, strict=True))
        return real(model, feeds, *args)

    monkeypatch.setattr(module, "run", recording)
    refs = tuple(_picture(w, h, k) for k, (w, h) in enumerate(inputs))
    specs = tuple(ImageSpec(p, "blurry", seed=1, guidance_scale=4.0, edit=EditImage(image=refs[0], references=refs))
                  for p in ("a hat on the dog", "a red car"))
    batch = Batch(specs, width=width, height=height, steps=2)
    assert batch.mode == "instruct"
    cfg = bool(pipe.uses_cfg(np.full(len(specs), 4.0, np.float32)))
    cond = pipe.encode(batch, pipe.max_sequence_length, cfg, None)
    extra = pipe.extra_tokens(batch)
    assert extra is not None
    cond = replace(cond, extra=extra)
    rows = cond.states.shape[0]
    f = pipe.geometry.vae_scale_factor
    h, w = height // f, width // f
    channels = pipe.geometry.latent_channels
    state = pipe.extra.upload(pipe.runtime, extra, rows // len(specs))
    dtype = pipe.transformer.input_dtype("hidden_states")
    noisy = (rows, channels, h, w) if isinstance(pipe.extra, LatentJoin) else (rows, (h // 2) * (w // 2), channels * 4)
    hidden = pipe.runtime.upload("h", np.zeros(noisy, dtype))
    joined = pipe.extra.join(hidden, state.tokens, extra.prepend)
    tables = pipe.transformer_feeds(cond, np.full(rows, 4.0, np.float32), h, w, rows)
    fed["transformer"] = {"hidden_states": tuple(joined.shape()), **{k: tuple(v.shape()) for k, v in tables.items()}}
    return fed


@pytest.mark.parametrize("name", list(PIPELINES))
def test_edit_plans_pass_orts_parser_and_take_the_edits_feeds(name: str, folders: dict[str, Path],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    folder = folders[name]
    plan = _plan(folder)
    dims = plan["dims"]
    assert dims["ref_tokens"] > 0 and dims["ref_side_max"] >= 1024
    for size in plan["sizes"].values():
        transformer = size["components"]["transformer"]["provider_options"]
        low, high = _shapes(transformer, "min"), _shapes(transformer, "max")
        assert high["rope_cos"][0] - low["rope_cos"][0] == dims["ref_tokens"]  # txt2img .. the most references
        if name == "qwen-2511":
            assert high["modulate_index"][0] - low["modulate_index"][0] == dims["ref_tokens"]
    verdicts = parser_verdicts(folder, plan)
    components = plan["sizes"]["64x48"]["components"]
    assert "vae_encoder" in components and len(verdicts) == len(SIZES) * len(components)
    if name.startswith("qwen"):
        assert {"vision", "text_encoder"} <= set(components)
    refused = {k: v for k, v in verdicts.items() if not v["accepted"]}
    assert not refused, refused
    for inputs in INPUTS[name]:
        fed = _edit_feeds(name, folder, inputs, 64, 48, monkeypatch)
        assert fed["transformer"]["rope_cos"][0] > _shapes(components["transformer"]["provider_options"],
                                                           "min")["rope_cos"][0]  # the references are in it
        for component, feeds in fed.items():
            if component in components:
                _fits(components[component]["provider_options"], feeds)


def test_qwen_vision_bounds_follow_the_processor(folders: dict[str, Path]) -> None:
    """The vision tower's patch bounds are the processor's own over the aspects the plan covers: a square input
    gives the opt, an 8:1 one lies within the bounds, and the text encoder's image embeddings cover three images."""
    folder = folders["qwen-2509"]
    dims = _plan(folder)["dims"]
    square = trtplan_edit.qwen_condition_patches(folder, 512, 512)
    assert dims["patches_opt"] == square
    wide = trtplan_edit.qwen_condition_patches(folder, 800, 100)
    assert dims["patches_min"] <= wide <= dims["patches_max"]
    assert dims["embed_tokens_max"] == 3 * dims["patches_max"] // 4
