"""The DiT pipeline's host-side pieces vs diffusers': Flux's 2x2 latent packing, position ids and rotary tables."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engines.pipelines.flow import pack_latents, unpack_latents
from engines.pipelines.flux import flux_rope, image_ids


@pytest.mark.parametrize(("h", "w"), [(8, 8), (4, 6), (12, 2)])
def test_packing_equals_flux_pipeline(h: int, w: int) -> None:
    from diffusers import FluxPipeline

    latents = np.random.default_rng(0).standard_normal((2, 16, h, w), dtype=np.float32)
    theirs = FluxPipeline._pack_latents(torch.from_numpy(latents), 2, 16, h, w).numpy()
    packed = pack_latents(latents)
    np.testing.assert_array_equal(packed, theirs)
    assert packed.shape == (2, h * w // 4, 64)
    np.testing.assert_array_equal(unpack_latents(packed, h, w), latents)
    unpacked = FluxPipeline._unpack_latents(torch.from_numpy(packed), h * 8, w * 8, 8).numpy()
    np.testing.assert_array_equal(unpack_latents(packed, h, w), unpacked)


def test_image_ids_equal_flux_pipeline() -> None:
    from diffusers import FluxPipeline

    theirs = FluxPipeline._prepare_latent_image_ids(1, 3, 5, "cpu", torch.float32).numpy()
    np.testing.assert_array_equal(image_ids(3, 5), theirs)
    assert image_ids(3, 5)[7].tolist() == [0.0, 1.0, 2.0]  # row-major: token 7 is row 1, column 2


@pytest.mark.parametrize("axes", [(4, 4, 8), (16, 56, 56)])
def test_rope_tables_equal_flux_pos_embed(axes: tuple[int, int, int]) -> None:
    """FluxPosEmbed computes in float64 and casts to float32; so do we, on the host (the graph never sees it)."""
    from diffusers.models.transformers.transformer_flux import FluxPosEmbed

    ids = np.concatenate([np.zeros((7, 3), np.float32), image_ids(16, 12)])
    cos, sin = FluxPosEmbed(theta=10000, axes_dim=list(axes))(torch.from_numpy(ids))
    ours_cos, ours_sin = flux_rope(ids, axes)
    assert ours_cos.dtype == ours_sin.dtype == np.float32
    assert ours_cos.shape == (7 + 16 * 12, sum(axes))
    np.testing.assert_array_equal(ours_cos, cos.numpy())
    np.testing.assert_array_equal(ours_sin, sin.numpy())
