"""The output-level step cache on real ONNX Runtime sessions (engines/numerics/step_cache.py): decisions follow
EasyCache's rule, a reusing row is left out of the tick's denoiser call, the images stay close to the uncached ones
on every family, and the gate (server/caching.py) passes or refuses a configuration by its measured PSNR."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engines.config import Canary, RuntimeSettings
from engines.engine import OrtEngine
from engines.errors import InvalidRequestError
from engines.numerics.step_cache import OutputCache
from engines.types.request import Batch, BatchResult, ImageSpec, StepCache
from server.caching import Caching, gate_shape, psnr_db
from server.settings import CacheSettings

CACHE = StepCache(threshold=0.2)


def _engine(model: Path) -> OrtEngine:
    engine = OrtEngine(model, RuntimeSettings(providers=("CPUExecutionProvider",), allow_cpu=True))
    engine.load()
    return engine


@pytest.fixture(scope="module")
def engine(tiny_model: Path) -> OrtEngine:
    return _engine(tiny_model)


def _batch(steps: int, scheduler: str = "euler", seed: int = 5, cache: StepCache | None = None, n: int = 1,
           size: int = 64) -> Batch:
    return Batch(tuple(ImageSpec(f"a lighthouse {k}", "", seed + k, 7.5) for k in range(n)), size, size, steps,
                 scheduler, cache=cache)


def _pixels(result: BatchResult) -> np.ndarray:
    return np.stack([np.asarray(g.image) for g in result.images])


def _together(engine: OrtEngine, batches: list[Batch]) -> list[BatchResult]:
    """The batches begun together and ticked side by side (step-level batching) to the end; results in order."""
    runs = [engine.begin(b) for b in batches]
    results: dict[int, BatchResult] = {}
    while len(results) < len(runs):
        engine.tick([r for r in runs if id(r) not in results])
        for run in runs:
            if run.finished and id(run) not in results:
                results[id(run)] = engine.finish(run)
    return [results[id(r)] for r in runs]


def _calls(engine: OrtEngine, runs_of: Callable[[], None]) -> int:
    """Denoiser calls made by ``runs_of``: counted at the pipeline's denoiser (our OrtModel, whose ``run`` binds
    and runs the real session; the session itself is untouched)."""
    unet = engine.pipeline.denoiser
    counted = {"n": 0}
    original = unet.run

    def counting(*args: Any, **kwargs: Any) -> None:
        counted["n"] += 1
        original(*args, **kwargs)

    unet.run = counting  # type: ignore[method-assign]
    try:
        runs_of()
    finally:
        del unet.run
    return counted["n"]


@pytest.mark.parametrize("scheduler", ["euler", "dpmpp_2m", "euler_a", "heun", "unipc"])
def test_a_cached_request_reuses_evaluations_and_stays_close(engine: OrtEngine, scheduler: str) -> None:
    plain = engine.generate(_batch(30, scheduler))
    cached = engine.generate(_batch(30, scheduler, cache=CACHE))
    assert plain.cache is None and cached.cache is not None
    use = cached.cache
    assert use.spec == CACHE and 0 < use.reused < use.evaluations
    assert use.evaluations == (59 if scheduler == "heun" else 30)
    assert psnr_db(_pixels(plain), _pixels(cached)) >= 30.0
    assert not np.array_equal(_pixels(plain), _pixels(cached))  # it did reuse: not the uncached image


def test_the_denoiser_runs_once_per_evaluation_not_reused(engine: OrtEngine) -> None:
    """Skipped evaluations skip the session call: calls = evaluations - reused."""
    results: list[BatchResult] = []
    calls = _calls(engine, lambda: results.append(engine.generate(_batch(20, cache=CACHE))))
    use = results[0].cache
    assert use is not None and use.reused > 0
    assert calls == use.evaluations - use.reused


def test_decisions_follow_the_rule(engine: OrtEngine) -> None:
    """Warm-up and final evaluations computed, never more than max_reuse reuses in a row, a threshold of ~0
    reuses nothing."""
    spec = StepCache(threshold=0.5, warmup=0.2, final=0.1, max_reuse=2)
    run = engine.begin(_batch(30, cache=spec))
    cache = run.begun.state.cache  # type: ignore[attr-defined]
    assert isinstance(cache, OutputCache)
    while not run.finished:
        engine.tick([run])
    engine.finish(run)
    decisions = cache.decisions
    assert len(decisions) == 30 and any(decisions)
    assert not any(decisions[:6]) and not any(decisions[-3:])
    longest = max(len(r) for r in "".join("r" if d else "." for d in decisions).split("."))
    assert longest <= 2
    none = engine.generate(_batch(30, cache=StepCache(threshold=1e-9)))
    assert none.cache is not None and none.cache.reused == 0


def test_few_step_requests_never_cache(engine: OrtEngine) -> None:
    result = engine.generate(_batch(8, cache=CACHE))
    assert result.cache is None


def test_a_reusing_row_leaves_the_joined_call_and_others_are_untouched(engine: OrtEngine) -> None:
    """Under step-level batching a cached row joins uncached ones; the uncached rows' images equal their solo
    runs, the cached row equals its solo cached run (its decisions depend on its own rows only)."""
    plain = _batch(20, "dpmpp_2m", seed=9)
    cached = _batch(20, "euler", seed=3, cache=CACHE)
    solo_plain, solo_cached = engine.generate(plain), engine.generate(cached)
    joined_plain, joined_cached = _together(engine, [plain, cached])
    assert joined_plain.cache is None and joined_cached.cache is not None
    assert joined_cached.cache.reused == solo_cached.cache.reused  # type: ignore[union-attr]
    assert np.abs(_pixels(joined_plain).astype(int) - _pixels(solo_plain)).max() <= 1
    assert np.abs(_pixels(joined_cached).astype(int) - _pixels(solo_cached)).max() <= 1


@pytest.mark.parametrize("family", ["flux", "sd3", "qwen-image", "flux2-dev"])
def test_dit_families_cache_at_the_output(dit_build: Callable[[str], tuple[Path, Path]], family: str) -> None:
    engine = _engine(dit_build(family)[0])
    try:
        plain = engine.generate(_batch(20))
        cached = engine.generate(_batch(20, cache=CACHE))
        assert cached.cache is not None and cached.cache.reused > 0
        assert psnr_db(_pixels(plain), _pixels(cached)) >= 30.0
    finally:
        engine.close()


def test_the_unet_refuses_the_first_block_method(engine: OrtEngine) -> None:
    with pytest.raises(InvalidRequestError) as err:
        engine.generate(_batch(20, cache=StepCache(method="first-block", threshold=0.05)))
    assert err.value.param == "cache"


CANARIES = (Canary(name="a", prompt="a red cube", seed=1), Canary(name="b", prompt="a harbour", seed=2))


def test_the_gate_refuses_a_configuration_under_its_threshold_and_serves_one_above(engine: OrtEngine) -> None:
    strict = CacheSettings(policy="opt-in", gate_steps=20, gate_min_mean_psnr_db=99.0)
    lenient = CacheSettings(policy="opt-in", gate_steps=20, gate_min_mean_psnr_db=30.0)
    refused, served = Caching(strict), Caching(lenient)
    for caching in (refused, served):
        caching.run_gate(engine.generate, [(64, 64)], CANARIES, "euler", 7.5)
    gate = refused.gates[(64, 64)]
    assert not gate.passed and "mean PSNR" in gate.reason and gate.reused > 0
    assert served.gates[(64, 64)].passed
    assert served.gates[(64, 64)].mean_psnr_db == pytest.approx(gate.mean_psnr_db)  # same seeds, same images
    request = _batch(20)
    assert served.spec_for(True, request) == served.spec
    with pytest.raises(InvalidRequestError) as err:
        refused.spec_for(True, request)
    assert err.value.param == "step_cache" and "gate failed" in str(err.value)
    assert refused.spec_for(None, request) is None


def test_gate_shape_reports_identical_images_at_the_cap(engine: OrtEngine) -> None:
    """A threshold so small nothing is reused: the cached canaries are the uncached ones exactly."""
    settings = CacheSettings(policy="opt-in", threshold=1e-6, gate_steps=12)
    gate = gate_shape(engine.generate, 64, 64, CANARIES[:1], settings, "euler", 7.5)
    assert gate.reused == 0 and gate.passed and gate.worst_psnr_db == 99.0


def test_a_gated_size_does_not_open_another(engine: OrtEngine) -> None:
    caching = Caching(CacheSettings(policy="on", gate_steps=12))
    caching.run_gate(engine.generate, [(64, 64)], CANARIES[:1], "euler", 7.5)
    assert caching.spec_for(None, _batch(20)) is not None
    assert caching.spec_for(None, dataclasses.replace(_batch(20), width=128, height=128)) is None
    assert caching.spec_for(False, _batch(20)) is None
    with pytest.raises(InvalidRequestError, match="no quality gate ran for 128x128"):
        caching.spec_for(True, dataclasses.replace(_batch(20), width=128, height=128))
    with pytest.raises(InvalidRequestError, match="at least 9 steps"):
        caching.spec_for(True, _batch(8))


@pytest.fixture(scope="module")
def flux_parts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OrtEngine]:
    """Tiny Flux dev exported with the first-block parts (engines/build/dit_split.py) beside its transformer."""
    from engines.build.dit import build_tiny_dit

    folder = build_tiny_dit("flux", tmp_path_factory.mktemp("flux-parts") / "onnx", vae_encoder=False,
                            first_block=True)
    engine = _engine(folder)
    yield engine
    engine.close()


def test_the_first_block_cache_runs_through_the_engine_and_joins_uncached_rows(flux_parts: OrtEngine) -> None:
    """method first-block on a folder with the parts: some evaluations skip the rest of the transformer (the
    counts come back), an uncached row stepping beside it gets its solo image, the cached row its solo cached one."""
    spec = StepCache(method="first-block", threshold=0.3)
    plain, cached = _batch(12, seed=2), _batch(12, seed=7, cache=spec)
    solo_plain, solo_cached = flux_parts.generate(plain), flux_parts.generate(cached)
    assert solo_cached.cache is not None and solo_cached.cache.spec == spec
    assert 0 < solo_cached.cache.reused < solo_cached.cache.evaluations == 12
    joined_plain, joined_cached = _together(flux_parts, [plain, cached])
    assert joined_cached.cache == solo_cached.cache
    assert np.abs(_pixels(joined_plain).astype(int) - _pixels(solo_plain)).max() <= 1
    assert np.abs(_pixels(joined_cached).astype(int) - _pixels(solo_cached)).max() <= 1


def test_the_first_block_method_needs_the_parts(dit_build: Callable[[str], tuple[Path, Path]]) -> None:
    engine = _engine(dit_build("flux")[0])
    try:
        with pytest.raises(InvalidRequestError, match="--first-block") as err:
            engine.generate(_batch(12, cache=StepCache(method="first-block", threshold=0.3)))
        assert err.value.param == "cache"
    finally:
        engine.close()


def test_a_few_step_model_is_never_gated(engine: OrtEngine) -> None:
    """A model whose default is 8 steps or fewer (Turbo, schnell): no gate, so no request is ever cached."""
    caching = Caching(CacheSettings(policy="on", gate_steps=12))
    assert caching.run_gate(engine.generate, [(64, 64)], CANARIES[:1], "euler", 7.5, model_steps=4) == []
    assert "few-step model" in caching.error
    with pytest.raises(InvalidRequestError, match="few-step model"):
        caching.spec_for(True, _batch(20))
