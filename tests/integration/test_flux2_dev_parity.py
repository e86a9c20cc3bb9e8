"""Our torch-free ORT FLUX.2 [dev] pipeline (engines/pipelines/flux2_dev.py) vs diffusers' ``Flux2Pipeline`` on the
same tiny weights and initial noise: txt2img at two sizes (square and not: the empirical shift and the rotary
positions change with them) with the embedded guidance at two scales; the schedule's timesteps and sigmas equal to
the scheduler's; the prompt embeddings equal to ``encode_prompt``'s; the template and ids equal to what the tiny
folder's chat template renders through transformers' ``apply_chat_template`` with ``padding="max_length",
truncation=True``. ORT runs the exported graphs with its CPU provider (onnxruntime/core/providers/cpu: fp32
kernels)."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from engines.config import RuntimeSettings
from engines.pipelines.contract import image_rng
from engines.pipelines.flow_family import detect_dit
from engines.pipelines.flux2_dev import SYSTEM_MESSAGE, Flux2DevPipeline, fit
from engines.runtime.sessions import Runtime
from engines.types.request import Batch, ImageSpec

pytestmark = pytest.mark.slow
PROMPTS = ["a photo of an astronaut riding a horse", "a red cube [IMG] on a table, studio lighting, a long shadow"]
SEEDS = [11, 12]
STEPS = 3
LENGTH = 96
"""max_sequence_length for both pipelines (512 in production: the same code path, a shorter test; the template with
its system message takes about 60 tokens of it)."""
CASES = [(64, 64, 4.0), (48, 32, 2.5)]
"""(width, height, guidance_scale)."""
MIN_MATCH = 0.999
"""Fraction of uint8 channel values that must be within 1/255 of diffusers'."""

Builder = Callable[[str], tuple[Path, Path]]


@functools.lru_cache(maxsize=1)
def _ours(folder: Path) -> Flux2DevPipeline:
    return Flux2DevPipeline(folder, Runtime(RuntimeSettings(providers=("CPUExecutionProvider",), allow_cpu=True)))


@functools.lru_cache(maxsize=1)
def _torch_pipeline(folder: Path) -> Any:
    import diffusers

    pipe = diffusers.Flux2Pipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _noise(width: int, height: int) -> np.ndarray:
    return np.stack([image_rng(s).standard_normal((128, height // 16, width // 16), dtype=np.float32)
                     for s in SEEDS])


@pytest.mark.parametrize(("width", "height", "guidance"), CASES, ids=[f"{w}x{h}-g{g}" for w, h, g in CASES])
def test_images_match_diffusers(width: int, height: int, guidance: float, dit_build: Builder) -> None:
    onnx_dir, diffusers_dir = dit_build("flux2-dev")
    assert detect_dit(onnx_dir).name == detect_dit(diffusers_dir).name == "flux2-dev"
    assert detect_dit(onnx_dir).guidance_embeds
    batch = Batch(tuple(ImageSpec(p, "", seed=s, guidance_scale=guidance) for p, s in zip(PROMPTS, SEEDS,
                                                                                          strict=True)),
                  width=width, height=height, steps=STEPS)
    ours = _ours(onnx_dir)
    assert not ours.uses_cfg(np.array([guidance], np.float32))
    out = ours(batch, max_sequence_length=LENGTH)
    pipe = _torch_pipeline(diffusers_dir)
    with torch.no_grad():
        theirs = pipe(prompt=PROMPTS, guidance_scale=guidance, height=height, width=width,
                      num_inference_steps=STEPS, latents=torch.from_numpy(_noise(width, height)),
                      max_sequence_length=LENGTH, output_type="np").images
    theirs_u8 = np.asarray((theirs * 255).round().astype(np.uint8))
    assert out.images.shape == theirs_u8.shape == (2, height, width, 3)
    diff = np.abs(out.images.astype(np.int16) - theirs_u8.astype(np.int16))
    match = float((diff <= 1).mean())
    print(f"\nflux2-dev {width}x{height} guidance {guidance}: {match:.6f} within 1/255, max |diff| {diff.max()}/255")
    assert match >= MIN_MATCH, f"only {match:.4%} within 1/255 (max diff {diff.max()})"
    assert theirs_u8.std() > 10  # a real pattern, not a flat image any pipeline would match
    assert not np.array_equal(out.images[0], out.images[1])
    schedule = ours.schedule(STEPS, height // 16, width // 16)
    np.testing.assert_allclose(schedule.timesteps, pipe.scheduler.timesteps.numpy(), rtol=1e-6)
    np.testing.assert_allclose(schedule.sigmas, pipe.scheduler.sigmas.numpy(), rtol=1e-6)


def test_prompt_embeddings_match_encode_prompt(dit_build: Builder) -> None:
    """The text encoder's states as served (template, ids, padding, the ONNX encoder) are ``encode_prompt``'s."""
    onnx_dir, diffusers_dir = dit_build("flux2-dev")
    ours = _ours(onnx_dir)
    batch = Batch(tuple(ImageSpec(p, "", seed=1) for p in PROMPTS), width=32, height=32, steps=1)
    cond = ours.encode(batch, LENGTH, False, None)
    with torch.no_grad():
        theirs, _ = _torch_pipeline(diffusers_dir).encode_prompt(PROMPTS, max_sequence_length=LENGTH)
    assert cond.states.shape == tuple(theirs.shape) == (2, LENGTH, 3 * 64)
    np.testing.assert_allclose(cond.states, theirs.numpy(), atol=1e-4, rtol=1e-4)


def test_the_guidance_scale_changes_the_image(dit_build: Builder) -> None:
    """The embedded guidance reaches the transformer (one row per image, no CFG)."""
    ours = _ours(dit_build("flux2-dev")[0])
    a, b = (ours(Batch((ImageSpec(PROMPTS[0], "", seed=3, guidance_scale=g),), width=32, height=32, steps=2),
                 max_sequence_length=LENGTH).images.astype(np.int16) for g in (1.0, 6.0))
    assert np.abs(a - b).mean() > 1


def test_template_and_ids_match_the_chat_template(dit_build: Builder) -> None:
    """The rendered text is what the folder's chat template gives for ``format_input``'s messages, and the served
    ids and mask (the tokenizers library on the exported tokenizer.json, the sides tokenizer_config.json names) are
    transformers' ``apply_chat_template(..., padding="max_length", truncation=True)``, a prompt cut included."""
    from diffusers.pipelines.flux2.pipeline_flux2 import format_input
    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE as THEIRS
    from transformers import AutoTokenizer

    assert SYSTEM_MESSAGE == THEIRS
    onnx_dir, diffusers_dir = dit_build("flux2-dev")
    tokenizer = AutoTokenizer.from_pretrained(diffusers_dir / "tokenizer")
    ours = _ours(onnx_dir)
    long = " ".join(["a very long prompt about a mountain lake at dawn"] * 20)
    prompts = ["Ein Foto, détaillé: 3 Äpfel & a sign saying \"HELLO\" [IMG]\n", long]
    messages = format_input(prompts)
    for prompt, message in zip(prompts, messages, strict=True):
        assert tokenizer.apply_chat_template(message, tokenize=False, add_generation_prompt=False) == \
            ours.render(prompt)
    theirs = tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=True, return_dict=True,
                                           padding="max_length", truncation=True, max_length=LENGTH)
    config = json.loads((onnx_dir / "tokenizer" / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert config["pad_token"] == "<pad>" and config["padding_side"] == "right"
    for row, prompt in enumerate(prompts):
        ids = ours.tokenizer.encode(ours.render(prompt), add_special_tokens=False).ids
        got = fit(ids, LENGTH, ours.pad_id, "right", "right")
        assert got == (list(theirs["input_ids"][row]), list(theirs["attention_mask"][row]))
    assert sum(theirs["attention_mask"][1]) == LENGTH  # the long prompt was cut


def test_left_padding_as_transformers_pads() -> None:
    """A folder whose tokenizer_config.json says left padding / left truncation gets its rows laid out so."""
    assert fit([5, 6, 7], 5, 0, "left", "right") == ([0, 0, 5, 6, 7], [0, 0, 1, 1, 1])
    assert fit([5, 6, 7], 2, 0, "right", "left") == ([6, 7], [1, 1])
    assert fit([5, 6, 7], 2, 0, "left", "right") == ([5, 6], [1, 1])


def test_the_tokenizer_settings_are_the_folders(tmp_path: Path) -> None:
    """Pad and BOS tokens and the sides come from tokenizer_config.json (transformers' AddedToken dicts too); a
    folder naming no pad token or an unknown side is refused at load, naming the file."""
    from engines.errors import ModelLoadError
    from engines.pipelines.flux2_dev import tokenizer_settings

    config = tmp_path / "tokenizer_config.json"
    config.write_text(json.dumps({"pad_token": {"content": "<pad>"}, "bos_token": "<s>", "padding_side": "left"}))
    assert tokenizer_settings(tmp_path) == {"pad": "<pad>", "bos": "<s>", "padding_side": "left",
                                            "truncation_side": "right"}
    for body, named in (({"bos_token": "<s>"}, "pad_token"), ({"pad_token": "<pad>"}, "bos_token"),
                        ({"pad_token": "<pad>", "bos_token": "<s>", "padding_side": "middle"}, "padding_side")):
        config.write_text(json.dumps(body))
        with pytest.raises(ModelLoadError, match=named):
            tokenizer_settings(tmp_path)


def test_export_of_the_diffusers_folder_is_the_tiny_build(dit_build: Builder, tmp_path: Path) -> None:
    """`sdserve engines export --from` a Flux2Pipeline folder (the registry row's ``export``) writes the graphs and
    tokenizer the tiny build wrote from the same weights."""
    from engines import architectures

    onnx_dir, diffusers_dir = dit_build("flux2-dev")
    row = architectures.of(diffusers_dir)
    assert row.name == "flux2-dev"
    out = row.load(row.export)(diffusers_dir, tmp_path / "exported")
    for part in ("text_encoder/model.onnx", "transformer/model.onnx", "vae_decoder/model.onnx",
                 "tokenizer/tokenizer.json"):
        assert (out / part).read_bytes() == (onnx_dir / part).read_bytes(), part
    index = json.loads((out / "model_index.json").read_text(encoding="utf-8"))
    assert index["_class_name"] == "OnnxFlux2Pipeline" and "is_distilled" not in index


def test_an_fp16_export_serves_the_fp32_image(dit_build: Builder, tmp_path: Path) -> None:
    """`sdserve engines export --dtype fp16`: the transformer in fp16 behind fp32 inputs and outputs, the Mistral
    encoder kept fp32 (engines/build/dit_folder.py ``HALF_TEXT``: a language model's states pass fp16's range), the
    manifest saying so; ORT's CPU provider runs it (its fp16 kernels, onnxruntime/core/providers/cpu) to the fp32
    export's image within 1/255 (bf16 runs on CUDA/TensorRT only)."""
    from engines import architectures

    onnx_dir, diffusers_dir = dit_build("flux2-dev")
    row = architectures.of(diffusers_dir)
    out = row.load(row.export)(diffusers_dir, tmp_path / "fp16", "fp16")
    source = json.loads((out / "manifest.json").read_text(encoding="utf-8"))["source"]
    assert source["precision"] == {"text_encoder": "fp32", "transformer": "fp16", "vae": "fp32"}
    batch = Batch((ImageSpec(PROMPTS[0], "", seed=1, guidance_scale=4.0),), width=32, height=32, steps=2)
    runtime = Runtime(RuntimeSettings(providers=("CPUExecutionProvider",), allow_cpu=True))
    half = Flux2DevPipeline(out, runtime)(batch, max_sequence_length=LENGTH).images.astype(np.int16)
    full = _ours(onnx_dir)(batch, max_sequence_length=LENGTH).images.astype(np.int16)
    assert np.abs(half - full).max() <= 1 and full.std() > 10
