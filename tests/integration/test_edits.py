"""Edits on the real pipeline (CPU, tiny model): what is served, what is refused and why, the paste-back."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from engines.config import RuntimeSettings
from engines.errors import InvalidRequestError
from engines.pipelines.unet import StableDiffusionOnnx
from engines.runtime.sessions import Runtime
from engines.types.request import Batch, EditImage, ImageSpec
from tests.integration.test_edit_parity import init_image, square_mask

CPU = RuntimeSettings(providers=("CPUExecutionProvider",), allow_cpu=True)


@pytest.fixture(scope="module")
def sd1(tiny_model: Path) -> StableDiffusionOnnx:
    return StableDiffusionOnnx(tiny_model, Runtime(CPU))


def _edit(mask: np.ndarray | None = None, strength: float = 0.5, scheduler: str = "euler", seed: int = 3,
          steps: int = 6) -> Batch:
    return Batch((ImageSpec("a cat", seed=seed, edit=EditImage(init_image(), mask)),), 64, 64, steps, scheduler,
                 strength=strength)


def test_inpainting_keeps_every_pixel_outside_the_mask(sd1: StableDiffusionOnnx) -> None:
    """The paste-back (A1111's overlay): outside the mask the init image comes back exactly; inside it changed."""
    mask = square_mask()
    out = sd1(_edit(mask, strength=0.9)).images[0]
    outside = mask == 0
    assert np.array_equal(out[outside], init_image()[outside])
    assert np.abs(out[~outside].astype(int) - init_image()[~outside]).mean() > 5
    raw = sd1(Batch(_edit(mask, 0.9).images, 64, 64, 6, "euler", strength=0.9, overlay=False)).images[0]
    assert not np.array_equal(raw[outside], init_image()[outside])  # without it: the VAE's reconstruction


def test_strength_runs_that_share_of_the_steps_and_changes_the_image(sd1: StableDiffusionOnnx) -> None:
    low, high = sd1(_edit(strength=0.2, steps=10)), sd1(_edit(strength=0.9, steps=10))
    assert (low.steps_total, high.steps_total) == (2, 9)
    drift = [np.abs(o.images[0].astype(int) - init_image()).mean() for o in (low, high)]
    assert drift[0] < drift[1]


def test_an_edit_alone_equals_the_same_edit_in_a_batch(sd1: StableDiffusionOnnx) -> None:
    alone = sd1(_edit(square_mask(), seed=5)).images[0]
    other = ImageSpec("a dog", seed=9, edit=EditImage(init_image()[::-1].copy(), square_mask()))
    both = sd1(Batch((other, *_edit(square_mask(), seed=5).images), 64, 64, 6, "euler", strength=0.5)).images
    assert np.abs(both[1].astype(int) - alone).max() <= 1


@pytest.mark.parametrize("scheduler", ["plms", "lms", "heun_karras", "unipc"])
def test_multistep_samplers_serve_edits(scheduler: str, sd1: StableDiffusionOnnx) -> None:
    """Once refused for edits (their history warmed up from the schedule's first step); now each runs the strength's
    share of the steps (parity: tests/integration/test_edit_multistep_parity.py)."""
    for batch in (_edit(scheduler=scheduler), _edit(square_mask(), scheduler=scheduler)):
        out = sd1(batch)
        assert out.steps_total == 3 and out.images.shape == (1, 64, 64, 3)
        assert np.abs(out.images[0].astype(int) - init_image()).mean() > 0  # it changed the image


@pytest.mark.parametrize(("batch", "named"), [
    (_edit(scheduler="dpm_fast"), "unknown scheduler 'dpm_fast'"),
    (_edit(strength=0.05, steps=10), "runs no step"),
    (_edit(strength=1.5), r"must be in \(0, 1\]"),
    (Batch((ImageSpec("a", edit=EditImage(init_image())), ImageSpec("b")), 64, 64, 4, "euler"), "mixes"),
    (Batch((ImageSpec("a", edit=EditImage(init_image()[:32])),), 64, 64, 4, "euler"), "image 0 is 64x32"),
    (Batch((ImageSpec("a", edit=EditImage(init_image(), square_mask()[:32])),), 64, 64, 4, "euler"), "mask 0"),
])
def test_unservable_edits_are_refused_by_name(batch: Batch, named: str, sd1: StableDiffusionOnnx) -> None:
    with pytest.raises(InvalidRequestError, match=named):
        sd1(batch)


def test_a_folder_without_the_encoder_serves_txt2img_only(tiny_model: Path, tmp_path: Path) -> None:
    folder = tmp_path / "old"
    shutil.copytree(tiny_model, folder)
    shutil.rmtree(folder / "vae_encoder")
    old = StableDiffusionOnnx(folder, Runtime(CPU))
    assert old.editor is None and "no vae_encoder" in old.edits_unavailable
    assert old(Batch((ImageSpec("a cat"),), 64, 64, 2, "euler")).images.shape == (1, 64, 64, 3)
    with pytest.raises(InvalidRequestError, match="edits are not served by this model: .*no vae_encoder"):
        old(_edit())
