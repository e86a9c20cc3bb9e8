"""Step-level batching on real ONNX Runtime sessions: a request's image is the same (within 1/255) whether it ran
alone or joined a running set mid-way, whatever the other rows do (engines/engine.py begin/tick/finish,
engines/numerics/rows.py). The rows differ in prompt, seed, steps, sampler, guidance (with and without CFG) and
mode; every sampler family is covered: single-history (Euler), ancestral noise streams (Euler a, DPM++ 2M SDE),
multistep history (DPM++ 2M, PLMS, LMS, UniPC) and two evaluations per step (Heun, DPM++ 2M SDE Heun).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from engines.build.tiny import build_tiny
from engines.config import RuntimeSettings
from engines.engine import OrtEngine
from engines.protocol import StepRun
from engines.types.request import Batch, BatchResult, EditImage, ImageSpec
from tests.integration.test_edit_parity import init_image, square_mask

SAMPLERS = ("euler", "euler_a", "dpmpp_2m", "dpmpp_2m_sde", "dpmpp_2m_sde_heun", "plms", "lms", "unipc", "heun",
            "ddim")
"""Every sampler family the step graph distinguishes (history depth, noise, evaluations per step)."""


def _engine(model: Path, verify: str = "full") -> OrtEngine:
    engine = OrtEngine(model, RuntimeSettings(providers=("CPUExecutionProvider",), allow_cpu=True, verify=verify))
    engine.load()
    return engine


@pytest.fixture(scope="module")
def engine(tiny_model: Path) -> OrtEngine:
    return _engine(tiny_model)


def _batch(prompt: str, seed: int, steps: int, scheduler: str, guidance: float = 7.5, n: int = 1,
           edit: EditImage | None = None, strength: float = 1.0) -> Batch:
    return Batch(tuple(ImageSpec(f"{prompt} {k}", "blurry" if k % 2 else "", seed + k, guidance, edit)
                       for k in range(n)), 64, 64, steps, scheduler, strength=strength)


def _pixels(result: BatchResult) -> np.ndarray:
    return np.stack([np.asarray(g.image, dtype=np.int16) for g in result.images])


def _run_joined(engine: OrtEngine, first: Batch, later: Batch, join_after: int) -> tuple[BatchResult, BatchResult]:
    """``first`` runs alone for ``join_after`` ticks, then ``later`` joins; every tick is one joined call."""
    running: list[tuple[Batch, StepRun]] = [(first, engine.begin(first))]
    results: dict[int, BatchResult] = {}
    for tick in range(1000):
        if tick == join_after:
            running.append((later, engine.begin(later)))
        assert len({engine.step_key(b) for b, _ in running}) == 1
        engine.tick([r for _, r in running])
        for batch, run in list(running):
            if run.finished:
                results[id(batch)] = engine.finish(run)
                running.remove((batch, run))
        if not running:
            break
    return results[id(first)], results[id(later)]


def _close(a: BatchResult, b: BatchResult) -> int:
    return int(np.abs(_pixels(a) - _pixels(b)).max())


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_a_row_joining_mid_way_gets_its_solo_image(engine: OrtEngine, sampler: str) -> None:
    """A long 2-image CFG job runs; a short job with another sampler, guidance 1 (no CFG rows) and other seeds
    joins at tick 3; both images equal their solo runs."""
    long = _batch("a lighthouse at dusk", 10, 9, "euler_a" if sampler != "euler_a" else "dpmpp_2m", n=2)
    short = _batch("a red cube", 40, 4, sampler, guidance=1.0 if sampler in ("euler", "heun") else 5.0)
    alone_long, alone_short = engine.generate(long), engine.generate(short)
    joined_long, joined_short = _run_joined(engine, long, short, join_after=3)
    assert joined_short.steps_done == 4 and joined_long.steps_done == 9
    assert not joined_short.interrupted and not joined_long.interrupted
    assert _close(joined_short, alone_short) <= 1, sampler
    assert _close(joined_long, alone_long) <= 1, sampler
    assert not np.array_equal(_pixels(joined_short)[0], _pixels(joined_long)[0])  # the rows did not mix


def test_an_img2img_row_joins_txt2img_rows_at_its_start_step(engine: OrtEngine) -> None:
    edit = EditImage(init_image())
    img2img = _batch("a watercolour", 7, 10, "dpmpp_2m", edit=edit, strength=0.5)  # 5 steps from step 5
    txt = _batch("a forest", 3, 8, "euler", n=2)
    alone = engine.generate(img2img)
    _, joined = _run_joined(engine, txt, img2img, join_after=2)
    assert joined.steps_done == 5
    assert _close(joined, alone) <= 1


def test_an_inpainting_row_keeps_its_blend_when_joined(engine: OrtEngine) -> None:
    edit = EditImage(init_image(), square_mask())
    inpaint = _batch("a window", 21, 6, "euler_a", edit=edit, strength=1.0)
    txt = _batch("a forest", 3, 8, "plms")
    alone = engine.generate(inpaint)
    joined, _ = _run_joined(engine, inpaint, txt, join_after=1)
    assert _close(joined, alone) <= 1
    outside = square_mask() == 0
    assert np.array_equal(_pixels(joined)[0][outside], init_image().astype(np.int16)[outside])


def test_a_stopped_row_is_decoded_where_it_stopped(engine: OrtEngine) -> None:
    """An interrupt at a step boundary: the row leaves with the image of the steps it ran, as a solo run stopped
    by its step hook at the same step."""
    batch = _batch("a harbour", 5, 8, "euler")
    other = _batch("a desert", 6, 8, "euler")
    solo = engine.generate(batch, on_step=lambda done, total: done < 3)
    runs = [engine.begin(batch), engine.begin(other)]
    while runs[0].steps_done < 3:
        engine.tick(runs)
    stopped = engine.finish(runs[0], stopped=True)
    assert stopped.interrupted and stopped.steps_done == 3
    assert _close(stopped, solo) <= 1
    while not runs[1].finished:
        engine.tick(runs[1:])
    assert engine.finish(runs[1]).steps_done == 8


def test_released_scopes_are_reused_and_runs_keep_apart(engine: OrtEngine) -> None:
    """A released run frees its buffer scope for the next; two runs of the same shape never share a buffer."""
    a, b = engine.begin(_batch("one", 1, 4, "euler")), engine.begin(_batch("two", 2, 4, "euler"))
    state_a, state_b = a.begun.state, b.begun.state  # type: ignore[attr-defined]
    assert state_a.lat[0] is not state_b.lat[0] and state_a.model_out is not state_b.model_out
    engine.discard(a)
    c = engine.begin(_batch("three", 3, 4, "euler"))
    assert c.scope == a.scope  # type: ignore[attr-defined]
    engine.discard(b)
    engine.discard(c)


def test_a_unet_with_one_timestep_per_call_groups_rows_by_timestep(tmp_path: Path) -> None:
    """A UNet exported before per-row timesteps ([1]): rows at different timesteps run in separate calls, rows
    at the same timestep share one, and every image still equals its solo run."""
    import onnx

    model = build_tiny(tmp_path / "tiny")
    path = model / "unet" / "model.onnx"
    graph = onnx.load(str(path))
    dim = next(i for i in graph.graph.input if i.name == "timestep").type.tensor_type.shape.dim[0]
    assert dim.dim_param  # the export takes a timestep per row
    dim.ClearField("dim_param")
    dim.dim_value = 1
    onnx.save(graph, str(path))
    old = _engine(model, verify="off")  # the edited graph no longer matches the manifest
    stages = old.pipeline.stepwise()
    assert stages is not None and not stages.joinable()
    same = _batch("a boat", 8, 5, "euler")
    later = dataclasses.replace(same, images=(ImageSpec("a car", seed=9),))
    alone = old.generate(later)
    _, joined = _run_joined(old, same, later, join_after=2)
    assert _close(joined, alone) <= 1


@pytest.mark.parametrize("family", ["flux", "sd3", "qwen-image"])
def test_dit_rows_joining_mid_way_get_their_solo_images(dit_build: Callable[[str], tuple[Path, Path]],
                                                        family: str) -> None:
    """The DiT families step the same way (every transformer input with a row per image joined, Flux's per-size rope
    tables bound once): a Flux row, or an SD 3 row without CFG beside CFG rows, and an img2img row, joining a
    running batch mid-way get their solo images."""
    dit = _engine(dit_build(family)[0])
    size = dit.pipeline.default_size
    long = dataclasses.replace(_batch("a lighthouse at dusk", 10, 6, "euler", n=2), width=size, height=size)
    short = dataclasses.replace(_batch("a red cube", 40, 3, "euler", guidance=1.0 if family == "sd3" else 3.5),
                                width=size, height=size)
    y, x = np.mgrid[0:size, 0:size]
    picture = np.stack([x * 255 // size, y * 255 // size, np.full_like(x, 90)], -1).astype(np.uint8)
    edit = dataclasses.replace(short, images=(ImageSpec("a watercolour", seed=5, edit=EditImage(picture)),),
                               strength=0.6, steps=5)
    for later in (short, edit):
        alone_long, alone_later = dit.generate(long), dit.generate(later)
        joined_long, joined_later = _run_joined(dit, long, later, join_after=2)
        assert joined_later.steps_done == alone_later.steps_done and joined_long.steps_done == 6
        assert _close(joined_later, alone_later) <= 1, family
        assert _close(joined_long, alone_long) <= 1, family


def _decoded_in_parts(engine: OrtEngine, batch: Batch, parts: list[int]) -> BatchResult:
    run = engine.begin(batch)
    while not run.finished:
        engine.tick([run])
    for images in parts:
        engine.decode(run, images)
    return engine.finish(run)


def test_a_decode_in_parts_gives_the_images_of_a_whole_one(engine: OrtEngine) -> None:
    """Step-level batching decodes a request a few images at a time (queue.decode_images): each part takes its
    rows of the latents on the device (rows.py ``take``) and an inpainting part pastes back its own init images;
    the images equal a whole decode's and come back in order."""
    txt = _batch("a harbour at night", 11, 5, "dpmpp_2m", n=3)
    whole = engine.generate(txt)
    for parts in ([1], [1, 1], [2]):
        split = _decoded_in_parts(engine, txt, parts)
        assert [g.seed for g in split.images] == [g.seed for g in whole.images]
        assert _close(split, whole) <= 1, parts
        assert split.timings.vae_decode > 0
    inpaint = _batch("a window", 21, 4, "euler", n=2, edit=EditImage(init_image(), square_mask()))
    whole = engine.generate(inpaint)
    split = _decoded_in_parts(engine, inpaint, [1])
    assert _close(split, whole) <= 1
    outside = square_mask() == 0
    for pixels in _pixels(split):
        assert np.array_equal(pixels[outside], init_image().astype(np.int16)[outside])


@pytest.mark.parametrize("family", ["flux", "sd3", "qwen-image"])
def test_a_dit_decode_in_parts_gives_the_images_of_a_whole_one(dit_build: Callable[[str], tuple[Path, Path]],
                                                               family: str) -> None:
    """The same for the DiT families' decode (Flux's and Qwen-Image's unpacking of each part's tokens)."""
    dit = _engine(dit_build(family)[0])
    size = dit.pipeline.default_size
    batch = dataclasses.replace(_batch("a lighthouse", 8, 3, "euler", n=3), width=size, height=size)
    whole = dit.generate(batch)
    split = _decoded_in_parts(dit, batch, [1, 1])
    assert _close(split, whole) <= 1, family
    assert not np.array_equal(_pixels(split)[0], _pixels(split)[1])


def test_a_joined_tick_copies_nothing_from_the_host(engine: OrtEngine) -> None:
    """Per-row state stays on the device: a tick joining three runs (CFG and no-CFG rows, two samplers) reads no
    host memory (Runtime.host_reads records every host->device copy and host feed; Slice's bounds are shape feeds,
    read where they lie). Only a new row's inputs go up, at its begin."""
    runs = [engine.begin(_batch("one", 1, 6, "euler")), engine.begin(_batch("two", 2, 6, "dpmpp_2m", guidance=1.0)),
            engine.begin(_batch("three", 3, 6, "euler", n=2))]
    runtime = engine.pipeline.runtime
    runtime.host_reads.clear()
    for _ in range(3):
        engine.tick(runs)
    assert list(runtime.host_reads) == []
    for run in runs:
        engine.discard(run)
