"""The step-cache gate's two bounds (server/caching.py gate_shape), each judged on what it names: the mean PSNR of
every canary against ``gate_min_mean_psnr_db`` and the worst canary's PSNR against ``gate_min_worst_psnr_db``
(issue 57: a gate checking the worst bound against the mean survived every test). The engine is a plain function
behind the gate's Generate type: canary images, cached and not."""

from __future__ import annotations

import dataclasses

import numpy as np
from PIL import Image

from engines.config import Canary
from engines.types.request import Batch, BatchResult, CacheUse, GeneratedImage
from server.caching import gate_shape
from server.settings import CacheSettings

CANARIES = [Canary(name=f"c{k}", prompt=f"p{k}", seed=k) for k in range(8)]


def _engine(noisy: dict[str, float]) -> object:
    """Images of one grey level per prompt; the cached run adds ``noisy[prompt]`` grey levels of Gaussian noise."""

    def generate(batch: Batch) -> BatchResult:
        spec = batch.images[0]
        base = np.full((batch.height, batch.width, 3), 100 + int(spec.prompt[1:]), np.float64)
        if batch.cache is not None:
            base += np.random.default_rng(spec.seed).normal(0, noisy.get(spec.prompt, 0.0), base.shape)
        image = Image.fromarray(np.clip(base, 0, 255).astype(np.uint8))
        cache = CacheUse(batch.cache, 5, 30) if batch.cache is not None else None
        return dataclasses.replace(BatchResult((GeneratedImage(image, spec.seed),), "CPUExecutionProvider"),
                                   cache=cache)

    return generate


def _gate(noisy: dict[str, float]) -> tuple[bool, str, float, float]:
    settings = CacheSettings(gate_min_mean_psnr_db=30.0, gate_min_worst_psnr_db=25.0)
    verdict = gate_shape(_engine(noisy), 32, 32, CANARIES, settings, "euler", 7.5)  # type: ignore[arg-type]
    return verdict.passed, verdict.reason, verdict.mean_psnr_db, verdict.worst_psnr_db


def test_one_bad_canary_fails_the_worst_bound_while_the_mean_passes() -> None:
    """Seven canaries identical cached and not (PSNR capped high), one with noise of sigma 20 (about 22 dB): the
    mean stays over 30 dB, the worst is under 25: refused, naming the worst bound only."""
    served, reason, mean, worst = _gate({"p3": 20.0})
    assert mean >= 30.0 and worst < 25.0, (mean, worst)
    assert not served and reason.startswith("worst PSNR") and "mean PSNR" not in reason


def test_every_canary_a_little_off_fails_the_mean_bound_while_the_worst_passes() -> None:
    """All eight with noise of sigma 9 (about 29 dB each): the mean is under 30 dB while the worst is over 25:
    refused, naming the mean bound only; with no noise both pass."""
    served, reason, mean, worst = _gate({f"p{k}": 9.0 for k in range(8)})
    assert mean < 30.0 and worst >= 25.0, (mean, worst)
    assert not served and reason.startswith("mean PSNR") and "worst PSNR" not in reason
    served, _, mean, worst = _gate({})
    assert served and mean >= 30.0 and worst >= 25.0
