"""Step-level batching with edits on the multistep and two-evaluation samplers (issue 57: LMS, Heun, PLMS and UniPC
serve img2img and inpainting since their plans take the edit's start step, engines/numerics/schedulers.py
``make_plan``). On real ONNX Runtime CPU sessions (engines/engine.py begin/tick/finish, engines/numerics/rows.py):
an edit row on each of these samplers joins a running set mid-way and gets its solo image within 1/255, and so do
the running rows beside it. PLMS's first two evaluations make one step and Heun takes two evaluations per step:
their rows join at an evaluation boundary of their own plan, not of the set's."""

from __future__ import annotations

import pytest

from engines.engine import OrtEngine
from engines.types.request import EditImage
from tests.integration.test_edit_parity import init_image, square_mask
from tests.integration.test_step_batching import _batch, _close, _pixels, _run_joined
from tests.integration.test_step_batching import engine as engine  # noqa: F401  (the module's tiny engine)

MULTISTEP = ("plms", "lms", "heun", "unipc", "lms_karras")


@pytest.mark.parametrize("sampler", MULTISTEP)
def test_an_img2img_row_on_a_multistep_sampler_joins_and_gets_its_solo_image(engine: OrtEngine,  # noqa: F811
                                                                             sampler: str) -> None:
    """A 2-image txt2img job (Euler a) runs; an img2img row at strength 0.6 (6 of 10 steps) on ``sampler`` joins
    at tick 2; then the other way round: a txt2img row joins the running edit at tick 1."""
    edit = _batch("a watercolour", 7, 10, sampler, edit=EditImage(init_image()), strength=0.6)
    txt = _batch("a forest", 3, 8, "euler_a", n=2)
    alone_edit, alone_txt = engine.generate(edit), engine.generate(txt)
    joined_txt, joined_edit = _run_joined(engine, txt, edit, join_after=2)
    assert joined_edit.steps_done == 6 and joined_txt.steps_done == 8
    assert _close(joined_edit, alone_edit) <= 1 and _close(joined_txt, alone_txt) <= 1, sampler
    first_edit, first_txt = _run_joined(engine, edit, txt, join_after=1)
    assert _close(first_edit, alone_edit) <= 1 and _close(first_txt, alone_txt) <= 1, sampler


@pytest.mark.parametrize("sampler", ["plms", "heun"])
def test_an_inpainting_row_on_a_multistep_sampler_keeps_its_blend_when_joined(engine: OrtEngine,  # noqa: F811
                                                                               sampler: str) -> None:
    """Inpainting blends the init image back after every UNet evaluation (Heun's second and PLMS's extra first
    one too): joined, the row keeps its solo image and the unmasked pixels stay the init image's."""
    inpaint = _batch("a window", 21, 6, sampler, edit=EditImage(init_image(), square_mask()), strength=0.75)
    txt = _batch("a forest", 3, 8, "dpmpp_2m")
    alone = engine.generate(inpaint)
    _, joined = _run_joined(engine, txt, inpaint, join_after=2)
    assert _close(joined, alone) <= 1, sampler
    outside = square_mask() == 0
    assert abs(_pixels(joined)[0][outside] - init_image().astype(int)[outside]).max() <= 1
