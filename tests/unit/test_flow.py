"""Flow-matching schedules and Euler steps vs diffusers' FlowMatchEulerDiscreteScheduler, step by step."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from engines.errors import InvalidRequestError
from engines.numerics.flow_schedule import FlowMatchConfig, calculate_shift, euler_step, flow_schedule, flux_sigmas

FLOW = {"num_train_timesteps": 1000, "base_shift": 0.5, "max_shift": 1.15, "base_image_seq_len": 256,
        "max_image_seq_len": 4096}
CONFIGS: dict[str, dict[str, Any]] = {
    "sd3": {**FLOW, "shift": 3.0},
    "flux-dev": {**FLOW, "shift": 3.0, "use_dynamic_shifting": True},
    "flux-schnell": {**FLOW, "shift": 1.0},
    "linear-shift": {**FLOW, "use_dynamic_shifting": True, "time_shift_type": "linear"},
}


def _theirs(config: dict[str, Any], steps: int, flux: bool, mu: float | None) -> Any:
    from diffusers import FlowMatchEulerDiscreteScheduler

    scheduler = FlowMatchEulerDiscreteScheduler(**config)
    scheduler.set_timesteps(steps, sigmas=flux_sigmas(steps) if flux else None, mu=mu)
    return scheduler


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize(("steps", "seq_len"), [(1, 16), (4, 4096), (28, 1024)])
@pytest.mark.parametrize("flux", [True, False], ids=["flux-sigmas", "default-sigmas"])
def test_schedule_equals_diffusers_bit_for_bit(name: str, steps: int, seq_len: int, flux: bool) -> None:
    cfg = FlowMatchConfig.from_config(CONFIGS[name])
    mu = cfg.mu(seq_len)
    theirs = _theirs(CONFIGS[name], steps, flux, mu)
    ours = flow_schedule(cfg, steps, sigmas=flux_sigmas(steps) if flux else None, mu=mu)
    assert ours.timesteps.dtype == np.float32 and ours.sigmas.dtype == np.float32
    np.testing.assert_array_equal(ours.timesteps, theirs.timesteps.numpy())
    np.testing.assert_array_equal(ours.sigmas, theirs.sigmas.numpy())
    assert ours.sigmas[-1] == 0.0 and len(ours) == steps


@pytest.mark.parametrize("name", ["sd3", "flux-dev"])
def test_euler_steps_follow_diffusers_on_random_velocities(name: str) -> None:
    steps, seq_len = 8, 64
    cfg = FlowMatchConfig.from_config(CONFIGS[name])
    flux = name.startswith("flux")
    theirs = _theirs(CONFIGS[name], steps, flux, cfg.mu(seq_len))
    ours = flow_schedule(cfg, steps, sigmas=flux_sigmas(steps) if flux else None, mu=cfg.mu(seq_len))
    rng = np.random.default_rng(0)
    x_ours = rng.standard_normal((2, seq_len, 16), dtype=np.float32)
    x_theirs = torch.from_numpy(x_ours.copy())
    for i, t in enumerate(theirs.timesteps):
        velocity = rng.standard_normal(x_ours.shape, dtype=np.float32)
        x_theirs = theirs.step(torch.from_numpy(velocity), t, x_theirs, return_dict=False)[0]
        x_ours = euler_step(x_ours, velocity, ours.sigmas[i], ours.sigmas[i + 1])
        np.testing.assert_allclose(x_ours, x_theirs.numpy(), rtol=0, atol=1e-6)
    assert np.abs(x_ours).max() > 1.0  # the trajectory moved: a no-op step would have failed the comparison


def test_dynamic_shift_depends_on_resolution() -> None:
    cfg = FlowMatchConfig.from_config(CONFIGS["flux-dev"])
    small, large = (flow_schedule(cfg, 4, sigmas=flux_sigmas(4), mu=cfg.mu(n)) for n in (16, 4096))
    assert not np.array_equal(small.sigmas, large.sigmas)
    assert (large.sigmas[1:-1] > small.sigmas[1:-1]).all()  # more tokens: more time at high noise
    assert cfg.mu(256) == pytest.approx(0.5) and cfg.mu(4096) == pytest.approx(1.15)
    assert calculate_shift(2176) == pytest.approx(0.825)


def test_static_shift_moves_sigmas_towards_noise() -> None:
    plain = flow_schedule(FlowMatchConfig(), 10)
    shifted = flow_schedule(FlowMatchConfig(shift=3.0), 10)
    assert (shifted.sigmas[1:-1] > plain.sigmas[1:-1]).all()
    assert plain.sigmas[0] == shifted.sigmas[0] == 1.0


@pytest.mark.parametrize("option", ["use_karras_sigmas", "invert_sigmas", "stochastic_sampling"])
def test_unsupported_options_are_refused_by_name(option: str) -> None:
    with pytest.raises(ValueError, match=option):
        FlowMatchConfig.from_config({**FLOW, option: True})


def test_dynamic_shifting_needs_mu_and_sigmas_must_match_steps() -> None:
    cfg = FlowMatchConfig.from_config(CONFIGS["flux-dev"])
    with pytest.raises(ValueError, match="mu"):
        flow_schedule(cfg, 4)
    with pytest.raises(ValueError, match="3 sigmas given for 4 steps"):
        flow_schedule(cfg, 4, sigmas=[1.0, 0.5, 0.25], mu=0.5)



def test_one_step_on_a_terminal_shift_is_refused_naming_steps_as_diffusers_would_give_nan() -> None:
    """Qwen-Image's scheduler stretches its sigmas to ``shift_terminal``: with one step the only sigma is 1 and
    diffusers' ``stretch_shift_to_terminal`` divides 0 by 0 (its sigmas are NaN); two steps follow diffusers."""
    config = {**FLOW, "use_dynamic_shifting": True, "shift_terminal": 0.02, "time_shift_type": "exponential"}
    cfg = FlowMatchConfig.from_config(config)
    with np.errstate(invalid="ignore"):
        theirs = _theirs(config, 1, True, 0.8)
    assert np.isnan(theirs.sigmas[0].item())
    with pytest.raises(InvalidRequestError, match="at least 2 steps") as refused:
        flow_schedule(cfg, 1, sigmas=flux_sigmas(1), mu=0.8)
    assert refused.value.param == "steps"
    two = flow_schedule(cfg, 2, sigmas=flux_sigmas(2), mu=0.8)
    np.testing.assert_allclose(two.sigmas, _theirs(config, 2, True, 0.8).sigmas.numpy(), rtol=1e-6)


def _session(model: bytes) -> Any:
    import onnxruntime as ort

    return ort.InferenceSession(model, providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("cfg", [True, False])
@pytest.mark.parametrize("shape", [(2, 16, 4, 6), (2, 12, 64)], ids=["sd3-latents", "flux-tokens"])
def test_step_graph_is_the_euler_step_with_cfg(cfg: bool, shape: tuple[int, ...]) -> None:
    """The device step graph equals euler_step on the guided velocity; an image with guidance <= 1 inside a CFG
    batch takes its text prediction alone."""
    from engines.numerics.flow_graph import build_flow_step_graph, flow_coefficients

    rng = np.random.default_rng(3)
    sample = rng.standard_normal(shape, dtype=np.float32)
    out = rng.standard_normal((2 * shape[0] if cfg else shape[0], *shape[1:]), dtype=np.float32)
    guidance = np.array([4.5, 1.0], dtype=np.float32)
    sigma, sigma_next = np.float32(0.8), np.float32(0.55)
    coeffs = flow_coefficients(sigma, sigma_next, guidance, cfg)
    nxt, model_in = _session(build_flow_step_graph(np.float32, np.float32, cfg, packed=len(shape) == 3)).run(
        None, {"sample": sample, "model_out": out, "coeffs": coeffs})
    if cfg:
        uncond, text = out[:2], out[2:]
        velocity = np.stack([uncond[0] + 4.5 * (text[0] - uncond[0]), text[1]])
    else:
        velocity = out
    np.testing.assert_allclose(nxt, euler_step(sample, velocity, sigma, sigma_next), rtol=0, atol=2e-6)
    np.testing.assert_array_equal(model_in, np.concatenate([nxt] * (2 if cfg else 1)))
    assert np.abs(nxt - sample).max() > 0.1  # the step moved the sample


def test_decode_graph_unpacks_and_rescales_like_diffusers() -> None:
    from diffusers import FluxPipeline

    from engines.numerics.flow_graph import build_flow_decode_graph
    from engines.pipelines.flow import pack_latents

    latents = np.random.default_rng(4).standard_normal((2, 16, 4, 6), dtype=np.float32)
    packed = pack_latents(latents)
    scaled = _session(build_flow_decode_graph(0.3611, 0.1159, np.float32, packed=True)).run(None, {
        "latents": packed, "unpacked_shape": np.array([2, 2, 3, 16, 2, 2]), "image_shape": np.array([2, 16, 4, 6])})[0]
    unpacked = FluxPipeline._unpack_latents(torch.from_numpy(packed), 32, 48, 8)
    np.testing.assert_array_equal(scaled, (unpacked / 0.3611 + 0.1159).numpy())
    plain = _session(build_flow_decode_graph(1.5035, 0.0609, np.float16, packed=False)).run(None, {"latents": latents})
    assert plain[0].dtype == np.float16
    np.testing.assert_allclose(plain[0], latents / np.float32(1.5035) + np.float32(0.0609), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize(("steps", "strength"), [(4, 0.6), (10, 0.35), (28, 1.0), (4, 0.01), (3, 0.5)])
def test_flow_start_is_the_dit_img2img_get_timesteps(steps: int, strength: float) -> None:
    from diffusers import FluxImg2ImgPipeline

    from engines.numerics.flow_graph import flow_start

    scheduler = _theirs(CONFIGS["flux-schnell"], steps, True, None)
    holder = type("P", (), {"scheduler": scheduler})()
    timesteps, remaining = FluxImg2ImgPipeline.get_timesteps(holder, steps, strength, "cpu")  # type: ignore[arg-type]
    first = flow_start(steps, strength)
    assert steps - first == remaining >= 1
    np.testing.assert_array_equal(timesteps.numpy(), scheduler.timesteps.numpy()[first:])


@pytest.mark.parametrize("strength", [0.0, -0.5, 1.5])
def test_flow_start_refuses_strengths_outside_the_unit_interval(strength: float) -> None:
    from engines.numerics.flow_graph import flow_start

    with pytest.raises(ValueError, match="strength"):
        flow_start(4, strength)


@pytest.mark.parametrize("packed", [True, False])
def test_noise_graph_is_scale_noise_then_packing(packed: bool) -> None:
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline

    from engines.numerics.flow_graph import build_flow_noise_graph

    rng = np.random.default_rng(5)
    sample, noise = (rng.standard_normal((2, 16, 4, 6), dtype=np.float32) for _ in range(2))
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    scheduler.set_timesteps(8)
    scheduler.set_begin_index(3)
    latents = (torch.from_numpy(sample) - 0.1159) * 0.3611
    theirs = scheduler.scale_noise(latents, scheduler.timesteps[3:4].repeat(2), torch.from_numpy(noise))
    if packed:
        theirs = FluxPipeline._pack_latents(theirs, 2, 16, 4, 6)
    feeds = {"sample": sample, "noise": noise, "sigma": scheduler.sigmas[3:4].numpy()}
    if packed:
        feeds |= {"patch_shape": np.array([2, 16, 2, 2, 3, 2]), "token_shape": np.array([2, 6, 64])}
    nxt, model_in = _session(build_flow_noise_graph(0.3611, 0.1159, np.float16, 2, packed)).run(None, feeds)
    np.testing.assert_allclose(nxt, theirs.numpy(), rtol=0, atol=1e-6)
    assert model_in.dtype == np.float16 and model_in.shape == (4, *nxt.shape[1:])
