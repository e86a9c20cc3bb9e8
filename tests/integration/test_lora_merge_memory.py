"""A LoRA set's merge is priced at its peak before any factor is read (issue 57, "Merges outside the budget": 8
large LoRAs merged with a 6.0 GB peak while the budget counted the factors once). Real safetensors files of large
rank on the tiny model's real graphs, merged by ONNX Runtime on the CPU.

The peak measured here is what numpy allocates (tracemalloc sees numpy's allocator, not ORT's): the factors read,
widened to float32 and stacked per weight (engines/lora/merge.py ``stack``); the merge graph's own intermediates
(MatMul, Transpose/Reshape, Cast and Add in onnxruntime/core/providers/cpu) come on top, and the price counts
them too (``LoraManager.merge_bytes``)."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from engines.config import LoraSettings, RuntimeSettings
from engines.engine import OrtEngine
from engines.errors import InvalidRequestError
from engines.types.request import Batch, ImageSpec, LoraUse
from tests import lora_files as lf

FILES = 4
"""Large-rank LoRAs on the same two weights: each weight's stacked float32 factors are several times the
factors' own bytes (the case the old price missed)."""


@pytest.fixture(scope="module")
def library(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("large_loras")
    for k in range(FILES):
        factors = lf.numpy_lora(tiny_model, ("unet",), rank=4096, seed=k, limit=2)
        lf.write_safetensors(root / f"large{k}.safetensors", {n: v.astype(np.float16) for n, v in factors.items()})
    return root


def _engine(model: Path, folder: Path, cache_mb: int) -> OrtEngine:
    engine = OrtEngine(model, RuntimeSettings(providers=("CPUExecutionProvider",), allow_cpu=True,
                                              lora=LoraSettings(dir=str(folder), cache_mb=cache_mb)))
    engine.load()
    return engine


def _uses(engine: OrtEngine) -> tuple[LoraUse, ...]:
    found = [f for f in engine.loras() if not f.problem]
    assert len(found) == FILES, [f.problem for f in engine.loras()]
    return tuple(LoraUse(f.name, f.sha256, 1.0, 1.0) for f in sorted(found, key=lambda f: f.name))


def _merge_peak(engine: OrtEngine, uses: tuple[LoraUse, ...]) -> int:
    assert engine._lora is not None
    tracemalloc.start()
    try:
        engine._lora.weights(uses)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_the_price_covers_the_merge_peak_that_factors_once_do_not(tiny_model: Path, library: Path) -> None:
    engine = _engine(tiny_model, library, cache_mb=1024)
    try:
        assert engine._lora is not None
        uses = _uses(engine)
        once = engine._lora.factor_bytes(uses) + engine._lora.set_bytes(uses)  # the price before
        price = engine._lora.merge_bytes(uses)
        peak = _merge_peak(engine, uses)
        assert peak > 2 * once, (peak, once)  # what the hostile pass saw: the merge took ~3x what was counted
        assert price >= peak, (price, peak)
        assert price < 3 * peak  # an upper bound, not a refusal of everything
    finally:
        engine.close()


def test_a_set_whose_merge_peak_is_over_the_budget_is_refused_by_tag_before_reading(
        tiny_model: Path, library: Path) -> None:
    """The budget holds the merged weights and the factors once (what passed before) but not the merge's peak:
    admission and generate both answer 400 naming ``loras`` and the set's ``<lora:...>`` tags, and nothing is
    merged."""
    probe = _engine(tiny_model, library, cache_mb=1024)
    try:
        assert probe._lora is not None
        uses = _uses(probe)
        once = probe._lora.factor_bytes(uses) + probe._lora.set_bytes(uses)
        price, alone = probe._lora.merge_bytes(uses), probe._lora.merge_bytes(uses[:1])
    finally:
        probe.close()
    budget_mb = -(-max(once, alone) // 2**20)
    assert once <= budget_mb * 2**20 < price  # the old rule admits it; the merge would not fit
    engine = _engine(tiny_model, library, cache_mb=budget_mb)
    try:
        assert engine._lora is not None
        batch = Batch((ImageSpec("a lighthouse", seed=3),), 64, 64, 2, loras=uses)
        for call in (lambda: engine.lora_cost_s(uses), lambda: engine.generate(batch)):
            with pytest.raises(InvalidRequestError, match=r"\[runtime.lora\] cache_mb") as caught:
                call()
            assert caught.value.param == "loras"
            assert "<lora:large0:1>" in caught.value.message and "<lora:large3:1>" in caught.value.message
        assert engine._lora.stats.misses == 0  # refused before any factor was read
        one = uses[:1]  # one file alone fits the same budget and merges
        assert engine.lora_cost_s(one) > 0
        engine._lora.weights(one)
        assert engine._lora.stats.misses == 1
    finally:
        engine.close()
