"""The shared-stream tick on real ONNX Runtime: its option sets through ORT's real parsers, its run option through
the real RunOptions API and real runs, and a real tiny-model tick whose latents are bit for bit those of a tick
that synchronizes every run.

ORT sources relied on: the CUDA provider parses ``user_compute_stream`` as a decimal size_t
(onnxruntime/core/providers/cuda/cuda_execution_provider_info.cc) and then runs on that stream
(cuda_execution_provider.cc: ``external_stream_``, ``use_ep_level_unified_stream_``); the binding parses the
TensorRT options itself (onnxruntime/python/onnxruntime_pybind_state.cc, std::stoull on the address);
``disable_synchronize_execution_providers`` (include/onnxruntime/core/session/onnxruntime_run_options_config_keys.h)
makes InferenceSession::Run skip each provider's end-of-run synchronize.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from engines.config import RuntimeSettings
from engines.engine import OrtEngine
from engines.runtime import optcheck
from engines.runtime.buffers import NO_SYNC
from engines.runtime.pinned import HostStream
from engines.runtime.sessions import STREAM_PLACEHOLDER, provider_options, session_providers
from engines.steps import Stepping
from engines.types.request import Batch, ImageSpec


def test_the_shared_stream_option_sets_pass_orts_parsers() -> None:
    """Every set a shared-stream production engine builds (TensorRT + CUDA for files, CUDA for in-process graphs)
    is accepted and fails here only at library loading; the control shows the TensorRT parser reads both the key
    (has_user_compute_stream is refused by name) and the value (a non-number fails std::stoull)."""
    from server.settings import load_settings

    runtime = load_settings("production").runtime
    total = 80 * 1024**3
    sets = [*provider_options(runtime, None, total, STREAM_PLACEHOLDER),
            *session_providers(runtime, True, None, total, STREAM_PLACEHOLDER)]
    assert {p for p, _ in sets} == {optcheck.TRT, optcheck.CUDA}
    for provider, options in sets:
        assert options["user_compute_stream"] == str(STREAM_PLACEHOLDER)
        result = optcheck.parse(provider, options)
        assert result.accepted and not result.loaded, f"{provider}: {result.detail}"
        assert "cannot load here" in result.detail
    trt = dict(sets)[optcheck.TRT]
    refused = optcheck.parse(optcheck.TRT, {**trt, "has_user_compute_stream": "True"})
    assert not refused.accepted and "has_user_compute_stream" in refused.detail
    garbage = optcheck.parse(optcheck.TRT, {**trt, "user_compute_stream": "stream"})
    assert not garbage.accepted and "stoull" in garbage.detail  # optcheck._REJECTED: a bare stoull is a refusal


def _batch(prompt: str, seed: int, scheduler: str) -> Batch:
    return Batch(tuple(ImageSpec(f"{prompt} {k}", "blurry", seed + k, 7.5) for k in range(2)), 64, 64, 5, scheduler)


def _ticks(engine: OrtEngine, ticks: int) -> tuple[list[np.ndarray], list[int], list[int]]:
    """Two requests denoised side by side for ``ticks`` ticks: their latents, and per tick (runs, syncs)."""
    runtime = engine.pipeline.runtime
    runs = [engine.begin(_batch("a lighthouse", 3, "euler_a")), engine.begin(_batch("a red cube", 40, "dpmpp_2m"))]
    per_tick, syncs = [], []
    for _ in range(ticks):
        engine.tick(runs)
        per_tick.append(runtime.syncs.last_tick_runs)
        syncs.append(runtime.syncs.last_tick_syncs)
    latents = []
    for run in runs:
        assert isinstance(run, Stepping)
        latents.append(np.array(run.begun.state.lat[0].numpy()))
        engine.discard(run)
    return latents, per_tick, syncs


@pytest.fixture(scope="module")
def engine(tiny_model: Path) -> OrtEngine:
    engine = OrtEngine(tiny_model, RuntimeSettings(providers=("CPUExecutionProvider",), allow_cpu=True,
                                                   verify="size"))
    engine.load()
    return engine


def test_a_tick_in_one_synchronize_gives_the_same_latents_bit_for_bit(engine: OrtEngine) -> None:
    """The CPU runtime is one host stream: its ticks run every ORT run with the real NO_SYNC run option and
    count one synchronize per tick. The same requests on separate streams (no shared stream: every run
    synchronizes, no run option) end with identical latents, and N runs count N synchronisations."""
    runtime = engine.pipeline.runtime
    assert isinstance(runtime.stream, HostStream)
    shared, runs, syncs = _ticks(engine, 3)
    assert min(runs) >= 7 and syncs == [1, 1, 1]  # 2 rows: the joins, the UNet, the split, 2 step graphs
    assert runtime._no_sync is not None and runtime._no_sync.get_run_config_entry(NO_SYNC) == "1"
    runtime.stream = None
    try:
        separate, runs_again, syncs_again = _ticks(engine, 3)
    finally:
        runtime.stream = HostStream()
    assert runs_again == runs and syncs_again == runs
    for a, b in zip(shared, separate, strict=True):
        assert a.dtype == b.dtype and np.array_equal(a, b)
