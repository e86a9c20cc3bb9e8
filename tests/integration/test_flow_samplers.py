"""Euler a, DPM++ 2M and UniPC on flow-matching models (engines/numerics/flow_samplers.py) through our ORT pipeline
vs diffusers' FluxPipeline / StableDiffusion3Pipeline with the flow scheduler swapped in, on the same tiny weights
and initial noise, within 1/255: ``FlowMatchEulerDiscreteScheduler(stochastic_sampling=True)`` with its step noise
answered by our per-image streams, ``DPMSolverMultistepScheduler`` and ``UniPCMultistepScheduler`` with
``use_flow_sigmas`` and ``prediction_type="flow_prediction"``. Flux (dynamic shift, no CFG) and SD 3 (static shift,
CFG). UniPC on Flux is diffusers' own schedule (it takes Flux's sigmas and ``mu``); DPM++ 2M, and UniPC on SD 3, are
put on the model's flow schedule (the one we serve, "Simple") after their own ``set_timesteps``, since their own
flow spacing differs. Runs on ONNX Runtime's CPU provider (onnxruntime/core/providers/cpu)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from engines.config import RuntimeSettings
from engines.numerics.flow_samplers import UNIPC_EPS
from engines.pipelines.contract import image_rng
from engines.pipelines.flow import FlowPipeline, load_pipeline, pack_latents
from engines.runtime.sessions import Runtime
from engines.types.request import Batch, ImageSpec

pytestmark = pytest.mark.slow
PROMPTS = ["a photo of an astronaut riding a horse", "a red cube on a table, studio lighting"]
NEGATIVES = ["blurry", "low quality, watermark"]
SEEDS = [21, 22]
STEPS = 5
GUIDANCE = {"flux": 3.5, "sd3": 5.0}
SAMPLERS = ("euler_a", "dpmpp_2m", "unipc")
MIN_MATCH = 0.999
"""Fraction of uint8 channel values that must be within 1/255 of diffusers'."""

Builder = Callable[[str], tuple[Path, Path]]


@functools.lru_cache(maxsize=2)
def _ours(folder: Path) -> FlowPipeline:
    return load_pipeline(folder, Runtime(RuntimeSettings(providers=("CPUExecutionProvider",), allow_cpu=True)))


@functools.lru_cache(maxsize=2)
def _torch_pipeline(family: str, folder: Path) -> Any:
    import diffusers

    kind = diffusers.FluxPipeline if family == "flux" else diffusers.StableDiffusion3Pipeline
    pipe = kind.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _on_schedule(base: type, sigmas: np.ndarray, timesteps: np.ndarray, eps: bool) -> type:
    """``base`` whose set_timesteps ends on our flow schedule (UniPC's first sigma lowered as its own does)."""
    table = sigmas.astype(np.float64)
    if eps and abs(float(table[0]) - 1.0) < UNIPC_EPS:
        table[0] -= UNIPC_EPS

    class OnFlowSchedule(base):  # type: ignore[misc]
        def set_timesteps(self, num_inference_steps: int | None = None, device: Any = None,
                          sigmas: Any = None, mu: float | None = None, **_: Any) -> None:
            super().set_timesteps(len(timesteps), device)
            self.sigmas = torch.from_numpy(table.astype(np.float32))
            self.timesteps = torch.from_numpy(timesteps.astype(np.float32))

    return OnFlowSchedule


def _scheduler(family: str, sampler: str, config: Any, ours: FlowPipeline) -> Any:
    """The diffusers flow scheduler for ``sampler`` on ``family``'s config."""
    import diffusers

    flow = {"use_flow_sigmas": True, "prediction_type": "flow_prediction"}
    if sampler == "euler_a":
        return diffusers.FlowMatchEulerDiscreteScheduler.from_config(config, stochastic_sampling=True)
    if sampler == "unipc" and family == "flux":  # diffusers' own: Flux's sigmas shifted by mu
        return diffusers.UniPCMultistepScheduler.from_config(config, **flow, use_dynamic_shifting=True)
    schedule = ours.schedule(STEPS, 8, 8)
    base = diffusers.DPMSolverMultistepScheduler if sampler == "dpmpp_2m" else diffusers.UniPCMultistepScheduler
    kind = _on_schedule(base, schedule.sigmas, schedule.timesteps, eps=sampler == "unipc")
    return kind.from_config(config, **flow, use_dynamic_shifting=False)


def _step_noise(shape: tuple[int, ...]) -> list[np.ndarray]:
    """Our Euler a draws: per step, each image's next draw from its stream after its initial noise."""
    rngs = [image_rng(s) for s in SEEDS]
    for r in rngs:
        r.standard_normal((16, 8, 8), dtype=np.float32)
    return [np.stack([r.standard_normal(shape[1:], dtype=np.float32) for r in rngs]) for _ in range(STEPS)]


@pytest.mark.parametrize("family", sorted(GUIDANCE))
@pytest.mark.parametrize("sampler", SAMPLERS)
def test_flow_sampler_matches_diffusers(family: str, sampler: str, dit_build: Builder,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    import diffusers.schedulers.scheduling_flow_match_euler_discrete as flow_module

    onnx_dir, diffusers_dir = dit_build(family)
    ours = _ours(onnx_dir)
    assert sampler in ours.model_info("m").schedulers
    flux = family == "flux"
    negatives = ["", ""] if flux else NEGATIVES
    batch = Batch(tuple(ImageSpec(p, n, seed=s, guidance_scale=GUIDANCE[family])
                        for p, n, s in zip(PROMPTS, negatives, SEEDS, strict=True)),
                  width=64, height=64, steps=STEPS, scheduler=sampler)
    length = 64 if flux else None
    out = ours(batch, max_sequence_length=length)
    noise = np.stack([image_rng(s).standard_normal((16, 8, 8), dtype=np.float32) for s in SEEDS])
    latents = pack_latents(noise) if flux else noise
    draws = iter(_step_noise(latents.shape))

    def randn(shape, generator=None, device=None, dtype=None, layout=None):  # type: ignore[no-untyped-def]
        array = next(draws)
        assert tuple(shape) == array.shape
        return torch.from_numpy(array).to(dtype=dtype)

    monkeypatch.setattr(flow_module, "randn_tensor", randn)
    pipe = _torch_pipeline(family, diffusers_dir)
    original = pipe.scheduler
    pipe.scheduler = _scheduler(family, sampler, original.config, ours)
    extra: dict[str, Any] = {"max_sequence_length": length} if flux else {"negative_prompt": NEGATIVES}
    try:
        with torch.no_grad():
            images = pipe(PROMPTS, height=64, width=64, num_inference_steps=STEPS, guidance_scale=GUIDANCE[family],
                          latents=torch.from_numpy(latents), output_type="np", **extra).images
    finally:
        pipe.scheduler = original
    theirs = (np.asarray(images) * 255).round().astype(np.uint8)
    diff = np.abs(out.images.astype(np.int16) - theirs.astype(np.int16))
    match = float((diff <= 1).mean())
    print(f"\n{sampler} on {family}: {match:.6f} of values within 1/255, max |diff| {diff.max()}/255")
    assert match >= MIN_MATCH, f"{sampler} on {family}: only {match:.4%} within 1/255 (max diff {diff.max()})"
    assert theirs.std() > 10
    assert (next(draws, None) is None) == (sampler == "euler_a")  # Euler a drew once per step, the others never
    euler = ours(Batch(batch.images, width=64, height=64, steps=STEPS), max_sequence_length=length).images
    close = float((np.abs(euler.astype(np.int16) - theirs) <= 1).mean())
    print(f"Euler's image within 1/255 of diffusers' {sampler}: {close:.4f}")
    assert close < MIN_MATCH  # Euler in its place would fail this parity


@pytest.mark.parametrize(("long_sampler", "short_sampler"), [("euler_a", "unipc"), ("dpmpp_2m", "euler_a")])
def test_rows_joining_mid_way_keep_their_sampler_state(long_sampler: str, short_sampler: str,
                                                        dit_build: Builder) -> None:
    """Step-level batching on SD 3 (engines/engine.py begin/tick/finish): a 2-image CFG request with one sampler
    runs; a 3-step request with another sampler, other seeds and no CFG joins at tick 2. Each row keeps its own
    history ring and noise streams: both get their solo images."""
    from tests.integration.test_step_batching import _close, _engine, _pixels, _run_joined

    engine = _engine(dit_build("sd3")[0])
    long = Batch(tuple(ImageSpec(f"a lighthouse {k}", "blurry", 10 + k, 5.0) for k in range(2)), 64, 64, 6,
                 long_sampler)
    short = Batch((ImageSpec("a red cube", "", 40, 1.0),), 64, 64, 3, short_sampler)
    alone_long, alone_short = engine.generate(long), engine.generate(short)
    joined_long, joined_short = _run_joined(engine, long, short, join_after=2)
    assert joined_long.steps_done == 6 and joined_short.steps_done == 3
    assert _close(joined_long, alone_long) <= 1 and _close(joined_short, alone_short) <= 1
    assert np.abs(_pixels(joined_long)[0] - _pixels(joined_short)[0]).max() > 8, "two requests, two images"


@pytest.mark.parametrize("sampler", ["euler_a", "unipc"])
def test_qwen_image_true_cfg_samplers_match_diffusers(sampler: str, dit_build: Builder,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Qwen-Image's norm-rescaled true CFG is no linear combination: its own CFG step graph writes the guided
    velocity, then the sampler steps on it (flow_samplers.Guide). diffusers' QwenImagePipeline with the scheduler
    swapped (UniPC takes Qwen's sigmas, ``mu`` and ``shift_terminal`` itself) agrees within 1/255."""
    import diffusers
    import diffusers.schedulers.scheduling_flow_match_euler_discrete as flow_module

    from engines.pipelines.qwen import QwenPipeline

    onnx_dir, diffusers_dir = dit_build("qwen-image")
    ours = QwenPipeline(onnx_dir, Runtime(RuntimeSettings(providers=("CPUExecutionProvider",), allow_cpu=True)))
    batch = Batch(tuple(ImageSpec(p, n, seed=s, guidance_scale=4.0) for p, n, s in zip(PROMPTS, NEGATIVES, SEEDS,
                                                                                       strict=True)),
                  width=64, height=64, steps=STEPS, scheduler=sampler)
    out = ours(batch)
    noise = np.stack([image_rng(s).standard_normal((16, 8, 8), dtype=np.float32) for s in SEEDS])
    latents = pack_latents(noise)
    draws = iter(_step_noise(latents.shape))
    monkeypatch.setattr(flow_module, "randn_tensor", lambda shape, **_: torch.from_numpy(next(draws)))
    pipe = diffusers.QwenImagePipeline.from_pretrained(diffusers_dir)
    pipe.set_progress_bar_config(disable=True)
    config = pipe.scheduler.config
    pipe.scheduler = diffusers.FlowMatchEulerDiscreteScheduler.from_config(config, stochastic_sampling=True) \
        if sampler == "euler_a" else diffusers.UniPCMultistepScheduler.from_config(
            config, use_flow_sigmas=True, prediction_type="flow_prediction", use_dynamic_shifting=True)
    with torch.no_grad():
        images = pipe(PROMPTS, negative_prompt=NEGATIVES, true_cfg_scale=4.0, height=64, width=64,
                      num_inference_steps=STEPS, latents=torch.from_numpy(latents), output_type="np").images
    theirs = (np.asarray(images) * 255).round().astype(np.uint8)
    diff = np.abs(out.images.astype(np.int16) - theirs.astype(np.int16))
    match = float((diff <= 1).mean())
    print(f"\n{sampler} on qwen-image (true CFG): {match:.6f} within 1/255, max |diff| {diff.max()}/255")
    assert match >= MIN_MATCH and theirs.std() > 10, f"only {match:.4%} within 1/255 (max diff {diff.max()})"
    euler = ours(Batch(batch.images, width=64, height=64, steps=STEPS)).images
    assert float((np.abs(euler.astype(np.int16) - theirs) <= 1).mean()) < MIN_MATCH
