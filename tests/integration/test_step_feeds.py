"""Per-step scalars (timestep, step coefficients, input scale) go to the device once per request, never as a host
feed every step: a pageable bind_cpu_input per step is a synchronous host->device copy on a GPU. Real ONNX Runtime
on the CPU, tiny model: the host feeds a request binds do not grow with its steps, and the images are bit-identical
to binding the same values as host arrays every step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest

from engines.config import RuntimeSettings
from engines.pipelines.unet import StableDiffusionOnnx
from engines.runtime.sessions import Runtime
from engines.types.request import Batch, ImageSpec

CPU = RuntimeSettings(providers=("CPUExecutionProvider",), allow_cpu=True)


@pytest.fixture(scope="module")
def pipe(tiny_model: Path) -> StableDiffusionOnnx:
    return StableDiffusionOnnx(tiny_model, Runtime(CPU))


@pytest.fixture
def host_feeds(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every bind_cpu_input call (a pageable host feed), by input name."""
    calls: list[str] = []
    original = ort.IOBinding.bind_cpu_input

    def counting(self: ort.IOBinding, name: str, array: np.ndarray) -> None:
        calls.append(name)
        original(self, name, array)

    monkeypatch.setattr(ort.IOBinding, "bind_cpu_input", counting)
    return calls


def _batch(steps: int, scheduler: str = "euler") -> Batch:
    return Batch((ImageSpec("a lighthouse at dusk", "blurry", 3, 7.5),), 64, 64, steps, scheduler)


@pytest.mark.parametrize("scheduler", ["euler", "euler_a"])
def test_host_feeds_per_request_do_not_grow_with_steps(pipe: StableDiffusionOnnx, host_feeds: list[str],
                                                       scheduler: str) -> None:
    pipe(_batch(2, scheduler))
    short = list(host_feeds)
    host_feeds.clear()
    pipe(_batch(7, scheduler))
    assert host_feeds == short == []  # every copy goes through the runtime's (pinned on a GPU) uploads
    reads = [r.tag for r in pipe.runtime.host_reads]
    assert reads.count("timesteps") == reads.count("coeffs") == reads.count("in_scales") >= 2  # one per request


def test_staged_scalars_give_the_images_per_step_host_feeds_give(pipe: StableDiffusionOnnx,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    staged = pipe(_batch(6, "dpmpp_2m")).images
    # The values as host arrays bound every step (what the pipeline did before staging them).
    monkeypatch.setattr(pipe.runtime, "upload_steps", lambda tag, table: [np.ascontiguousarray(row) for row in table])
    per_step = pipe(_batch(6, "dpmpp_2m")).images
    assert np.array_equal(staged, per_step)


@pytest.mark.parametrize("family", ["flux", "sd3"])
def test_a_dit_request_binds_no_pageable_feed_but_the_shapes(family: str, dit_build: Any,
                                                            host_feeds: list[str]) -> None:
    """The staging check (engines/accept/checks.py staging_buffers) judges every host read the runtime recorded.
    A DiT request's text ids, edit sigma and per-request tables go up through the runtime's staging (pinned on a
    GPU); only the Reshape targets of Flux's unpacking stay host feeds, which ORT's CUDA and TensorRT providers read
    from host memory, and which are not recorded as copies (before, they made the check fail on every Flux)."""
    from engines.pipelines.flow import load_pipeline

    model, _ = dit_build(family)
    pipe = load_pipeline(model, Runtime(CPU))
    pipe.runtime.host_reads.clear()
    pipe(Batch((ImageSpec("a red cube", seed=3, guidance_scale=3.5),), 64, 64, 2))
    shapes = {"unpacked_shape", "image_shape"} if family == "flux" else set()
    assert set(host_feeds) == shapes
    recorded = {r.tag for r in pipe.runtime.host_reads}
    assert recorded and not any(tag.endswith(("unpacked_shape", "image_shape")) for tag in recorded)
