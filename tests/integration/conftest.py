"""Fixtures shared by the integration tests (real ONNX Runtime, tiny models)."""

from __future__ import annotations

import numpy as np
import pytest
import torch


@pytest.fixture
def shared_step_noise(monkeypatch: pytest.MonkeyPatch) -> list[list[np.random.Generator]]:
    """Euler ancestral draws fresh noise each step: give diffusers the draws our per-image streams make."""
    import diffusers.schedulers.scheduling_euler_ancestral_discrete as module

    holder: list[list[np.random.Generator]] = []

    def randn(shape, generator=None, device=None, dtype=None, layout=None):  # type: ignore[no-untyped-def]
        draws = np.stack([r.standard_normal(tuple(shape[1:]), dtype=np.float32) for r in holder[0]])
        return torch.from_numpy(draws).to(dtype=dtype)

    monkeypatch.setattr(module, "randn_tensor", randn)
    return holder
