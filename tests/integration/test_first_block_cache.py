"""The first-block cache (engines/pipelines/first_block.py, parts from engines/build/dit_split.py) against diffusers'
own ``apply_first_block_cache`` on tiny Flux dev and tiny SD 3.5 (the SD 3 family with two blocks; one-block SD 3
has nothing to skip): the same initial latents and threshold give the same skip decisions step by step, the same
relative changes, the same latents after every step and the same images; with threshold 0 the parts give the full
transformer's images.

Two faults of diffusers 0.42.1 keep its hook from running on SD 3 at all, so its reference run there carries two
output-neutral workarounds (``_sd3_reference``): ``SD3Transformer2DModel`` is no ``CacheMixin`` and
``StableDiffusion3Pipeline`` sets no cache context ("No cache context is set"), so the test sets one around the
whole call, as FluxPipeline does with "cond"; and SD 3's last block (``context_pre_only``) returns ``None`` encoder
states, on which the tail hook's residual ``None - tensor`` raises TypeError, so the test has that block return its
input encoder states instead (nothing after the last block reads them).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from engines.config import RuntimeSettings
from engines.errors import InferenceError
from engines.lora.active import Adapters
from engines.pipelines.contract import image_rng
from engines.pipelines.first_block import FirstBlockRunner
from engines.pipelines.flow import FlowPipeline, load_pipeline, pack_latents
from engines.runtime.sessions import Runtime
from engines.types.request import Batch, ImageSpec

pytestmark = pytest.mark.slow
PROMPTS = ["a photo of an astronaut riding a horse", "a red cube on a table, studio lighting"]
NEGATIVES = ["blurry", "low quality, watermark"]
SEEDS = [11, 12]
STEPS = 8
SIZE = 64
GUIDANCE = {"flux": 3.5, "sd35": 4.5}
T5_LENGTH = {"flux": 64, "sd35": None}
THRESHOLDS = {"flux": 0.3, "sd35": 0.4}
"""Where these tiny models skip some steps and compute others (their relative changes run 0.18-0.56)."""
LATENT_ATOL = 2e-5
"""Ours vs diffusers' latents after each step (seen: under 2e-6)."""
MARGIN = 1e-3
"""No relative change this close to the threshold (where float rounding could flip a decision)."""

Builder = Callable[[str], tuple[Path, Path]]


@dataclass
class Run:
    images: np.ndarray
    latents: list[np.ndarray]
    """After each step (Flux: packed tokens)."""
    skips: list[bool]
    ratios: list[float]


@pytest.fixture(scope="module")
def fbc_build(tmp_path_factory: pytest.TempPathFactory) -> Builder:
    """(ONNX folder with the parts, diffusers folder) of a tiny family, built once per module through the export
    hook (``build_tiny_dit(first_block=True)``)."""
    from engines.build.dit import build_tiny_dit

    @functools.cache
    def build(family: str) -> tuple[Path, Path]:
        root = tmp_path_factory.mktemp(f"fbc-{family}")
        build_tiny_dit(family, root / "onnx", diffusers_out=root / "diffusers", vae_encoder=False, first_block=True)
        return root / "onnx", root / "diffusers"

    return build


@functools.cache
def _ours_pipeline(folder: Path) -> tuple[FlowPipeline, FirstBlockRunner]:
    runtime = Runtime(RuntimeSettings(providers=("CPUExecutionProvider",), allow_cpu=True))
    assert FirstBlockRunner.available(folder)
    return load_pipeline(folder, runtime), FirstBlockRunner(folder, runtime)


def _batch(family: str) -> Batch:
    negatives = NEGATIVES if family.startswith("sd3") else ["", ""]
    return Batch(tuple(ImageSpec(p, n, seed=s, guidance_scale=GUIDANCE[family])
                       for p, n, s in zip(PROMPTS, negatives, SEEDS, strict=True)), width=SIZE, height=SIZE,
                 steps=STEPS)


def _ours(family: str, folder: Path, threshold: float | None) -> Run:
    """Our denoising loop, each evaluation through the runner (``threshold``) or the full transformer (None)."""
    pipe, runner = _ours_pipeline(folder)
    run = pipe.begin(_batch(family), None, None, T5_LENGTH[family])
    state = run.state
    if threshold is not None:
        state.first_block = runner.start(state.model_in, threshold)
    latents, skips = [], []
    while not run.finished:
        if threshold is None:
            pipe.run_denoiser([state])
        else:
            skips.append(runner.run(state))
        pipe.advance(state)
        latents.append(state.lat[0].numpy().copy())
    ratios = state.first_block.ratios if threshold is not None else []
    return Run(pipe.finish(run).images, latents, skips, list(ratios))


def _sd3_reference(transformer: Any) -> None:
    """The SD 3 workaround for the hook's tail residual (the module docstring), before the hook wraps the block."""
    tail = transformer.transformer_blocks[-1]
    forward = tail.forward

    def keep_encoder(hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor, temb: torch.Tensor,
                     joint_attention_kwargs: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        encoder, hidden = forward(hidden_states=hidden_states, encoder_hidden_states=encoder_hidden_states,
                                  temb=temb, joint_attention_kwargs=joint_attention_kwargs)
        return (encoder_hidden_states if encoder is None else encoder), hidden

    tail.forward = keep_encoder


def _record_decisions(transformer: Any, skips: list[bool], ratios: list[float]) -> None:
    """Record each decision of diffusers' head-block hook and the relative change it read."""
    hook = transformer.transformer_blocks[0]._diffusers_hook.get_hook("fbc_leader_block_hook")
    decide = hook._should_compute_remaining_blocks

    def recorded(residual: torch.Tensor) -> bool:
        previous = hook.state_manager.get_state().head_block_residual
        ratios.append(math.nan if previous is None else
                      float(((residual - previous).abs().mean() / previous.abs().mean()).item()))
        compute = bool(decide(residual))
        skips.append(not compute)
        return compute

    hook._should_compute_remaining_blocks = recorded


def _theirs(family: str, folder: Path, threshold: float) -> Run:
    import diffusers
    from diffusers.hooks.first_block_cache import FirstBlockCacheConfig, apply_first_block_cache
    from diffusers.hooks.hooks import CacheContext, HookRegistry, _set_cache_context

    flux = family.startswith("flux")
    pipe = (diffusers.FluxPipeline if flux else diffusers.StableDiffusion3Pipeline).from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    if not flux:
        _sd3_reference(pipe.transformer)
    apply_first_block_cache(pipe.transformer, FirstBlockCacheConfig(threshold=threshold))
    skips: list[bool] = []
    ratios: list[float] = []
    _record_decisions(pipe.transformer, skips, ratios)
    noise = np.stack([image_rng(s).standard_normal((16, SIZE // 8, SIZE // 8), dtype=np.float32) for s in SEEDS])
    latents: list[np.ndarray] = []

    def keep(_pipe: Any, _i: int, _t: Any, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        latents.append(tensors["latents"].numpy().copy())
        return {}

    extra: dict[str, Any] = {"max_sequence_length": T5_LENGTH[family]} if flux else {"negative_prompt": NEGATIVES}
    if not flux:
        _set_cache_context(pipe.transformer, CacheContext("cond"))
    with torch.no_grad():
        images = pipe(PROMPTS, height=SIZE, width=SIZE, num_inference_steps=STEPS, guidance_scale=GUIDANCE[family],
                      latents=torch.from_numpy(pack_latents(noise) if flux else noise), output_type="np",
                      callback_on_step_end=keep, callback_on_step_end_tensor_inputs=["latents"], **extra).images
    HookRegistry.check_if_exists_or_initialize(pipe.transformer).reset_stateful_hooks()
    return Run(np.asarray((images * 255).round().astype(np.uint8)), latents, skips, ratios)


@pytest.mark.parametrize("family", sorted(THRESHOLDS))
def test_decisions_latents_and_images_match_diffusers_first_block_cache(family: str, fbc_build: Builder) -> None:
    onnx_dir, diffusers_dir = fbc_build(family)
    threshold = THRESHOLDS[family]
    ours, theirs = _ours(family, onnx_dir, threshold), _theirs(family, diffusers_dir, threshold)
    full = _ours(family, onnx_dir, None)
    print(f"\n{family} threshold {threshold}: skips {ours.skips}, ratios {np.round(ours.ratios, 4).tolist()}")
    assert ours.skips == theirs.skips
    assert any(ours.skips) and not all(ours.skips)  # both paths ran
    assert not ours.skips[0] and math.isnan(ours.ratios[0])  # the first evaluation always computes
    np.testing.assert_allclose(ours.ratios[1:], theirs.ratios[1:], rtol=1e-4)
    assert min(abs(r - threshold) for r in ours.ratios[1:]) > MARGIN
    assert ours.skips == [not r > threshold for r in [math.inf, *ours.ratios[1:]]]
    for step, (a, b, uncached) in enumerate(zip(ours.latents, theirs.latents, full.latents, strict=True)):
        np.testing.assert_allclose(a, b, rtol=0, atol=LATENT_ATOL, err_msg=f"{family} step {step}")
        if step >= ours.skips.index(True):  # a reused step changed the result, by far more than the tolerance
            assert np.abs(a - uncached).max() > 50 * LATENT_ATOL
    diff = np.abs(ours.images.astype(np.int16) - theirs.images.astype(np.int16))
    assert diff.max() <= 1, f"{family}: images differ by {diff.max()}/255"
    assert theirs.images.std() > 10


@pytest.mark.parametrize("family", sorted(THRESHOLDS))
def test_threshold_zero_runs_every_step_and_gives_the_full_transformers_images(family: str,
                                                                              fbc_build: Builder) -> None:
    onnx_dir, _ = fbc_build(family)
    parts, full = _ours(family, onnx_dir, 0.0), _ours(family, onnx_dir, None)
    assert parts.skips == [False] * STEPS
    np.testing.assert_array_equal(parts.images, full.images)
    for a, b in zip(parts.latents, full.latents, strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)


def test_counters_one_block_models_and_lora_refusal(fbc_build: Builder) -> None:
    """The state counts what ran; a one-block SD 3 has no parts to write; LoRA on the transformer is refused
    (the parts carry the base weights: running them would contradict the response's adapter record)."""
    from engines.build.dit import make_dit_components
    from engines.build.dit_split import splittable

    onnx_dir, _ = fbc_build("flux")
    pipe, runner = _ours_pipeline(onnx_dir)
    run = pipe.begin(_batch("flux"), None, None, T5_LENGTH["flux"])
    run.state.first_block = cache = runner.start(run.state.model_in, THRESHOLDS["flux"])
    skipped = 0
    while not run.finished:
        skipped += runner.run(run.state)
        pipe.advance(run.state)
    assert (cache.reused, cache.computed) == (skipped, STEPS - skipped) and skipped > 0
    assert not splittable(make_dit_components("sd3")["transformer"])
    assert splittable(make_dit_components("sd35")["transformer"])
    with pytest.raises(ValueError, match="threshold"):
        runner.start(run.state.model_in, -0.1)
    run = pipe.begin(_batch("flux"), None, Adapters(weights={"transformer": {}}), T5_LENGTH["flux"])
    run.state.first_block = runner.start(run.state.model_in, 0.1)
    with pytest.raises(InferenceError, match="LoRA"):
        runner.run(run.state)
