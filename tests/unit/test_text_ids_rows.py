"""The registry's ``text_ids`` (engines/architectures.py): every fixed-length text row says how its text encoder is
fed ids, and the TensorRT plan's id-length profile (engines/build/trtplan_dit.py ``text_dims``) follows the row, not
the graph's inputs: padded (one length), longest (1 .. max_sequence_length), longest+prefix (Qwen-Image's system
prefix read and dropped). A fixed row without it is refused by name rather than planned by a guess.
(tests/unit/test_flux2_zimage_trtplan.py checks these profiles against the pipelines' real feeds.)"""

from __future__ import annotations

import dataclasses

import pytest

from engines import architectures
from engines.build import trtplan_dit
from engines.pipelines.flow_family import DitFamily

KINDS = {"padded", "longest", "longest+prefix"}


def test_every_fixed_text_row_names_its_id_feed() -> None:
    fixed = {name: row.text_ids for name, row in architectures.REGISTRY.items() if row.text_tokens == "fixed"}
    assert {"qwen-image", "z-image", "flux2-klein"} <= set(fixed)
    assert all(kind in KINDS for kind in fixed.values()), fixed
    others = {name: row.text_ids for name, row in architectures.REGISTRY.items() if row.text_tokens != "fixed"}
    assert set(others.values()) == {""}, others


@pytest.mark.parametrize(("base", "ids"), [
    ("flux2-klein", (64, 64, 64)), ("z-image", (1, min(trtplan_dit.TEXT_OPT, 64), 64)),
    ("qwen-image", (trtplan_dit.QWEN_TEXT_MIN, min(trtplan_dit.QWEN_TEXT_OPT, trtplan_dit.TEMPLATE_DROP + 64),
                    trtplan_dit.TEMPLATE_DROP + 64))])
def test_text_dims_follow_the_row(base: str, ids: tuple[int, int, int]) -> None:
    family = DitFamily(base, base, guidance_embeds=False, steps=4, guidance=0.0, max_sequence_length=64)
    dims = trtplan_dit.text_dims(family)
    assert dims["text_tokens"] == 64
    assert (dims["text_ids_min"], dims["text_ids_opt"], dims["text_ids_max"]) == ids


def test_a_fixed_row_without_text_ids_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    row = dataclasses.replace(architectures.get("z-image"), name="z-image-unsaid", text_ids="")
    monkeypatch.setitem(architectures.REGISTRY, row.name, row)
    family = DitFamily(row.name, row.name, guidance_embeds=False, steps=4, guidance=0.0, max_sequence_length=64)
    with pytest.raises(ValueError, match="z-image-unsaid: a fixed-length text row needs text_ids"):
        trtplan_dit.text_dims(family)
